//! Stamps on what a write leaves on disk while it runs, and the sweep that
//! removes what a killed process left.
//!
//! A COPY writes into a temporary directory beside its target
//! (`.<name>.<stamp>.zarrfusion-tmp`) and renames it into place; a rechunk,
//! a selection COPY and the FFT paths keep intermediate arrays in scratch
//! stores under `work_dir` (`zarrfusion-<what>-<stamp>[.zarr]`). Both are
//! removed when the operation ends, also on an error or a panic; a process
//! killed with `kill -9` (or a machine that lost power) leaves them behind.
//! The stamp says whose they are: `<pid>-<nanos>-<host>`. The next write
//! into the same directory removes those of processes of this machine that
//! are gone ([`sweep`]); those of running processes and of other machines
//! (a shared file system) are left alone.
//!
//! In an object store, a bucket many machines share, a name is not enough
//! (two machines can have one host name): a scratch store there holds a
//! marker object ([`SCRATCH_MARKER`], as a COPY target holds its claim)
//! naming its process, machine and *boot* (the kernel's boot id). The first
//! scratch store a process makes in an object-store work directory removes
//! those whose marker names this boot and a process that is gone
//! ([`sweep_remote`]); without a marker, or of another boot, they are left.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use serde_json::{json, Value};
use zarrs::storage::{ReadableWritableListableStorageTraits, StoreKey, StorePrefix};

/// What the sweep looks for in a directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leftover {
    /// Temporary targets of atomic writes, beside their targets.
    TemporaryTarget,
    /// Scratch stores, in a work directory.
    Scratch,
}

/// This machine's name as stamps carry it (letters, digits and `_`), or
/// `None` when it cannot be told (then nothing is swept).
pub(crate) fn host() -> Option<&'static str> {
    static HOST: OnceLock<Option<String>> = OnceLock::new();
    HOST.get_or_init(|| {
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())?;
        let name: String = (name.trim().chars())
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        (!name.is_empty()).then_some(name)
    })
    .as_deref()
}

/// This boot of this machine (`/proc/sys/kernel/random/boot_id`), or
/// `None` where there is none (then nothing in an object store is swept or
/// taken over).
pub(crate) fn boot() -> Option<&'static str> {
    static BOOT: OnceLock<Option<String>> = OnceLock::new();
    BOOT.get_or_init(|| {
        let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let id = id.trim();
        (!id.is_empty()).then(|| id.to_string())
    })
    .as_deref()
}

/// Who this process is, as markers and claims in object stores record it:
/// `{"pid", "host", "boot", "started"}` (seconds since 1970).
pub(crate) fn owner_record() -> Value {
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    json!({
        "pid": std::process::id(),
        "host": host().unwrap_or("unknown"),
        "boot": boot().unwrap_or("unknown"),
        "started": started,
    })
}

/// The process a record ([`owner_record`]) names, when it ran in this boot
/// of this machine and is gone; `None` for a running one, another
/// machine's or boot's, or a record without a boot.
pub(crate) fn gone_owner(record: &Value) -> Option<u32> {
    let pid = record["pid"].as_u64().and_then(|p| u32::try_from(p).ok())?;
    let here = record["host"].as_str().is_some_and(|h| Some(h) == host());
    let this_boot = record["boot"].as_str().is_some_and(|b| Some(b) == boot());
    (here && this_boot && is_gone(pid)).then_some(pid)
}

/// The object at the root of a scratch store in an object store: its
/// maker's `owner_record`.
pub const SCRATCH_MARKER: &str = ".zarrfusion-scratch";

/// Removes the scratch stores under the object-store work directory
/// `storage` (`display` for messages) whose marker names a process of this
/// boot that is gone; returns how many. Runs once per process and work
/// directory (a listing of the directory's top level, one GET per scratch
/// store of this machine). Errors are ignored: a sweep never fails the
/// operation that runs it.
pub fn sweep_remote(display: &str, storage: &dyn ReadableWritableListableStorageTraits) -> usize {
    static SWEPT: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    {
        let mut swept = SWEPT.lock().unwrap_or_else(|e| e.into_inner());
        if !swept
            .get_or_insert_with(HashSet::new)
            .insert(display.to_string())
        {
            return 0;
        }
    }
    let Ok(top) = storage.list_dir(&StorePrefix::root()) else {
        return 0;
    };
    let mut removed = 0;
    for prefix in top.prefixes() {
        let name = prefix.as_str().trim_end_matches('/');
        if owner(name, Leftover::Scratch).is_none() {
            continue;
        }
        let Ok(marker) = StoreKey::new(format!("{name}/{SCRATCH_MARKER}")) else {
            continue;
        };
        let record: Value = (storage.get(&marker).ok().flatten())
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or(Value::Null);
        let Some(pid) = gone_owner(&record) else {
            continue;
        };
        // Everything but the marker, then the marker: a sweep cut short
        // leaves it to the next.
        let Ok(keys) = storage.list_prefix(prefix) else {
            continue;
        };
        let rest: Vec<StoreKey> = keys.into_iter().filter(|k| *k != marker).collect();
        if storage.erase_many(&rest).is_ok() && storage.erase(&marker).is_ok() {
            log::info!("removed '{display}/{name}', left by process {pid}, which is gone");
            removed += 1;
        }
    }
    removed
}

/// A name no other write of this process (or another, or another
/// machine's) is using now: `<pid>-<nanos>-<host>`.
pub fn unique_suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{}-{nanos}-{}",
        std::process::id(),
        host().unwrap_or("unknown")
    )
}

/// The process of a stamp at the end of `name`, when it is one of this
/// machine's.
fn owner(name: &str, kind: Leftover) -> Option<u32> {
    let stamp = match kind {
        Leftover::TemporaryTarget => {
            let rest = name.strip_prefix('.')?.strip_suffix(".zarrfusion-tmp")?;
            rest.rsplit('.').next()?
        }
        Leftover::Scratch => {
            let rest = name.strip_prefix("zarrfusion-")?;
            let rest = rest.strip_suffix(".zarr").unwrap_or(rest);
            let mut fields = rest.rsplitn(4, '-');
            let host = fields.next()?;
            let nanos = fields.next()?;
            let pid = fields.next()?;
            fields.next()?;
            return owner_of(pid, nanos, host);
        }
    };
    let mut fields = stamp.splitn(3, '-');
    let pid = fields.next()?;
    let nanos = fields.next()?;
    owner_of(pid, nanos, fields.next()?)
}

fn owner_of(pid: &str, nanos: &str, stamp_host: &str) -> Option<u32> {
    nanos.parse::<u32>().ok()?;
    (Some(stamp_host) == host()).then_some(())?;
    pid.parse().ok()
}

/// Whether process `pid` of this machine has ended (never said where there
/// is no `/proc` to tell).
pub(crate) fn is_gone(pid: u32) -> bool {
    pid != std::process::id()
        && Path::new("/proc/self").exists()
        && !Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes the leftovers of `kind` in `dir` whose process (of this
/// machine) is gone; returns how many. Errors are ignored: a sweep never
/// fails the write that runs it.
pub fn sweep(dir: &Path, kind: Leftover) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| owner(n, kind)) else {
            continue;
        };
        // Only directories the writes made, never a link to elsewhere.
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && is_gone(pid) && std::fs::remove_dir_all(entry.path()).is_ok() {
            log::info!(
                "removed '{}', left by process {pid}, which is gone",
                entry.path().display()
            );
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_name_their_process_and_machine() {
        let stamp = unique_suffix();
        let pid = std::process::id();
        assert!(stamp.starts_with(&format!("{pid}-")), "{stamp}");
        let temporary = format!(".out.zarr.{stamp}.zarrfusion-tmp");
        assert_eq!(owner(&temporary, Leftover::TemporaryTarget), Some(pid));
        for scratch in [
            format!("zarrfusion-rechunk-{stamp}"),
            format!("zarrfusion-fft-four-step-{stamp}.zarr"),
        ] {
            assert_eq!(owner(&scratch, Leftover::Scratch), Some(pid), "{scratch}");
        }
        // Another machine's, someone else's names, the wrong kind.
        let host = host().unwrap();
        for (name, kind) in [
            (
                format!(".o.{pid}-1-not{host}.zarrfusion-tmp"),
                Leftover::TemporaryTarget,
            ),
            (format!("zarrfusion-x-{pid}-1-not{host}"), Leftover::Scratch),
            (format!("mine-{pid}-1-{host}"), Leftover::Scratch),
            (format!("zarrfusion-{pid}-x-{host}"), Leftover::Scratch),
            (
                ".out.zarr.zarrfusion-tmp".to_string(),
                Leftover::TemporaryTarget,
            ),
            (temporary.clone(), Leftover::Scratch),
        ] {
            assert_eq!(owner(&name, kind), None, "{name}");
        }
    }

    #[test]
    fn the_sweep_removes_only_directories_of_processes_gone() {
        let dir = std::env::temp_dir().join(format!("zf-stamp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let host = host().unwrap();
        let ours = std::process::id();
        let names = [
            format!("zarrfusion-rechunk-{gone}-5-{host}"),
            format!("zarrfusion-rechunk-{ours}-5-{host}"),
            format!("zarrfusion-rechunk-{gone}-5-other{host}"),
            format!("zarrfusion-copy-{gone}-6-{host}.zarr"),
        ];
        for name in &names {
            std::fs::create_dir_all(dir.join(name).join("a")).unwrap();
        }
        std::fs::write(dir.join(format!("zarrfusion-file-{gone}-7-{host}")), b"x").unwrap();
        assert_eq!(sweep(&dir, Leftover::TemporaryTarget), 0);
        assert_eq!(sweep(&dir, Leftover::Scratch), 2);
        assert!(!dir.join(&names[0]).exists() && !dir.join(&names[3]).exists());
        assert!(dir.join(&names[1]).exists() && dir.join(&names[2]).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
