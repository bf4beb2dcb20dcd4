//! Expandable segments (`expandable_segments:True`, PyTorch's semantics) and stepalloc's page
//! policies on top of them. Part of the heap: runs under the device lock, `&mut self` throughout.
//!
//! An expandable segment is one virtual range per (pool, stream), 1.125 × device memory, with
//! physical pages (2 MiB in the small pool, `large_segment_size_mb` in the large one) mapped on
//! demand. Its blocks tile the range; unmapped blocks are page-aligned and never merge with
//! mapped ones. PyTorch's rules, as followed here:
//! - free mapped blocks are tried first (`find_free`), a block that is not the free tail before
//!   the unmapped end before the tail;
//! - otherwise the lowest unmapped block of this stream's segments that, with a free block
//!   before it and the blocks after it, has room is mapped, page by page, and merged with the
//!   free block before it; if none has room, a new segment is reserved;
//! - `empty_cache` and the last out-of-memory retry unmap the whole pages inside free blocks
//!   (after synchronizing the stream that used them) and free a range that is wholly unmapped;
//! - `reserved_bytes` counts mapped bytes, `num_device_alloc` counts map operations.
//!
//! stepalloc's additions, each behind its own key:
//! - `big_page_mb`: past `big_page_after_mb` of peak mapped bytes, the large pool grows in
//!   new segments with bigger pages (one growing segment per stream, pool and page size);
//! - `close_holes`: a request that needs pages goes first to the smallest hole it fills up
//!   to the free block after it (two mapped runs join), before PyTorch's first fit;
//! - `pack_small` (in `Heap::malloc`): a small request that finds no free small-pool block
//!   takes a free large-pool block before the small pool maps a page;
//! - `param_lane`: requests of a parameter's size (gradients, optimizer states) have segments
//!   and free lists of their own (a lane bit in the block class and the list key), so a step's
//!   short-lived tensors never sit between long-lived ones; pages stay fungible across lanes;
//! - `page_reuse`: before creating physical memory for new pages, idle whole pages inside free
//!   blocks elsewhere (any stream's segment with the same page size) are unmapped and mapped
//!   where the request needs them, so mapped bytes track live bytes;
//! - `page_release`: at step end, the whole pages of free blocks that no allocation touched
//!   during the step are unmapped and released; over the cache limit, free pages go too.
//!
//! Unmapping needs the work that used the pages to be complete: the stream of the block is
//! synchronized first (once per stream per operation); a block every stream may use
//! (`ANY_STREAM`) had its events completed already.

use super::Heap;
use crate::backend::{PhysHandle, Stream};
use crate::error::Result;
use crate::segment::{Block, BlockClass, BlockId, BlockState, Segment, SegmentId, ANY_STREAM, NIL};
use crate::sizeclass::SMALL_SEGMENT;
use crate::stats::ReleaseReason;
use crate::trace::TraceAction;

/// At most this many free blocks give up pages for one request (bounds the driver calls).
const MAX_REUSE_SOURCES: usize = 64;

/// What to keep of pages being unmapped.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Unmapped {
    /// Release the physical chunks to the device.
    Release(ReleaseReason),
    /// Keep them in `idle_pages` to map elsewhere (`page_reuse`).
    Keep,
}

impl Heap {
    /// Falls back to plain segments, saying why once on stderr, when the device cannot do
    /// virtual memory management or its granularity does not divide the page sizes.
    pub(super) fn check_virtual_memory(&mut self) {
        let why = match self.backend.vm_granularity() {
            Ok(g)
                if g > 0
                    && SMALL_SEGMENT % g == 0
                    && self.config.large_page % g == 0
                    && self.config.big_page % g == 0 =>
            {
                return
            }
            Ok(g) => format!("its granularity ({g} bytes) does not divide the page sizes"),
            Err(e) => e.to_string(),
        };
        eprintln!(
            "stepalloc: device {}: expandable_segments:True needs virtual memory management, which this \
             device cannot do ({why}); using plain segments",
            self.device
        );
        self.config.expandable_segments = false;
        self.config.page_reuse = false;
        self.config.page_release = false;
        self.config.param_lane = false;
    }

    /// `torch.cuda.memory._set_allocator_settings("expandable_segments:...")` at run time, as
    /// PyTorch's allocator takes it: the general pool's new segments are expandable (when the
    /// device can map virtual memory) or plain from now on; segments already made keep their
    /// kind, and blocks of both kinds serve requests until they are released. Page reuse, page
    /// release and the parameter lane stay as configured (off when the configuration had
    /// plain segments).
    pub fn set_expandable_segments(&mut self, on: bool) {
        if on == self.config.expandable_segments {
            return;
        }
        self.config.expandable_segments = on;
        if on {
            self.check_virtual_memory();
        }
        self.page_limit = self.config.expandable_segments && self.config.page_release && self.cache_limit() > 0;
    }

    /// `param_lane`: whether a request of `rounded` bytes belongs in the parameter lane: its
    /// size is that of a block live when the first step began (a parameter, whose gradient and
    /// optimizer states have its size) and the large pool's pages are still fine. Kept apart,
    /// the optimizer states created in the first step pack together instead of filling holes
    /// between that step's activations, which would leave them as islands whose partly used
    /// end pages stay mapped. Past `big_page_after` the lane stops: its free gradient pages
    /// would move to the activations at each step's peak and back for the next gradients,
    /// driver time a large heap's budget does not have (measured: docs/performance.md, "param_lane").
    pub(super) fn in_param_lane(&self, rounded: u64) -> bool {
        self.config.expandable_segments
            && !self.param_sizes.is_empty()
            && self.page_size(false) == self.config.large_page
            && self.param_sizes.contains(&rounded)
    }

    /// `param_lane`, at a step's begin: the first step that finds blocks live records their
    /// rounded sizes (the model's parameters and buffers, in a training loop).
    pub(crate) fn note_param_sizes(&mut self) {
        if !self.config.param_lane || !self.param_sizes.is_empty() {
            return;
        }
        let config = &self.config;
        let sizes = self
            .arena
            .blocks_in_state(BlockState::Allocated)
            .map(|id| crate::sizeclass::round_size(self.arena.block(id).requested, config));
        self.param_sizes = sizes.collect();
    }

    /// The page size of the pool's expandable segments that grow now: the large pool's turns
    /// to `big_page` once the peak of mapped bytes has reached `big_page_after` (a large heap
    /// then needs fewer driver calls per byte; a small one keeps fine pages, whose partly used
    /// ends waste less). A tagged region's ranges take big pages from the start: they hold bulk
    /// memory (weights, KV caches) that every pause and resume unmaps and maps page by page.
    /// Segments keep the page size they were created with.
    fn page_size(&self, small: bool) -> u64 {
        if small {
            SMALL_SEGMENT
        } else if self.config.big_page > 0
            && (self.request_tag != 0 || self.stats.reserved_bytes.peak() >= self.config.big_page_after)
        {
            self.config.big_page
        } else {
            self.config.large_page
        }
    }

    /// Maps memory for a request no free block could serve, running the out-of-memory path of
    /// PyTorch's allocator (release every free page, retry) when the device is full.
    pub(super) fn grow_expandable(
        &mut self,
        small: bool,
        stream: Stream,
        rounded: u64,
        requested: u64,
        lane: bool,
    ) -> Result<BlockId> {
        self.address_space_short = 0;
        if let Some(id) = self.try_expand(small, stream, rounded, lane)? {
            return Ok(id);
        }
        let mut unmapped = 0;
        if self.captures_underway == 0 {
            self.stats.num_alloc_retries += 1;
            unmapped = self.release_all_cached(ReleaseReason::Oom)?;
            if let Some(id) = self.try_expand(small, stream, rounded, lane)? {
                return Ok(id);
            }
        }
        if let Some(id) = self.last_resort_block(small, stream, rounded) {
            return Ok(id); // a free block of a `use_on_oom` pool (heap/pools.rs)
        }
        if self.release_lenders()? {
            if let Some(id) = self.try_expand(small, stream, rounded, lane)? {
                return Ok(id);
            }
        }
        let page = self.page_size(small);
        let mut e = self.out_of_memory(requested, rounded, rounded.div_ceil(page).saturating_mul(page));
        if let crate::Error::OutOfMemory(report) = &mut e {
            report.unmapped = Some(unmapped);
            if self.address_space_short > 0 {
                report.address_space = Some(crate::error::AddressSpaceShort {
                    range: self.address_space_short,
                    reserved: self.stats.virtual_reserved_bytes,
                    ranges: self.arena.live_segment_ids().filter(|&s| self.arena.segment(s).expandable()).count()
                        as u64,
                });
            }
        }
        Err(e)
    }

    /// One attempt: the block (out of its list) holding `rounded` bytes, or `None` when the
    /// device (or the memory fraction) has no room.
    fn try_expand(&mut self, small: bool, stream: Stream, rounded: u64, lane: bool) -> Result<Option<BlockId>> {
        let page = self.page_size(small);
        let Some(mut head) = self.find_expandable(small, stream, rounded, page, lane)? else { return Ok(None) };
        if self.config.page_reuse && self.captures_underway == 0 {
            let (needed, chain) = self.pages_to_map(head, rounded, page);
            if needed > 0 {
                self.take_idle_pages(needed, page, &chain)?;
                // Big pages cannot take finer idle ones: those are given back instead, as much
                // as the new big pages add, so that mapped bytes keep tracking live bytes.
                let short = needed.saturating_sub(self.idle_pages.len() as u64);
                if short > 0 && self.config.big_page > 0 {
                    self.release_finer_pages(short.saturating_mul(page), page, &chain)?;
                }
                // Taking pages reshapes blocks: look for the place again.
                match self.find_expandable(small, stream, rounded, page, lane)? {
                    Some(h) => head = h,
                    None => {
                        self.release_idle_pages()?;
                        return Ok(None);
                    }
                }
            }
        }
        let found = self.map_chain(head, rounded);
        self.release_idle_pages()?;
        found
    }

    /// PyTorch's `find_expandable_block`: the first chain, in address order over this stream's
    /// segments (of the parameter lane when `lane`), of a free block or unmapped block followed
    /// by blocks that together hold `rounded` bytes; a new segment when none has room. `None`
    /// when no range can be reserved.
    fn find_expandable(
        &mut self,
        small: bool,
        stream: Stream,
        rounded: u64,
        page: u64,
        lane: bool,
    ) -> Result<Option<BlockId>> {
        let mut segments: Vec<(u64, SegmentId)> = self
            .arena
            .live_segment_ids()
            .filter(|&s| {
                let seg = self.arena.segment(s);
                seg.expandable()
                    && seg.small == small
                    && seg.pool == self.request_pool
                    && seg.stream == stream
                    && seg.page == page
                    && seg.lane == lane
                    && seg.tag == self.request_tag
            })
            .map(|s| (self.arena.segment(s).addr, s))
            .collect();
        segments.sort_unstable();
        // The largest range this stream has in the pool (a new range may double it).
        let widest = segments.iter().map(|&(_, s)| self.arena.segment(s).size).max().unwrap_or(0);
        // `close_holes`: the smallest chain that the request closes (one that reaches the free
        // block after an unmapped hole) before PyTorch's first fit: a closed hole joins two
        // mapped runs, and their partly used end pages with them.
        let close_holes = self.config.close_holes;
        let (mut first, mut closing): (Option<BlockId>, Option<(u64, BlockId)>) = (None, None);
        for (_, seg_id) in segments {
            // The segment's unmapped blocks in address order, from the index: not its blocks.
            for id in self.arena.unmapped_in(seg_id) {
                let prev = self.arena.block(id).prev;
                let start = if prev != NIL && self.reusable_by(prev, stream) { prev } else { id };
                if !self.room_from(start, rounded, stream) {
                    continue;
                }
                if !close_holes {
                    return Ok(Some(start));
                }
                first = first.or(Some(start));
                if let Some(room) = self.room_closing(start, id, rounded, stream) {
                    if closing.is_none_or(|(best, _)| room < best) {
                        closing = Some((room, start));
                    }
                }
            }
        }
        if let Some(start) = closing.map(|(_, start)| start).or(first) {
            return Ok(Some(start));
        }
        let Some((addr, bytes)) = self.reserve_range(rounded, page, widest)? else { return Ok(None) };
        let pages = (bytes / page) as usize;
        let seg = self.arena.new_segment(
            Segment {
                addr,
                size: bytes,
                small,
                pool: self.request_pool,
                stream,
                first: NIL,
                oversize: false,
                live: true,
                page,
                mapped: 0,
                lane,
                tag: self.request_tag,
            },
            self.step.step,
        );
        let class = BlockClass::new(self.request_pool, small, true).in_lane(lane).with_tag(self.request_tag);
        let block = Block::unlinked(addr, bytes, seg, class, stream, self.alloc_clock);
        let id = self.arena.new_block(block, BlockState::Unmapped);
        self.arena.add_unmapped(id);
        self.arena.segment_mut(seg).first = id;
        self.pages.insert(seg, vec![None; pages]);
        self.stats.segment.increase(small, 1);
        self.stats.virtual_reserved_bytes += bytes;
        self.count_pool_segment(self.request_pool, true);
        Ok(Some(id))
    }

    /// The address range of a new segment for a request of `rounded` bytes, `None` when the
    /// address space has no room (recorded in `address_space_short`) or the request exceeds
    /// what the device could map.
    ///
    /// First 1.125 × device memory, as PyTorch reserves, so that the layout (and every figure)
    /// is PyTorch's while the address space has room. A process with many streams reserves that
    /// per stream and pool, which exhausts a window long before memory (1,000 streams on an
    /// 80 GiB device need 180 TiB; the simulated window is 16 TiB): then the range is sized to
    /// what it will map, twice the stream's widest range in the pool (ranges grow in chunks)
    /// or, failing that, the request's pages alone, so that address space is spent in step
    /// with mapped memory and runs out only when the window is full of those.
    fn reserve_range(&mut self, rounded: u64, page: u64, widest: u64) -> Result<Option<(u64, u64)>> {
        let total = self.device_total;
        let full = total.saturating_add(total / 8).div_ceil(page).saturating_mul(page);
        if full < rounded {
            return Ok(None);
        }
        let need = rounded.div_ceil(page).saturating_mul(page);
        let grown = widest.saturating_mul(2).clamp(need, full);
        let mut tried = u64::MAX;
        for bytes in [full, grown, need] {
            if bytes >= tried {
                continue;
            }
            tried = bytes;
            match self.backend.reserve_address(bytes) {
                Ok(addr) => return Ok(Some((addr, bytes))),
                Err(e) if e.is_out_of_memory() => {}
                Err(e) => return Err(e),
            }
        }
        self.address_space_short = need;
        Ok(None)
    }

    /// Whether `stream` may use the free block `id` (PyTorch's "allocatable").
    fn reusable_by(&self, id: BlockId, stream: Stream) -> bool {
        let b = self.arena.block(id);
        self.arena.state(id) == BlockState::Free && (b.stream == stream || b.stream == ANY_STREAM)
    }

    /// Whether the blocks from `start` on, free or unmapped, hold `rounded` bytes.
    fn room_from(&self, start: BlockId, rounded: u64, stream: Stream) -> bool {
        let mut bytes = 0u64;
        let mut id = start;
        while bytes < rounded && id != NIL {
            let b = self.arena.block(id);
            if !(self.arena.state(id) == BlockState::Unmapped || self.reusable_by(id, stream)) {
                break;
            }
            bytes += b.size;
            id = b.next;
        }
        bytes >= rounded
    }

    /// When `rounded` bytes from `start` fill the unmapped block `hole` and reach the free
    /// block after it, the room of the whole chain (free and unmapped blocks from `start`).
    fn room_closing(&self, start: BlockId, hole: BlockId, rounded: u64, stream: Stream) -> Option<u64> {
        let after = self.arena.block(hole).next;
        if after == NIL || !self.reusable_by(after, stream) {
            return None;
        }
        let mut before = 0u64;
        let mut id = start;
        while id != after {
            before = before.saturating_add(self.arena.block(id).size);
            id = self.arena.block(id).next;
        }
        if rounded <= before {
            return None;
        }
        let mut room = before;
        while id != NIL && (self.arena.state(id) == BlockState::Unmapped || self.reusable_by(id, stream)) {
            room = room.saturating_add(self.arena.block(id).size);
            id = self.arena.block(id).next;
        }
        Some(room)
    }

    /// The pages `map_chain(head, rounded)` will map, and the blocks of that chain.
    fn pages_to_map(&self, head: BlockId, rounded: u64, page: u64) -> (u64, Vec<BlockId>) {
        let (mut need, mut pages, mut chain) = (rounded, 0u64, Vec::new());
        let mut id = head;
        while need > 0 && id != NIL {
            let b = self.arena.block(id);
            chain.push(id);
            let used = if self.arena.state(id) == BlockState::Unmapped {
                let mapped = need.div_ceil(page).saturating_mul(page).min(b.size);
                pages += mapped / page;
                mapped
            } else {
                b.size
            };
            need = need.saturating_sub(used);
            id = b.next;
        }
        (pages, chain)
    }

    /// PyTorch's `try_allocate_expandable_block` after the search: maps the unmapped blocks of
    /// the chain from `head` until it holds `rounded` bytes; returns the block, out of its list.
    fn map_chain(&mut self, head: BlockId, rounded: u64) -> Result<Option<BlockId>> {
        let mut candidate = head;
        if self.arena.state(candidate) == BlockState::Unmapped {
            let bytes = self.arena.block(candidate).size.min(rounded);
            match self.map_block(candidate, bytes)? {
                Some(id) => candidate = id,
                None => return Ok(None),
            }
        }
        while self.arena.block(candidate).size < rounded {
            let next = self.arena.block(candidate).next;
            if next == NIL || self.arena.state(next) != BlockState::Unmapped {
                // `room_from` saw enough room: a different layout here is a heap bug.
                return Err(crate::Error::InvalidArgument("expandable segment: the chain lost its room".into()));
            }
            let remaining = rounded - self.arena.block(candidate).size;
            let bytes = remaining.min(self.arena.block(next).size);
            match self.map_block(next, bytes)? {
                Some(id) => candidate = id,
                None => return Ok(None),
            }
        }
        self.unlist(candidate);
        Ok(Some(candidate))
    }

    /// Maps the first `bytes` (rounded up to pages) of the unmapped block `id`, with idle pages
    /// first and new physical memory after; the mapped part becomes a free block merged with
    /// its free neighbours and filed. Returns it, or `None` when the device is full.
    fn map_block(&mut self, id: BlockId, bytes: u64) -> Result<Option<BlockId>> {
        let (addr, size, seg_id) = {
            let b = self.arena.block(id);
            (b.addr, b.size, b.segment)
        };
        let (seg_addr, page, small, seg_stream) = {
            let seg = self.arena.segment(seg_id);
            (seg.addr, seg.page, seg.small, seg.stream)
        };
        let map_bytes = bytes.div_ceil(page).saturating_mul(page).min(size);
        if self.stats.reserved_bytes.current().saturating_add(map_bytes) > self.allowed {
            self.stats.num_oom_rejections += 1;
            return Ok(None);
        }
        let first = ((addr - seg_addr) / page) as usize;
        let pages = (map_bytes / page) as usize;
        // A map operation is this heap's device malloc: timed like one (modelled on the sim).
        let started = std::time::Instant::now();
        let modelled_before = self.vm_driver_ns();
        for i in 0..pages {
            let page_addr = addr + i as u64 * page;
            let (handle, moved) = match self.idle_pages.pop() {
                Some(handle) => (handle, true),
                None => match self.create_page(page) {
                    Ok(handle) => (handle, false),
                    Err(e) => {
                        self.unmap_partial(seg_id, first, i)?;
                        return if e.is_out_of_memory() { Ok(None) } else { Err(e) };
                    }
                },
            };
            if let Err(e) = self.backend.map(page_addr, page, handle) {
                self.idle_pages.push(handle);
                self.unmap_partial(seg_id, first, i)?;
                return if e.is_out_of_memory() { Ok(None) } else { Err(e) };
            }
            self.stats.num_map += 1;
            if moved {
                self.stats.moved_bytes = self.stats.moved_bytes.saturating_add(page);
            }
            self.page_slot(seg_id, first + i).replace(handle);
        }
        self.arena.remove_unmapped(id);
        if map_bytes < size {
            let rest = self.split_block(id, map_bytes);
            debug_assert_eq!(self.arena.state(rest), BlockState::Unmapped);
            self.arena.add_unmapped(rest);
        }
        let clock = self.alloc_clock;
        self.arena.set_state(id, BlockState::Free);
        let b = self.arena.block_mut(id);
        b.stream = seg_stream;
        b.freed_at = clock;
        self.arena.segment_mut(seg_id).mapped += map_bytes;
        let modelled = self.vm_driver_ns() - modelled_before;
        self.stats.record_device_alloc_latency(if modelled > 0 {
            modelled
        } else {
            started.elapsed().as_nanos() as u64
        });
        let s = &mut self.stats;
        s.reserved_bytes.increase(small, map_bytes);
        s.num_device_alloc += 1;
        self.step.note_reserved(self.stats.reserved_bytes.current());
        self.trace.record(TraceAction::SegmentMap, addr, map_bytes, 0, seg_stream.0, 0);
        let (merged, absorbed, absorbed_bytes) = self.merge_neighbours(id);
        self.enlist(merged);
        self.count_merged_free(merged, absorbed, absorbed_bytes);
        Ok(Some(merged))
    }

    /// The handle slot of page `index` of an expandable segment.
    fn page_slot(&mut self, seg_id: SegmentId, index: usize) -> &mut Option<PhysHandle> {
        &mut self.pages.entry(seg_id).or_default()[index]
    }

    /// Creates one page of physical memory.
    fn create_page(&mut self, page: u64) -> Result<PhysHandle> {
        let handle = self.backend.create_physical(page)?;
        self.stats.num_create += 1;
        Ok(handle)
    }

    /// Modelled time of the virtual-memory calls so far (0 on CUDA, where time is measured).
    fn vm_driver_ns(&self) -> u64 {
        let t = self.backend.driver_time();
        t.create_ns.saturating_add(t.map_ns)
    }

    /// Undoes the first `count` page maps of a failed `map_block` (pages from `first`); their
    /// chunks go to `idle_pages`, released at the end of the request.
    fn unmap_partial(&mut self, seg_id: SegmentId, first: usize, count: usize) -> Result<()> {
        let (seg_addr, page) = (self.arena.segment(seg_id).addr, self.arena.segment(seg_id).page);
        for i in first..first + count {
            if let Some(handle) = self.page_slot(seg_id, i).take() {
                self.backend.unmap(seg_addr + i as u64 * page, page)?;
                self.stats.num_unmap += 1;
                self.idle_pages.push(handle);
            }
        }
        Ok(())
    }

    /// Releases chunks taken for a request and not mapped in the end.
    fn release_idle_pages(&mut self) -> Result<()> {
        while let Some(handle) = self.idle_pages.pop() {
            self.backend.release_physical(handle)?;
            self.stats.num_release_physical += 1;
        }
        Ok(())
    }

    /// Free blocks of the general pool of at least `min` bytes that hold whole pages, outside
    /// `exclude`, in segments whose page size `keep` accepts: the blocks whose whole pages page
    /// reuse may take, the `MAX_REUSE_SOURCES` largest first (the fewest blocks cut for the
    /// pages needed; least recently freed first made fewer moves but higher peaks on the model
    /// traces and agent presets), equal sizes highest address first (an order of the heap's
    /// contents, not of where their records happen to lie). From `free_pages`, so the cost is
    /// that of the blocks with pages to give, not of every free block.
    fn page_sources(&self, min: u64, exclude: &[BlockId], keep: impl Fn(u64) -> bool) -> Vec<(u64, BlockId)> {
        let mut sources: Vec<(u64, BlockId)> = self
            .free_pages
            .iter()
            .filter(|&id| {
                let b = self.arena.block(id);
                b.class.pool() == 0
                    && b.size >= min
                    && !exclude.contains(&id)
                    && keep(self.arena.segment(b.segment).page)
            })
            .map(|id| (self.arena.block(id).size, id))
            .collect();
        let order = |&(size, id): &(u64, BlockId)| std::cmp::Reverse((size, self.arena.block(id).addr));
        if sources.len() > MAX_REUSE_SOURCES {
            sources.select_nth_unstable_by_key(MAX_REUSE_SOURCES, order);
            sources.truncate(MAX_REUSE_SOURCES);
        }
        sources.sort_unstable_by_key(order);
        sources
    }

    /// `page_reuse`: unmaps up to `needed` whole idle pages of size `page` from free blocks
    /// outside `exclude`, largest blocks first, into `idle_pages`.
    fn take_idle_pages(&mut self, needed: u64, page: u64, exclude: &[BlockId]) -> Result<()> {
        let sources = self.page_sources(page, exclude, |p| p == page);
        let mut synced: Vec<Stream> = Vec::new();
        for &(_, id) in sources.iter().take(MAX_REUSE_SOURCES) {
            let have = self.idle_pages.len() as u64;
            if have >= needed {
                break;
            }
            let Some((lo, hi)) = self.whole_pages(id) else { continue };
            let take = ((hi - lo) / page).min(needed - have);
            // The top pages of the block: its start stays mapped for requests that fit there.
            self.unmap_range(id, hi - take * page, hi, Unmapped::Keep, &mut synced)?;
        }
        Ok(())
    }

    /// `page_reuse` with `big_page_mb`: unmaps and releases up to `bytes` of whole idle pages
    /// finer than `page` from free blocks outside `exclude`, largest blocks first.
    fn release_finer_pages(&mut self, bytes: u64, page: u64, exclude: &[BlockId]) -> Result<()> {
        let sources = self.page_sources(SMALL_SEGMENT, exclude, |p| p < page);
        let (mut released, mut synced) = (0u64, Vec::new());
        for &(_, id) in sources.iter().take(MAX_REUSE_SOURCES) {
            if released >= bytes {
                break;
            }
            let Some((lo, hi)) = self.whole_pages(id) else { continue };
            let fine = self.arena.segment(self.arena.block(id).segment).page;
            let take = (hi - lo).min((bytes - released).div_ceil(fine) * fine);
            self.unmap_range(id, hi - take, hi, Unmapped::Release(ReleaseReason::Limit), &mut synced)?;
            released += take;
        }
        // Ranges left empty stay reserved (the request's own new segment may be one) until
        // `empty_cache` or the out-of-memory path frees them.
        Ok(())
    }

    /// The whole pages inside the free block `id` of an expandable segment, as `[lo, hi)`.
    pub(super) fn whole_pages(&self, id: BlockId) -> Option<(u64, u64)> {
        if self.arena.state(id) != BlockState::Free {
            return None;
        }
        let b = self.arena.block(id);
        let seg = self.arena.segment(b.segment);
        // A paused tag's pages are not mapped: nothing to take or release (`heap/sleep.rs`); a
        // graph pool's free pages are the graph's (`heap/graphs.rs`).
        if !seg.expandable() || self.sleep.is_paused(seg.tag) || seg.pool != 0 {
            return None;
        }
        let (lo, hi) = seg.whole_pages(b.addr, b.size);
        (hi > lo).then_some((lo, hi))
    }

    /// Unmaps `[start, end)`, whole pages inside the free block `id` (in its list), after the
    /// work that used it completed. The block is cut into free pieces around an unmapped one.
    pub(super) fn unmap_range(
        &mut self,
        id: BlockId,
        start: u64,
        end: u64,
        what: Unmapped,
        synced: &mut Vec<Stream>,
    ) -> Result<()> {
        let (seg_id, stream) = (self.arena.block(id).segment, self.arena.block(id).stream);
        let (seg_addr, page, small, seg_stream) = {
            let seg = self.arena.segment(seg_id);
            (seg.addr, seg.page, seg.small, seg.stream)
        };
        // PyTorch synchronizes before unmapping: unmap does not wait for queued work.
        if stream != ANY_STREAM && !synced.contains(&stream) {
            self.backend.synchronize_stream(stream)?;
            synced.push(stream);
        }
        for p in (start..end).step_by(page as usize) {
            let index = ((p - seg_addr) / page) as usize;
            let Some(handle) = self.page_slot(seg_id, index).take() else { continue };
            self.backend.unmap(p, page)?;
            self.stats.num_unmap += 1;
            match what {
                Unmapped::Keep => self.idle_pages.push(handle),
                Unmapped::Release(_) => {
                    self.backend.release_physical(handle)?;
                    self.stats.num_release_physical += 1;
                }
            }
        }
        self.unlist(id);
        self.split_stat_out(id);
        let addr = self.arena.block(id).addr;
        let size = self.arena.block(id).size;
        let mut middle = id;
        if start > addr {
            middle = self.split_block(id, start - addr);
            self.enlist(id);
            self.split_stat_in(id);
        }
        if end < addr + size {
            let after = self.split_block(middle, end - start);
            self.enlist(after);
            self.split_stat_in(after);
        }
        let bytes = end - start;
        self.arena.set_state(middle, BlockState::Unmapped);
        self.arena.add_unmapped(middle);
        self.arena.segment_mut(seg_id).mapped -= bytes;
        let s = &mut self.stats;
        s.reserved_bytes.decrease(small, bytes);
        s.num_device_free += 1;
        if let Unmapped::Release(reason) = what {
            s.released_bytes[reason as usize] = s.released_bytes[reason as usize].saturating_add(bytes);
        }
        self.trace.record(TraceAction::SegmentUnmap, start, bytes, 0, seg_stream.0, 0);
        self.merge_unmapped(middle);
        Ok(())
    }

    /// Merges the unmapped block `id` with unmapped neighbours.
    pub(super) fn merge_unmapped(&mut self, id: BlockId) {
        for forward in [false, true] {
            let b = self.arena.block(id);
            let other = if forward { b.next } else { b.prev };
            if other != NIL && self.arena.state(other) == BlockState::Unmapped {
                let stream = self.arena.block(id).stream;
                self.arena.remove_unmapped(id);
                self.arena.remove_unmapped(other);
                self.absorb(id, other, forward, stream);
                self.arena.add_unmapped(id);
            }
        }
    }

    /// Unmaps and releases the whole pages inside free blocks of expandable segments that
    /// `pick` selects (all of them for `empty_cache`), then frees the ranges left wholly
    /// unmapped. Returns the bytes unmapped.
    pub(crate) fn release_free_pages(&mut self, reason: ReleaseReason, pick: impl Fn(&Block) -> bool) -> Result<u64> {
        if self.captures_underway > 0 {
            // No unmap during a capture: `run_deferred_work` releases after it.
            self.deferred_work = true;
            return Ok(0);
        }
        // In block order: an order of the heap's contents, not of when blocks were filed.
        let mut candidates: Vec<BlockId> = self.free_pages.iter().filter(|&id| pick(self.arena.block(id))).collect();
        candidates.sort_unstable();
        let mut synced = Vec::new();
        let mut released = 0;
        for id in candidates {
            // Filed blocks hold whole pages (`check_free_pages`); checked again all the same.
            let Some((lo, hi)) = self.whole_pages(id) else { continue };
            self.unmap_range(id, lo, hi, Unmapped::Release(reason), &mut synced)?;
            released += hi - lo;
        }
        self.free_unmapped_segments()?;
        Ok(released)
    }

    /// Frees the address range of every expandable segment with nothing mapped.
    pub(super) fn free_unmapped_segments(&mut self) -> Result<()> {
        let empty: Vec<SegmentId> = self
            .arena
            .live_segment_ids()
            .filter(|&s| {
                let seg = self.arena.segment(s);
                seg.expandable()
                    && seg.mapped == 0
                    && self.arena.block(seg.first).next == NIL
                    && !self.sleep.keeps_cached(seg.tag)
            })
            .collect();
        for seg_id in empty {
            let (addr, size, small, first, pool) = {
                let seg = self.arena.segment(seg_id);
                (seg.addr, seg.size, seg.small, seg.first, seg.pool)
            };
            self.backend.free_address(addr, size)?;
            self.arena.remove_unmapped(first);
            self.arena.drop_block(first);
            self.arena.drop_segment(seg_id);
            self.pages.remove(&seg_id);
            self.stats.segment.decrease(small, 1);
            self.stats.virtual_reserved_bytes -= size;
            self.count_pool_segment(pool, false);
        }
        Ok(())
    }

    /// `page_release` at step end: the free pages no allocation touched during the step.
    pub(crate) fn release_idle_pages_at_step_end(&mut self) -> Result<u64> {
        let since = self.step_clock;
        self.release_free_pages(ReleaseReason::Step, |b| b.freed_at < since)
    }

    /// Bytes mapped in expandable segments (a paused tag's hold none).
    pub fn mapped_bytes(&self) -> u64 {
        let segments = self.arena.live_segment_ids().map(|s| self.arena.segment(s));
        segments.filter(|s| s.expandable() && !self.sleep.is_paused(s.tag)).map(|s| s.mapped).sum()
    }
}
