//! User memory pools (`torch.cuda.MemPool` under process-wide stepalloc) on top of the private
//! pools of CUDA graphs: a pool created and referenced by its owner, its use count, a segment
//! source of its own (another library's allocator gives the pool's segments, as vLLM's sleep
//! mode passes one), `use_on_oom` (a general allocation that finds no memory takes a free
//! block of such a pool, PyTorch's last resort) and `no_split` (each block is a whole segment). Part of the heap: runs under the device lock.
//!
//! Invariants: a pool's segments come from its source for as long as it has one; the source is
//! set before the pool holds any segment (so every segment goes back where it came from); the
//! last-resort search only takes free blocks, it never grows a pool.

use super::{Heap, PoolId};
use crate::backend::Stream;
use crate::error::{Error, Result};

/// Where a pool's segments come from instead of the device (the C ABI wraps another library's
/// alloc / free functions in one). Called under the device lock: it must not call back into
/// this allocator.
pub trait SegmentSource: Send {
    /// A segment of `bytes` for `stream` on `device`; None when the source is out of memory.
    fn alloc(&mut self, device: usize, bytes: u64, stream: Stream) -> Option<u64>;
    /// Gives back a segment `alloc` returned, with the size and stream it was asked for.
    fn free(&mut self, device: usize, addr: u64, bytes: u64, stream: Stream);
}

impl Heap {
    /// `createOrIncrefPool`: creates pool `id` with one reference, or takes another.
    pub fn create_pool(&mut self, id: PoolId) {
        self.add_pool_reference(id);
    }

    /// The references to pool `id` (`MemPool.use_count()`); 0 for no such pool.
    pub fn pool_use_count(&self, id: PoolId) -> u32 {
        self.private_pools.iter().flatten().find(|p| p.id == id).map_or(0, |p| p.use_count)
    }

    /// Makes `source` give pool `id`'s segments (None: the device). Refused once the pool holds
    /// segments, which must go back to where they came from; the pool must exist.
    pub fn set_pool_segment_source(&mut self, id: PoolId, source: Option<Box<dyn SegmentSource>>) -> Result<()> {
        let Some(pool) = self.private_pools.iter_mut().flatten().find(|p| p.id == id) else {
            return Err(Error::InvalidArgument(format!(
                "no memory pool ({}, {}) to give a segment allocator",
                id.0, id.1
            )));
        };
        if pool.segments > 0 {
            return Err(Error::InvalidArgument(format!(
                "memory pool ({}, {}) already holds segments; set its segment allocator before it allocates",
                id.0, id.1
            )));
        }
        pool.source = source;
        Ok(())
    }

    /// `use_on_oom`: whether a general allocation that finds no memory may take a free block of
    /// pool `id`. The pool must exist.
    pub fn set_pool_use_on_oom(&mut self, id: PoolId, on: bool) -> Result<()> {
        let Some(pool) = self.private_pools.iter_mut().flatten().find(|p| p.id == id) else {
            return Err(Error::InvalidArgument(format!("no memory pool ({}, {})", id.0, id.1)));
        };
        pool.use_on_oom = on;
        Ok(())
    }

    /// The tag an allocation inside a region of `tag` carries when it is routed to private pool
    /// number `pool`: the pool's own (a graph captured inside a region puts its pool under the
    /// region's tag, `heap/graphs.rs`, so a pause gives the pool back whole), else none. A pool
    /// entered with `use_mem_pool` inside a region is refused, since a pause of the tag could
    /// not give back the pool's blocks and would report the tag paused with its bytes still on
    /// the device.
    pub(super) fn pool_tag(&self, pool: u32, tag: u8) -> Result<u8> {
        let Some(p) = (pool as usize).checked_sub(1).and_then(|i| self.private_pools.get(i)).and_then(Option::as_ref)
        else {
            return Ok(0);
        };
        // A pool a graph was captured into inside a region carries that region's tag
        // (`heap/graphs.rs`): its blocks take it, whoever allocates.
        if p.tag != 0 || tag == 0 || p.capturing > 0 {
            return Ok(p.tag);
        }
        Err(Error::InvalidArgument(format!(
            "an allocation inside region {:?} is routed to memory pool ({}, {}) (torch.cuda.use_mem_pool): a \
             pool's blocks cannot carry a tag, so pause({:?}) could not give them back. Allocate the region's \
             tensors outside use_mem_pool, or enter use_mem_pool outside the region",
            crate::tags::name(tag),
            p.id.0,
            p.id.1,
            crate::tags::name(tag)
        )))
    }

    /// `no_split`: whether each block of pool `id` takes a whole segment, never split from a
    /// larger free block, as PyTorch's `MemPool(no_split=True)`. The pool must exist.
    pub fn set_pool_no_split(&mut self, id: PoolId, on: bool) -> Result<()> {
        let Some(pool) = self.private_pools.iter_mut().flatten().find(|p| p.id == id) else {
            return Err(Error::InvalidArgument(format!("no memory pool ({}, {})", id.0, id.1)));
        };
        pool.no_split = on;
        Ok(())
    }

    /// Whether private pool number `number` (1-based) never splits its blocks.
    pub(super) fn pool_no_split(&self, number: u32) -> bool {
        let Some(index) = (number as usize).checked_sub(1) else { return false };
        self.private_pools.get(index).and_then(Option::as_ref).is_some_and(|p| p.no_split)
    }

    /// The id of private pool number `number` (1-based, as segments record it); (0, 0) for the
    /// general pool or a pool that is gone.
    pub(crate) fn pool_id_of(&self, number: u32) -> PoolId {
        let Some(index) = (number as usize).checked_sub(1) else { return (0, 0) };
        self.private_pools.get(index).and_then(Option::as_ref).map_or((0, 0), |p| p.id)
    }

    /// One segment of `bytes` for private pool number `pool` (0: general): from the pool's own
    /// source if it has one, else a device reserve. `Ok(None)` when out of memory.
    pub(super) fn reserve_for(&mut self, pool: u32, bytes: u64, stream: Stream) -> Result<Option<u64>> {
        let device = self.device;
        let over_limit = self.stats.reserved_bytes.current().saturating_add(bytes) > self.allowed;
        match self.pool_source(pool) {
            Some(source) => {
                if over_limit {
                    self.stats.num_oom_rejections += 1;
                    return Ok(None);
                }
                Ok(source.alloc(device, bytes, stream))
            }
            None => self.reserve(bytes),
        }
    }

    /// Gives a segment of private pool number `pool` back to where it came from.
    pub(super) fn release_to_source(&mut self, pool: u32, addr: u64, bytes: u64, stream: Stream) -> Result<()> {
        let device = self.device;
        match self.pool_source(pool) {
            Some(source) => {
                source.free(device, addr, bytes, stream);
                Ok(())
            }
            None => self.backend.release(addr, bytes),
        }
    }

    fn pool_source(&mut self, pool: u32) -> Option<&mut Box<dyn SegmentSource>> {
        let index = (pool as usize).checked_sub(1)?;
        self.private_pools.get_mut(index)?.as_mut()?.source.as_mut()
    }

    /// PyTorch's last resort before out of memory: a free block of a `use_on_oom` pool (taken
    /// out of its list), for a general-pool request that found no memory.
    pub(super) fn last_resort_block(&mut self, small: bool, stream: Stream, rounded: u64) -> Option<super::BlockId> {
        let numbers: Vec<u32> = (0..self.private_pools.len())
            .filter(|&i| self.private_pools[i].as_ref().is_some_and(|p| p.use_on_oom))
            .map(|i| i as u32 + 1)
            .collect();
        numbers.into_iter().find_map(|n| self.find_free(n, small, stream, rounded, false, 0))
    }
}
