//! One device's caching heap: pools, per-stream free lists, splitting and merging, the
//! out-of-memory path, limits and garbage collection. Everything here runs under the device
//! lock held by `allocator`, so every method takes `&mut self`.
//!
//! Policy (PyTorch's, unless noted):
//! - requests are rounded (`sizeclass::round_size`); rounded sizes up to 1 MiB use the small
//!   pool of 2 MiB segments, larger ones the large pool (stepalloc, `pack_small`: a small
//!   request that finds no free small-pool block may take a free large-pool block first);
//! - a free block is reused by its own stream; then (stepalloc) by any stream once every event
//!   recorded at its free has completed; otherwise the heap grows;
//! - a large block is split only when more than 1 MiB would remain, a small one when at least
//!   512 B would; blocks at or above `max_split_size` are never split and serve only requests
//!   less than `max_non_split_rounding` smaller;
//! - on a failed device reserve: release cached oversize blocks and retry; then wait for pending
//!   events, release every unsplit cached segment and retry; then report out of memory.
//!
//! Giving memory back (OOM steps, `empty_cache`, limits, GC) and CUDA-graph pools live in
//! `heap/release.rs`; user memory pools on top of those (`torch.cuda.MemPool`: use counts,
//! another allocator's segments, `use_on_oom`) in `heap/pools.rs`.
//!
//! Invariants (checked by `check_invariants` in tests): blocks tile their segments; adjacent
//! free blocks of compatible streams are merged; the free lists hold exactly the `Free` blocks;
//! `Arena::find_allocated` finds exactly the `Allocated` blocks; every statistic equals the sum
//! it stands for.

use crate::backend::{Backend, Event, PhysHandle, Stream};
use crate::config::Config;
use crate::error::{Error, OomReport, Result};
use crate::freelist::{FreeList, ListKey};
use crate::segment::{Arena, Block, BlockClass, BlockId, BlockState, Segment, SegmentId, ANY_STREAM, NIL};
use crate::sizeclass::{self, GRANULE, MAX_REQUEST, SMALL_REQUEST};
use crate::stats::{ActiveCounter, DeviceStats, HeapStats, PoolCounter, ReleaseReason};
use crate::step::StepState;
use crate::trace::{TraceAction, TraceRing};
use crate::units::{format_bytes, MIB};
use rustc_hash::FxHashMap;
use std::cell::Cell;
use std::collections::VecDeque;
use std::time::Instant;

mod expandable;
mod ipc;
mod pools;
mod release;
mod sleep;
mod steps;

pub use pools::SegmentSource;
pub use sleep::{SleepOutcome, TagFigures};

/// Exclusive upper bounds of the free-block size ranges of `Heap::free_block_ranges`:
/// < 1 MiB, 1-10 MiB, 10-100 MiB, 100 MiB-1 GiB, and >= 1 GiB.
pub const FREE_BLOCK_RANGE_BOUNDS: [u64; 4] = [MIB, 10 * MIB, 100 * MIB, 1024 * MIB];
/// Number of free-block size ranges (the bounds plus the open-ended last range).
pub const FREE_BLOCK_RANGES: usize = FREE_BLOCK_RANGE_BOUNDS.len() + 1;

/// A CUDA-graph memory pool id, as PyTorch's `MempoolId_t`.
pub type PoolId = (u64, u64);

/// A private pool: memory of one CUDA graph, kept out of general reuse until released.
struct PrivatePool {
    id: PoolId,
    /// `begin_allocate_to_pool` calls not yet matched by `release_pool`.
    use_count: u32,
    /// Segments it still holds.
    segments: u32,
    /// Captures into it begun and neither ended nor abandoned (counted in `captures_underway`).
    capturing: u32,
    /// Where its segments come from (`heap/pools.rs`); None: the device.
    source: Option<Box<dyn SegmentSource>>,
    /// A general allocation that finds no memory may take its free blocks (`MemPool(use_on_oom)`).
    use_on_oom: bool,
}

pub struct Heap {
    pub(crate) device: usize,
    pub(crate) config: Config,
    pub(crate) backend: Box<dyn Backend>,
    pub(crate) arena: Arena,
    lists: Vec<FreeList>,
    /// Index in `lists` of each list's key (lists are never removed, so indices are stable).
    list_of: FxHashMap<ListKey, u32>,
    /// The last list found for each size class (large, small): most lookups repeat one.
    list_cache: [Cell<Option<(ListKey, u32)>>; 2],
    /// Events recorded at frees of blocks used by several streams, oldest first.
    pending: VecDeque<(Event, BlockId)>,
    /// Private pools; index `i` is pool number `i + 1` (0 is the general pool).
    private_pools: Vec<Option<PrivatePool>>,
    pub(crate) stats: HeapStats<PoolCounter, ActiveCounter>,
    pub(crate) step: StepState,
    pub(crate) trace: TraceRing,
    device_total: u64,
    /// Bytes the heap may reserve (`per_process_memory_fraction` of the device).
    allowed: u64,
    fraction_set: bool,
    /// Counts mallocs; a free block's age is this minus its `freed_at`.
    pub(crate) alloc_clock: u64,
    /// `begin_pool` calls not yet matched by `end_pool`: CUDA-graph captures in progress.
    captures_underway: u32,
    /// Frees made during a capture of blocks used by several streams: their events are recorded
    /// once no capture is underway (PyTorch's `needs_events_deferred_until_no_capture`).
    deferred_frees: Vec<BlockId>,
    /// Work a capture held back is waiting (`run_deferred_work`): deferred frees, releases.
    deferred_work: bool,
    /// `empty_cache` was asked for during a capture.
    deferred_empty_cache: bool,
    /// MemPool mode: the caller (PyTorch's caching allocator) caches; a free that leaves a
    /// general-pool segment entirely free gives it back to the device.
    mempool_mode: bool,
    /// Expandable segments: the physical chunk mapped at each page, `None` where unmapped.
    /// Beside the segment records, which the hot path reads, rather than in them.
    pages: FxHashMap<SegmentId, Vec<Option<PhysHandle>>>,
    /// Physical pages unmapped for the request in progress (`page_reuse`); empty between calls.
    idle_pages: Vec<PhysHandle>,
    /// `alloc_clock` when the current step began (`page_release`).
    pub(crate) step_clock: u64,
    /// `param_lane`: rounded sizes of the blocks live when the first step began.
    param_sizes: rustc_hash::FxHashSet<u64>,
    /// `page_release` over the cache limit: no free block holds a whole page and no expandable
    /// range is wholly unmapped, as the last release over the limit left it (see
    /// `release_pages_over_limit`).
    no_free_pages: bool,
    /// Expandable segments: bytes of the last range the address space had no room for in the
    /// request in progress (0 = none), for its out-of-memory report.
    address_space_short: u64,
    /// Ranges mapped from other processes (CUDA IPC, `ipc.rs`).
    ipc: ipc::IpcState,
    /// The tag of the request growing the heap now (`sleep`): the segments `find_expandable`
    /// may use or create. 0 between calls.
    request_tag: u8,
    /// Paused tags, their backups and per-tag figures (`heap/sleep.rs`).
    pub(crate) sleep: sleep::SleepState,
}

impl Heap {
    pub fn new(device: usize, config: &Config, backend: Box<dyn Backend>) -> Heap {
        let device_total = backend.info().total_bytes;
        let mut heap = Heap {
            device,
            config: config.clone(),
            backend,
            arena: Arena::default(),
            lists: Vec::new(),
            list_of: FxHashMap::default(),
            list_cache: Default::default(),
            pending: VecDeque::new(),
            private_pools: Vec::new(),
            stats: HeapStats::default(),
            step: StepState::default(),
            trace: TraceRing::new(config.trace_entries),
            device_total,
            allowed: u64::MAX,
            fraction_set: false,
            alloc_clock: 0,
            captures_underway: 0,
            pages: FxHashMap::default(),
            idle_pages: Vec::new(),
            step_clock: 0,
            param_sizes: Default::default(),
            no_free_pages: false,
            address_space_short: 0,
            ipc: Default::default(),
            request_tag: 0,
            sleep: Default::default(),
            deferred_frees: Vec::new(),
            deferred_work: false,
            deferred_empty_cache: false,
            mempool_mode: false,
        };
        if config.per_process_memory_fraction < 1.0 {
            heap.set_memory_fraction(config.per_process_memory_fraction);
        }
        if config.expandable_segments {
            heap.check_virtual_memory();
        }
        heap
    }

    pub fn device_total(&self) -> u64 {
        self.device_total
    }

    /// `torch.cuda.set_per_process_memory_fraction`.
    pub fn set_memory_fraction(&mut self, fraction: f64) {
        self.allowed = (fraction * self.device_total as f64) as u64;
        self.fraction_set = fraction < 1.0;
    }

    // ----- malloc -------------------------------------------------------------------------

    /// Allocates `size` bytes for `stream`, in the private pool `pool` when given.
    /// Size 0 gets a unique block of one granule (PyTorch calls alloc for size 0 too).
    pub fn malloc(&mut self, size: u64, stream: Stream, pool: Option<PoolId>) -> Result<u64> {
        self.malloc_tagged(size, stream, pool, 0)
    }

    /// `malloc` for tag `tag` (`crate::tags`; 0 is "default"). A tagged request in the general
    /// pool is served from its tag's own segments (`heap/sleep.rs`); CUDA-graph pools are
    /// untagged.
    #[inline]
    pub fn malloc_tagged(&mut self, size: u64, stream: Stream, pool: Option<PoolId>, tag: u8) -> Result<u64> {
        if size > MAX_REQUEST || size > self.device_total {
            return Err(self.out_of_memory(size, size, size));
        }
        if self.deferred_work && self.captures_underway == 0 {
            self.run_deferred_work()?;
        }
        // No event is queried while a capture is underway (it would invalidate the capture).
        if !self.pending.is_empty() && self.captures_underway == 0 {
            self.process_events()?;
        }
        self.alloc_clock += 1;
        let pool_index = match pool {
            Some(id) => self.private_pool_index(id),
            None => 0,
        };
        let rounded = sizeclass::round_size(size, &self.config);
        let small = sizeclass::is_small(rounded);
        let tag = if pool_index == 0 { tag } else { 0 };
        if tag != 0 && self.sleep.is_paused(tag) {
            return Err(self.paused_error(tag, size));
        }
        let lane = tag == 0 && self.config.param_lane && pool_index == 0 && self.in_param_lane(rounded);
        let mut found = self.find_free(pool_index, small, stream, rounded, lane, tag);
        if found.is_none() && small && pool_index == 0 && self.config.pack_small {
            // `pack_small`: free space in the large pool's mapped pages (the partly used pages
            // at the ends of its free blocks, which page reuse cannot move) before a new
            // small-pool page.
            found = self.find_free(pool_index, false, stream, rounded, lane, tag);
        }
        let id = match found {
            Some(id) => {
                self.stats.num_cache_hits += 1;
                id
            }
            None if tag != 0 => self.grow_tagged(small, stream, rounded, size, tag)?,
            None if self.config.expandable_segments && pool_index == 0 => {
                // As PyTorch: CUDA-graph pools keep plain segments.
                self.grow_expandable(small, stream, rounded, size, lane)?
            }
            None => self.grow(pool_index, small, stream, rounded, size)?,
        };
        Ok(self.hand_out(id, rounded, size, stream))
    }

    /// A cached block for the request: this stream's list first, then blocks any stream may use;
    /// `lane`: the parameter lane's lists (`param_lane`); `tag`: the tag's own lists.
    #[inline(always)]
    fn find_free(
        &mut self,
        pool: u32,
        small: bool,
        stream: Stream,
        rounded: u64,
        lane: bool,
        tag: u8,
    ) -> Option<BlockId> {
        for s in [stream, ANY_STREAM] {
            let Some(li) = self.list_index(ListKey::new(pool, small, s, lane, tag)) else { continue };
            let oversize_request = rounded >= self.config.max_split_size;
            let found = if oversize_request {
                self.lists[li].find_oversize(rounded, self.config.max_non_split_rounding)
            } else {
                self.find_in(li, rounded)
            };
            if let Some(id) = found {
                self.unlist(id);
                return Some(self.prefer_not_tail(li, id, rounded));
            }
        }
        None
    }

    /// A free block below `max_split_size` of list `li` that holds `rounded` bytes.
    fn find_in(&self, li: usize, rounded: u64) -> Option<BlockId> {
        if self.config.exact_fit {
            self.lists[li].find_exact(&self.arena.blocks, rounded)
        } else {
            self.lists[li].find(&self.arena.blocks, rounded)
        }
    }

    /// Expandable segments, as PyTorch: a free block followed by unmapped space (the free tail,
    /// which can grow in place) is taken only when no other free block fits.
    #[inline]
    fn prefer_not_tail(&mut self, li: usize, id: BlockId, rounded: u64) -> BlockId {
        if !self.config.expandable_segments {
            return id; // no neighbour to load on the plain path
        }
        self.prefer_not_tail_expandable(li, id, rounded)
    }

    #[inline(never)]
    fn prefer_not_tail_expandable(&mut self, li: usize, id: BlockId, rounded: u64) -> BlockId {
        let next = self.arena.block(id).next;
        if next == NIL || self.arena.state(next) != BlockState::Unmapped || rounded >= self.config.max_split_size {
            return id;
        }
        match self.find_in(li, rounded) {
            Some(other) => {
                self.unlist(other);
                self.enlist(id);
                other
            }
            None => id,
        }
    }

    /// Marks a free block (already out of its list) allocated, splitting off the rest.
    fn hand_out(&mut self, id: BlockId, rounded: u64, requested: u64, stream: Stream) -> u64 {
        // A record left under another address (a merge) or by a grown array moves home.
        let id = self.arena.rehome(id);
        let (seg_id, small, expandable, block_size, was_split) = {
            let b = self.arena.block(id);
            (b.segment, b.class.small(), b.class.expandable(), b.size, b.is_split())
        };
        debug_assert_eq!(self.arena.state(id), BlockState::Free);
        // Inactive-split statistics change by the operation's net effect, as PyTorch's do: an
        // already split block shrinks by `rounded` or leaves; an unsplit one leaves a new piece.
        if self.should_split(block_size, rounded, small || expandable) {
            // The remainder stays free, reusable by whoever could reuse the whole block.
            let rest = self.split_block(id, rounded);
            self.arena.block_mut(rest).freed_at = self.alloc_clock;
            self.enlist(rest);
            if was_split {
                self.stats.inactive_split_bytes.decrease(small, rounded);
            } else {
                self.stats.inactive_split.increase(small, 1);
                self.stats.inactive_split_bytes.increase(small, block_size - rounded);
            }
        } else if was_split {
            self.stats.inactive_split.decrease(small, 1);
            self.stats.inactive_split_bytes.decrease(small, block_size);
        }
        let step = self.step.step;
        let phase_bit = self.step.phase_bit();
        self.arena.set_state(id, BlockState::Allocated);
        let b = self.arena.block_mut(id);
        b.requested = requested;
        b.stream = stream;
        let (addr, size) = (b.addr, b.size);
        let usage = self.arena.segment_use_mut(seg_id);
        usage.last_used_step = step;
        usage.phase_mask |= phase_bit;
        self.arena.file_allocated(id);
        let s = &mut self.stats;
        s.num_mallocs += 1;
        s.allocation.increase(small, 1);
        s.allocated_bytes.increase(small, size);
        s.requested_bytes.increase(small, requested);
        if s.active.any_pending() {
            s.active.note_increase(&s.allocation);
            s.active_bytes.note_increase(&s.allocated_bytes);
        }
        if size >= self.config.max_split_size {
            s.oversize_allocations.increase(1);
        }
        self.step.note_allocated(self.stats.allocated_bytes.current());
        self.trace.record(TraceAction::Alloc, addr, size, requested, stream.0, 0);
        addr
    }

    /// `fine`: the small pool, or an expandable segment (PyTorch splits those whenever a
    /// granule would remain).
    fn should_split(&self, block_size: u64, rounded: u64, fine: bool) -> bool {
        let remaining = block_size - rounded;
        if fine {
            remaining >= GRANULE
        } else {
            rounded < self.config.max_split_size && remaining > SMALL_REQUEST
        }
    }

    /// Reserves a new segment for the request, running the out-of-memory path on failure.
    fn grow(&mut self, pool: u32, small: bool, stream: Stream, rounded: u64, requested: u64) -> Result<BlockId> {
        if self.fraction_set && self.config.garbage_collection_threshold > 0.0 && self.captures_underway == 0 {
            self.garbage_collect()?;
        }
        let seg_size = sizeclass::segment_size(rounded);
        // During a CUDA-graph capture, freeing device memory or waiting on streams would break
        // the capture: only a plain reserve is tried.
        let capturing = self.captures_underway > 0;
        let mut attempt = self.reserve_for(pool, seg_size, stream)?;
        if attempt.is_none() && !capturing && self.release_oversize(seg_size)? {
            attempt = self.reserve_for(pool, seg_size, stream)?;
        }
        if attempt.is_none() && !capturing {
            self.stats.num_alloc_retries += 1;
            self.release_all_cached(ReleaseReason::Oom)?;
            attempt = self.reserve_for(pool, seg_size, stream)?;
        }
        let Some(addr) = attempt else {
            if let Some(id) = (pool == 0).then(|| self.last_resort_block(small, stream, rounded)).flatten() {
                return Ok(id);
            }
            return Err(self.out_of_memory(requested, rounded, seg_size));
        };
        Ok(self.new_segment(addr, seg_size, small, pool, stream))
    }

    /// One device reserve within the allowed limit: `Ok(None)` when out of memory.
    fn reserve(&mut self, bytes: u64) -> Result<Option<u64>> {
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

    fn new_segment(&mut self, addr: u64, size: u64, small: bool, pool: u32, stream: Stream) -> BlockId {
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
        id
    }

    fn out_of_memory(&mut self, requested: u64, rounded: u64, segment_size: u64) -> Error {
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

    // ----- free ---------------------------------------------------------------------------

    /// Frees the block at `ptr`. `size`, when not 0, must be the size asked for at malloc;
    /// a mismatch is refused and the block stays allocated.
    pub fn free(&mut self, ptr: u64, size: u64) -> Result<()> {
        if self.deferred_work && self.captures_underway == 0 {
            self.run_deferred_work()?;
        }
        // Usually one load: the block's record in its home slot, which the free needs anyway.
        let id = match self.arena.take_allocated(ptr, |b| size == 0 || size == b.requested) {
            Ok(id) => id,
            Err(None) => return Err(Error::UnknownPointer { device: self.device, ptr }),
            Err(Some(id)) => return Err(self.wrong_free_size(id, ptr, size)),
        };
        if self.sleep.any_paused() && self.sleep.is_paused(self.arena.block(id).class.tag()) {
            return self.free_paused(id);
        }
        let (block_size, stream, small, requested) = {
            let b = self.arena.block(id);
            (b.size, b.stream, b.class.small(), b.requested)
        };
        let s = &mut self.stats;
        s.num_frees += 1;
        s.allocation.decrease(small, 1);
        s.allocated_bytes.decrease(small, block_size);
        s.requested_bytes.decrease(small, requested);
        if block_size >= self.config.max_split_size {
            s.oversize_allocations.decrease(1);
        }
        self.trace.record(TraceAction::FreeRequested, ptr, block_size, requested, stream.0, 0);
        if !self.arena.has_extra_streams(id) {
            return self.finish_free(id);
        }
        if self.captures_underway > 0 {
            self.defer_free_events(id);
            return Ok(());
        }
        self.mark_pending(id);
        self.record_free_events(id)
    }

    /// A freed block waits for other streams' work before it is free (it stays active).
    fn mark_pending(&mut self, id: BlockId) {
        self.arena.set_state(id, BlockState::Pending);
        let b = self.arena.block(id);
        let (small, size) = (b.class.small(), b.size);
        self.stats.note_pending(small, size);
    }

    #[cold]
    fn wrong_free_size(&self, id: BlockId, ptr: u64, size: u64) -> Error {
        let requested = self.arena.block(id).requested;
        Error::InvalidArgument(format!(
            "free of {ptr:#x} on device {} with size {size}, but {requested} bytes were allocated there",
            self.device
        ))
    }

    /// A block becomes free: merge it with free neighbours and file it.
    fn finish_free(&mut self, id: BlockId) -> Result<()> {
        let was_pending = self.arena.state(id) == BlockState::Pending;
        self.arena.set_state(id, BlockState::Free);
        let (seg_id, size, stream, addr, requested, class) = {
            let b = self.arena.block_mut(id);
            b.freed_at = self.alloc_clock;
            // `requested` stays set while a free is pending, for snapshots and this trace entry.
            let requested = std::mem::take(&mut b.requested);
            (b.segment, b.size, b.stream, b.addr, requested, b.class)
        };
        let small = class.small();
        if was_pending {
            self.stats.note_pending_done(small, size);
        }
        self.trace.record(TraceAction::FreeCompleted, addr, size, requested, stream.0, 0);
        let (id, absorbed, absorbed_bytes) = self.merge_neighbours(id);
        self.enlist(id);
        self.count_merged_free(id, absorbed, absorbed_bytes);
        // Free neighbours of different streams do not merge, so check the merged result: the
        // segment is free when this block is all of it (what `segment_is_free` tests, without
        // loading the segment).
        let whole_segment_free = !class.expandable() && !self.arena.block(id).is_split();
        debug_assert_eq!(whole_segment_free, self.segment_is_free(seg_id));
        if whole_segment_free && self.captures_underway > 0 {
            // No device free during a capture: `run_deferred_work` releases it afterwards.
            self.deferred_work = true;
            return Ok(());
        }
        if whole_segment_free && class.pool() > 0 {
            // A released graph pool gives its memory back as soon as it is free.
            let pool = &self.private_pools[class.pool() as usize - 1];
            if pool.as_ref().is_some_and(|p| p.use_count == 0) {
                self.release_segment(seg_id, ReleaseReason::EmptyCache)?;
                return Ok(());
            }
        }
        if whole_segment_free && self.over_cache_limit() {
            self.release_segment(seg_id, ReleaseReason::Limit)?;
        } else if whole_segment_free && self.mempool_mode && class.pool() == 0 {
            self.release_segment(seg_id, ReleaseReason::EmptyCache)?;
        } else if self.mempool_mode && class.tag() != 0 && self.captures_underway == 0 {
            // MemPool mode: a tagged segment's free pages go back as a plain segment would.
            self.release_tagged_free(id)?;
        } else if self.config.page_release && class.expandable() {
            self.release_pages_over_limit(id)?;
        }
        Ok(())
    }

    /// Splits block `id` at `offset`: it keeps the first `offset` bytes; the rest becomes a new
    /// block of the same state and stream after it (not filed in any list). Returns the new id.
    pub(super) fn split_block(&mut self, id: BlockId, offset: u64) -> BlockId {
        let b = self.arena.block(id);
        debug_assert!(offset > 0 && offset < b.size);
        let mut rest = Block::unlinked(b.addr + offset, b.size - offset, b.segment, b.class, b.stream, b.freed_at);
        rest.prev = id;
        rest.next = b.next;
        let next = b.next;
        let rest = self.arena.new_block(rest, self.arena.state(id));
        if next != NIL {
            // `next` was split before (its prev was `id`) and still is: no statistic changes.
            self.arena.block_mut(next).prev = rest;
        }
        let b = self.arena.block_mut(id);
        b.next = rest;
        b.size = offset;
        rest
    }

    /// Merges the free block `id` (not in a list) with free neighbours of compatible streams,
    /// as far as they reach each way. Returns the merged block and the number and bytes of the
    /// free blocks it absorbed (each a piece of a split segment, counted in the
    /// inactive-split statistics until now: see `count_merged_free`).
    #[inline(always)]
    fn merge_neighbours(&mut self, id: BlockId) -> (BlockId, u64, u64) {
        let (mut absorbed, mut absorbed_bytes) = (0, 0);
        for forward in [false, true] {
            loop {
                let b = self.arena.block(id);
                let other = if forward { b.next } else { b.prev };
                // The dense state array: an allocated neighbour's record is not loaded.
                if other == NIL || self.arena.state(other) != BlockState::Free {
                    break;
                }
                let o = self.arena.block(other);
                let Some(stream) = merged_stream(b.stream, o.stream) else { break };
                absorbed += 1;
                absorbed_bytes += o.size;
                self.absorb(id, other, forward, stream);
            }
        }
        (id, absorbed, absorbed_bytes)
    }

    /// The inactive-split statistics after `merge_neighbours` made the free block `merged`,
    /// which is not counted yet, from blocks that were: one net change, as PyTorch's
    /// `free_block` makes.
    #[inline]
    fn count_merged_free(&mut self, merged: BlockId, absorbed: u64, absorbed_bytes: u64) {
        let b = self.arena.block(merged);
        let small = b.class.small();
        let (count, bytes) = if b.is_split() { (1, b.size) } else { (0, 0) };
        let s = &mut self.stats;
        if count > absorbed {
            s.inactive_split.increase(small, count - absorbed);
        } else if count < absorbed {
            s.inactive_split.decrease(small, absorbed - count);
        }
        if bytes > absorbed_bytes {
            s.inactive_split_bytes.increase(small, bytes - absorbed_bytes);
        } else if bytes < absorbed_bytes {
            s.inactive_split_bytes.decrease(small, absorbed_bytes - bytes);
        }
    }

    /// Block `id` takes over its neighbour `other` (after it when `forward`): a free `other`
    /// leaves its list (its inactive-split count is the caller's), an unmapped `other` merges
    /// with an unmapped `id` (no list, no split statistics).
    fn absorb(&mut self, id: BlockId, other: BlockId, forward: bool, stream: Stream) {
        if self.arena.state(other) == BlockState::Free {
            self.unlist(other);
        }
        let o = self.arena.block(other);
        let (o_addr, o_size, o_prev, o_next, o_freed_at) = (o.addr, o.size, o.prev, o.next, o.freed_at);
        let b = self.arena.block_mut(id);
        b.size += o_size;
        b.stream = stream;
        b.freed_at = b.freed_at.max(o_freed_at);
        if forward {
            b.next = o_next;
            if o_next != NIL {
                self.arena.block_mut(o_next).prev = id;
            }
        } else {
            b.addr = o_addr;
            b.prev = o_prev;
            if o_prev != NIL {
                self.arena.block_mut(o_prev).next = id;
            } else {
                let seg = self.arena.block(id).segment;
                self.arena.segment_mut(seg).first = id;
            }
        }
        self.arena.drop_block(other);
    }

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
    fn process_events(&mut self) -> Result<()> {
        while let Some(&(event, id)) = self.pending.front() {
            if !self.backend.event_done(event)? {
                break;
            }
            self.pending.pop_front();
            self.event_completed(event, id)?;
        }
        Ok(())
    }

    fn event_completed(&mut self, event: Event, id: BlockId) -> Result<()> {
        self.backend.free_event(event);
        if self.arena.complete_pending_event(id) == 0 {
            self.finish_free(id)?;
        }
        Ok(())
    }

    /// Waits for every pending event and completes those frees.
    fn synchronize_pending(&mut self) -> Result<()> {
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
    fn defer_free_events(&mut self, id: BlockId) {
        self.mark_pending(id);
        self.deferred_frees.push(id);
        self.deferred_work = true;
    }

    /// A free of a block used by several streams (`record_stream`): it is reusable once each
    /// stream's queued work, and the allocating stream's, has passed this point. Records those
    /// events (at the free, or when a capture that deferred it has ended).
    fn record_free_events(&mut self, id: BlockId) -> Result<()> {
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
        if self.over_cache_limit() {
            let order = self.releasable_segments();
            self.release_in_order(order, ReleaseReason::Limit, |h| !h.over_cache_limit())?;
        }
        if self.config.page_release && self.over_cache_limit() {
            self.release_free_pages(ReleaseReason::Limit, |_| true, |h| !h.over_cache_limit())?;
        }
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

    // ----- free lists ----------------------------------------------------------------------

    /// A comparison with the size class's last list, else one hash lookup however many
    /// streams have lists.
    #[inline]
    fn list_index(&self, key: ListKey) -> Option<usize> {
        let cached = &self.list_cache[usize::from(key.small())];
        if let Some((k, li)) = cached.get() {
            if k == key {
                return Some(li as usize);
            }
        }
        let li = *self.list_of.get(&key)?;
        cached.set(Some((key, li)));
        Some(li as usize)
    }

    /// The key of the list a free block belongs in: (its pool, its size class, its stream, its
    /// lane).
    #[inline]
    fn list_key(b: &Block) -> ListKey {
        ListKey::of(b.class, b.stream)
    }

    /// Files a free block in the list of its (pool, size class, stream).
    #[inline(always)]
    fn enlist(&mut self, id: BlockId) {
        let b = self.arena.block(id);
        let key = Self::list_key(b);
        let oversize = b.size >= self.config.max_split_size;
        let li = match self.list_index(key) {
            Some(li) => li,
            None => self.new_list(key),
        };
        self.lists[li].insert(&mut self.arena.blocks, id, oversize);
    }

    #[cold]
    fn new_list(&mut self, key: ListKey) -> usize {
        self.lists.push(FreeList::new(key));
        self.list_of.insert(key, (self.lists.len() - 1) as u32);
        self.lists.len() - 1
    }

    /// Takes a free block out of its list (the one its key names: a listed block's stream,
    /// pool and size class do not change).
    #[inline(always)]
    fn unlist(&mut self, id: BlockId) {
        let b = self.arena.block(id);
        let oversize = b.size >= self.config.max_split_size;
        let li = self.list_index(Self::list_key(b));
        debug_assert!(li.is_some(), "free block {id} has no list");
        if let Some(li) = li {
            self.lists[li].remove(&mut self.arena.blocks, id, oversize);
        }
    }

    /// Inactive-split accounting: a free block counts while its segment is split.
    fn split_stat_out(&mut self, id: BlockId) {
        let b = self.arena.block(id);
        if self.arena.state(id) == BlockState::Free && b.is_split() {
            let small = b.class.small();
            self.stats.inactive_split.decrease(small, 1);
            self.stats.inactive_split_bytes.decrease(small, b.size);
        }
    }

    fn split_stat_in(&mut self, id: BlockId) {
        let b = self.arena.block(id);
        if self.arena.state(id) == BlockState::Free && b.is_split() {
            let small = b.class.small();
            self.stats.inactive_split.increase(small, 1);
            self.stats.inactive_split_bytes.increase(small, b.size);
        }
    }

    // ----- reports -------------------------------------------------------------------------

    /// Free (cached, reusable) blocks summarised by size: `(count, bytes)` per range of
    /// [`FREE_BLOCK_RANGE_BOUNDS`], the last range open-ended. Pending blocks are not free.
    /// A linear scan of the block slots: for scrapes and reports, never the hot path.
    pub fn free_block_ranges(&self) -> [(u64, u64); FREE_BLOCK_RANGES] {
        let mut ranges = [(0u64, 0u64); FREE_BLOCK_RANGES];
        for b in self.arena.blocks_in_state(BlockState::Free).map(|id| self.arena.block(id)) {
            let i = FREE_BLOCK_RANGE_BOUNDS.iter().position(|&upper| b.size < upper).unwrap_or(FREE_BLOCK_RANGES - 1);
            ranges[i].0 += 1;
            ranges[i].1 += b.size;
        }
        ranges
    }

    pub fn largest_free_block(&self) -> u64 {
        self.lists.iter().map(|l| l.largest(&self.arena.blocks)).max().unwrap_or(0)
    }

    pub fn stats(&mut self) -> DeviceStats {
        DeviceStats {
            device: self.device,
            heap: self.stats.read(),
            max_split_size: self.config.max_split_size,
            device_total: self.device_total,
            cached_free: self.cached_free(),
            largest_free_block: self.largest_free_block(),
            steps_by_phase: self.step.steps_by_phase(),
            last_step: self.step.last.clone(),
            driver_time: self.backend.driver_time(),
            mapped_bytes: self.mapped_bytes(),
            tags: if crate::tags::registered().is_empty() { Vec::new() } else { self.tag_figures() },
            backup_host_bytes: self.backup_host_bytes(),
        }
    }

    /// The block holding `ptr` (anywhere inside it), for `set_base_alloc_fn`: the segment's base
    /// address and size (`Ok(None)`: in no segment). An expandable segment is refused, as
    /// PyTorch's `getBaseAllocation` refuses it: its range is mostly unmapped, and IPC of its
    /// memory goes through the physical pages' handles, not a base pointer.
    pub fn base_allocation(&self, ptr: u64) -> Result<Option<(u64, u64)>> {
        match self.segment_holding(ptr) {
            Some((_, _, true)) => Err(Error::InvalidArgument(format!(
                "{ptr:#x} lies in an expandable segment, which has no base allocation: tensors allocated \
                 with expandable_segments:True cannot be shared between processes (as in PyTorch); use \
                 expandable_segments:False for memory to be shared"
            ))),
            found => Ok(found.map(|(addr, size, _)| (addr, size))),
        }
    }

    /// The segment holding `ptr` (anywhere inside it): its address, size (an expandable
    /// segment's whole range) and whether it is expandable.
    pub fn segment_holding(&self, ptr: u64) -> Option<(u64, u64, bool)> {
        let mut segments = self.arena.live_segment_ids().map(|s| self.arena.segment(s));
        segments.find(|s| s.addr <= ptr && ptr < s.addr + s.size).map(|s| (s.addr, s.size, s.expandable()))
    }

    /// Whether `ptr` is the start of a live allocation of this heap.
    pub fn is_live(&self, ptr: u64) -> bool {
        self.arena.find_allocated(ptr).is_some()
    }

    /// Allocated blocks: (address, block size, requested size, stream).
    pub fn live_blocks(&self) -> Vec<(u64, u64, u64, Stream)> {
        self.arena
            .blocks_in_state(BlockState::Allocated)
            .map(|id| {
                let b = self.arena.block(id);
                (b.addr, b.size, b.requested, b.stream)
            })
            .collect()
    }

    /// Reserved memory: (address, size, small pool) of each plain segment and of each run of
    /// mapped blocks of an expandable segment.
    pub fn segments(&self) -> Vec<(u64, u64, bool)> {
        let mut out = Vec::new();
        for seg_id in self.arena.live_segment_ids() {
            let seg = self.arena.segment(seg_id);
            if !seg.expandable() {
                out.push((seg.addr, seg.size, seg.small));
                continue;
            }
            let mut run: Option<(u64, u64)> = None;
            for id in self.arena.segment_blocks(seg_id) {
                let b = self.arena.block(id);
                match (self.arena.state(id) == BlockState::Unmapped, run) {
                    (false, Some((start, size))) => run = Some((start, size + b.size)),
                    (false, None) => run = Some((b.addr, b.size)),
                    (true, Some((start, size))) => {
                        out.push((start, size, seg.small));
                        run = None;
                    }
                    (true, None) => {}
                }
            }
            if let Some((start, size)) = run {
                out.push((start, size, seg.small));
            }
        }
        out
    }

    /// Free and total device memory as the device reports them (`cuMemGetInfo`).
    pub fn device_mem_info(&mut self) -> Result<(u64, u64)> {
        self.backend.mem_info()
    }

    /// Lets simulated time pass (no effect on CUDA).
    pub fn advance_time(&mut self, ns: u64) {
        self.backend.advance_time(ns);
    }

    /// Checks every structural invariant and that each statistic equals what it counts.
    /// O(blocks); for tests and debugging.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut allocated = [0u64; 2];
        let mut requested = [0u64; 2];
        let mut active = [0u64; 2];
        let mut split_bytes = [0u64; 2];
        let mut reserved = [0u64; 2];
        let mut listed = 0u64;
        let mut displaced = 0usize;
        let mut unmapped = 0usize;
        for seg_id in self.arena.live_segment_ids() {
            let seg = self.arena.segment(seg_id);
            let p = if seg.small { 0 } else { 1 };
            // A paused tag's segments hold no memory and count in no statistic (`heap/sleep.rs`).
            let paused = self.sleep.is_paused(seg.tag);
            reserved[p] += if paused { 0 } else { seg.mapped };
            let mut mapped = 0;
            let mut expect = seg.addr;
            let mut prev = NIL;
            let mut prev_free_stream: Option<Stream> = None;
            for id in self.arena.segment_blocks(seg_id) {
                let b = self.arena.block(id);
                if b.addr != expect || b.prev != prev || b.segment != seg_id {
                    return Err(format!("segment {:#x}: block {id} does not tile it", seg.addr));
                }
                if b.size == 0 || b.size % GRANULE != 0 {
                    return Err(format!("block {:#x} has size {}", b.addr, b.size));
                }
                expect += b.size;
                prev = id;
                let state = self.arena.state(id);
                if state != BlockState::Unmapped {
                    mapped += b.size;
                } else if (b.addr - seg.addr) % seg.page != 0 || b.size % seg.page != 0 {
                    return Err(format!("unmapped block {:#x} is not page-aligned", b.addr));
                }
                if b.class != BlockClass::of(seg) {
                    return Err(format!("block {:#x}: class {:?} differs from its segment's", b.addr, b.class));
                }
                match state {
                    // A paused tag's blocks count in no statistic, but stay filed by address.
                    BlockState::Allocated if paused => {
                        displaced += usize::from(!self.arena.filed_at_home(id));
                        if self.arena.find_allocated(b.addr) != Some(id) {
                            return Err(format!("paused block {:#x} not found by its address", b.addr));
                        }
                    }
                    BlockState::Allocated => {
                        allocated[p] += b.size;
                        requested[p] += b.requested;
                        active[p] += b.size;
                        if self.arena.filed_at_home(id) && !self.arena.is_home(id) {
                            return Err(format!("allocated block {:#x} filed at home outside it", b.addr));
                        }
                        displaced += usize::from(!self.arena.filed_at_home(id));
                        if self.arena.find_allocated(b.addr) != Some(id) {
                            return Err(format!("allocated block {:#x} not found by its address", b.addr));
                        }
                    }
                    BlockState::Pending => {
                        active[p] += b.size;
                    }
                    BlockState::Free => {
                        listed += 1;
                        if b.is_split() {
                            split_bytes[p] += b.size;
                        }
                        if let Some(s) = prev_free_stream {
                            if merged_stream(s, b.stream).is_some() {
                                return Err(format!("free neighbours at {:#x} were not merged", b.addr));
                            }
                        }
                    }
                    BlockState::Unmapped if seg.expandable() => {
                        unmapped += 1;
                        if self.arena.unmapped_at(b.addr) != Some(id) {
                            return Err(format!("unmapped block {:#x} missing from their index", b.addr));
                        }
                    }
                    BlockState::Unmapped | BlockState::Vacant => {
                        return Err(format!("{state:?} block {id} linked in a segment"))
                    }
                }
                prev_free_stream = (state == BlockState::Free).then_some(b.stream);
            }
            if expect != seg.addr + seg.size {
                return Err(format!("segment {:#x}: blocks do not reach its end", seg.addr));
            }
            if mapped != seg.mapped {
                return Err(format!(
                    "segment {:#x}: {mapped} bytes in mapped blocks, {} counted",
                    seg.addr, seg.mapped
                ));
            }
            if seg.expandable() {
                let pages = self.pages.get(&seg_id).map_or(0, |p| p.iter().filter(|h| h.is_some()).count()) as u64;
                if pages * seg.page != if paused { 0 } else { seg.mapped } {
                    return Err(format!("segment {:#x}: {pages} pages mapped for {} bytes", seg.addr, seg.mapped));
                }
            }
        }
        self.check_no_free_pages()?;
        if unmapped != self.arena.unmapped_filed() {
            return Err(format!("{unmapped} unmapped blocks, {} in their index", self.arena.unmapped_filed()));
        }
        if displaced != self.arena.displaced_blocks() {
            let filed = self.arena.displaced_blocks();
            return Err(format!("{filed} blocks in the index of displaced ones, {displaced} filed as displaced"));
        }
        let in_lists: u64 = self.lists.iter().map(|l| l.count).sum();
        if in_lists != listed {
            return Err(format!("free lists hold {in_lists} blocks, {listed} blocks are free"));
        }
        let s = self.stats.read();
        let checks = [
            ("allocated_bytes", &s.allocated_bytes, allocated),
            ("requested_bytes", &s.requested_bytes, requested),
            ("active_bytes", &s.active_bytes, active),
            ("inactive_split_bytes", &s.inactive_split_bytes, split_bytes),
            ("reserved_bytes", &s.reserved_bytes, reserved),
        ];
        for (name, stat, expect) in checks {
            if stat.small_pool.current != expect[0]
                || stat.large_pool.current != expect[1]
                || stat.all.current != expect[0] + expect[1]
            {
                return Err(format!(
                    "{name}: stats say small {} large {} all {}, blocks sum to {:?}",
                    stat.small_pool.current, stat.large_pool.current, stat.all.current, expect
                ));
            }
        }
        if s.segment.all.current != self.arena.live_segments as u64 {
            return Err("segment count differs from live segments".into());
        }
        Ok(())
    }
}

/// The stream a merge of two free neighbours belongs to, if they may merge: the same stream,
/// or any stream with one that every stream may use.
fn merged_stream(a: Stream, b: Stream) -> Option<Stream> {
    if a == b || b == ANY_STREAM {
        Some(a)
    } else if a == ANY_STREAM {
        Some(b)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::SimDevice;

    fn heap() -> Heap {
        let config = Config::parse("backend:sim,sim_capacity_mb:1048576").expect("config");
        Heap::new(0, &config, Box::new(SimDevice::new(0, &config.sim)))
    }

    /// A small xorshift generator: the heap tests' random sizes and victims, reproducible.
    fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }

    /// 20,000 blocks of random sizes up to 256 KiB; `at_peak` sees the heap at its largest;
    /// then random ones are freed until `keep` remain. Returns the live blocks.
    fn grow_then_shrink(
        heap: &mut Heap,
        next: &mut impl FnMut() -> u64,
        keep: usize,
        at_peak: impl FnOnce(&Heap),
    ) -> Vec<(u64, u64)> {
        let mut live: Vec<(u64, u64)> = (0..20_000)
            .map(|_| {
                let size = 1 + next() % (256 << 10);
                (heap.malloc(size, Stream(0), None).expect("malloc"), size)
            })
            .collect();
        at_peak(heap);
        while live.len() > keep {
            let (p, size) = live.swap_remove((next() % live.len() as u64) as usize);
            heap.free(p, size).expect("free");
        }
        live
    }

    /// The slot array doubles while 20 000 blocks are allocated, which moves homes: every
    /// allocated block is still found by its address (home, or filed as displaced), and after
    /// the heap shrank the index of displaced blocks is small again, so the history of a heap
    /// does not slow it down.
    #[test]
    fn blocks_are_found_across_growth_and_the_displaced_index_shrinks() {
        let mut heap = heap();
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        let mut large = 0;
        let live = grow_then_shrink(&mut heap, &mut next, 200, |h| {
            h.check_invariants().expect("invariants at the peak");
            assert!(h.arena.blocks.len() >= 32_768, "{} slots for 20 000 blocks", h.arena.blocks.len());
            large = h.arena.displaced_capacity();
        });
        assert!(large > 0, "growth displaced no allocated block");
        let small = heap.arena.displaced_capacity();
        assert!(small * 8 <= large, "displaced index {small} of {large} after shrinking");
        for &(p, size) in &live {
            let id = heap.arena.find_allocated(p).expect("allocated");
            assert_eq!(heap.arena.block(id).requested, size);
        }
        heap.check_invariants().expect("invariants");
    }

    /// A block handed out from the cache moves to a vacant slot of its home bucket when it has
    /// one, so `free` finds nearly every block with one load; the few that are not home are
    /// those whose bucket other blocks fill.
    #[test]
    fn blocks_handed_out_move_home() {
        for conf in ["", ",expandable_segments:True"] {
            let config = Config::parse(&format!("backend:sim,sim_capacity_mb:1048576{conf}")).expect("config");
            shrink_then_churn(Heap::new(0, &config, Box::new(SimDevice::new(0, &config.sim))));
        }
    }

    fn shrink_then_churn(mut heap: Heap) {
        let mut next = xorshift(0x2545_F491_4F6C_DD1D);
        let mut live = grow_then_shrink(&mut heap, &mut next, 500, |_| {});
        for round in 0..2_000 {
            let i = (next() % live.len() as u64) as usize;
            let (p, size) = live[i];
            heap.free(p, size).expect("free");
            let p = heap.malloc(size, Stream(0), None).expect("malloc");
            live[i] = (p, size);
            let id = heap.arena.find_allocated(p).expect("allocated");
            if !heap.arena.is_home(id) {
                let home = heap.arena.home(p);
                let bucket: Vec<_> = (home..home + 4).map(|h| heap.arena.state(h)).collect();
                assert!(
                    !bucket.contains(&BlockState::Vacant),
                    "block {p:#x} in slot {id}, its home bucket at {home} has a vacant slot: {bucket:?}"
                );
            }
            if round % 100 == 0 {
                heap.check_invariants().expect("invariants");
            }
        }
        let displaced = heap.arena.displaced_blocks();
        assert!(displaced * 10 <= live.len(), "{displaced} of {} allocated blocks not home", live.len());
        heap.check_invariants().expect("invariants");
    }
}
