//! Segments and blocks: host-side metadata for device memory, kept out of band.
//!
//! A *segment* is one device reservation. It is cut into *blocks* that tile it exactly, in
//! address order, linked by `prev`/`next` indices. Blocks and segments live in `Vec`s and refer
//! to each other by index; no metadata is ever stored in device memory.
//!
//! ```text
//!  segment  [addr ................................................ addr+size)
//!  blocks   [ allocated | free (in a free list) | pending (events) | free  ]
//!             first ->   next ->                 next ->            next -> NIL
//! ```
//!
//! An *expandable* segment (`expandable_segments:True`) is a virtual range; its blocks tile the
//! whole range, and the ones with no memory behind them are `Unmapped` (page-aligned, never
//! merged with mapped blocks, never in a free list).
//!
//! Invariants: the blocks of a segment tile it without gap or overlap; two physically adjacent
//! free blocks of compatible streams are always merged.

use crate::backend::Stream;
use rustc_hash::FxHashMap;

pub type BlockId = u32;
pub type SegmentId = u32;
pub const NIL: u32 = u32::MAX;

/// Marks a free block that any stream may reuse: all its events completed.
pub const ANY_STREAM: Stream = Stream(u64::MAX);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out to the caller.
    Allocated,
    /// Freed by the caller, but other streams' work may still use it: waits for events.
    Pending,
    /// In a free list.
    Free,
    /// Virtual addresses of an expandable segment with no memory mapped behind them.
    Unmapped,
    /// The slot is unused.
    Vacant,
}

/// What a block inherits from its segment and the free path needs: the pool, the size class,
/// whether the segment is expandable and its lane (`param_lane`), packed in one word
/// (`pool << 3 | lane << 2 | expandable << 1 | small`), so that `free` never loads the segment
/// record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockClass(u32);

impl BlockClass {
    /// Pool numbers are indices into the heap's private pools plus one; 2^29 of them would take
    /// far more memory than any process has.
    pub const MAX_POOL: u32 = u32::MAX >> 3;
    const LANE: u32 = 1 << 2;

    pub fn new(pool: u32, small: bool, expandable: bool) -> BlockClass {
        debug_assert!(pool <= Self::MAX_POOL);
        BlockClass((pool.min(Self::MAX_POOL) << 3) | (u32::from(expandable) << 1) | u32::from(small))
    }

    /// The class of a block in the parameter lane (`param_lane`) when `lane`.
    pub fn in_lane(self, lane: bool) -> BlockClass {
        BlockClass(if lane { self.0 | Self::LANE } else { self.0 & !Self::LANE })
    }

    pub fn of(segment: &Segment) -> BlockClass {
        BlockClass::new(segment.pool, segment.small, segment.expandable()).in_lane(segment.lane)
    }

    pub fn pool(self) -> u32 {
        self.0 >> 3
    }

    /// Whether the block is in the parameter lane's segments (`param_lane`).
    pub fn lane(self) -> bool {
        self.0 & Self::LANE != 0
    }

    pub fn small(self) -> bool {
        self.0 & 1 != 0
    }

    pub fn expandable(self) -> bool {
        self.0 & 2 != 0
    }
}

/// A block record: what `malloc`, `free` and the merge of neighbours read, in one 64-byte cache
/// line. Its state is in the arena's dense state array (so a merge tests neighbours without
/// loading their records); the rare fields (extra streams, pending events) are in side tables.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
pub struct Block {
    pub addr: u64,
    pub size: u64,
    /// Bytes the caller asked for (0 while free).
    pub requested: u64,
    /// The stream the block was allocated on; for a free block, the stream that may reuse it
    /// (`ANY_STREAM` once nothing can be in flight). A free block sits in the list of
    /// (its pool, its size class, this stream).
    pub stream: Stream,
    /// The allocation counter when the block was last freed (garbage-collection age).
    pub freed_at: u64,
    pub segment: SegmentId,
    pub prev: BlockId,
    pub next: BlockId,
    /// Links in the free list's bin (valid while `Free` and not oversize).
    pub link_prev: BlockId,
    pub link_next: BlockId,
    pub class: BlockClass,
}

const _: () = assert!(std::mem::size_of::<Block>() == 64);

impl Block {
    /// A block not linked to neighbours or a list, with nothing requested.
    pub fn unlinked(
        addr: u64,
        size: u64,
        segment: SegmentId,
        class: BlockClass,
        stream: Stream,
        freed_at: u64,
    ) -> Block {
        Block {
            addr,
            size,
            requested: 0,
            stream,
            freed_at,
            segment,
            prev: NIL,
            next: NIL,
            link_prev: NIL,
            link_next: NIL,
            class,
        }
    }

    pub fn is_split(&self) -> bool {
        self.prev != NIL || self.next != NIL
    }
}

#[derive(Clone, Debug)]
pub struct Segment {
    pub addr: u64,
    pub size: u64,
    pub small: bool,
    /// Index of the private (CUDA-graph) pool, 0 for the general pool.
    pub pool: u32,
    /// Stream of the allocation that created the segment.
    pub stream: Stream,
    pub first: BlockId,
    /// The reserve was at or above `max_split_size`.
    pub oversize: bool,
    pub live: bool,
    /// Page size of an expandable segment (`size` is then its virtual range); 0 for a plain one.
    pub page: u64,
    /// Bytes mapped (the whole size for a plain segment).
    pub mapped: u64,
    /// An expandable segment of the parameter lane (`param_lane`): its free blocks serve only
    /// requests of the lane, and the lane's requests only its free blocks.
    pub lane: bool,
}

impl Segment {
    pub fn expandable(&self) -> bool {
        self.page != 0
    }
}

/// What every allocation from a segment updates, kept densely beside the segment records (which
/// `malloc` and `free` then do not load).
#[derive(Clone, Copy, Debug, Default)]
pub struct SegmentUse {
    /// Step number of the last allocation from this segment.
    pub last_used_step: u64,
    /// Bit per phase (phase index mod 64) that allocated from this segment.
    pub phase_mask: u64,
}

/// Slot storage for blocks and segments, with reuse of vacant slots.
///
/// A new block takes the lowest vacant slot, so live records stay packed at the front of
/// `blocks` even after the heap shrinks (a heap that once held many blocks does not keep its
/// few live ones spread over a large array).
#[derive(Default)]
pub struct Arena {
    pub blocks: Vec<Block>,
    /// The state of each block slot, densely: one byte per slot (`Vacant` for vacant slots).
    states: Vec<BlockState>,
    vacant_blocks: VacantSet,
    /// Other streams that used a block (`record_stream`); entries only for blocks that have any.
    extra_streams: FxHashMap<BlockId, Vec<Stream>>,
    /// Events still to complete before a pending block is free; entries only while non-zero.
    pending_events: FxHashMap<BlockId, u32>,
    pub segments: Vec<Segment>,
    /// Per segment slot, what allocations update (see `SegmentUse`).
    uses: Vec<SegmentUse>,
    vacant_segments: Vec<SegmentId>,
    pub live_segments: usize,
}

impl Arena {
    pub fn new_block(&mut self, block: Block, state: BlockState) -> BlockId {
        match self.vacant_blocks.pop_lowest() {
            Some(id) => {
                self.blocks[id as usize] = block;
                self.states[id as usize] = state;
                id
            }
            None => {
                let capacity = self.blocks.capacity();
                self.blocks.push(block);
                self.states.push(state);
                if self.blocks.capacity() != capacity {
                    advise_huge_pages(&self.blocks);
                }
                (self.blocks.len() - 1) as BlockId
            }
        }
    }

    /// Moves the record of block `id` to the lowest vacant slot when `id` lies beyond the
    /// packed front of the array (a quarter more slots than are in use): after a heap shrank,
    /// the records it hands out again then gather at the front instead of staying spread over
    /// the large array of its past (the history effect). The block must be in no free list and
    /// not in the live index (the caller files it afterwards). Returns its id, new or not.
    #[inline]
    pub fn pack(&mut self, id: BlockId) -> BlockId {
        let in_use = self.blocks.len() - self.vacant_blocks.len;
        if (id as usize) < in_use + in_use / 4 {
            return id;
        }
        self.move_to_front(id)
    }

    #[cold]
    #[inline(never)]
    fn move_to_front(&mut self, id: BlockId) -> BlockId {
        let Some(low) = self.vacant_blocks.pop_lowest() else { return id };
        if low > id {
            self.vacant_blocks.insert(low);
            return id;
        }
        let block = self.blocks[id as usize].clone();
        let (prev, next, segment) = (block.prev, block.next, block.segment);
        if prev != NIL {
            self.blocks[prev as usize].next = low;
        } else if self.segments[segment as usize].first == id {
            self.segments[segment as usize].first = low;
        }
        if next != NIL {
            self.blocks[next as usize].prev = low;
        }
        self.blocks[low as usize] = block;
        self.states[low as usize] = self.states[id as usize];
        // The side tables are empty for a block leaving a free list; moved all the same.
        if let Some(streams) = self.take_extra_streams(id) {
            self.extra_streams.insert(low, streams);
        }
        if let Some(events) = self.pending_events.remove(&id) {
            self.pending_events.insert(low, events);
        }
        self.drop_block(id);
        low
    }

    /// Block slots holding a block (not vacant).
    pub fn blocks_in_use(&self) -> usize {
        self.blocks.len() - self.vacant_blocks.len
    }

    pub fn drop_block(&mut self, id: BlockId) {
        self.states[id as usize] = BlockState::Vacant;
        if !self.extra_streams.is_empty() {
            self.extra_streams.remove(&id);
        }
        if !self.pending_events.is_empty() {
            self.pending_events.remove(&id);
        }
        self.vacant_blocks.insert(id);
    }

    #[inline]
    pub fn state(&self, id: BlockId) -> BlockState {
        self.states[id as usize]
    }

    #[inline]
    pub fn set_state(&mut self, id: BlockId, state: BlockState) {
        self.states[id as usize] = state;
    }

    /// Ids of the block slots in `state` (a scan of the dense state array).
    pub fn blocks_in_state(&self, state: BlockState) -> impl Iterator<Item = BlockId> + '_ {
        self.states.iter().enumerate().filter(move |(_, &s)| s == state).map(|(i, _)| i as BlockId)
    }

    /// Whether the block has streams recorded by `record_stream`.
    #[inline]
    pub fn has_extra_streams(&self, id: BlockId) -> bool {
        !self.extra_streams.is_empty() && self.extra_streams.contains_key(&id)
    }

    /// Records that `stream` used block `id` (no-op when already recorded).
    pub fn add_extra_stream(&mut self, id: BlockId, stream: Stream) {
        let streams = self.extra_streams.entry(id).or_default();
        if !streams.contains(&stream) {
            streams.push(stream);
        }
    }

    pub fn take_extra_streams(&mut self, id: BlockId) -> Option<Vec<Stream>> {
        if self.extra_streams.is_empty() {
            return None;
        }
        self.extra_streams.remove(&id)
    }

    pub fn pending_events(&self, id: BlockId) -> u32 {
        self.pending_events.get(&id).copied().unwrap_or(0)
    }

    pub fn add_pending_event(&mut self, id: BlockId) {
        *self.pending_events.entry(id).or_insert(0) += 1;
    }

    /// One pending event of block `id` completed; returns how many remain.
    pub fn complete_pending_event(&mut self, id: BlockId) -> u32 {
        match self.pending_events.get_mut(&id) {
            Some(n) if *n > 1 => {
                *n -= 1;
                *n
            }
            _ => {
                self.pending_events.remove(&id);
                0
            }
        }
    }

    pub fn new_segment(&mut self, segment: Segment, last_used_step: u64) -> SegmentId {
        self.live_segments += 1;
        let usage = SegmentUse { last_used_step, phase_mask: 0 };
        match self.vacant_segments.pop() {
            Some(id) => {
                self.segments[id as usize] = segment;
                self.uses[id as usize] = usage;
                id
            }
            None => {
                self.segments.push(segment);
                self.uses.push(usage);
                (self.segments.len() - 1) as SegmentId
            }
        }
    }

    pub fn drop_segment(&mut self, id: SegmentId) {
        self.live_segments -= 1;
        self.segments[id as usize].live = false;
        self.vacant_segments.push(id);
    }

    #[inline]
    pub fn block(&self, id: BlockId) -> &Block {
        &self.blocks[id as usize]
    }

    #[inline]
    pub fn block_mut(&mut self, id: BlockId) -> &mut Block {
        &mut self.blocks[id as usize]
    }

    pub fn segment(&self, id: SegmentId) -> &Segment {
        &self.segments[id as usize]
    }

    pub fn segment_mut(&mut self, id: SegmentId) -> &mut Segment {
        &mut self.segments[id as usize]
    }

    #[inline]
    pub fn segment_use(&self, id: SegmentId) -> &SegmentUse {
        &self.uses[id as usize]
    }

    #[inline]
    pub fn segment_use_mut(&mut self, id: SegmentId) -> &mut SegmentUse {
        &mut self.uses[id as usize]
    }

    /// Block ids of a segment in address order.
    pub fn segment_blocks(&self, id: SegmentId) -> impl Iterator<Item = BlockId> + '_ {
        let mut cursor = self.segment(id).first;
        std::iter::from_fn(move || {
            if cursor == NIL {
                return None;
            }
            let current = cursor;
            cursor = self.block(current).next;
            Some(current)
        })
    }

    pub fn live_segment_ids(&self) -> impl Iterator<Item = SegmentId> + '_ {
        self.segments.iter().enumerate().filter(|(_, s)| s.live).map(|(i, _)| i as SegmentId)
    }
}

/// Asks the kernel to back the whole 2 MiB pages of a large array with huge pages (Linux
/// transparent huge pages in `madvise` mode): at 100 k blocks the records span 6.4 MB, and a
/// random free then costs an address-translation miss as well as a cache miss. Called when the
/// array grows (once per doubling); a refusal changes nothing.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)] // one madvise call; the block says why it is sound
fn advise_huge_pages<T>(array: &Vec<T>) {
    const HUGE: usize = 2 << 20;
    let start = array.as_ptr() as usize;
    let end = start.saturating_add(array.capacity().saturating_mul(std::mem::size_of::<T>()));
    let (lo, hi) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
    if hi > lo {
        // Safety: [lo, hi) lies inside the vector's own allocation, and MADV_HUGEPAGE changes
        // how its pages are backed, never their contents.
        unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages<T>(_: &Vec<T>) {}

/// The vacant block slots, as a three-level bitmap: a bit per slot, a bit per non-zero word of
/// slots, a bit per non-zero word of those. Finding the lowest vacant slot is a short scan of
/// the top level (one word per 262 144 slots) and two `trailing_zeros`.
#[derive(Default)]
struct VacantSet {
    /// Vacant slots (set bits of `slots`).
    len: usize,
    slots: Vec<u64>,
    mid: Vec<u64>,
    top: Vec<u64>,
}

impl VacantSet {
    fn insert(&mut self, id: BlockId) {
        let i = id as usize;
        let (w, m, t) = (i / 64, i / 4096, i / 262_144);
        if self.slots.len() <= w {
            self.slots.resize(w + 1, 0);
            self.mid.resize(m + 1, 0);
            self.top.resize(t + 1, 0);
        }
        if self.slots[w] & (1 << (i % 64)) == 0 {
            self.len += 1;
        }
        self.slots[w] |= 1 << (i % 64);
        self.mid[m] |= 1 << (w % 64);
        self.top[t] |= 1 << (m % 64);
    }

    fn pop_lowest(&mut self) -> Option<BlockId> {
        let t = self.top.iter().position(|&x| x != 0)?;
        let m = t * 64 + self.top[t].trailing_zeros() as usize;
        let w = m * 64 + self.mid[m].trailing_zeros() as usize;
        let bit = self.slots[w].trailing_zeros() as usize;
        self.slots[w] &= !(1 << bit);
        self.len -= 1;
        if self.slots[w] == 0 {
            self.mid[m] &= !(1 << (w % 64));
            if self.mid[m] == 0 {
                self.top[t] &= !(1 << (m % 64));
            }
        }
        Some((w * 64 + bit) as BlockId)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vacant_slots_are_reused_lowest_first() {
        let mut set = VacantSet::default();
        for id in [300_000, 5, 4_100, 70, 64] {
            set.insert(id);
        }
        let order: Vec<_> = std::iter::from_fn(|| set.pop_lowest()).collect();
        assert_eq!(order, [5, 64, 70, 4_100, 300_000]);
        set.insert(9);
        assert_eq!(set.pop_lowest(), Some(9));
        assert_eq!(set.pop_lowest(), None);
    }

    #[test]
    fn block_record_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Block>(), 64);
        assert_eq!(std::mem::align_of::<Block>(), 64);
    }
}
