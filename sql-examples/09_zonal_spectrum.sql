-- Zonal power spectrum: the FFT of 2 m temperature along longitude, a real
-- transform (rfft) with xrft's defaults (true phase and amplitude), averaged
-- over time and latitude. Values are complex (`t2m['re']`, `t2m['im']`); the
-- frequencies are xrft's (cycles per degree, rfftfreq of the spacing).
-- tolerance: 1e-5 (float32 input is transformed in single precision, as numpy 2 does)
CREATE EXTERNAL TABLE IF NOT EXISTS era5 STORED AS ZARR LOCATION 'demo/era5.zarr';
SELECT freq_lon, avg(t2m['re'] * t2m['re'] + t2m['im'] * t2m['im']) AS power
FROM fft('era5', 't2m', dims => 'lon', real_dim => 'lon')
GROUP BY freq_lon
ORDER BY freq_lon;
