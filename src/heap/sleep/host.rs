//! The host side of a backup: each tag number's host buffers (of its store, `heap/backup.rs`:
//! pinned, or pageable for `mmap`; none for disk) and the copies between them and the tag's
//! blocks. Part of the heap's sleep and wake (`heap/sleep.rs`); runs under the device lock,
//! `&mut self` throughout.
//!
//! Invariants: a tag's buffers are kept across pauses and only grow (by `HOST_GROWTH` at least,
//! or by just the shortfall when the host has less) until `release_backup` frees those of every
//! tag with no paused bytes in them; a backup fills them from the start, in the tag's block
//! order; a copy is cut into pieces of at most `COPY_PIECE` bytes that never cross a buffer's
//! end, and the pause records an event on the copy stream every `COPY_BATCH` bytes; when a
//! pause cannot get its buffers or queue its copies, it waits for what it queued and nothing
//! was released.

use super::COPY_BATCH;
use crate::backend::Event;
use crate::error::{Error, Result};
use crate::heap::Heap;
use crate::tags::{self, TagId};
use crate::units::{format_bytes, MIB};
use std::collections::BTreeMap;

/// One asynchronous copy at most: large enough for a copy engine's full speed.
const COPY_PIECE: u64 = 64 * MIB;
/// The least a tag's host buffers grow by (a pinned allocation costs far more than its bytes'
/// copy, so few and large).
const HOST_GROWTH: u64 = 64 * MIB;

impl Heap {
    /// Frees the host buffers of every tag that holds no paused bytes in them, and the disk
    /// store's staging. Returns the bytes freed.
    pub fn release_backup(&mut self) -> Result<u64> {
        let mut freed = self.release_staging()?;
        for i in 0..self.sleep.tags.len() {
            if !self.sleep.tags[i].backup.is_empty() {
                continue;
            }
            self.sleep.tags[i].retained.clear();
            while let Some((addr, bytes)) = self.sleep.tags[i].host.pop() {
                self.host_buffer_free(i as TagId, addr, bytes)?;
                freed += bytes;
            }
        }
        Ok(freed)
    }

    /// Bytes of pinned host memory held for backups.
    pub fn backup_host_bytes(&self) -> u64 {
        self.sleep.host_bytes()
    }

    /// Queues the copies of `live` blocks (address, bytes, size) into `tag`'s host buffers
    /// (grown when short). Returns the batches' events with the end address each covers, and
    /// the backup records.
    #[allow(clippy::type_complexity)]
    pub(super) fn queue_backup(
        &mut self,
        tag: TagId,
        live: &[(u64, u64, u64)],
    ) -> Result<(Vec<(u64, Event)>, BTreeMap<u64, (u64, u64)>)> {
        if tags::Store::of(tag) == tags::Store::Disk {
            return Ok((Vec::new(), self.backup_to_disk(tag, live)?));
        }
        let need: u64 = live.iter().map(|&(_, bytes, _)| bytes).sum();
        self.grow_host(tag, need)?;
        let host = self.sleep.tag(tag).host.clone();
        let (mut batches, mut backups) = (Vec::new(), BTreeMap::new());
        let (mut offset, mut in_batch) = (0u64, 0u64);
        let mut queued = Ok(());
        for &(addr, bytes, size) in live {
            if bytes == 0 {
                continue;
            }
            queued = copy_pieces(&host, offset, bytes, addr, |dev, host, n| self.backend.copy_to_host(host, dev, n));
            if queued.is_err() {
                break;
            }
            backups.insert(addr, (offset, bytes));
            offset += bytes;
            in_batch += bytes;
            if in_batch >= COPY_BATCH {
                match self.backend.record_copy_event() {
                    Ok(event) => batches.push((addr + size, event)),
                    Err(e) => {
                        queued = Err(e);
                        break;
                    }
                }
                in_batch = 0;
            }
        }
        if queued.is_ok() && in_batch > 0 {
            match self.backend.record_copy_event() {
                Ok(event) => batches.push((u64::MAX, event)),
                Err(e) => queued = Err(e),
            }
        }
        if let Err(e) = queued {
            // Nothing was unmapped yet: wait for what was queued and leave the tag as it was.
            let drained = self.wait_for_copies();
            for (_, event) in batches {
                self.backend.free_event(event);
            }
            drained?;
            return Err(e);
        }
        Ok((batches, backups))
    }

    /// Waits until every copy queued on the copy stream so far has completed.
    pub(super) fn wait_for_copies(&mut self) -> Result<()> {
        let event = self.backend.record_copy_event()?;
        let waited = self.backend.wait_event(event);
        self.backend.free_event(event);
        waited
    }

    /// Grows `tag`'s host buffers (of its store) to hold `need` bytes.
    fn grow_host(&mut self, tag: TagId, need: u64) -> Result<()> {
        let have: u64 = self.sleep.tag(tag).host.iter().map(|&(_, bytes)| bytes).sum();
        if have >= need {
            return Ok(());
        }
        let mut bytes = (need - have).max(HOST_GROWTH).div_ceil(2 * MIB).saturating_mul(2 * MIB);
        // The growth is a floor for speed, not a need: short of host memory, ask for the need.
        let addr = match self.host_buffer_alloc(tag, bytes) {
            Ok(addr) => addr,
            Err(_) if bytes > need - have => {
                bytes = (need - have).div_ceil(2 * MIB).saturating_mul(2 * MIB);
                self.host_buffer_alloc(tag, bytes).map_err(|e| self.host_short(tag, bytes, e))?
            }
            Err(e) => return Err(self.host_short(tag, bytes, e)),
        };
        self.sleep.tag(tag).host.push((addr, bytes));
        Ok(())
    }

    /// The error of a pause that could not get `bytes` of host memory for `tag`'s backup:
    /// nothing was released yet, so the tag stays resident with its bytes.
    #[cold]
    fn host_short(&self, tag: TagId, bytes: u64, cause: Error) -> Error {
        let why = match cause {
            Error::OutOfMemory(_) => "out of memory".to_string(),
            other => other.to_string(),
        };
        Error::Unavailable(format!(
            "pause of tag {:?} on device {}: could not allocate {} of {} for its backup ({why}); \
             nothing was released: the tag stays on the device with its contents. Free host memory, or pause it \
             with backup=False (its contents are then discarded)",
            tags::name(tag),
            self.device,
            format_bytes(bytes),
            Self::host_kind(tag)
        ))
    }
}

/// Runs `copy(device address, host address, bytes)` over `bytes` at `device`, backed at
/// `offset` of the concatenated host `buffers`, in pieces of at most `COPY_PIECE` that never
/// cross a buffer's end.
pub(super) fn copy_pieces(
    buffers: &[(u64, u64)],
    offset: u64,
    bytes: u64,
    device: u64,
    mut copy: impl FnMut(u64, u64, u64) -> Result<()>,
) -> Result<()> {
    let (mut offset, mut done) = (offset, 0u64);
    let mut base = 0u64;
    for &(host, size) in buffers {
        while done < bytes && offset < base + size {
            let n = (bytes - done).min(base + size - offset).min(COPY_PIECE);
            copy(device + done, host + (offset - base), n)?;
            done += n;
            offset += n;
        }
        base += size;
        if done == bytes {
            return Ok(());
        }
    }
    Err(Error::InvalidArgument(format!("backup of {bytes} bytes does not fit the host buffers")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_cut_at_buffer_ends_and_piece_size() {
        let buffers = [(1000, 100 * MIB), (9_000_000_000, 200 * MIB)];
        let mut calls = Vec::new();
        copy_pieces(&buffers, 90 * MIB, 80 * MIB, 1 << 40, |d, h, n| {
            calls.push((d, h, n));
            Ok(())
        })
        .unwrap();
        assert_eq!(
            calls,
            vec![
                (1 << 40, 1000 + 90 * MIB, 10 * MIB),
                ((1 << 40) + 10 * MIB, 9_000_000_000, 64 * MIB),
                ((1 << 40) + 74 * MIB, 9_000_000_000 + 64 * MIB, 6 * MIB)
            ]
        );
        assert!(copy_pieces(&buffers, 250 * MIB, 100 * MIB, 0, |_, _, _| Ok(())).is_err());
    }
}
