//! Finding the arrays of a Zarr group without listing chunks.
//!
//! In order of preference: consolidated metadata (v3 `consolidated_metadata`
//! in `zarr.json`, v2 `.zmetadata`), else one directory listing of the group
//! and one metadata read per child. The cost grows with the number of arrays,
//! never with the number of chunks. From an object store, the children's
//! metadata documents are requested together (up to
//! [`LISTING_READ_AHEAD`] at once), so a group without consolidated metadata
//! opens in a few round trips, not one per array.

use std::sync::Arc;

use serde_json::{Map, Value};
use zarrs::metadata::v2::ArrayMetadataV2;
use zarrs::metadata::v3::ArrayMetadataV3;
use zarrs::metadata::ArrayMetadata;
use zarrs::storage::{ReadableListableStorage, StoreKey, StorePrefix};

use super::remote::ReadAhead;
use super::store::{OpenedStore, StoreAccess};
use crate::error::{Result, ZarrFusionError};

/// Metadata documents of a group's children requested at once from an
/// object store while they are read.
pub const LISTING_READ_AHEAD: usize = 64;

/// One array of a group: its name (path relative to the group) and metadata.
#[derive(Debug, Clone)]
pub struct ArrayEntry {
    /// The array's name inside the group.
    pub name: String,
    /// Its node path in the store (`/` for an array at the store's root).
    pub path: String,
    /// Its metadata (v2 with `.zattrs` merged into `attributes`).
    pub metadata: ArrayMetadata,
}

/// The direct child arrays of the group at the root of `opened`.
///
/// A store whose root is itself an array yields that one array, named `root_name`.
pub fn discover_arrays(
    opened: &OpenedStore,
    store: &str,
    root_name: &str,
) -> Result<Vec<ArrayEntry>> {
    let storage = &opened.storage;
    if let Some(root) = read_json(storage, store, "", "zarr.json")? {
        return match root.get("node_type").and_then(Value::as_str) {
            Some("array") => Ok(vec![at_root(parse_v3(store, root_name, root)?)]),
            Some("group") => match root
                .get("consolidated_metadata")
                .and_then(|c| c.get("metadata"))
                .and_then(Value::as_object)
            {
                Some(consolidated) => from_consolidated_v3(store, consolidated),
                None => from_listing(opened, store, true),
            },
            _ => Err(ZarrFusionError::store(
                store,
                "zarr.json has no valid node_type ('group' or 'array')",
            )),
        };
    }
    if let Some(consolidated) = read_json(storage, store, "", ".zmetadata")? {
        let entries = consolidated
            .get("metadata")
            .and_then(Value::as_object)
            .ok_or_else(|| ZarrFusionError::store(store, ".zmetadata has no 'metadata' object"))?;
        return from_consolidated_v2(store, entries);
    }
    if read_json(storage, store, "", ".zgroup")?.is_some() {
        return from_listing(opened, store, false);
    }
    if let Some(zarray) = read_json(storage, store, "", ".zarray")? {
        let attrs = read_json(storage, store, "", ".zattrs")?;
        return Ok(vec![at_root(parse_v2(store, root_name, zarray, attrs)?)]);
    }
    Err(ZarrFusionError::store(
        store,
        "no Zarr metadata found (zarr.json, .zmetadata, .zgroup or .zarray)",
    ))
}

fn at_root(entry: ArrayEntry) -> ArrayEntry {
    ArrayEntry {
        path: "/".to_string(),
        ..entry
    }
}

/// The JSON document `file` of node `node`, `None` when absent.
pub(crate) fn read_json(
    storage: &ReadableListableStorage,
    store: &str,
    node: &str,
    file: &str,
) -> Result<Option<Value>> {
    let key_text = if node.is_empty() {
        file.to_string()
    } else {
        format!("{node}/{file}")
    };
    let key = StoreKey::new(key_text.clone()).map_err(|e| ZarrFusionError::store(store, e))?;
    let describe = |message: String| {
        if node.is_empty() {
            ZarrFusionError::store(store, message)
        } else {
            ZarrFusionError::array(store, node, message)
        }
    };
    let Some(bytes) = storage
        .get(&key)
        .map_err(|e| describe(format!("cannot read '{key_text}': {e}")))?
    else {
        return Ok(None);
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| describe(format!("malformed metadata '{key_text}': {e}")))
}

fn parse_v3(store: &str, name: &str, json: Value) -> Result<ArrayEntry> {
    let metadata: ArrayMetadataV3 = serde_json::from_value(json)
        .map_err(|e| ZarrFusionError::array(store, name, format!("invalid zarr.json: {e}")))?;
    Ok(ArrayEntry {
        name: name.to_string(),
        path: format!("/{name}"),
        metadata: ArrayMetadata::V3(metadata),
    })
}

fn parse_v2(store: &str, name: &str, zarray: Value, zattrs: Option<Value>) -> Result<ArrayEntry> {
    let mut metadata: ArrayMetadataV2 = serde_json::from_value(zarray)
        .map_err(|e| ZarrFusionError::array(store, name, format!("invalid .zarray: {e}")))?;
    if let Some(Value::Object(attrs)) = zattrs {
        metadata.attributes = attrs;
    }
    Ok(ArrayEntry {
        name: name.to_string(),
        path: format!("/{name}"),
        metadata: ArrayMetadata::V2(metadata),
    })
}

fn from_consolidated_v3(store: &str, entries: &Map<String, Value>) -> Result<Vec<ArrayEntry>> {
    let mut arrays = Vec::new();
    for (path, json) in entries {
        let path = path.trim_matches('/');
        if path.contains('/') || json.get("node_type").and_then(Value::as_str) != Some("array") {
            continue;
        }
        arrays.push(parse_v3(store, path, json.clone())?);
    }
    arrays.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(arrays)
}

fn from_consolidated_v2(store: &str, entries: &Map<String, Value>) -> Result<Vec<ArrayEntry>> {
    let mut arrays = Vec::new();
    for (key, zarray) in entries {
        let Some(name) = key.strip_suffix("/.zarray") else {
            continue;
        };
        if name.contains('/') {
            continue;
        }
        let attrs = entries.get(&format!("{name}/.zattrs")).cloned();
        arrays.push(parse_v2(store, name, zarray.clone(), attrs)?);
    }
    arrays.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(arrays)
}

/// The arrays among the children of the group (Zarr v3 when `v3`, else
/// v2), from a listing of it and each child's metadata; from an object
/// store, the documents of an array in the group's format are requested
/// for every child together, ahead of their reading.
fn from_listing(opened: &OpenedStore, store: &str, v3: bool) -> Result<Vec<ArrayEntry>> {
    let storage = &opened.storage;
    let files: &[&str] = match v3 {
        true => &["zarr.json"],
        false => &[".zarray", ".zattrs"],
    };
    let listing = storage
        .list_dir(&StorePrefix::root())
        .map_err(|e| ZarrFusionError::store(store, format!("cannot list the group: {e}")))?;
    let children: Vec<&str> = listing
        .prefixes()
        .iter()
        .map(|prefix| prefix.as_str().trim_end_matches('/'))
        .filter(|name| !name.starts_with('.'))
        .collect();
    let _ahead = match &opened.access {
        StoreAccess::Remote(remote) => {
            let keys: Vec<StoreKey> = children
                .iter()
                .flat_map(|name| files.iter().map(move |file| format!("{name}/{file}")))
                .filter_map(|key| StoreKey::new(key).ok())
                .collect();
            let depth = keys.len().clamp(1, LISTING_READ_AHEAD);
            Some(ReadAhead::keys(Arc::clone(remote), keys, depth))
        }
        StoreAccess::Local(_) => None,
    };
    let mut arrays = Vec::new();
    // A child's metadata in the group's format first (what was asked for
    // ahead), then in the other.
    for &name in &children {
        let child = match v3 {
            true => match v3_child(storage, store, name)? {
                Child::Missing => v2_child(storage, store, name)?,
                found => found,
            },
            false => match v2_child(storage, store, name)? {
                Child::Missing => v3_child(storage, store, name)?,
                found => found,
            },
        };
        match child {
            Child::Array(entry) => arrays.push(*entry),
            Child::Other => {}
            Child::Missing => {
                return Err(ZarrFusionError::array(
                    store,
                    name,
                    "no metadata (zarr.json or .zarray) for this child of the group",
                ))
            }
        }
    }
    arrays.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(arrays)
}

/// What a child of a group is, from its metadata.
enum Child {
    /// An array (boxed: metadata is large beside the other variants).
    Array(Box<ArrayEntry>),
    /// Another node (a group).
    Other,
    /// No metadata in the format asked.
    Missing,
}

/// Child `name` read as a Zarr v3 node (`zarr.json`).
fn v3_child(storage: &ReadableListableStorage, store: &str, name: &str) -> Result<Child> {
    Ok(match read_json(storage, store, name, "zarr.json")? {
        Some(json) if json.get("node_type").and_then(Value::as_str) == Some("array") => {
            Child::Array(Box::new(parse_v3(store, name, json)?))
        }
        Some(_) => Child::Other,
        None => Child::Missing,
    })
}

/// Child `name` read as a Zarr v2 node (`.zarray` and `.zattrs`, or `.zgroup`).
fn v2_child(storage: &ReadableListableStorage, store: &str, name: &str) -> Result<Child> {
    if let Some(zarray) = read_json(storage, store, name, ".zarray")? {
        let attrs = read_json(storage, store, name, ".zattrs")?;
        return Ok(Child::Array(Box::new(parse_v2(
            store, name, zarray, attrs,
        )?)));
    }
    Ok(match read_json(storage, store, name, ".zgroup")? {
        Some(_) => Child::Other,
        None => Child::Missing,
    })
}
