//! Growing the heap: a new segment or range when no cached block serves a request, and the
//! out-of-memory path with its report. Layer: the heap, under the device lock.
//!
//! The out-of-memory path of plain segments, step by step (PyTorch's, with stepalloc's steps
//! marked; `pytorch_oom_path` leaves those out, for the stress tool's PyTorch presets):
//! 1. release cached oversize blocks and retry the device;
//! 2. wait for pending events (frees after `record_stream`) and let free blocks of different
//!    streams merge; (stepalloc) search the cache again: a block those frees completed may fit;
//! 3. release every unsplit free segment — (stepalloc) those of pools in use too, as
//!    `empty_cache` does, but not yet those of `use_on_oom` pools — and retry the device;
//! 4. a general request takes a free block of a `use_on_oom` pool (PyTorch's last resort);
//! 5. (stepalloc) release the `use_on_oom` pools' free segments and retry the device;
//! 6. report out of memory.
//!
//! Expandable segments (`expandable.rs`) take the same steps, with step 2's search done by
//! their page search.

use super::Heap;
use crate::backend::Stream;
use crate::error::{Error, OomReport, Result};
use crate::segment::{Block, BlockClass, BlockId, BlockState, Segment, NIL};
use crate::sizeclass::{self};
use crate::stats::ReleaseReason;
use crate::trace::TraceAction;
use crate::units::format_bytes;
use std::time::Instant;

impl Heap {
    /// Reserves a new segment for the request, running the out-of-memory path on failure.
    pub(super) fn grow(
        &mut self,
        pool: u32,
        small: bool,
        stream: Stream,
        rounded: u64,
        requested: u64,
    ) -> Result<BlockId> {
        if self.fraction_set && self.config.garbage_collection_threshold > 0.0 && self.captures_underway == 0 {
            self.garbage_collect()?;
        }
        let seg_size = sizeclass::segment_size(rounded);
        // During a CUDA-graph capture, freeing device memory or waiting on streams would break
        // the capture: only a plain reserve is tried.
        let capturing = self.captures_underway > 0;
        let mut attempt = self.reserve_for(pool, seg_size, stream)?;
        // PyTorch's `release_available_cached_blocks` looks for the rounded request, at least
        // `max_split_size` (its search key), not for the segment it would reserve.
        let key = rounded.max(self.config.max_split_size);
        if attempt.is_none() && !capturing && self.release_oversize(pool, small, stream, key)? {
            attempt = self.reserve_for(pool, seg_size, stream)?;
        }
        if attempt.is_none() && !capturing {
            self.stats.num_alloc_retries += 1;
            self.complete_pending_frees()?;
            if let Some(id) = self.reuse_after_waiting(pool, small, stream, rounded) {
                return Ok(id);
            }
            self.release_free_cache(ReleaseReason::Oom)?;
            attempt = self.reserve_for(pool, seg_size, stream)?;
        }
        if attempt.is_none() {
            if let Some(id) = (pool == 0).then(|| self.last_resort_block(small, stream, rounded)).flatten() {
                return Ok(id);
            }
            if self.release_lenders()? {
                attempt = self.reserve_for(pool, seg_size, stream)?;
            }
        }
        let Some(addr) = attempt else {
            return Err(self.out_of_memory(requested, rounded, seg_size));
        };
        Ok(self.new_segment(addr, seg_size, small, pool, stream))
    }

    /// Whether the out-of-memory path is exactly PyTorch's, without stepalloc's steps (the
    /// module's list). `exact_fit` is what the stress tool's PyTorch presets set to reproduce
    /// PyTorch's allocator byte for byte (`scripts/torch_replay.py` checks it against PyTorch's
    /// own), so it keeps PyTorch's sequence too, shortcomings included: PyTorch 2.15 raises when
    /// the block a wait for events freed would fit, and keeps a pool in use's free memory.
    pub(super) fn pytorch_oom_path(&self) -> bool {
        self.config.exact_fit
    }

    /// Step 2's search (stepalloc's): after the frees waiting on events completed, a cached
    /// block of the request's pool and stream may fit (out of its list, as `find_free` gives
    /// it). None under PyTorch's path, and for requests that skip the cache
    /// (`caching_allocator_enable(False)`).
    fn reuse_after_waiting(&mut self, pool: u32, small: bool, stream: Stream, rounded: u64) -> Option<BlockId> {
        if self.pytorch_oom_path() || (self.caching_disabled && pool == 0) {
            return None;
        }
        let id = self.find_free(pool, small, stream, rounded, false, 0)?;
        self.stats.num_cache_hits = self.stats.num_cache_hits.wrapping_add(1);
        Some(id)
    }

    /// One device reserve within the allowed limit: `Ok(None)` when out of memory.
    pub(super) fn reserve(&mut self, bytes: u64) -> Result<Option<u64>> {
        if self.stats.reserved_bytes.current().saturating_add(bytes) > self.allowed {
            self.stats.num_oom_rejections += 1;
            return Ok(None);
        }
        let start = Instant::now();
        let before = self.backend.driver_time().reserve_ns;
        let result = self.backend.reserve(bytes);
        let modelled = self.backend.driver_time().reserve_ns - before;
        let ns = if modelled > 0 { modelled } else { start.elapsed().as_nanos() as u64 };
        match result {
            Ok(addr) => {
                self.stats.record_device_alloc_latency(ns);
                Ok(Some(addr))
            }
            Err(e) if e.is_out_of_memory() => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub(super) fn new_segment(&mut self, addr: u64, size: u64, small: bool, pool: u32, stream: Stream) -> BlockId {
        let oversize = size >= self.config.max_split_size;
        let seg = self.arena.new_segment(
            Segment {
                addr,
                size,
                small,
                pool,
                stream,
                first: NIL,
                oversize,
                live: true,
                page: 0,
                mapped: size,
                lane: false,
                tag: 0,
            },
            self.step.step,
        );
        let block = Block::unlinked(addr, size, seg, BlockClass::new(pool, small, false), stream, self.alloc_clock);
        let id = self.arena.new_block(block, BlockState::Free);
        self.arena.segment_mut(seg).first = id;
        if pool > 0 {
            if let Some(p) = self.private_pools[pool as usize - 1].as_mut() {
                p.segments += 1;
            }
        }
        let s = &mut self.stats;
        s.num_device_alloc += 1;
        s.segment.increase(small, 1);
        s.reserved_bytes.increase(small, size);
        if oversize {
            s.oversize_segments.increase(1);
        }
        self.step.note_reserved(self.stats.reserved_bytes.current());
        self.trace.record(TraceAction::SegmentAlloc, addr, size, 0, stream.0, 0);
        if pool > 0 && !self.listeners.is_empty() {
            self.segment_added(pool, addr, size);
        }
        id
    }

    pub(super) fn out_of_memory(&mut self, requested: u64, rounded: u64, segment_size: u64) -> Error {
        self.stats.num_ooms += 1;
        let (device_free, device_total) = self.backend.mem_info().unwrap_or((0, self.device_total));
        // As in torch's trace, an `oom` entry carries the device's free bytes in its address.
        self.trace.record(TraceAction::Oom, device_free, rounded, requested, 0, 0);
        let reserved = self.stats.reserved_bytes.current();
        let allocated = self.stats.allocated_bytes.current();
        let largest = self.largest_free_block();
        let cached_free = reserved - self.stats.active_bytes_current();
        let hint = if segment_size > device_total {
            // A device smaller than a segment or page: free memory cannot help.
            format!(
                "The request needs a segment or page of {}, more than the device's whole memory: \
                 it cannot be served however much is free (the page of expandable segments' large \
                 pool is large_segment_size_mb).",
                format_bytes(segment_size),
            )
        } else if cached_free >= rounded && largest < rounded && !self.config.page_reuse {
            format!(
                "{} is cached but no free block is large enough: the cache is fragmented. \
                 stepalloc's recommended configuration (`{}`) moves free pages to where a \
                 request needs them, so free memory in holes serves it.",
                format_bytes(cached_free),
                crate::config::RECOMMENDED,
            )
        } else if self.fraction_set && rounded <= device_free {
            "The device has room, but per_process_memory_fraction forbids using it.".to_string()
        } else {
            String::new()
        };
        Error::OutOfMemory(Box::new(OomReport {
            device: self.device,
            requested,
            rounded,
            segment_size,
            device_total,
            device_free,
            reserved,
            allocated,
            allowed: self.fraction_set.then_some(self.allowed),
            largest_free_block: largest,
            hint,
            unmapped: None,
            address_space: None,
        }))
    }
}
