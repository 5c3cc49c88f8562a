-- Surface pressure is stored as int16 with scale_factor, add_offset and a
-- _FillValue (CF packing). Queries see unpacked Pa, with fill values as NULL,
-- exactly as xarray.open_zarr shows them: count(sp) skips the missing cells.
CREATE EXTERNAL TABLE IF NOT EXISTS era5 STORED AS ZARR LOCATION 'demo/era5.zarr';
SELECT date_trunc('day', time) AS day, avg(sp) / 100 AS sp_hpa, count(sp) AS valid, count(*) AS cells
FROM era5
GROUP BY date_trunc('day', time)
ORDER BY day;
