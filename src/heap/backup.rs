//! The backup stores of paused tags (`tags::Store`): where a pause keeps the bytes of a tag
//! number's live blocks and where a resume finds them. Part of the heap: runs under the device
//! lock, `&mut self` throughout; `heap/sleep/` orders the pause and the resume and calls in
//! here (`host.rs` to back a tag up, `resume.rs` to restore it; `heap/tagged.rs` when a paused
//! block is freed).
//!
//! - `Pinned`: the tag's host buffers (`TagState::host`) are pinned (`Backend::host_alloc`);
//!   copies are asynchronous on the copy stream, and unmaps follow them batch by batch.
//! - `Mmap`: the same buffers, but pageable anonymous memory (`host_alloc_pageable`), never
//!   pinned nor registered with the driver (torch_memory_saver's `mmap` backend): the driver
//!   stages each copy, so they are slower, and the OS may page them out. They count in no
//!   pinned figure (`SleepState::host_bytes`), in the tag's `mmap_bytes`.
//! - `Disk`: one file per live block in the backup directory (`set_dir`; process-wide, like
//!   torch_memory_saver's `TMS_DISK_BACKUP_DIR`), written through two pinned staging buffers of
//!   `DISK_CHUNK` bytes (the copy of one piece runs while the other is written), each synced
//!   before the pause goes on; a resume reads them back the same way and removes them. Host
//!   memory holds no copy, so `backup_host_address` finds none (torch_memory_saver's
//!   `get_cpu_backup` returns None for disk-backed memory too).
//!
//! Invariants: a disk pause writes every file before any page of the tag is released; when one
//! cannot be created or written (missing or unwritable directory, full disk, file-size limit)
//! the files it created are removed and the error names the tag and the path, with the tag still
//! resident and intact. While a tag number is paused to disk, `DiskStore::files` holds a file
//! for exactly its backed-up blocks (a free of one removes its file); none once it resumed.

use super::Heap;
use crate::backend::Event;
use crate::error::{Error, Result};
use crate::tags::{self, Store, TagId};
use crate::units::{format_bytes, MIB};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// One staging buffer of the disk store, and the most one copy or file call moves.
const DISK_CHUNK: u64 = 64 * MIB;

/// The backup directory set by `set_dir` (None: `default_dir`). A leaf lock: taken alone, for
/// a copy of the path.
static DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Taken by the library's own tests that set the backup directory (it is process-wide).
#[cfg(test)]
pub(crate) static TEST_DIR_LOCK: Mutex<()> = Mutex::new(());

/// The directory disk backups go to when none was set: `STEPALLOC_BACKUP_DIR`, else the
/// system's temporary directory.
fn default_dir() -> PathBuf {
    std::env::var_os("STEPALLOC_BACKUP_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir)
}

/// The directory disk backups go to now.
pub fn dir() -> PathBuf {
    DIR.lock().clone().unwrap_or_else(default_dir)
}

/// Sets the directory later disk backups go to (created if missing). Refused, naming the path
/// and the reason, when it cannot be created or is not a directory this process can create
/// files in (checked by creating and removing one).
pub fn set_dir(path: &str) -> Result<()> {
    if path.is_empty() || path.contains('\0') {
        return Err(Error::InvalidArgument(format!("backup directory {path:?}: not a path")));
    }
    let dir = PathBuf::from(path);
    let refuse = |why: String| Error::InvalidArgument(format!("backup directory {path:?}: {why}"));
    std::fs::create_dir_all(&dir).map_err(|e| refuse(format!("cannot be created ({e})")))?;
    if !dir.is_dir() {
        return Err(refuse("is not a directory".into()));
    }
    let probe = dir.join(format!(".stepalloc-probe-{}", std::process::id()));
    create_file(&probe).map_err(|e| refuse(format!("no file can be created in it ({e})")))?;
    let _ = std::fs::remove_file(&probe);
    *DIR.lock() = Some(dir);
    Ok(())
}

/// A new file, readable and writable by this user only; an existing one is not reused.
fn create_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path)
}

/// Why a call failed, without the error kind's prefix when the message says it all.
fn reason(e: &Error) -> String {
    match e {
        Error::Unavailable(why) => why.clone(),
        other => other.to_string(),
    }
}

/// The disk store of one device: the staging buffers and the files of paused blocks.
#[derive(Default)]
pub(crate) struct DiskStore {
    /// Two pinned staging buffers (address, bytes) once a disk pause needed them.
    staging: Vec<(u64, u64)>,
    /// (tag number, block address) -> its file, while the tag number is paused.
    files: BTreeMap<(TagId, u64), PathBuf>,
    /// Files created by this device's heap, for unique names.
    created: u64,
}

impl DiskStore {
    /// Bytes of pinned staging memory held.
    pub(super) fn staging_bytes(&self) -> u64 {
        self.staging.iter().map(|&(_, bytes)| bytes).sum()
    }
}

impl Heap {
    /// Allocates a host buffer of `tag`'s store: pageable for `Mmap`, else pinned.
    pub(super) fn host_buffer_alloc(&mut self, tag: TagId, bytes: u64) -> Result<u64> {
        match Store::of(tag) {
            Store::Mmap => self.backend.host_alloc_pageable(bytes),
            _ => self.backend.host_alloc(bytes),
        }
    }

    /// Frees a buffer from `host_buffer_alloc(tag, bytes)`.
    pub(super) fn host_buffer_free(&mut self, tag: TagId, addr: u64, bytes: u64) -> Result<()> {
        match Store::of(tag) {
            Store::Mmap => self.backend.host_free_pageable(addr, bytes),
            _ => self.backend.host_free(addr, bytes),
        }
    }

    /// What kind of host memory `tag`'s buffers are, for messages.
    pub(super) fn host_kind(tag: TagId) -> &'static str {
        match Store::of(tag) {
            Store::Mmap => "pageable (mmap) host memory",
            _ => "pinned host memory",
        }
    }

    /// Frees the disk store's staging buffers (outside a pause or resume). Returns bytes freed.
    pub(super) fn release_staging(&mut self) -> Result<u64> {
        let mut freed = 0;
        while let Some((addr, bytes)) = self.sleep.disk.staging.pop() {
            self.backend.host_free(addr, bytes)?;
            freed += bytes;
        }
        Ok(freed)
    }

    /// Writes each of `live` blocks (address, bytes, size) of `tag` to a file of its own in the
    /// backup directory, all before returning (so the caller's unmaps need no copy batches).
    /// Returns the backup records (address -> (0, bytes)). On an error, the files written so far
    /// are removed and nothing else changed.
    pub(super) fn backup_to_disk(&mut self, tag: TagId, live: &[(u64, u64, u64)]) -> Result<BTreeMap<u64, (u64, u64)>> {
        if live.iter().all(|&(_, bytes, _)| bytes == 0) {
            return Ok(BTreeMap::new());
        }
        let dir = dir();
        self.ensure_staging(tag)?;
        let mut written: Vec<(u64, PathBuf)> = Vec::new();
        let mut backups = BTreeMap::new();
        let mut result = Ok(());
        for &(addr, bytes, _) in live {
            if bytes == 0 {
                continue;
            }
            self.sleep.disk.created += 1;
            let path = dir.join(format!(
                "stepalloc-{}-d{}-{}-{}.bak",
                std::process::id(),
                self.device,
                tags::name(tag),
                self.sleep.disk.created
            ));
            let file = match create_file(&path) {
                Ok(file) => file,
                Err(e) => {
                    result = Err(self.disk_error(tag, &path, "could not create", &e.to_string()));
                    break;
                }
            };
            written.push((addr, path.clone()));
            let done = self
                .device_to_file(&file, addr, bytes)
                .and_then(|()| file.sync_data().map_err(|e| Error::Unavailable(format!("fsync: {e}"))));
            if let Err(e) = done {
                result = Err(self.disk_error(tag, &path, "could not write", &reason(&e)));
                break;
            }
            backups.insert(addr, (0, bytes));
        }
        if let Err(e) = result {
            for (_, path) in written {
                let _ = std::fs::remove_file(path);
            }
            return Err(e);
        }
        for (addr, path) in written {
            self.sleep.disk.files.insert((tag, addr), path);
        }
        Ok(backups)
    }

    /// Restores `bytes` at `addr` (mapped) of paused `tag` from its file. The copies are queued
    /// on the copy stream; the caller waits for them. The file stays until `drop_disk_files`.
    pub(super) fn restore_from_disk(&mut self, tag: TagId, addr: u64, bytes: u64) -> Result<()> {
        let Some(path) = self.sleep.disk.files.get(&(tag, addr)).cloned() else {
            return Err(Error::Unavailable(format!(
                "resume of tag {:?}: the disk backup of the block at {addr:#x} is missing",
                tags::name(tag)
            )));
        };
        self.ensure_staging(tag)?;
        let file = File::open(&path).map_err(|e| self.disk_error(tag, &path, "could not open", &e.to_string()))?;
        self.file_to_device(&file, addr, bytes).map_err(|e| self.disk_error(tag, &path, "could not read", &reason(&e)))
    }

    /// Removes the files of `tag` (after its resume, or when its blocks are gone).
    pub(super) fn drop_disk_files(&mut self, tag: TagId) {
        let keys: Vec<(TagId, u64)> =
            self.sleep.disk.files.range((tag, 0)..=(tag, u64::MAX)).map(|(&k, _)| k).collect();
        for key in keys {
            if let Some(path) = self.sleep.disk.files.remove(&key) {
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// Removes the file of one block of `tag` (freed while paused), if it has one.
    pub(super) fn drop_disk_file(&mut self, tag: TagId, addr: u64) {
        if let Some(path) = self.sleep.disk.files.remove(&(tag, addr)) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Bytes held in disk files for `tag` now.
    pub(super) fn disk_bytes(&self, tag: TagId) -> u64 {
        if Store::of(tag) != Store::Disk || !self.sleep.is_paused(tag) {
            return 0;
        }
        self.sleep.tags.get(usize::from(tag)).map_or(0, |s| s.backup.values().map(|&(_, bytes)| bytes).sum())
    }

    // ----- the steps ------------------------------------------------------------------------

    /// The error of a disk pause or resume of `tag` that failed at `path`.
    #[cold]
    fn disk_error(&self, tag: TagId, path: &Path, what: &str, why: &str) -> Error {
        let pausing = !self.sleep.is_paused(tag);
        Error::Unavailable(format!(
            "disk backup of tag {:?} on device {}: {what} {} ({why}); {}",
            tags::name(tag),
            self.device,
            path.display(),
            if pausing {
                "nothing was released or lost: the tag is resident, as before the pause. Free disk space or set \
                 another backup directory, or use a host backup"
            } else {
                "the tag stays paused with its backup files; resume it again once the cause is fixed"
            }
        ))
    }

    /// Allocates the two staging buffers once.
    fn ensure_staging(&mut self, tag: TagId) -> Result<()> {
        while self.sleep.disk.staging.len() < 2 {
            let addr = self.backend.host_alloc(DISK_CHUNK).map_err(|e| {
                Error::Unavailable(format!(
                    "disk backup of tag {:?} on device {}: could not allocate {} of pinned host memory to stage \
                     it ({e}); nothing was released or lost",
                    tags::name(tag),
                    self.device,
                    format_bytes(DISK_CHUNK)
                ))
            })?;
            self.sleep.disk.staging.push((addr, DISK_CHUNK));
        }
        Ok(())
    }

    /// Copies `[addr, addr + bytes)` to `file` in pieces through the staging buffers: the copy
    /// of a piece runs while the one before is written.
    fn device_to_file(&mut self, file: &File, addr: u64, bytes: u64) -> Result<()> {
        let staging = [self.sleep.disk.staging[0].0, self.sleep.disk.staging[1].0];
        // The piece copied and not yet written: (staging slot, event, offset, bytes).
        let mut pending: Option<(usize, Event, u64, u64)> = None;
        let (mut offset, mut slot) = (0u64, 0usize);
        let mut result = Ok(());
        while result.is_ok() && offset < bytes {
            let n = (bytes - offset).min(DISK_CHUNK);
            // The slot's last piece was written before this one was queued (two slots).
            let queued = self
                .backend
                .copy_to_host(staging[slot], addr + offset, n)
                .and_then(|()| self.backend.record_copy_event());
            let event = match queued {
                Ok(event) => event,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            if let Some((s, before, at, m)) = pending.replace((slot, event, offset, n)) {
                result = self.write_piece(file, staging[s], before, at, m);
            }
            offset += n;
            slot ^= 1;
        }
        if let Some((s, event, at, m)) = pending {
            let written = self.write_piece(file, staging[s], event, at, m);
            result = result.and(written);
        }
        result
    }

    /// Waits for `event` (the copy into the staging buffer at `host`), then writes its `bytes`
    /// to `file` at `offset`.
    fn write_piece(&mut self, file: &File, host: u64, event: Event, offset: u64, bytes: u64) -> Result<()> {
        let waited = self.backend.wait_event(event);
        self.backend.free_event(event);
        waited?;
        self.backend.host_to_file(host, bytes, file, offset)
    }

    /// Reads `file` into `[addr, addr + bytes)` in pieces through the staging buffers: a piece
    /// is read while the copy of the one before runs.
    fn file_to_device(&mut self, file: &File, addr: u64, bytes: u64) -> Result<()> {
        let staging = [self.sleep.disk.staging[0].0, self.sleep.disk.staging[1].0];
        // The copy still reading each slot.
        let mut in_flight: [Option<Event>; 2] = [None, None];
        let (mut offset, mut slot) = (0u64, 0usize);
        let mut result = Ok(());
        while offset < bytes {
            let n = (bytes - offset).min(DISK_CHUNK);
            if let Some(event) = in_flight[slot].take() {
                let waited = self.backend.wait_event(event);
                self.backend.free_event(event);
                if let Err(e) = waited {
                    result = Err(e);
                    break;
                }
            }
            let queued = self
                .backend
                .file_to_host(file, offset, staging[slot], n)
                .and_then(|()| self.backend.copy_to_device(addr + offset, staging[slot], n))
                .and_then(|()| self.backend.record_copy_event());
            match queued {
                Ok(event) => in_flight[slot] = Some(event),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            offset += n;
            slot ^= 1;
        }
        // The staging buffers are free again once their copies completed.
        for event in in_flight.into_iter().flatten() {
            let waited = self.backend.wait_event(event);
            self.backend.free_event(event);
            result = result.and(waited);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_that_cannot_hold_files_is_refused_when_set() {
        let _dir = TEST_DIR_LOCK.lock();
        let base = std::env::temp_dir().join(format!("stepalloc-backup-dir-test-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let file = base.join("a-file");
        std::fs::write(&file, b"x").unwrap();
        // A path under a regular file cannot be created.
        let under = file.join("sub");
        let e = set_dir(under.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("backup directory") && e.contains("sub"), "{e}");
        // A regular file is not a directory.
        let e = set_dir(file.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("is not a directory") || e.contains("cannot be created"), "{e}");
        assert!(set_dir("").is_err());
        // A good one is created and taken.
        let good = base.join("new").join("dir");
        set_dir(good.to_str().unwrap()).unwrap();
        assert_eq!(dir(), good);
        assert!(good.is_dir() && std::fs::read_dir(&good).unwrap().next().is_none(), "the probe file was left");
        *DIR.lock() = None;
        std::fs::remove_dir_all(&base).unwrap();
    }
}
