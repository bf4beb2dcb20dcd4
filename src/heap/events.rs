//! Events and streams: a freed block waits for the events recorded on the streams that used it
//! before another stream may reuse it (`record_stream` adds streams); work deferred while a CUDA
//! graph capture is underway (no event query, sync or free may run then) runs once none is.
//! Layer: the heap, under the device lock.

use super::Heap;
use crate::backend::{Event, Stream};
use crate::error::{Error, Result};
use crate::segment::{BlockId, ANY_STREAM};
use crate::stats::ReleaseReason;

impl Heap {
    // ----- events and streams --------------------------------------------------------------

    /// `Tensor.record_stream`: the block's reuse will wait for `stream`'s work queued before
    /// its free.
    pub fn record_stream(&mut self, ptr: u64, stream: Stream) -> Result<()> {
        let Some(id) = self.arena.find_allocated(ptr) else {
            return Err(Error::UnknownPointer { device: self.device, ptr });
        };
        if self.arena.block(id).stream != stream {
            self.arena.add_extra_stream(id, stream);
        }
        Ok(())
    }

    /// Completes pending frees whose events have all completed, in recording order.
    pub(super) fn process_events(&mut self) -> Result<()> {
        while let Some(&(event, id)) = self.pending.front() {
            if !self.backend.event_done(event)? {
                break;
            }
            self.pending.pop_front();
            self.event_completed(event, id)?;
        }
        Ok(())
    }

    pub(super) fn event_completed(&mut self, event: Event, id: BlockId) -> Result<()> {
        self.backend.free_event(event);
        if self.arena.complete_pending_event(id) == 0 {
            self.finish_free(id)?;
        }
        Ok(())
    }

    /// Waits for every pending event and completes those frees.
    pub(super) fn synchronize_pending(&mut self) -> Result<()> {
        self.stats.num_sync_all_streams += 1;
        // The event leaves the queue only once waited for: a failed wait leaves it there for
        // the next attempt, so its block is not stranded as pending.
        while let Some(&(event, id)) = self.pending.front() {
            self.backend.wait_event(event)?;
            self.pending.pop_front();
            self.event_completed(event, id)?;
        }
        Ok(())
    }

    // ----- CUDA-graph captures -------------------------------------------------------------
    // While a capture is underway no event is recorded or queried, no memory is freed and no
    // stream or device is synchronized: any of these invalidates a global-mode capture, and an
    // event recorded inside a capture cannot be queried at all. What they would have done is
    // deferred to `run_deferred_work`, which runs once no capture is underway (when the last
    // one ends or is abandoned, and at the next malloc or free).

    /// A free during a capture of a block used by several streams: it stays pending, and its
    /// events are recorded when no capture is underway.
    pub(super) fn defer_free_events(&mut self, id: BlockId) {
        self.mark_pending(id);
        self.deferred_frees.push(id);
        self.deferred_work = true;
    }

    /// A free of a block used by several streams (`record_stream`): it is reusable once each
    /// stream's queued work, and the allocating stream's, has passed this point. Records those
    /// events (at the free, or when a capture that deferred it has ended).
    pub(super) fn record_free_events(&mut self, id: BlockId) -> Result<()> {
        let stream = self.arena.block(id).stream;
        let Some(streams) = self.arena.take_extra_streams(id) else {
            return self.finish_free(id);
        };
        for s in streams.iter().copied().chain(std::iter::once(stream)) {
            match self.backend.record_event(s) {
                Ok(event) => {
                    self.arena.add_pending_event(id);
                    self.pending.push_back((event, id));
                }
                Err(e) => {
                    // Cannot order the reuse: wait for the device instead.
                    self.backend.synchronize()?;
                    if self.arena.pending_events(id) == 0 {
                        self.arena.block_mut(id).stream = ANY_STREAM;
                        self.finish_free(id)?;
                    }
                    return Err(e);
                }
            }
        }
        self.arena.block_mut(id).stream = ANY_STREAM;
        Ok(())
    }

    /// Runs what captures held back, once none is underway: records the events of deferred
    /// frees, then gives back what `finish_free` kept (segments of released graph pools, the
    /// cache limit, MemPool mode) and a deferred `empty_cache`. A no-op during a capture.
    pub fn run_deferred_work(&mut self) -> Result<()> {
        if self.captures_underway > 0 || !self.deferred_work {
            return Ok(());
        }
        self.deferred_work = false;
        while let Some(id) = self.deferred_frees.pop() {
            if let Err(e) = self.record_free_events(id) {
                self.deferred_work = true;
                return Err(e);
            }
        }
        if std::mem::take(&mut self.deferred_empty_cache) {
            self.release_all_cached(ReleaseReason::EmptyCache)?;
            return Ok(());
        }
        let mempool_mode = self.mempool_mode;
        let order: Vec<_> = self
            .releasable_segments()
            .into_iter()
            .filter(|&s| self.arena.segment(s).pool > 0 || mempool_mode)
            .collect();
        for seg in order {
            self.release_segment(seg, ReleaseReason::EmptyCache)?;
        }
        self.release_released_pools_pages()?;
        if self.over_cache_limit() {
            let order = self.releasable_segments();
            self.release_in_order(order, ReleaseReason::Limit, |h| !h.over_cache_limit())?;
        }
        self.release_pages_over_limit(ReleaseReason::Limit)?;
        Ok(())
    }

    /// Whether a CUDA-graph capture is underway on this device (as far as the heap was told).
    pub fn captures_underway(&self) -> u32 {
        self.captures_underway
    }

    /// Asks the device whether `stream` is being captured (for callers reconciling captures
    /// whose end never arrived).
    pub fn stream_is_capturing(&mut self, stream: Stream) -> Result<bool> {
        self.backend.stream_is_capturing(stream)
    }

    /// MemPool mode (`torch.cuda.MemPool`): PyTorch caches in front of the heap, so a free that
    /// leaves a general-pool segment entirely free gives it back to the device.
    pub fn set_mempool_mode(&mut self, on: bool) {
        self.mempool_mode = on;
    }

    /// `torch.cuda.caching_allocator_enable(enabled)`: while disabled, a general untagged
    /// request takes a new plain segment of its own (never split, never served from the cache)
    /// that goes back to the device when it is freed, as PyTorch's allocator then calls
    /// `cudaMalloc` / `cudaFree` directly. Blocks already cached stay cached.
    pub fn set_caching_enabled(&mut self, enabled: bool) {
        self.caching_disabled = !enabled;
    }

    /// Whether caching is enabled (`set_caching_enabled`).
    pub fn caching_enabled(&self) -> bool {
        !self.caching_disabled
    }
}
