-- A box and a time window. Filters on dimensions are pushed into the scan:
-- blocks outside the box are never read and edge chunks are sliced, so only
-- the cells inside are built. Latitude is stored descending; BETWEEN still works.
CREATE EXTERNAL TABLE IF NOT EXISTS era5 STORED AS ZARR LOCATION 'demo/era5.zarr';
SELECT count(*) AS cells, avg(t2m) AS t2m_mean, min(t2m) AS t2m_min, max(t2m) AS t2m_max
FROM era5
WHERE lat BETWEEN 30 AND 60
  AND lon BETWEEN 0 AND 40
  AND time >= TIMESTAMP '2020-01-01T00:00:00'
  AND time < TIMESTAMP '2020-01-03T00:00:00';
