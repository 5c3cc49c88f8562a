-- Join two stores on their dimensions: the temperature store (Zarr v2) and a
-- precipitation store (Zarr v3, zstd) on the same grid.
CREATE EXTERNAL TABLE IF NOT EXISTS era5 STORED AS ZARR LOCATION 'demo/era5.zarr';
CREATE EXTERNAL TABLE IF NOT EXISTS precip STORED AS ZARR LOCATION 'demo/era5_precip.zarr';
SELECT e.lat, avg(p.tp) AS tp_mean, avg(e.t2m) AS t2m_mean, count(*) AS cells
FROM era5 e
JOIN precip p ON e.time = p.time AND e.lat = p.lat AND e.lon = p.lon
WHERE e.lat >= 40
GROUP BY e.lat
ORDER BY e.lat;
