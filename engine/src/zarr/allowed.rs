//! Which locations a session may reach: `zarrfusion.allowed_locations`.
//!
//! A service that runs SQL written by others sets the list when it builds
//! the session (Rust: the session config; Python:
//! `SessionContext(allowed_locations=[...])`; the shell: `--allow`); SQL
//! cannot change it. Every store a statement reads or writes, every work
//! directory it sets, and every `CREATE EXTERNAL TABLE` or `COPY` location
//! of any format must then lie under one of its entries:
//!
//! ```text
//! zarrfusion.allowed_locations = 's3://era5-public, /data/zarr, s3://scratch/team-a/'
//! ```
//!
//! - A local entry is a directory: a path is under it when, with symbolic
//!   links resolved, it is the directory or inside it (`..` cannot climb
//!   out; a `..` in the part of a path that does not exist yet is refused).
//! - A URL entry is a scheme, a bucket or host, and a path prefix matched
//!   by whole segments (`s3://b/team-a` allows `s3://b/team-a/x.zarr`, not
//!   `s3://b/team-ab`).
//! - Table options that say where requests go or which local files are
//!   read (endpoints, proxies, `allow_http`, credential and token files)
//!   are refused while a list is set: they would reach past it.
//!
//! An empty list (the default) allows everything.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

use url::Url;

use super::store::StoreLocation;
use crate::error::{Result, ZarrFusionError};

/// The locations a session may reach; empty: every location.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedLocations {
    entries: Vec<Entry>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    /// A directory, symbolic links resolved.
    Local(PathBuf),
    /// Scheme, authority and path segments.
    Remote {
        scheme: String,
        authority: String,
        segments: Vec<String>,
    },
}

impl AllowedLocations {
    /// Parses a comma-separated list of directories and URLs; an empty
    /// text allows everything.
    pub fn parse(text: &str) -> Result<Self> {
        let mut entries = Vec::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let bad = |why: String| {
                ZarrFusionError::Invalid(format!("zarrfusion.allowed_locations: '{item}' {why}"))
            };
            entries.push(match StoreLocation::parse(item)? {
                StoreLocation::Local(path) => Entry::Local(resolve(&path).map_err(bad)?),
                StoreLocation::Remote(url) => remote(&url).map_err(bad)?,
            });
        }
        Ok(Self { entries })
    }

    /// Whether a list is set (not everything is allowed).
    pub fn is_restricted(&self) -> bool {
        !self.entries.is_empty()
    }

    /// Checks that `location` (written as `display`) is under an entry.
    pub fn check(&self, location: &StoreLocation, display: &str) -> Result<()> {
        if !self.is_restricted() {
            return Ok(());
        }
        let allowed = match location {
            StoreLocation::Local(path) => {
                let path = resolve(path).map_err(|why| refused(display, &why))?;
                (self.entries.iter())
                    .any(|e| matches!(e, Entry::Local(dir) if path.starts_with(dir)))
            }
            StoreLocation::Remote(url) => {
                let Ok(Entry::Remote {
                    scheme,
                    authority,
                    segments,
                }) = remote(url)
                else {
                    return Err(refused(display, "has no bucket or host"));
                };
                self.entries.iter().any(|e| {
                    matches!(e, Entry::Remote { scheme: s, authority: a, segments: p }
                        if *s == scheme && *a == authority && segments.starts_with(p))
                })
            }
        };
        match allowed {
            true => Ok(()),
            false => Err(refused(
                display,
                "is not under zarrfusion.allowed_locations",
            )),
        }
    }

    /// Checks a location written as text (a path or a URL).
    pub fn check_text(&self, location: &str) -> Result<()> {
        match self.is_restricted() {
            true => self.check(&StoreLocation::parse(location)?, location),
            false => Ok(()),
        }
    }

    /// Refuses object-store options that would reach past the list (where
    /// requests go, which local files are read) while a list is set.
    pub fn check_options(&self, options: &HashMap<String, String>, display: &str) -> Result<()> {
        if !self.is_restricted() {
            return Ok(());
        }
        let mut reaching: Vec<&str> = (options.keys())
            .filter(|key| {
                let key = key.to_ascii_lowercase();
                [
                    "endpoint",
                    "proxy",
                    "allow_http",
                    "allow_invalid",
                    "file",
                    "path",
                    "url",
                    "uri",
                    "credentials",
                ]
                .iter()
                .any(|word| key.contains(word))
            })
            .map(String::as_str)
            .collect();
        reaching.sort_unstable();
        match reaching.is_empty() {
            true => Ok(()),
            false => Err(ZarrFusionError::forbidden(
                display,
                format!(
                    "option {} is not allowed while zarrfusion.allowed_locations is set \
                     (it chooses where requests go or which local files are read)",
                    reaching.join(", ")
                ),
            )),
        }
    }
}

fn refused(display: &str, why: &str) -> ZarrFusionError {
    ZarrFusionError::forbidden(display, format!("refused: {why}"))
}

/// A URL as an entry: schemes that name the same service made one, the
/// path cut into segments.
fn remote(url: &Url) -> std::result::Result<Entry, String> {
    let scheme = match url.scheme() {
        "s3a" => "s3",
        "gcs" => "gs",
        other => other,
    };
    let authority = url.authority().to_ascii_lowercase();
    if authority.is_empty() {
        return Err("has no bucket or host".to_string());
    }
    Ok(Entry::Remote {
        scheme: scheme.to_string(),
        authority,
        segments: (url.path().split('/'))
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
    })
}

/// `path` made absolute, with symbolic links of the part that exists
/// resolved; a `..` in the part that does not exist is refused (it could
/// climb out once created).
fn resolve(path: &Path) -> std::result::Result<PathBuf, String> {
    let absolute = match path.is_absolute() {
        true => path.to_path_buf(),
        false => std::env::current_dir()
            .map_err(|e| format!("cannot be made absolute: {e}"))?
            .join(path),
    };
    let mut existing = absolute.as_path();
    let mut missing = Vec::new();
    loop {
        if let Ok(real) = std::fs::canonicalize(existing) {
            let mut resolved = real;
            for part in missing.iter().rev() {
                match part {
                    Component::Normal(name) => resolved.push(name),
                    Component::CurDir => {}
                    _ => return Err("has '..' in a part that does not exist".to_string()),
                }
            }
            return Ok(resolved);
        }
        match (existing.components().next_back(), existing.parent()) {
            (Some(last), Some(parent)) => {
                missing.push(last);
                existing = parent;
            }
            _ => return Err("cannot be resolved".to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(list: &str, location: &str) -> bool {
        (AllowedLocations::parse(list).unwrap())
            .check_text(location)
            .is_ok()
    }

    #[test]
    fn urls_are_matched_by_scheme_bucket_and_whole_segments() {
        let list = "s3://b/team-a, gs://pub";
        assert!(allowed(list, "s3://b/team-a"));
        assert!(allowed(list, "s3://b/team-a/x.zarr"));
        assert!(allowed(list, "s3a://b/team-a/x.zarr"));
        assert!(allowed(list, "gcs://pub/any/thing"));
        assert!(!allowed(list, "s3://b/team-ab/x.zarr"));
        assert!(!allowed(list, "s3://b/x.zarr"));
        assert!(!allowed(list, "s3://b/team-a/../team-b/x.zarr"));
        assert!(!allowed(list, "s3://other/team-a"));
        assert!(!allowed(list, "gs://pub2/x"));
        assert!(!allowed(list, "http://pub/x"));
        assert!(!allowed(list, "memory://b/team-a"));
        assert!(!allowed(list, "/tmp"));
    }

    #[test]
    fn local_paths_are_matched_after_resolving_links_and_dots() {
        let root = std::env::temp_dir().join(format!("zf-allowed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("data/inner")).unwrap();
        std::fs::create_dir_all(root.join("secret")).unwrap();
        std::os::unix::fs::symlink(root.join("secret"), root.join("data/link")).unwrap();
        let list = root.join("data").to_string_lossy().into_owned();
        let at = |p: &str| root.join(p).to_string_lossy().into_owned();
        assert!(allowed(&list, &at("data")));
        assert!(allowed(&list, &at("data/inner/x.zarr")));
        assert!(allowed(&list, &at("data/new/deeper/x.zarr")));
        assert!(allowed(&list, &format!("file://{}", at("data/inner"))));
        assert!(!allowed(&list, &at("data/../secret")));
        assert!(!allowed(&list, &at("data/inner/../../secret/x.zarr")));
        assert!(!allowed(&list, &at("data/link/x.zarr")));
        assert!(!allowed(&list, &at("data/new/../../secret")));
        assert!(!allowed(&list, &at("database")));
        assert!(!allowed(&list, "s3://data/x"));
        // No list: everything.
        assert!(allowed("", &at("secret")));
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn options_that_reach_past_the_list_are_refused_while_one_is_set() {
        let list = AllowedLocations::parse("s3://b").unwrap();
        let options = |keys: &[&str]| -> HashMap<String, String> {
            keys.iter()
                .map(|k| (k.to_string(), "x".to_string()))
                .collect()
        };
        for key in [
            "aws.endpoint",
            "AWS.ENDPOINT_URL",
            "aws.allow_http",
            "client.proxy_url",
            "gcp.service_account_path",
            "aws.web_identity_token_file",
            "client.allow_invalid_certificates",
            "gcp.application_credentials",
            "aws.container_credentials_relative_uri",
        ] {
            let err = list
                .check_options(&options(&[key]), "s3://b/x")
                .unwrap_err();
            assert!(err.to_string().contains(key), "{err}");
        }
        let fine = options(&["aws.region", "retry.max_retries", "client.timeout"]);
        assert!(list.check_options(&fine, "s3://b/x").is_ok());
        let open = AllowedLocations::default();
        assert!(open
            .check_options(&options(&["aws.endpoint"]), "s3://b/x")
            .is_ok());
    }

    #[test]
    fn entries_that_cannot_be_resolved_are_refused() {
        assert!(AllowedLocations::parse("s3://").is_err());
        assert!(AllowedLocations::parse("/no/such/../dir").is_err());
        assert!(AllowedLocations::parse(" , ").unwrap() == AllowedLocations::default());
    }
}
