-- Sea surface temperature is NaN over land. NaN reads as NULL, so count(sst)
-- counts ocean cells and avg(sst) averages over the ocean only.
CREATE EXTERNAL TABLE IF NOT EXISTS era5 STORED AS ZARR LOCATION 'demo/era5.zarr';
SELECT count(*) AS cells, count(sst) AS ocean_cells, avg(sst) AS sst_mean FROM era5;
