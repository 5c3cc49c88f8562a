//! The options of `COPY ... STORED AS ZARR` and `DataFrame.to_zarr`.
//!
//! | option | values | default |
//! |---|---|---|
//! | `chunks` | `dim=n,...` (other dimensions: chosen) | about 8 MiB chunks |
//! | `codec` | `zstd`, `gzip`, `blosc`, `none` | `zstd` |
//! | `zarr_format` | `2`, `3` | `3` |
//! | `dims` | `dim,dim,...`: the dimension columns, in order | the session's Zarr dimensions |
//! | `aws.*`, `gcp.*`, `azure.*`, `http.*`, `retry.*`, `client.*` | the object store's settings, as a table's `OPTIONS` (an object-store target only) | the bucket's store registered in the session, else one from the environment |

use std::collections::HashMap;

use datafusion::common::{plan_err, Result};

use crate::zarr::{is_object_store_option, StoreLocation};

/// How chunks are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Codec {
    /// Zstandard, level 3.
    Zstd,
    /// gzip (zlib), level 5.
    Gzip,
    /// Blosc with LZ4 and byte shuffle (what ERA5 Zarr stores use).
    Blosc,
    /// Uncompressed.
    None,
}

/// The Zarr format version to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ZarrVersion {
    /// Zarr v2 (`.zarray`, `.zattrs`, consolidated `.zmetadata`).
    V2,
    /// Zarr v3 (`zarr.json`).
    V3,
}

/// Options of a Zarr write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZarrWriteOptions {
    /// Chunk lengths per dimension; dimensions not named are chosen.
    pub chunks: Vec<(String, u64)>,
    /// The compression of every array.
    pub codec: Codec,
    /// The format version.
    pub zarr_format: ZarrVersion,
    /// The dimension columns, outermost first, when given.
    pub dims: Option<Vec<String>>,
    /// Object-store settings of an object-store target (`aws.region`,
    /// `retry.max_retries`, ...): the write gets a client built from them.
    pub storage: HashMap<String, String>,
}

impl Default for ZarrWriteOptions {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            codec: Codec::Zstd,
            zarr_format: ZarrVersion::V3,
            dims: None,
            storage: HashMap::new(),
        }
    }
}

const KNOWN: &str =
    "chunks, codec, zarr_format, dims, and for object stores aws.*, gcp.*, azure.*, http.*, retry.*, client.*";

impl ZarrWriteOptions {
    /// Parses options as COPY hands them over (keys may carry the `format.` prefix).
    pub fn from_map(map: &HashMap<String, String>) -> Result<Self> {
        let mut options = Self::default();
        let mut keys: Vec<&String> = map.keys().collect();
        keys.sort();
        for key in keys {
            let value = map[key].trim();
            let name = key.strip_prefix("format.").unwrap_or(key);
            match name.to_ascii_lowercase().as_str() {
                "chunks" => options.chunks = parse_chunks(value)?,
                "codec" | "compression" => {
                    options.codec = match value.to_ascii_lowercase().as_str() {
                        "zstd" => Codec::Zstd,
                        "gzip" | "zlib" => Codec::Gzip,
                        "blosc" => Codec::Blosc,
                        "none" | "" => Codec::None,
                        other => {
                            return plan_err!(
                        "Zarr option 'codec': unknown codec '{other}' (zstd, gzip, blosc, none)"
                    )
                        }
                    }
                }
                "zarr_format" | "zarr_version" => {
                    options.zarr_format = match value {
                        "2" => ZarrVersion::V2,
                        "3" => ZarrVersion::V3,
                        other => {
                            return plan_err!("Zarr option 'zarr_format': '{other}' is not 2 or 3")
                        }
                    }
                }
                "dims" => {
                    let dims: Vec<String> = value
                        .split(',')
                        .map(|d| d.trim().to_string())
                        .filter(|d| !d.is_empty())
                        .collect();
                    if dims.is_empty() {
                        return plan_err!("Zarr option 'dims' names no column");
                    }
                    options.dims = Some(dims);
                }
                lower if is_object_store_option(lower) => {
                    options.storage.insert(lower.to_string(), value.to_string());
                }
                _ => return plan_err!("unknown Zarr write option '{name}' (options: {KNOWN})"),
            }
        }
        Ok(options)
    }
}

impl ZarrWriteOptions {
    /// Refuses object-store settings for a local target (they would be
    /// ignored).
    pub fn check_storage_target(&self, target: &StoreLocation) -> Result<()> {
        if matches!(target, StoreLocation::Local(_)) && !self.storage.is_empty() {
            let mut keys: Vec<&str> = self.storage.keys().map(String::as_str).collect();
            keys.sort_unstable();
            return plan_err!(
                "Zarr write options {} are object-store settings; '{target}' is a local path",
                keys.join(", ")
            );
        }
        Ok(())
    }
}

/// Parses `time=240,lat=16,lon=16`.
fn parse_chunks(text: &str) -> Result<Vec<(String, u64)>> {
    let mut out: Vec<(String, u64)> = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((dim, n)) = part.split_once('=') else {
            return plan_err!("Zarr option 'chunks': '{part}' is not dim=length");
        };
        let dim = dim.trim();
        let n: u64 = match n.trim().parse() {
            Ok(n) if n > 0 => n,
            _ => {
                return plan_err!(
                    "Zarr option 'chunks': '{}' is not a positive length",
                    n.trim()
                )
            }
        };
        if out.iter().any(|(d, _)| d == dim) {
            return plan_err!("Zarr option 'chunks': '{dim}' is given twice");
        }
        out.push((dim.to_string(), n));
    }
    if out.is_empty() {
        return plan_err!("Zarr option 'chunks' is empty");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parses_options_with_and_without_prefix() {
        let o = ZarrWriteOptions::from_map(&map(&[
            ("format.chunks", "time=240, lat=16,lon=16"),
            ("codec", "GZIP"),
            ("format.zarr_format", "2"),
            ("format.dims", "time,lat,lon"),
        ]))
        .unwrap();
        assert_eq!(o.chunks[0], ("time".to_string(), 240));
        assert_eq!(o.chunks.len(), 3);
        assert_eq!(o.codec, Codec::Gzip);
        assert_eq!(o.zarr_format, ZarrVersion::V2);
        assert_eq!(o.dims.unwrap(), vec!["time", "lat", "lon"]);
        for bad in [
            ("format.chunks", "time:3"),
            ("format.chunks", "time=0"),
            ("format.chunks", "t=1,t=2"),
            ("format.codec", "lzma"),
            ("format.zarr_format", "4"),
            ("format.nope", "1"),
        ] {
            let err = ZarrWriteOptions::from_map(&map(&[bad])).unwrap_err();
            assert!(err.to_string().contains("Zarr"), "{err}");
        }
    }
}
