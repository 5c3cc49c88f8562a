-- Two variables in one expression: 10 m wind speed from its u and v
-- components, per latitude, at one time step (a time filter that reads one
-- slice of the time-chunked store).
CREATE EXTERNAL TABLE IF NOT EXISTS era5 STORED AS ZARR LOCATION 'demo/era5.zarr';
SELECT lat,
       max(sqrt(u10 * u10 + v10 * v10)) AS max_wind,
       avg(sqrt(u10 * u10 + v10 * v10)) AS mean_wind
FROM era5
WHERE time = TIMESTAMP '2020-01-02T00:00:00'
GROUP BY lat
ORDER BY lat;
