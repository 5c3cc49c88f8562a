-- The land-sea mask lives on (lat, lon) only: a second dimension set in the
-- same group. OPTIONS ('dims' 'lat,lon') picks it.
CREATE EXTERNAL TABLE IF NOT EXISTS lsm STORED AS ZARR LOCATION 'demo/era5.zarr' OPTIONS ('dims' 'lat,lon');
SELECT count(*) AS cells, sum(lsm) AS land_cells FROM lsm;
