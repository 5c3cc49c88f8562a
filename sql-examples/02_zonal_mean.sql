-- Zonal mean: average 2 m temperature along each latitude circle.
-- Only the `lat` coordinate and the `t2m` array are read (projection pushdown).
CREATE EXTERNAL TABLE IF NOT EXISTS era5 STORED AS ZARR LOCATION 'demo/era5.zarr';
SELECT lat, avg(t2m) AS t2m_mean FROM era5 GROUP BY lat ORDER BY lat;
