//! Tagged memory outside pause and resume: where a tagged request grows (its own virtual
//! ranges), how a free of a paused tag's block drops it, how free pages of a tagged segment
//! become unmapped, and the per-tag figures. Part of the heap: runs under the device lock,
//! `&mut self` throughout. The layout and the invariants are described in `heap/sleep.rs`.

use super::Heap;
use crate::backend::{PhysHandle, Stream};
use crate::error::{Error, Result};
use crate::segment::{BlockId, BlockState, SegmentId, ANY_STREAM};
use crate::stats::ReleaseReason;
use crate::tags::{self, TagId};
use crate::trace::TraceAction;
use crate::units::format_bytes;
use std::collections::BTreeMap;

pub use crate::stats::TagFigures;

impl Heap {
    /// A tagged request no free block could serve: the tag's own virtual ranges in `pool` grow
    /// (0: the general pool; a CUDA graph's pool captured under a tag, `heap/graphs.rs`).
    pub(super) fn grow_tagged(
        &mut self,
        pool: u32,
        small: bool,
        stream: Stream,
        rounded: u64,
        requested: u64,
        tag: TagId,
    ) -> Result<BlockId> {
        (self.request_pool, self.request_tag) = (pool, tag);
        let grown = self.grow_expandable(small, stream, rounded, requested, false);
        (self.request_pool, self.request_tag) = (0, 0);
        grown
    }

    #[cold]
    pub(super) fn paused_error(&self, tag: TagId, size: u64) -> Error {
        Error::Paused(format!(
            "allocation of {} on device {} in a region of tag {:?}, which is paused; resume it first",
            format_bytes(size),
            self.device,
            tags::name(tag)
        ))
    }

    /// The live segments of `tag`, in address order.
    pub(super) fn tag_segments(&self, tag: TagId) -> Vec<SegmentId> {
        let mut segments: Vec<(u64, SegmentId)> = self
            .arena
            .live_segment_ids()
            .filter(|&s| self.arena.segment(s).tag == tag)
            .map(|s| (self.arena.segment(s).addr, s))
            .collect();
        segments.sort_unstable();
        segments.into_iter().map(|(_, s)| s).collect()
    }

    /// Whether `tag` is paused on this device.
    pub fn tag_paused(&self, tag: TagId) -> bool {
        self.sleep.is_paused(tag)
    }

    /// Figures of "default" and of every tag with memory, state or a registered name, one per
    /// name (its numbers, one per backup store, summed).
    pub fn tag_figures(&self) -> Vec<TagFigures> {
        let mut figures: BTreeMap<TagId, TagFigures> = BTreeMap::new();
        let mut tagged_live = 0;
        for seg_id in self.arena.live_segment_ids() {
            let seg = self.arena.segment(seg_id);
            if seg.tag == 0 {
                continue;
            }
            let paused = self.sleep.is_paused(seg.tag);
            let f = figures.entry(tags::base(seg.tag)).or_default();
            for id in self.arena.segment_blocks(seg_id) {
                if self.arena.state(id) == BlockState::Allocated {
                    let size = self.arena.block(id).size;
                    f.backup |= tags::backup(seg.tag);
                    if paused {
                        f.paused_bytes += size;
                    } else {
                        f.live_bytes += size;
                        tagged_live += size;
                    }
                }
            }
        }
        for (tag, _) in tags::registered() {
            figures.entry(tag).or_default();
        }
        figures.entry(0).or_default();
        // Per tag number; a number no name owns (the state vector is grown by index) shows nothing.
        for (i, state) in self.sleep.tags.iter().enumerate() {
            let Some(f) = figures.get_mut(&tags::base(i as TagId)) else { continue };
            f.backup_bytes += state.backup.values().map(|&(_, bytes)| bytes).sum::<u64>();
            let host = state.host.iter().map(|&(_, bytes)| bytes).sum::<u64>();
            match tags::Store::of(i as TagId) {
                tags::Store::Mmap => f.mmap_bytes += host,
                _ => f.host_bytes += host,
            }
            f.disk_bytes += self.disk_bytes(i as TagId);
            // A pause or resume of a name acts on both its numbers: count it once.
            f.pauses = f.pauses.max(state.pauses);
            f.resumes = f.resumes.max(state.resumes);
            f.pause_seconds += state.pause_ns as f64 / 1e9;
            f.resume_seconds += state.resume_ns as f64 / 1e9;
        }
        let default = figures.entry(0).or_default();
        default.live_bytes = self.stats.allocated_bytes.current().saturating_sub(tagged_live);
        figures
            .into_iter()
            .map(|(tag, mut f)| {
                f.tag = tags::name(tag);
                f.paused = tags::numbers(tag).iter().any(|&t| self.sleep.is_paused(t));
                f
            })
            .collect()
    }

    /// The handle slot of page `index` of a tagged segment.
    pub(super) fn sleep_page(&mut self, seg: SegmentId, index: usize) -> &mut Option<PhysHandle> {
        &mut self.pages.entry(seg).or_default()[index]
    }

    /// A free of an allocated block of a paused tag: the block is dropped with its backup. It
    /// merges with free neighbours and its whole pages become unmapped (nothing is mapped
    /// there, so no driver call); the heap's statistics left it at the pause.
    pub(super) fn free_paused(&mut self, id: BlockId) -> Result<()> {
        let (addr, size, requested, stream, tag) = {
            let b = self.arena.block(id);
            (b.addr, b.size, b.requested, b.stream, b.class.tag())
        };
        self.stats.num_frees += 1;
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.decrease(1);
        }
        self.trace.record(TraceAction::FreeRequested, addr, size, requested, stream.0, 0);
        self.sleep.tag(tag).backup.remove(&addr);
        self.drop_disk_file(tag, addr);
        self.arena.take_extra_streams(id);
        self.arena.set_state(id, BlockState::Free);
        let clock = self.alloc_clock;
        let b = self.arena.block_mut(id);
        b.requested = 0;
        b.freed_at = clock;
        // Its streams' work completed before the pause released its pages: any stream may use it.
        b.stream = ANY_STREAM;
        self.trace.record(TraceAction::FreeCompleted, addr, size, requested, stream.0, 0);
        let (merged, absorbed, absorbed_bytes) = self.merge_neighbours(id);
        self.enlist(merged);
        self.count_merged_free(merged, absorbed, absorbed_bytes);
        if !self.graph_keeps(merged) {
            if self.sleep.keeps_cached(tag) {
                // Its pages come back at the resume as the tag's cached memory, as those of
                // the blocks free at the pause (torch_memory_saver maps whole segments again).
                self.note_cached(tag, merged);
            }
            self.unmap_free_pages(merged, ReleaseReason::Pause)?;
        }
        Ok(())
    }

    /// Makes every free block of `segments` (a tag's, whose streams' work completed) serve any
    /// stream and merges neighbours that could not merge before, as `settle_free_streams` does
    /// after a device sync.
    pub(super) fn settle_tag_free_streams(&mut self, segments: &[SegmentId]) {
        let free: Vec<BlockId> = segments
            .iter()
            .flat_map(|&seg| self.arena.segment_blocks(seg))
            .filter(|&id| self.arena.state(id) == BlockState::Free)
            .collect();
        self.merge_as_any_stream(free);
    }

    /// MemPool mode: the whole pages of a tagged free block (merged, in its list) go back to the
    /// device once the stream that used it finished, as a plain segment entirely free does.
    pub(super) fn release_tagged_free(&mut self, id: BlockId) -> Result<()> {
        let stream = self.arena.block(id).stream;
        if stream != ANY_STREAM {
            self.backend.synchronize_stream(stream)?;
        }
        self.unmap_free_pages(id, ReleaseReason::EmptyCache)?;
        Ok(())
    }

    /// Turns the whole pages inside the free block `id` (in its list) of a tagged segment into
    /// an unmapped block, unmapping and releasing those still mapped. The caller waited for the
    /// work that used them. Returns the bytes released to the device.
    pub(super) fn unmap_free_pages(&mut self, id: BlockId, reason: ReleaseReason) -> Result<u64> {
        let (addr, size, seg_id) = {
            let b = self.arena.block(id);
            (b.addr, b.size, b.segment)
        };
        let (seg_addr, page, small, stream) = {
            let s = self.arena.segment(seg_id);
            (s.addr, s.page, s.small, s.stream)
        };
        let (lo, hi) = self.arena.segment(seg_id).whole_pages(addr, size);
        if hi <= lo {
            return Ok(0);
        }
        let mut released = 0;
        for p in (lo..hi).step_by(page as usize) {
            let index = ((p - seg_addr) / page) as usize;
            let Some(handle) = self.sleep_page(seg_id, index).take() else { continue };
            self.backend.unmap(p, page)?;
            self.backend.release_physical(handle)?;
            let s = &mut self.stats;
            s.num_unmap += 1;
            s.num_release_physical += 1;
            s.reserved_bytes.decrease(small, page);
            s.released_bytes[reason as usize] = s.released_bytes[reason as usize].saturating_add(page);
            released += page;
        }
        self.unlist(id);
        self.split_stat_out(id);
        let mut middle = id;
        if lo > addr {
            middle = self.split_block(id, lo - addr);
            self.enlist(id);
            self.split_stat_in(id);
        }
        if hi < addr + size {
            let after = self.split_block(middle, hi - lo);
            self.enlist(after);
            self.split_stat_in(after);
        }
        self.arena.set_state(middle, BlockState::Unmapped);
        self.arena.add_unmapped(middle);
        self.arena.segment_mut(seg_id).mapped -= hi - lo;
        if released > 0 {
            self.stats.num_device_free += 1;
            self.trace.record(TraceAction::SegmentUnmap, lo, hi - lo, 0, stream.0, 0);
        }
        self.merge_unmapped(middle);
        Ok(released)
    }

    /// The host address holding the backed-up bytes `[ptr, ptr + bytes)` of a block of a paused
    /// tag (`torch_memory_saver.get_cpu_backup`), or of a resumed one whose buffers were kept
    /// (the last backup, while the block lives), when they lie in one backup buffer that this
    /// process can read; None otherwise (no backup, another device, the simulated device). The
    /// bytes are valid until the tag resumes (or pauses again) or the block is freed.
    pub fn backup_host_address(&mut self, ptr: u64, bytes: u64) -> Option<u64> {
        if !self.backend.host_readable() {
            return None;
        }
        let end = ptr.checked_add(bytes)?;
        for tag in 1..self.sleep.tags.len() {
            let tag = TagId::try_from(tag).ok()?;
            let paused = self.sleep.is_paused(tag);
            let state = &self.sleep.tags[usize::from(tag)];
            let records = if paused { &state.backup } else { &state.retained };
            let Some((&addr, &(offset, size))) = records.range(..=ptr).next_back() else { continue };
            if end > addr.saturating_add(size) || (!paused && self.arena.find_allocated(addr).is_none()) {
                continue;
            }
            // The buffers are filled one after another from offset 0.
            let mut at = offset + (ptr - addr);
            for &(buffer, len) in &state.host {
                if at < len {
                    return (at + bytes <= len).then_some(buffer + at);
                }
                at -= len;
            }
        }
        None
    }
}
