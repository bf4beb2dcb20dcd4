//! The cached pages a pause keeps for its resume (torch_memory_saver's semantics). Part of the
//! heap's sleep and wake (`heap/sleep.rs`); runs under the device lock, `&mut self` throughout.
//!
//! With `tags::keeps_cached` (torch_memory_saver's semantics, set per name by its room), the
//! pause also records the free pages it unmapped (`TagState::cached`; a block freed while paused
//! adds its pages) and keeps the tag's segments reserved, and the resume maps them again, no
//! copy, after the live pages: counted in its room check, all or none, then adopted as free
//! blocks of the tag (filed, in reserved bytes) that its mallocs reuse and `empty_cache` and the
//! cache limits release. Without it a pause releases them for good.
//!
//! Invariants: while such a tag is paused, `TagState::cached` holds the whole pages of its
//! free blocks at the pause and of those freed since (a CUDA graph's pool aside: its free pages
//! come back with its live ones), none of them mapped; `cached_runs` puts the ranges back,
//! merged, until the resume succeeds, so a failed resume leaves them as they were.

use crate::heap::Heap;
use crate::segment::{BlockId, BlockState, SegmentId, ANY_STREAM};
use crate::tags::TagId;

impl Heap {
    /// Records the whole pages of the free block `id` of paused (or pausing) `tag` as cached
    /// pages its resume maps again.
    pub(in crate::heap) fn note_cached(&mut self, tag: TagId, id: BlockId) {
        let b = self.arena.block(id);
        let (lo, hi) = self.arena.segment(b.segment).whole_pages(b.addr, b.size);
        if hi > lo {
            self.sleep.tag(tag).cached.push((lo, hi));
        }
    }

    /// The unmapped runs of `segments` (paused `tag`'s) inside the cached ranges its pause
    /// kept: (segment, start, end), page-aligned, each inside one unmapped block.
    pub(super) fn cached_runs(&mut self, tag: TagId, segments: &[SegmentId]) -> Vec<CachedRun> {
        let mut ranges = std::mem::take(&mut self.sleep.tag(tag).cached);
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
        for (lo, hi) in ranges {
            match merged.last_mut() {
                Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
                _ => merged.push((lo, hi)),
            }
        }
        let mut runs = Vec::new();
        for &seg in segments {
            for id in self.arena.segment_blocks(seg) {
                if self.arena.state(id) != BlockState::Unmapped {
                    continue;
                }
                let (addr, end) = (self.arena.block(id).addr, self.arena.block(id).addr + self.arena.block(id).size);
                for &(lo, hi) in &merged {
                    let (start, stop) = (lo.max(addr), hi.min(end));
                    if start < stop {
                        runs.push((seg, start, stop));
                    }
                }
            }
        }
        // Kept until the resume succeeds: a failed one leaves the tag paused as it was.
        self.sleep.tag(tag).cached = merged;
        runs
    }

    /// After a resume mapped the pages of `run` (reserved bytes counted then): the part of the
    /// unmapped block there becomes a free block, merged with free neighbours and filed, as
    /// `map_block` leaves pages it maps for a request. Its pages are the tag's cached memory:
    /// a malloc of the tag reuses them, `empty_cache` and the cache limits release them.
    pub(super) fn adopt_cached(&mut self, (seg, start, end): CachedRun) {
        let Some(id) = self.arena.segment_blocks(seg).find(|&id| {
            let b = self.arena.block(id);
            self.arena.state(id) == BlockState::Unmapped && b.addr <= start && end <= b.addr + b.size
        }) else {
            debug_assert!(false, "a cached run lost its unmapped block");
            return;
        };
        let (addr, size) = (self.arena.block(id).addr, self.arena.block(id).size);
        self.arena.remove_unmapped(id);
        let mut middle = id;
        if start > addr {
            middle = self.split_block(id, start - addr);
            self.arena.add_unmapped(id);
        }
        if end < addr + size {
            let rest = self.split_block(middle, end - start);
            self.arena.add_unmapped(rest);
        }
        let clock = self.alloc_clock;
        self.arena.set_state(middle, BlockState::Free);
        let b = self.arena.block_mut(middle);
        // Fresh pages: no stream's work is queued on them.
        b.stream = ANY_STREAM;
        b.freed_at = clock;
        self.arena.segment_mut(seg).mapped += end - start;
        let (merged, absorbed, absorbed_bytes) = self.merge_neighbours(middle);
        self.enlist(merged);
        self.count_merged_free(merged, absorbed, absorbed_bytes);
    }
}

/// Cached pages a resume maps again: (segment, start, end), inside one unmapped block.
pub(super) type CachedRun = (SegmentId, u64, u64);
