-- Register the bundled ERA5-like demo store and look at its columns.
-- Every dimension (time, lat, lon) is a column holding coordinate values;
-- every variable on those dimensions is a column. The store also has `lsm`
-- on (lat, lon) only: without OPTIONS ('dims' ...) the table exposes the
-- dimension set with the most dimensions.
CREATE EXTERNAL TABLE IF NOT EXISTS era5 STORED AS ZARR LOCATION 'demo/era5.zarr';
DESCRIBE era5;
