//! A CUDA graph's private pool under a tag: a capture begun inside a region (`crate::tags`)
//! puts its pool under the region's tag, so that pausing the tag gives back the graph's memory
//! (its intermediates and outputs) and resuming maps it again at the same addresses, with the
//! graph still valid: no recapture. Part of the heap: runs under the device lock.
//!
//! Layout: a tagged pool's segments are virtual ranges with pages mapped on demand, like any
//! tagged memory (`heap/sleep.rs`), recorded with the pool's number; every request into the
//! pool carries the pool's tag, whichever thread makes it. An untagged pool keeps plain
//! segments, as PyTorch's.
//!
//! Invariants: while the pool is referenced, its free blocks keep their pages — the graph's
//! kernels use that memory on every replay — so they are never filed as free pages
//! (`whole_page_bytes` is 0 for them), and neither `empty_cache`, the cache limit, page reuse
//! nor a pause unmaps them into unmapped blocks; a pause releases their pages like the live
//! blocks' and a resume maps every page under a block that is not unmapped, so the free
//! blocks' pages come back with the live ones. Once the pool is released (no reference left)
//! its free pages go back to the device and its ranges are freed when nothing is mapped.
//! A pool's tag is set once, when the pool is created by a capture and holds nothing yet; a
//! pool fed by another library's allocator (`SegmentSource`) takes no tag.

use super::{Heap, PoolId};
use crate::error::Result;
use crate::segment::{BlockId, BlockState};
use crate::stats::ReleaseReason;
use crate::tags::TagId;

impl Heap {
    /// Puts pool `id` under `tag` (0: none) when it holds no segment and has no tag or source
    /// of its own; called right after `begin_pool` with the capturing thread's tag. Returns the
    /// pool's tag.
    pub fn tag_pool(&mut self, id: PoolId, tag: TagId) -> TagId {
        let Some(pool) = self.private_pools.iter_mut().flatten().find(|p| p.id == id) else { return 0 };
        if pool.tag == 0 && pool.segments == 0 && pool.source.is_none() {
            pool.tag = tag;
        }
        pool.tag
    }

    /// Counts a paged segment of pool `pool` (0: the general pool, nothing to count) in or out;
    /// a released pool that holds no segment any more is gone.
    pub(super) fn count_pool_segment(&mut self, pool: u32, added: bool) {
        let Some(index) = (pool as usize).checked_sub(1) else { return };
        let Some(slot) = self.private_pools.get_mut(index) else { return };
        let Some(p) = slot.as_mut() else { return };
        if added {
            p.segments += 1;
        } else {
            p.segments = p.segments.saturating_sub(1);
            if p.segments == 0 && p.use_count == 0 {
                *slot = None;
            }
        }
    }

    /// Whether the free block `id` lies in a paged segment of a graph pool still referenced:
    /// its pages are the graph's and stay with it (a pause releases them, a resume maps them).
    pub(super) fn graph_keeps(&self, id: BlockId) -> bool {
        let pool = self.arena.block(id).class.pool();
        pool != 0 && self.private_pools.get(pool as usize - 1).and_then(Option::as_ref).is_some_and(|p| p.use_count > 0)
    }

    /// A free of a block of a paged graph-pool segment: when the pool is released, the free
    /// pages go back to the device (and the range with them once nothing is mapped there).
    #[cold]
    pub(super) fn release_if_pool_released(&mut self, id: BlockId) -> Result<()> {
        if self.graph_keeps(id) {
            return Ok(());
        }
        if self.captures_underway > 0 {
            self.deferred_work = true; // `run_deferred_work` releases it after the capture
            return Ok(());
        }
        self.release_tagged_free(id)?;
        self.free_unmapped_segments()
    }

    /// Gives back the free pages of released pool number `number`'s paged segments (after a
    /// device synchronize: the graph's last replay may still run), then frees the ranges left
    /// with nothing mapped. Nothing to do for a pool still referenced or without such pages.
    pub(super) fn release_pool_pages(&mut self, number: u32) -> Result<()> {
        let Some(index) = (number as usize).checked_sub(1) else { return Ok(()) };
        if self.private_pools.get(index).and_then(Option::as_ref).is_some_and(|p| p.use_count > 0) {
            return Ok(());
        }
        if self.captures_underway > 0 {
            self.deferred_work = true;
            return Ok(());
        }
        let mut synced = false;
        // One block at a time: an unmap merges unmapped neighbours, which ends their ids.
        loop {
            let next = self.arena.blocks_in_state(BlockState::Free).find(|&id| {
                let b = self.arena.block(id);
                b.class.pool() == number && b.class.expandable() && {
                    let (lo, hi) = self.arena.segment(b.segment).whole_pages(b.addr, b.size);
                    hi > lo
                }
            });
            let Some(id) = next else { break };
            if !synced {
                self.backend.synchronize()?;
                self.stats.num_device_synchronize += 1;
                synced = true;
            }
            self.unmap_free_pages(id, ReleaseReason::EmptyCache)?;
        }
        self.free_unmapped_segments()
    }

    /// `release_pool_pages` for every released pool (work a capture held back).
    pub(super) fn release_released_pools_pages(&mut self) -> Result<()> {
        let released: Vec<u32> = (0..self.private_pools.len())
            .filter(|&i| self.private_pools[i].as_ref().is_some_and(|p| p.use_count == 0))
            .map(|i| i as u32 + 1)
            .collect();
        for number in released {
            self.release_pool_pages(number)?;
        }
        Ok(())
    }
}
