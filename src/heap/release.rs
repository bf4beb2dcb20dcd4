//! Giving cached memory back: whole free segments to the device (the OOM path's steps,
//! `empty_cache`, limits, garbage collection, settling free blocks of different streams after a
//! device sync) and the private pools of CUDA graphs, whose memory stays out of general reuse
//! until released. Part of the heap: runs under the device lock, `&mut self` throughout.

use super::{merged_stream, Heap, PoolId, PrivatePool};
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::segment::{BlockId, BlockState, SegmentId, ANY_STREAM, NIL};
use crate::stats::ReleaseReason;
use crate::trace::TraceAction;

/// Which free segments of pools still referenced (a `MemPool`, a `use_mem_pool` underway) a
/// release reaches. The general pool's and those of pools nobody references always go; those
/// of a pool a CUDA graph captured into never do while it is referenced (a replay may use its
/// free blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoolsInUse {
    /// None: PyTorch's out-of-memory path (`exact_fit`, see `Heap::pytorch_oom_path`).
    Kept,
    /// All but those of `use_on_oom` pools, whose free blocks the out-of-memory path lends
    /// first (`last_resort_block`); it releases them after that (`release_lenders`).
    AllButLenders,
    /// All: `empty_cache`, the step and limit policies.
    All,
}

impl Heap {
    // ----- releasing cached memory ---------------------------------------------------------

    /// Returns a segment whose single block is free to the device.
    pub(crate) fn release_segment(&mut self, seg_id: SegmentId, reason: ReleaseReason) -> Result<u64> {
        let seg = self.arena.segment(seg_id).clone();
        let id = seg.first;
        debug_assert!(self.arena.block(id).next == NIL && self.arena.state(id) == BlockState::Free);
        self.wait_for_last_use(id)?;
        if seg.pool > 0 && !self.listeners.is_empty() {
            // Deregistered (NCCL) before its memory goes back.
            self.segment_removed(seg.pool, seg.addr, seg.size);
        }
        self.release_to_source(seg.pool, seg.addr, seg.size, seg.stream)?;
        self.unlist(id);
        self.arena.drop_block(id);
        self.arena.drop_segment(seg_id);
        if seg.pool > 0 {
            let slot = &mut self.private_pools[seg.pool as usize - 1];
            if let Some(p) = slot.as_mut() {
                p.segments -= 1;
                if p.segments == 0 && p.use_count == 0 {
                    *slot = None;
                }
            }
        }
        let s = &mut self.stats;
        s.num_device_free += 1;
        s.segment.decrease(seg.small, 1);
        s.reserved_bytes.decrease(seg.small, seg.size);
        if seg.oversize {
            s.oversize_segments.decrease(1);
        }
        s.released_bytes[reason as usize] = s.released_bytes[reason as usize].saturating_add(seg.size);
        self.trace.record(TraceAction::SegmentFree, seg.addr, seg.size, 0, seg.stream.0, 0);
        Ok(seg.size)
    }

    /// `Backend::release`'s precondition: no queued work uses the segment. Its free block `id`
    /// belongs to one stream, whose kernels may still use it, unless it is any stream's (every
    /// other use was ordered by events that completed, or by a device synchronization).
    fn wait_for_last_use(&mut self, id: BlockId) -> Result<()> {
        let stream = self.arena.block(id).stream;
        if stream != ANY_STREAM {
            self.backend.synchronize_stream(stream)?;
        }
        Ok(())
    }

    /// Whether a plain segment is entirely one free block (expandable ones give back pages).
    pub(crate) fn segment_is_free(&self, seg_id: SegmentId) -> bool {
        let seg = self.arena.segment(seg_id);
        // A plain segment is free when its first block is free and is all of it (an allocated or
        // pending block is never in the `Free` state).
        !seg.expandable() && {
            let b = self.arena.block(seg.first);
            b.next == NIL && self.arena.state(seg.first) == BlockState::Free
        }
    }

    /// Free segments that may be released (not held by an active graph pool).
    pub(crate) fn releasable_segments(&self) -> Vec<SegmentId> {
        self.releasable_segments_of(PoolsInUse::All)
    }

    /// The free segments that may go back: the general pool's, those of pools nobody
    /// references, and those of referenced pools no CUDA graph captured into that `in_use`
    /// reaches (a captured graph may replay into its pool's free blocks). `empty_cache` and the
    /// step and limit policies reach them all, so a pool in use does not strand its free memory
    /// (PyTorch's `empty_cache` frees nothing while a pool is in use); so does the
    /// out-of-memory path, its lenders last (`Heap::oom_pools`).
    pub(crate) fn releasable_segments_of(&self, in_use: PoolsInUse) -> Vec<SegmentId> {
        self.arena
            .live_segment_ids()
            .filter(|&s| self.segment_is_free(s))
            .filter(|&s| {
                let pool = self.arena.segment(s).pool;
                pool == 0
                    || self.private_pools[pool as usize - 1].as_ref().is_none_or(|p| {
                        p.use_count == 0
                            || match in_use {
                                PoolsInUse::Kept => false,
                                PoolsInUse::AllButLenders => !p.captured && !p.use_on_oom,
                                PoolsInUse::All => !p.captured,
                            }
                    })
            })
            .collect()
    }

    /// The pools in use whose free segments the out-of-memory path releases: PyTorch's keeps
    /// them all (`pytorch_oom_path`); stepalloc's releases what `empty_cache` releases, the
    /// `use_on_oom` pools' after their blocks were offered (`release_lenders`).
    pub(super) fn oom_pools(&self) -> PoolsInUse {
        if self.pytorch_oom_path() {
            PoolsInUse::Kept
        } else {
            PoolsInUse::AllButLenders
        }
    }

    /// First OOM step, PyTorch's `release_available_cached_blocks`: release cached oversize
    /// blocks (whole segments) of the request's pool and stream — the smallest one that covers
    /// `needed` (its search key: the rounded request, at least `max_split_size`), else the
    /// largest ones until `needed` bytes are released. The small pool holds no oversize block.
    pub(super) fn release_oversize(&mut self, pool: u32, small: bool, stream: Stream, needed: u64) -> Result<bool> {
        if self.config.max_split_size == u64::MAX || small {
            return Ok(false);
        }
        // In PyTorch's order of free blocks: size, then address.
        let mut candidates: Vec<(u64, u64, SegmentId)> = self
            .releasable_segments_of(self.oom_pools())
            .into_iter()
            .filter(|&s| {
                let seg = self.arena.segment(s);
                seg.oversize && !seg.small && seg.pool == pool && seg.stream == stream
            })
            .map(|s| (self.arena.segment(s).size, self.arena.segment(s).addr, s))
            .collect();
        candidates.sort_unstable();
        if let Some(&(_, _, seg)) = candidates.iter().find(|(size, _, _)| *size >= needed) {
            self.release_segment(seg, ReleaseReason::Oom)?;
            return Ok(true);
        }
        let mut released = 0;
        for &(_, _, seg) in candidates.iter().rev() {
            if released >= needed {
                break;
            }
            released += self.release_segment(seg, ReleaseReason::Oom)?;
        }
        Ok(released >= needed)
    }

    /// Waits for pending events, then releases every free unsplit segment. Returns bytes released.
    pub fn release_all_cached(&mut self, reason: ReleaseReason) -> Result<u64> {
        if self.captures_underway > 0 {
            // No sync or device free during a capture; `run_deferred_work` does it afterwards.
            self.deferred_empty_cache = true;
            self.deferred_work = true;
            return Ok(0);
        }
        self.complete_pending_frees()?;
        self.release_free_cache(reason)
    }

    /// Waits for every pending event, so that the frees waiting on them complete, and lets free
    /// blocks of different streams merge. Not during a capture (the caller checks).
    pub(super) fn complete_pending_frees(&mut self) -> Result<()> {
        self.synchronize_pending()?;
        if self.has_stranded_free_blocks() {
            self.settle_free_streams()?;
        }
        Ok(())
    }

    /// Releases the free pages of expandable segments and every free unsplit segment
    /// (`releasable_segments_of`: on the out-of-memory path, `oom_pools`). Returns the bytes.
    pub(super) fn release_free_cache(&mut self, reason: ReleaseReason) -> Result<u64> {
        let mut released = self.release_free_pages(reason, |_| true)?;
        let in_use = if reason == ReleaseReason::Oom { self.oom_pools() } else { PoolsInUse::All };
        for seg in self.releasable_segments_of(in_use) {
            released += self.release_segment(seg, reason)?;
        }
        Ok(released)
    }

    /// The out-of-memory path's last release (stepalloc's): the free segments of `use_on_oom`
    /// pools in use, once none of their blocks served the request, as `empty_cache` would
    /// release them. Returns whether any went. Nothing under PyTorch's path or during a capture.
    pub(super) fn release_lenders(&mut self) -> Result<bool> {
        if self.pytorch_oom_path() || self.captures_underway > 0 {
            return Ok(false);
        }
        let mut released = false;
        for seg in self.releasable_segments_of(PoolsInUse::All) {
            self.release_segment(seg, ReleaseReason::Oom)?;
            released = true;
        }
        Ok(released)
    }

    /// Whether some segment holds adjacent free blocks of different streams, which cannot merge
    /// (and so cannot be released) while either stream may still have work queued.
    pub(super) fn has_stranded_free_blocks(&self) -> bool {
        self.arena.blocks_in_state(BlockState::Free).any(|id| {
            let b = self.arena.block(id);
            b.next != NIL
                && self.arena.state(b.next) == BlockState::Free
                && merged_stream(b.stream, self.arena.block(b.next).stream).is_none()
        })
    }

    /// Waits for the whole device; then no stream has work queued, every free block may serve
    /// any stream, and neighbours that could not merge before are merged.
    pub(super) fn settle_free_streams(&mut self) -> Result<()> {
        self.backend.synchronize()?;
        self.stats.num_device_synchronize += 1;
        // All free blocks, ANY ones too: a merge reaches one neighbour each way, so a chain of
        // free blocks merges fully only if each of its blocks gets its turn.
        let free: Vec<BlockId> = self.arena.blocks_in_state(BlockState::Free).collect();
        self.merge_as_any_stream(free);
        Ok(())
    }

    /// Makes the free blocks `free` serve any stream (the caller waited for their streams'
    /// work), then merges each with its free neighbours.
    pub(super) fn merge_as_any_stream(&mut self, free: Vec<BlockId>) {
        // First every free block becomes ANY, so that each merge below yields ANY again.
        for &id in &free {
            self.unlist(id);
            self.arena.block_mut(id).stream = ANY_STREAM;
            self.enlist(id);
        }
        for id in free {
            // An earlier merge in this loop may have absorbed this block already.
            if self.arena.state(id) != BlockState::Free {
                continue;
            }
            self.unlist(id);
            self.split_stat_out(id);
            let (merged, absorbed, absorbed_bytes) = self.merge_neighbours(id);
            self.enlist(merged);
            self.count_merged_free(merged, absorbed, absorbed_bytes);
        }
    }

    /// `torch.cuda.empty_cache()`.
    pub fn empty_cache(&mut self) -> Result<u64> {
        self.release_all_cached(ReleaseReason::EmptyCache)
    }

    /// Releases free segments in the given order until `done` says enough.
    pub(crate) fn release_in_order(
        &mut self,
        order: Vec<SegmentId>,
        reason: ReleaseReason,
        mut done: impl FnMut(&Heap) -> bool,
    ) -> Result<u64> {
        if self.captures_underway > 0 {
            // No device free during a capture: step releases wait for the next boundary.
            return Ok(0);
        }
        let mut released = 0;
        for seg in order {
            if done(self) {
                break;
            }
            released += self.release_segment(seg, reason)?;
        }
        Ok(released)
    }

    /// The cache limit in bytes (0 = none).
    pub(crate) fn cache_limit(&self) -> u64 {
        let from_fraction = (self.config.cache_limit_fraction * self.device_total as f64) as u64;
        match (self.config.cache_limit_bytes, from_fraction) {
            (0, f) => f,
            (b, 0) => b,
            (b, f) => b.min(f),
        }
    }

    pub(crate) fn cached_free(&self) -> u64 {
        self.stats.reserved_bytes.current() - self.stats.active_bytes_current()
    }

    pub(crate) fn over_cache_limit(&self) -> bool {
        let limit = self.cache_limit();
        limit > 0 && self.cached_free() > limit
    }

    /// PyTorch's garbage collection: with a memory fraction set and reserved memory above
    /// `garbage_collection_threshold` of it, release unsplit free large segments older than
    /// the average age until reserved drops below the threshold.
    pub(super) fn garbage_collect(&mut self) -> Result<()> {
        let threshold = (self.config.garbage_collection_threshold * self.allowed as f64) as u64;
        let reserved = self.stats.reserved_bytes.current();
        if reserved <= threshold {
            return Ok(());
        }
        let target = reserved - threshold;
        let mut candidates: Vec<(u64, SegmentId)> = self
            .releasable_segments()
            .into_iter()
            .filter(|&s| !self.arena.segment(s).small && self.arena.segment(s).pool == 0)
            .map(|s| (self.alloc_clock - self.arena.block(self.arena.segment(s).first).freed_at, s))
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        self.synchronize_pending()?;
        let mut reclaimed = 0;
        while reclaimed < target && !candidates.is_empty() {
            let average = candidates.iter().map(|c| c.0).sum::<u64>() / candidates.len() as u64;
            let (old, young): (Vec<_>, Vec<_>) = candidates.into_iter().partition(|c| c.0 >= average);
            for (_, seg) in old {
                if reclaimed >= target {
                    break;
                }
                reclaimed += self.release_segment(seg, ReleaseReason::Limit)?;
            }
            candidates = young;
        }
        Ok(())
    }

    // ----- private pools (CUDA graphs) -----------------------------------------------------

    /// `beginAllocateToPool`: a capture starts; creates the pool or takes another reference.
    /// A capture of this pool that never ended is counted as ended first (PyTorch never
    /// captures into one pool twice at once; a failed capture never calls `end_pool`).
    pub fn begin_pool(&mut self, id: PoolId) {
        self.abandon_capture(id);
        self.captures_underway += 1;
        self.add_pool_reference(id);
        if let Some(p) = self.private_pools.iter_mut().flatten().find(|p| p.id == id) {
            p.capturing += 1;
            p.captured = true;
        }
    }

    /// A route into pool `id` begins (`use_mem_pool`, `beginAllocateToPool` with a filter that
    /// claims the default stream: no capture): creates the pool or takes another reference. No
    /// capture is counted, so events, releases and `empty_cache` go on while it lasts. Routes
    /// nest: one of a pool already routed to, or captured into, adds to it and ends first (the C
    /// ABI's table unwinds them as a stack); nothing underway counts as ended.
    pub fn begin_route(&mut self, id: PoolId) {
        self.add_pool_reference(id);
        if let Some(p) = self.private_pools.iter_mut().flatten().find(|p| p.id == id) {
            p.routes += 1;
        }
    }

    /// The route into pool `id` ends; the pool keeps its references until `release_pool`.
    pub fn end_route(&mut self, id: PoolId) {
        if let Some(p) = self.private_pools.iter_mut().flatten().find(|p| p.id == id && p.routes > 0) {
            p.routes -= 1;
        }
    }

    /// `endAllocateToPool`: the capture ends; the pool keeps its memory until `release_pool`.
    /// An end of a pool with no capture underway (ended or abandoned already) changes nothing.
    /// Deferred work runs at the next malloc or free, or through `run_deferred_work`.
    pub fn end_pool(&mut self, id: PoolId) {
        if let Some(p) = self.private_pools.iter_mut().flatten().find(|p| p.id == id && p.capturing > 0) {
            p.capturing -= 1;
            self.captures_underway = self.captures_underway.saturating_sub(1);
        }
    }

    /// Counts every capture of pool `id` still underway as ended: for a capture that failed,
    /// whose `end_pool` never comes. Returns whether there was one. The pool keeps its
    /// references (a failed capture's pool is released by `release_pool` like any other).
    pub fn abandon_capture(&mut self, id: PoolId) -> bool {
        let Some(p) = self.private_pools.iter_mut().flatten().find(|p| p.id == id && p.capturing > 0) else {
            return false;
        };
        self.captures_underway = self.captures_underway.saturating_sub(p.capturing);
        p.capturing = 0;
        true
    }

    /// Captures into pool `id` underway (begun, neither ended nor abandoned).
    pub fn pool_captures(&self, id: PoolId) -> u32 {
        self.private_pools.iter().flatten().find(|p| p.id == id).map_or(0, |p| p.capturing)
    }

    pub(super) fn add_pool_reference(&mut self, id: PoolId) {
        if let Some(p) = self.private_pools.iter_mut().flatten().find(|p| p.id == id) {
            p.use_count += 1;
            return;
        }
        let pool = PrivatePool {
            id,
            use_count: 1,
            segments: 0,
            capturing: 0,
            routes: 0,
            captured: false,
            source: None,
            use_on_oom: false,
            tag: 0,
            no_split: false,
        };
        match self.private_pools.iter().position(Option::is_none) {
            Some(i) => self.private_pools[i] = Some(pool),
            None => self.private_pools.push(Some(pool)),
        }
    }

    /// `releasePool`: drops a reference; at zero the pool's free segments go back to the
    /// device now and its other segments as soon as they are free.
    pub fn release_pool(&mut self, id: PoolId) -> Result<()> {
        let Some(index) = self.private_pools.iter().position(|p| p.as_ref().is_some_and(|p| p.id == id)) else {
            return Err(Error::InvalidArgument(format!("release of unknown memory pool ({}, {})", id.0, id.1)));
        };
        let pool = self.private_pools[index].as_mut().expect("position found it");
        pool.use_count = pool.use_count.saturating_sub(1);
        if pool.use_count > 0 {
            return Ok(());
        }
        let segments = pool.segments;
        // No reference is left, so no capture can still use the pool: one that never ended
        // failed, and counts as ended.
        self.abandon_capture(id);
        if segments == 0 {
            self.private_pools[index] = None;
            return Ok(());
        }
        if self.captures_underway > 0 {
            // No device free during another capture; `run_deferred_work` releases them after.
            self.deferred_work = true;
            return Ok(());
        }
        let number = index as u32 + 1;
        let free: Vec<SegmentId> =
            self.releasable_segments().into_iter().filter(|&s| self.arena.segment(s).pool == number).collect();
        for seg in free {
            self.release_segment(seg, ReleaseReason::EmptyCache)?;
        }
        self.release_pool_pages(number)
    }

    pub(super) fn private_pool_index(&mut self, id: PoolId) -> u32 {
        if let Some(i) = self.private_pools.iter().position(|p| p.as_ref().is_some_and(|p| p.id == id)) {
            return i as u32 + 1;
        }
        // Allocating to a pool nobody began: create it with no references (freed when empty).
        self.add_pool_reference(id);
        let i = self.private_pools.iter().position(|p| p.as_ref().is_some_and(|p| p.id == id)).unwrap_or(0);
        if let Some(p) = self.private_pools[i].as_mut() {
            p.use_count = 0;
        }
        i as u32 + 1
    }
}
