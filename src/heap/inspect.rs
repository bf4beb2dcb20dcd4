//! Reading the heap: free-block ranges, statistics, segments and live blocks for reports and
//! snapshots, the device's memory figures, and `check_invariants` (tests and the oracle).
//! Never on the hot path.

use super::{merged_stream, Heap, FREE_BLOCK_RANGES, FREE_BLOCK_RANGE_BOUNDS};
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::segment::{BlockClass, BlockState, NIL};
use crate::sizeclass::GRANULE;
use crate::stats::DeviceStats;

impl Heap {
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
        self.check_free_pages()?;
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
