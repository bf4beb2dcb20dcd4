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
//!   events, release every unsplit cached segment and retry; then report out of memory
//!   (stepalloc, unless `exact_fit` keeps PyTorch's sequence: after the wait the cache is
//!   searched again, and the release reaches pools in use as `empty_cache` does; `grow.rs`).
//!
//! This file holds the heap's state and the hot path (malloc, free, split, merge). The rest,
//! one concern a file, all `impl Heap` under the same lock:
//! - `grow.rs`: new segments and the out-of-memory path and report;
//! - `lists.rs`: the free lists and their one-entry cache (inlined into the hot path);
//! - `events.rs`: stream-ordered reuse (events, `record_stream`) and work deferred by captures;
//! - `expandable.rs`: expandable segments (pages mapped on demand, page reuse, address space);
//! - `release.rs`: giving memory back (OOM steps, `empty_cache`, limits, GC) and CUDA-graph pools;
//! - `graphs.rs`: a CUDA graph's private pool under a tag (paged ranges a pause releases and a
//!   resume maps again, the graph still valid);
//! - `limit.rs`: the free blocks holding whole pages (what page reuse, `empty_cache` and the
//!   cache limit take) and `page_release` under a cache limit;
//! - `checkpoint.rs`: a private pool's state recorded and restored (CUDA-graph trees);
//! - `listeners.rs`: listeners of a pool's segments (NCCL buffer registration);
//! - `pools.rs`: user memory pools (`torch.cuda.MemPool`: use counts, another allocator's
//!   segments, `use_on_oom`);
//! - `steps.rs`: the step-boundary release policies;
//! - `tagged.rs`: tagged memory in virtual ranges of its own; `sleep.rs`: tags paused and
//!   resumed with their addresses kept (the state and the invariants; the work in `sleep/`:
//!   `pause.rs`, `resume.rs`, `cached.rs` for the free pages kept for the resume, `host.rs` for
//!   the host buffers); `backup.rs`: where their bytes go meanwhile (pinned or pageable host
//!   buffers, files on disk);
//! - `ipc.rs`: blocks shared with other processes (PyTorch's IPC formats);
//! - `inspect.rs`: statistics, segments and live blocks for reports, `check_invariants`.
//!
//! Invariants (checked by `check_invariants` in tests): blocks tile their segments; adjacent
//! free blocks of compatible streams are merged; the free lists hold exactly the `Free` blocks;
//! `Arena::find_allocated` finds exactly the `Allocated` blocks; every statistic equals the sum
//! it stands for.

use crate::backend::{Backend, Event, PhysHandle, Stream};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::freelist::{FreeList, ListKey};
use crate::segment::{Arena, Block, BlockId, BlockState, SegmentId, ANY_STREAM, NIL};
use crate::sizeclass::{self, GRANULE, MAX_REQUEST, SMALL_REQUEST};
use crate::stats::{ActiveCounter, HeapStats, PoolCounter, ReleaseReason};
use crate::step::StepState;
use crate::trace::{TraceAction, TraceRing};
use crate::units::MIB;
use rustc_hash::FxHashMap;
use std::cell::Cell;
use std::collections::VecDeque;

pub(crate) mod backup;
mod checkpoint;
mod events;
mod expandable;
mod graphs;
mod grow;
mod inspect;
mod ipc;
mod limit;
mod listeners;
mod lists;
mod pools;
mod release;
mod sleep;
mod steps;
mod tagged;

pub use backup::{dir as backup_dir, set_dir as set_backup_dir};
pub use checkpoint::{CheckpointBlock, PoolCheckpoint, RestoreDelta};
pub use listeners::SegmentListener;
pub use pools::SegmentSource;
pub use sleep::SleepOutcome;
pub use tagged::TagFigures;

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
    /// Routes into it underway (`use_mem_pool`, `beginAllocateToPool`): not captures, so they
    /// hold back nothing that a capture holds back.
    routes: u32,
    /// A CUDA graph captured into it: a captured graph replays into blocks that are free to the
    /// heap, so its segments stay until its last reference goes (as in PyTorch). A pool never
    /// captured into gives its free segments back like the general pool.
    captured: bool,
    /// Where its segments come from (`heap/pools.rs`); None: the device.
    source: Option<Box<dyn SegmentSource>>,
    /// A general allocation that finds no memory may take its free blocks (`MemPool(use_on_oom)`).
    use_on_oom: bool,
    /// The tag its memory carries (`heap/graphs.rs`); 0: none, plain segments as PyTorch's.
    tag: u8,
    /// Its blocks are never split: each takes a whole segment (`MemPool(no_split=True)`).
    no_split: bool,
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
    /// The fraction `allowed` came from (`get_per_process_memory_fraction`); 1.0 unless set.
    fraction: f64,
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
    /// `torch.cuda.caching_allocator_enable(False)`: general untagged requests skip the cache
    /// (a segment each, never split, released when freed).
    caching_disabled: bool,
    /// Expandable segments: the physical chunk mapped at each page, `None` where unmapped.
    /// Beside the segment records, which the hot path reads, rather than in them.
    pages: FxHashMap<SegmentId, Vec<Option<PhysHandle>>>,
    /// Physical pages unmapped for the request in progress (`page_reuse`); empty between calls.
    idle_pages: Vec<PhysHandle>,
    /// `alloc_clock` when the current step began (`page_release`).
    pub(crate) step_clock: u64,
    /// `param_lane`: rounded sizes of the blocks live when the first step began.
    param_sizes: rustc_hash::FxHashSet<u64>,
    /// The free blocks of expandable segments (tagged ones too) holding whole pages and their
    /// bytes, kept by `enlist` and `unlist` (`heap/limit.rs`): what page reuse, the cache
    /// limit and `empty_cache` take.
    free_pages: limit::FreePages,
    /// `page_release` with a cache limit (`heap/limit.rs`).
    page_limit: bool,
    /// `alloc_clock` at which the release a free over the cache limit scheduled runs
    /// (`page_release_grace`); `u64::MAX` when none is due.
    page_release_due: u64,
    /// Expandable segments: bytes of the last range the address space had no room for in the
    /// request in progress (0 = none), for its out-of-memory report.
    address_space_short: u64,
    /// Ranges mapped from other processes (CUDA IPC, `ipc.rs`).
    ipc: ipc::IpcState,
    /// The tag and the private pool (0: the general pool) of the tagged request growing the
    /// heap now (`grow_tagged`): the segments `find_expandable` may use or create. 0 between
    /// calls.
    request_tag: u8,
    request_pool: u32,
    /// Paused tags, their backups and per-tag figures (`heap/sleep.rs`).
    pub(crate) sleep: sleep::SleepState,
    /// Blocks a checkpoint restore allocated, waiting for their pools' next allocations
    /// (`heap/checkpoint.rs`).
    adoptions: checkpoint::Adoptions,
    /// Listeners of private pools' segments (`heap/listeners.rs`: NCCL buffer registration).
    listeners: listeners::Listeners,
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
            fraction: 1.0,
            alloc_clock: 0,
            captures_underway: 0,
            pages: FxHashMap::default(),
            idle_pages: Vec::new(),
            step_clock: 0,
            param_sizes: Default::default(),
            free_pages: limit::FreePages::default(),
            page_limit: false,
            page_release_due: u64::MAX,
            address_space_short: 0,
            ipc: Default::default(),
            request_tag: 0,
            request_pool: 0,
            sleep: Default::default(),
            adoptions: Default::default(),
            listeners: Default::default(),
            deferred_frees: Vec::new(),
            deferred_work: false,
            deferred_empty_cache: false,
            mempool_mode: false,
            caching_disabled: false,
        };
        if config.per_process_memory_fraction < 1.0 {
            heap.set_memory_fraction(config.per_process_memory_fraction);
        }
        if config.expandable_segments {
            heap.check_virtual_memory();
        }
        heap.page_limit = heap.config.expandable_segments && config.page_release && heap.cache_limit() > 0;
        heap
    }

    pub fn device_total(&self) -> u64 {
        self.device_total
    }

    /// `torch.cuda.set_per_process_memory_fraction`.
    pub fn set_memory_fraction(&mut self, fraction: f64) {
        self.allowed = (fraction * self.device_total as f64) as u64;
        self.fraction_set = fraction < 1.0;
        self.fraction = fraction;
    }

    /// `torch.cuda.get_per_process_memory_fraction`: the last fraction set (1.0 if none).
    pub fn memory_fraction(&self) -> f64 {
        self.fraction
    }

    // ----- malloc -------------------------------------------------------------------------

    /// Allocates `size` bytes for `stream`, in the private pool `pool` when given.
    /// Size 0 gets a unique block of one granule (PyTorch calls alloc for size 0 too).
    pub fn malloc(&mut self, size: u64, stream: Stream, pool: Option<PoolId>) -> Result<u64> {
        self.malloc_tagged(size, stream, pool, 0)
    }

    /// `malloc` for tag `tag` (`crate::tags`; 0 is "default"). A tagged request in the general
    /// pool is served from its tag's own segments (`heap/sleep.rs`); a request in a CUDA-graph
    /// pool carries the pool's tag (`heap/graphs.rs`), whatever `tag` says.
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
        // Counts of calls wrap rather than carry the release profile's overflow check: 2^64
        // calls would take centuries.
        self.alloc_clock = self.alloc_clock.wrapping_add(1);
        let pool_index = match pool {
            Some(id) => self.private_pool_index(id),
            None => 0,
        };
        if pool_index != 0 && !self.adoptions.is_empty() {
            if let Some(ptr) = self.adopt(pool_index, size, stream)? {
                return Ok(ptr);
            }
        }
        let rounded = sizeclass::round_size(size, &self.config);
        let small = sizeclass::is_small(rounded);
        let tag = if pool_index == 0 { tag } else { self.pool_tag(pool_index, tag)? };
        if tag != 0 && self.sleep.is_paused(tag) {
            return Err(self.paused_error(tag, size));
        }
        let lane = tag == 0 && self.config.param_lane && pool_index == 0 && self.in_param_lane(rounded);
        // `caching_allocator_enable(False)`: a general, untagged request takes a new plain
        // segment of its own, which goes back to the device when it is freed.
        let uncached = self.caching_disabled && pool_index == 0 && tag == 0;
        let mut found = if uncached { None } else { self.find_free(pool_index, small, stream, rounded, lane, tag) };
        if found.is_none() && small && pool_index == 0 && self.config.pack_small && !uncached {
            // `pack_small`: free space in the large pool's mapped pages (the partly used pages
            // at the ends of its free blocks, which page reuse cannot move) before a new
            // small-pool page.
            found = self.find_free(pool_index, false, stream, rounded, lane, tag);
        }
        let id = match found {
            Some(id) => {
                self.stats.num_cache_hits = self.stats.num_cache_hits.wrapping_add(1);
                id
            }
            None if tag != 0 => self.grow_tagged(pool_index, small, stream, rounded, size, tag)?,
            None if self.config.expandable_segments && pool_index == 0 && !uncached => {
                // As PyTorch: CUDA-graph pools keep plain segments.
                self.grow_expandable(small, stream, rounded, size, lane)?
            }
            None => self.grow(pool_index, small, stream, rounded, size)?,
        };
        let ptr = self.hand_out(id, rounded, size, stream);
        if self.alloc_clock >= self.page_release_due {
            self.release_due_pages();
        }
        Ok(ptr)
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
    #[inline(always)]
    fn find_in(&self, li: usize, rounded: u64) -> Option<BlockId> {
        if self.config.exact_fit {
            self.lists[li].find_exact(&self.arena.blocks, rounded)
        } else {
            self.lists[li].find(&self.arena.blocks, rounded)
        }
    }

    /// Expandable segments: a free block followed by unmapped space (the free tail, which can
    /// grow in place) is passed over for another. Under `exact_fit` (PyTorch's rules) as
    /// PyTorch's `get_free_block` does: from the best fit, move to the next free block in (size,
    /// address) order while that one's expandable size (its size plus the unmapped block after
    /// it) is smaller. Otherwise (stepalloc's own choice) the tail is taken only when no other
    /// free block fits.
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
            // Only a tail can have a larger expandable size than a block after it in order.
            return id;
        }
        if self.config.exact_fit {
            return self.pytorch_expandable_choice(li, id);
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

    /// PyTorch's walk from the best fit `id` (out of its list) of list `li`; see
    /// `prefer_not_tail`. The blocks walked over are all below `max_split_size` (the list's
    /// bins; PyTorch would walk into an oversize block and then find none, which is not
    /// followed here).
    fn pytorch_expandable_choice(&mut self, li: usize, id: BlockId) -> BlockId {
        let expandable_size = |h: &Heap, b: BlockId| {
            let block = h.arena.block(b);
            let after = block.next;
            let unmapped = if after != NIL && h.arena.state(after) == BlockState::Unmapped {
                h.arena.block(after).size
            } else {
                0
            };
            block.size.saturating_add(unmapped)
        };
        let mut chosen = id;
        loop {
            let (size, addr) = (self.arena.block(chosen).size, self.arena.block(chosen).addr);
            let Some(next) = self.lists[li].next_exact(&self.arena.blocks, size, addr) else { break };
            if expandable_size(self, next) >= expandable_size(self, chosen) {
                break;
            }
            chosen = next;
        }
        if chosen != id {
            self.unlist(chosen);
            self.enlist(id);
        }
        chosen
    }

    /// Marks a free block (already out of its list) allocated, splitting off the rest.
    #[inline(always)] // one caller: malloc
    fn hand_out(&mut self, id: BlockId, rounded: u64, requested: u64, stream: Stream) -> u64 {
        // A record left under another address (a merge) or by a grown array moves home.
        let id = self.arena.rehome(id);
        let (seg_id, small, expandable, block_size, was_split, class) = {
            let b = self.arena.block(id);
            (b.segment, b.class.small(), b.class.expandable(), b.size, b.is_split(), b.class)
        };
        let pool = class.pool();
        debug_assert_eq!(self.arena.state(id), BlockState::Free);
        // Inactive-split statistics change by the operation's net effect, as PyTorch's do: an
        // already split block shrinks by `rounded` or leaves; an unsplit one leaves a new piece.
        // A `no_split` pool's block keeps its whole segment (one block per segment), as does a
        // general untagged block while caching is disabled.
        let may_split = if pool == 0 { !self.caching_disabled || class.tag() != 0 } else { !self.pool_no_split(pool) };
        if may_split && self.should_split(block_size, rounded, small || expandable) {
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
        s.num_mallocs = s.num_mallocs.wrapping_add(1);
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

    // ----- free ---------------------------------------------------------------------------

    /// The statistics and the trace entry of a free request of allocated block `id` at `ptr`
    /// (the block no longer counts as allocated): returns its size, stream and requested bytes.
    #[inline]
    fn count_free_request(&mut self, id: BlockId, ptr: u64) -> (u64, Stream, u64) {
        let (size, stream, small, requested) = {
            let b = self.arena.block(id);
            (b.size, b.stream, b.class.small(), b.requested)
        };
        let s = &mut self.stats;
        s.num_frees = s.num_frees.wrapping_add(1);
        s.allocation.decrease(small, 1);
        s.allocated_bytes.decrease(small, size);
        s.requested_bytes.decrease(small, requested);
        if size >= self.config.max_split_size {
            s.oversize_allocations.decrease(1);
        }
        self.trace.record(TraceAction::FreeRequested, ptr, size, requested, stream.0, 0);
        (size, stream, requested)
    }

    /// Frees the block at `ptr`. `size`, when not 0, must be the size asked for at malloc;
    /// a mismatch is refused and the block stays allocated.
    #[inline]
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
        self.count_free_request(id, ptr);
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
    #[inline]
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
        } else if whole_segment_free
            && (self.mempool_mode || (self.caching_disabled && class.tag() == 0))
            && class.pool() == 0
        {
            self.release_segment(seg_id, ReleaseReason::EmptyCache)?;
        } else if self.mempool_mode && class.tag() != 0 && self.captures_underway == 0 {
            // MemPool mode: a tagged segment's free pages go back as a plain segment would.
            self.release_tagged_free(id)?;
        } else if class.pool() > 0 && class.expandable() {
            // A tagged graph pool's pages stay with the graph until the pool is released.
            self.release_if_pool_released(id)?;
        } else if self.page_limit && class.expandable() && self.free_pages.bytes > self.cache_limit() {
            self.schedule_page_release()?;
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
    #[inline(always)]
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
