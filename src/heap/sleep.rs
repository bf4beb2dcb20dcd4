//! Sleep and wake: tagged memory (`crate::tags`) that `pause_tags` gives back to the device with
//! its addresses kept, and `resume_tags` maps again. Part of the heap: runs under the device lock,
//! `&mut self` throughout.
//!
//! Layout: a non-default tag's allocations live in segments of their own (the tag is in the
//! segment, the block class and the free-list key, like the stream and the lane), and those are
//! always virtual ranges with pages mapped on demand, as expandable segments are — even when
//! the configuration uses plain segments (vLLM's sleep mode reserves one virtual range per
//! allocation for the same reason); with `big_page_mb`, their large blocks take big pages from
//! the first allocation (a pause and a resume then cost few driver calls per byte). So pages
//! never hold blocks of two tags, and a pause unmaps exactly its tag's pages. The default tag
//! is untouched: its memory is laid out as before.
//!
//! This file holds what each tag keeps across pauses (`SleepState`, `TagState`), what a call
//! reports (`SleepOutcome`) and what pause and resume share. The work, one concern a file:
//! - `pause.rs`: `pause_tags` (the device drained, the copies queued, the pages released, in
//!   that order; vLLM's discardable blocks);
//! - `resume.rs`: `resume_tags` (the room checked first, the pages mapped and the bytes copied
//!   back batch by batch, all or none);
//! - `cached.rs`: the free pages a pause keeps for its resume (torch_memory_saver's semantics);
//! - `host.rs`: a tag's host buffers and the copies between them and its blocks.
//!
//! Beside them in the heap: `backup.rs` (the stores a backup goes to: pinned or pageable host
//! buffers, files on disk) and `tagged.rs` (where tagged memory grows, what a free of a paused
//! block does, per-tag figures).
//!
//! Invariants while a tag is paused: its segments keep their blocks (allocated blocks stay
//! allocated, so `free` finds them) but none of their pages is mapped (`pages` holds `None`);
//! its free blocks hold no whole page (they are unmapped blocks); its allocated blocks count in
//! no statistic of the heap (not allocated, not reserved) but in the tag's paused bytes; a free
//! of one drops it and its backup; nothing maps, unmaps or hands out its pages: `malloc` with
//! the tag fails with `Error::Paused`, and `empty_cache`, the cache limit and page reuse take
//! whole pages of free blocks, which `whole_pages` never finds in a paused tag's segments.

mod cached;
mod host;
mod pause;
mod resume;

use super::backup::DiskStore;
use super::Heap;
use crate::error::{Error, Result};
use crate::segment::{BlockState, SegmentId};
use crate::tags::{self, TagId};
use crate::units::MIB;
use std::collections::BTreeMap;

/// Bytes queued between two events of the copy stream: the unit in which unmaps follow copies.
const COPY_BATCH: u64 = 256 * MIB;

/// Paused tags and what each tag keeps across pauses.
#[derive(Default)]
pub(crate) struct SleepState {
    /// Bit `t % 128` of word `t / 128` set while tag number `t` is paused on this device.
    pub(super) paused: [u128; 2],
    /// Per tag number (grown on demand).
    pub(super) tags: Vec<TagState>,
    /// The disk store's staging buffers and files (`heap/backup.rs`).
    pub(super) disk: DiskStore,
}

#[derive(Default)]
pub(super) struct TagState {
    /// Host buffers (address, bytes) of the tag number's store (`heap/backup.rs`: pinned, or
    /// pageable for `mmap`; none for disk), kept across pauses: a backup fills them from the
    /// start, in the order of the tag's blocks.
    pub(super) host: Vec<(u64, u64)>,
    /// While paused with a backup: each backed-up block's address -> (offset into the buffers,
    /// bytes). A block freed while paused leaves.
    pub(super) backup: BTreeMap<u64, (u64, u64)>,
    /// After a resume, the last backup's records while its buffers are kept
    /// (torch_memory_saver's `retain_cpu_backup`): its bytes stay readable through
    /// `backup_host_address` until the next pause, `release_backup`, or the block's free.
    pub(super) retained: BTreeMap<u64, (u64, u64)>,
    /// While paused by a pause that kept cached pages (`tags::keeps_cached`): the whole pages of
    /// the tag's free blocks it unmapped, and those of blocks freed since, as `[lo, hi)` ranges;
    /// the resume maps them again as free cached memory. The tag's segments stay reserved.
    pub(super) cached: Vec<(u64, u64)>,
    /// The last pause kept cached pages (`cached`) for the resume.
    pub(super) keep_cached: bool,
    pub(super) pauses: u64,
    pub(super) resumes: u64,
    pub(super) pause_ns: u64,
    pub(super) resume_ns: u64,
}

impl SleepState {
    #[inline]
    pub(crate) fn any_paused(&self) -> bool {
        self.paused != [0, 0]
    }

    #[inline]
    pub(crate) fn is_paused(&self, tag: TagId) -> bool {
        tag != 0 && self.paused[usize::from(tag >> 7)] & (1u128 << (tag & 127)) != 0
    }

    fn set_paused(&mut self, tag: TagId, paused: bool) {
        let (word, bit) = (usize::from(tag >> 7), 1u128 << (tag & 127));
        if paused {
            self.paused[word] |= bit;
        } else {
            self.paused[word] &= !bit;
        }
    }

    /// The outcome of each of a call's tag numbers and the positions the call acts on: a
    /// number already as the call would leave it (`paused`), or named earlier in the call, is
    /// skipped.
    fn plan(&self, numbers: &[TagId], paused: bool) -> (Vec<SleepOutcome>, Vec<usize>) {
        let mut out = vec![SleepOutcome::default(); numbers.len()];
        let mut todo: Vec<usize> = Vec::new();
        for (i, &tag) in numbers.iter().enumerate() {
            if self.is_paused(tag) == paused || numbers[..i].contains(&tag) {
                out[i].skipped = true;
            } else {
                todo.push(i);
            }
        }
        (out, todo)
    }

    /// Whether `tag` is paused (or pausing) with its free cached pages kept for the resume: its
    /// segments must stay reserved even when nothing of them is mapped.
    pub(super) fn keeps_cached(&self, tag: TagId) -> bool {
        self.tags.get(usize::from(tag)).is_some_and(|t| t.keep_cached)
    }

    pub(super) fn tag(&mut self, tag: TagId) -> &mut TagState {
        let i = usize::from(tag);
        if self.tags.len() <= i {
            self.tags.resize_with(i + 1, TagState::default);
        }
        &mut self.tags[i]
    }

    /// Bytes of pinned host memory held for backups on this device (an `mmap` store's buffers
    /// are not pinned; the disk store's staging is).
    pub(crate) fn host_bytes(&self) -> u64 {
        let pinned = self.tags.iter().enumerate().filter(|&(i, _)| tags::Store::of(i as TagId) != tags::Store::Mmap);
        pinned.flat_map(|(_, t)| t.host.iter()).map(|&(_, bytes)| bytes).sum::<u64>() + self.disk.staging_bytes()
    }
}

/// What one pause or resume of one tag on one device did.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct SleepOutcome {
    /// The tag was paused already (pause) or not paused (resume): nothing was done.
    pub skipped: bool,
    /// Bytes of physical memory given back to the device (the tag's and other tags' idle pages).
    pub released_bytes: u64,
    /// Bytes of physical memory mapped again (resume).
    pub mapped_bytes: u64,
    /// Bytes copied to the host (pause) or back (resume).
    pub copied_bytes: u64,
    /// Bytes of live blocks whose contents were discarded (pause without backup).
    pub discarded_bytes: u64,
}

impl Heap {
    pub(crate) fn check_sleep_call(&self, tag: TagId, what: &str) -> Result<()> {
        if tag == 0 {
            return Err(Error::InvalidArgument(format!(
                "{what} of tag \"default\": memory allocated outside any region has no tag of its own and \
                 cannot be paused; allocate it in a region"
            )));
        }
        if self.captures_underway > 0 {
            return Err(Error::InvalidArgument(format!(
                "{what} of tag {:?} on device {} during a CUDA graph capture: unmapping or mapping memory \
                 would invalidate the capture; {what} after it ends",
                tags::name(tag),
                self.device
            )));
        }
        Ok(())
    }

    /// The allocated blocks of `segments` (a tag's) enter the heap's allocation statistics
    /// (`counted`, at resume) or leave them (at pause): a paused tag's blocks count in none.
    fn count_live_blocks(&mut self, segments: &[SegmentId], counted: bool) {
        for &seg in segments {
            for id in self.arena.segment_blocks(seg).filter(|&id| self.arena.state(id) == BlockState::Allocated) {
                let b = self.arena.block(id);
                let (small, size, requested) = (b.class.small(), b.size, b.requested);
                let s = &mut self.stats;
                if counted {
                    s.allocation.increase(small, 1);
                    s.allocated_bytes.increase(small, size);
                    s.requested_bytes.increase(small, requested);
                } else {
                    s.allocation.decrease(small, 1);
                    s.allocated_bytes.decrease(small, size);
                    s.requested_bytes.decrease(small, requested);
                }
            }
        }
    }
}
