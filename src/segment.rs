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
//!
//! Parts: `block` (the records: ids, states, classes, blocks, segments) and `live` (the index of
//! allocated blocks not in their home slot, which the arena owns); this file is the arena that
//! stores the records and finds blocks by address.

mod block;
mod live;

pub use block::{Block, BlockClass, BlockId, BlockState, Segment, SegmentId, SegmentUse, ANY_STREAM, NIL};

use crate::backend::Stream;
use live::LiveIndex;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Slot storage for blocks and segments, with reuse of vacant slots, and the lookup of
/// allocated blocks by address.
///
/// Each address has a *home*: a bucket of four slots chosen by a hash of the address. A new
/// block takes a vacant slot of its home when there is one, and a free block handed out again
/// moves home when it is not there yet (`rehome`). Each slot's byte in the dense state array
/// holds, beside the state, a 5-bit tag of the block's address, so `free` finds its block by
/// reading one byte group and then loading the one record it must change anyway, instead of a
/// hash-table probe followed by the record (two dependent cache misses at 100 k live blocks).
/// Allocated blocks not at home (their bucket was full) are in a small index, `displaced`.
/// The home table (the first `home_slots` slots) stays at least twice the blocks in use, a
/// power of two, so buckets are rarely full. When the heap shrinks to an eighth of it, the
/// table halves: records beyond it move into it as they are handed out again, and new ones
/// take its vacant slots, so a heap that was large has its records and state bytes gathered in
/// a small table again (the history effect) without moving any record another part of the
/// heap holds an id of.
pub struct Arena {
    pub blocks: Vec<Block>,
    /// The slots homes are chosen among: a power of two, at most `blocks.len()`.
    home_slots: usize,
    /// Each block slot's state and tag (see `slot_byte`), densely: one byte per slot.
    states: Vec<u8>,
    vacant_blocks: VacantSet,
    /// The allocated blocks not in their home bucket, by address.
    displaced: LiveIndex,
    /// Other streams that used a block (`record_stream`); entries only for blocks that have any.
    extra_streams: FxHashMap<BlockId, Vec<Stream>>,
    /// Events still to complete before a pending block is free; entries only while non-zero.
    pending_events: FxHashMap<BlockId, u32>,
    /// The unmapped blocks of expandable segments, by address: what a request that needs pages
    /// searches. Kept by the code that makes, splits, merges, maps and drops them
    /// (`add_unmapped`, `remove_unmapped`), so that finding room costs the unmapped blocks it
    /// looks at, not every block of the segments.
    unmapped: BTreeMap<u64, BlockId>,
    pub segments: Vec<Segment>,
    /// Per segment slot, what allocations update (see `SegmentUse`).
    uses: Vec<SegmentUse>,
    vacant_segments: Vec<SegmentId>,
    pub live_segments: usize,
    /// Where homes lie, for readers without the device lock (`HomeHint`).
    hint: Arc<HomeHint>,
}

/// Where the home bucket of an address lies, readable without the device lock: the addresses
/// of the state bytes and of the records and the home table's size, stored by the arena
/// whenever they change (`resize_homes`). A reader may see them stale or torn (another thread
/// may be resizing), so the addresses are only fit for a prefetch: the C ABI's `free` asks for
/// the lines of the freed block's bucket before it takes the lock, so that the record `free`
/// must load (a miss in a large heap) arrives while the lock is taken.
#[derive(Debug, Default)]
pub struct HomeHint {
    states: AtomicUsize,
    records: AtomicUsize,
    slots: AtomicUsize,
}

impl HomeHint {
    /// The address of the state bytes and of the first of the four records of the home bucket
    /// of a block at `addr` (both possibly stale: for a prefetch only).
    #[inline]
    pub fn lines(&self, addr: u64) -> (usize, usize) {
        let slots = self.slots.load(Ordering::Relaxed);
        let home = Arena::home_in(home_hash(addr), slots.max(BUCKET)) as usize;
        let states = self.states.load(Ordering::Relaxed).wrapping_add(home);
        let records =
            self.records.load(Ordering::Relaxed).wrapping_add(home.wrapping_mul(std::mem::size_of::<Block>()));
        (states, records)
    }
}

/// A slot's byte: its `BlockState` in the low three bits and, for an allocated block filed at
/// home, its address's tag above them. An allocated block not filed at home (displaced) has a
/// code of its own, so a lookup, which compares whole bytes, never takes it for a block at home,
/// and loads the record only of a slot whose code and tag match (a false match, 1 in 32).
mod slot_byte {
    use super::BlockState;

    pub const VACANT: u8 = BlockState::Vacant as u8;
    /// An allocated block filed in the index of displaced blocks.
    pub const DISPLACED: u8 = 5;

    #[inline]
    pub fn state(byte: u8) -> BlockState {
        match byte & 7 {
            0 | DISPLACED => BlockState::Allocated,
            1 => BlockState::Pending,
            2 => BlockState::Free,
            3 => BlockState::Unmapped,
            _ => BlockState::Vacant,
        }
    }

    /// The byte of a block in `state`, an allocated one as displaced (`file_allocated` tags it
    /// when it is home).
    #[inline]
    pub fn of(state: BlockState) -> u8 {
        match state {
            BlockState::Allocated => DISPLACED,
            other => other as u8,
        }
    }

    /// The byte of an allocated block at home, at the address with home hash `hash`.
    #[inline]
    pub fn allocated(hash: u64) -> u8 {
        ((hash >> 59) as u8) << 3 | BlockState::Allocated as u8
    }

    /// Bit 8 i + 7 set for each of the bucket's bytes `i` equal to `byte`, lowest first
    /// (a higher bit can be set falsely; the lowest set one is always a true match). Without a
    /// branch per slot: which slot of a bucket holds a block is random, so a loop over the
    /// slots mispredicts.
    #[inline]
    pub fn matches(bucket: [u8; 4], byte: u8) -> u32 {
        let x = u32::from_le_bytes(bucket) ^ (u32::from(byte) * 0x0101_0101);
        x.wrapping_sub(0x0101_0101) & !x & 0x8080_8080
    }
}

/// Block slots of a new arena.
const FIRST_SLOTS: usize = 1024;
/// Slots in a home bucket: four state bytes read as one word, four records of which a lookup
/// loads the one whose tag matches.
const BUCKET: usize = 4;

/// The home hash of an address: Fibonacci hashing of its 512-byte granule. The bucket is its
/// bits from 29 up, masked (so a slot array twice as large keeps a bucket's low bits, and half
/// the records stay home when it grows); the tag is its top five bits.
#[inline]
fn home_hash(addr: u64) -> u64 {
    (addr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl Default for Arena {
    fn default() -> Arena {
        let mut arena = Arena {
            blocks: Vec::new(),
            home_slots: 0,
            states: Vec::new(),
            vacant_blocks: VacantSet::default(),
            displaced: LiveIndex::default(),
            extra_streams: FxHashMap::default(),
            pending_events: FxHashMap::default(),
            unmapped: BTreeMap::new(),
            segments: Vec::new(),
            uses: Vec::new(),
            vacant_segments: Vec::new(),
            live_segments: 0,
            hint: Arc::default(),
        };
        arena.resize_homes(FIRST_SLOTS);
        arena
    }
}

impl Arena {
    /// The first slot of the home bucket of a block at `addr`.
    #[inline]
    pub fn home(&self, addr: u64) -> BlockId {
        Self::home_in(home_hash(addr), self.home_slots)
    }

    /// The home bucket's first slot for `hash` in a home table of `slots` slots (a power of two).
    #[inline]
    fn home_in(hash: u64, slots: usize) -> BlockId {
        ((hash >> 29) & (slots as u64 - 1) & !(BUCKET as u64 - 1)) as BlockId
    }

    /// The lookup hint this arena keeps up to date (`HomeHint`).
    pub fn home_hint(&self) -> Arc<HomeHint> {
        Arc::clone(&self.hint)
    }

    /// Whether block `id` is in its home bucket.
    #[inline]
    pub fn is_home(&self, id: BlockId) -> bool {
        id & !(BUCKET as BlockId - 1) == self.home(self.blocks[id as usize].addr)
    }

    /// The state bytes of the bucket starting at `home`.
    #[inline]
    fn bucket(&self, home: BlockId) -> [u8; BUCKET] {
        let h = home as usize;
        let mut bytes = [0; BUCKET];
        bytes.copy_from_slice(&self.states[h..h + BUCKET]);
        bytes
    }

    /// A vacant slot of the bucket starting at `home`.
    #[inline]
    fn vacant_in(&self, home: BlockId) -> Option<BlockId> {
        let m = slot_byte::matches(self.bucket(home), slot_byte::VACANT);
        (m != 0).then(|| home + m.trailing_zeros() / 8)
    }

    pub fn new_block(&mut self, block: Block, state: BlockState) -> BlockId {
        if self.blocks_in_use() * 2 >= self.home_slots {
            self.resize_homes(self.home_slots * 2);
        }
        let id = match self.vacant_in(self.home(block.addr)) {
            Some(id) => {
                self.vacant_blocks.remove(id);
                id
            }
            // At most half the slots are in use, so one is vacant.
            None => self.vacant_blocks.pop_lowest().unwrap_or_else(|| unreachable!("half the block slots are vacant")),
        };
        self.blocks[id as usize] = block;
        self.states[id as usize] = slot_byte::of(state);
        id
    }

    /// Makes the home table `slots` slots (a power of two), growing the array when it is
    /// smaller. Allocated blocks filed at home whose home bucket moved are displaced now: filed
    /// in `displaced` (amortised over the inserts or removals since the last resize; records
    /// never move here, so no id held elsewhere changes).
    #[cold]
    #[inline(never)]
    fn resize_homes(&mut self, slots: usize) {
        let old = self.blocks.len();
        if slots > old {
            // A new array, advised before any of it is written: its pages are then faulted in
            // as huge pages (growing in place would fault them in first, as small ones).
            let mut blocks = Vec::with_capacity(slots);
            advise_huge_pages(&blocks);
            blocks.extend_from_slice(&self.blocks);
            blocks.resize(slots, Block::unlinked(0, 0, NIL, BlockClass(0), ANY_STREAM, 0));
            self.blocks = blocks;
            self.states.resize(slots, slot_byte::VACANT);
            for id in old..slots {
                self.vacant_blocks.insert(id as BlockId);
            }
        }
        // Blocks filed at home all lie in the old table.
        let filed = std::mem::replace(&mut self.home_slots, slots);
        self.hint.states.store(self.states.as_ptr() as usize, Ordering::Relaxed);
        self.hint.records.store(self.blocks.as_ptr() as usize, Ordering::Relaxed);
        self.hint.slots.store(slots, Ordering::Relaxed);
        for id in 0..filed as BlockId {
            let hash = home_hash(self.blocks[id as usize].addr);
            if self.states[id as usize] == slot_byte::allocated(hash) && !self.is_home(id) {
                self.states[id as usize] = slot_byte::DISPLACED;
                self.displaced.insert(&self.blocks, id);
            }
        }
    }

    /// Moves the record of block `id` into its home bucket when it is not there and the bucket
    /// has a vacant slot (a merge can leave a record under its neighbour's address, and a grown
    /// array moves homes). The block must be in no free list and not allocated (the caller
    /// files it afterwards). Returns its id, new or not.
    #[inline]
    pub fn rehome(&mut self, id: BlockId) -> BlockId {
        if self.is_home(id) {
            return id;
        }
        match self.vacant_in(self.home(self.blocks[id as usize].addr)) {
            Some(to) => self.move_block(id, to),
            None => id,
        }
    }

    #[cold]
    #[inline(never)]
    fn move_block(&mut self, id: BlockId, to: BlockId) -> BlockId {
        debug_assert_eq!(self.states[to as usize], slot_byte::VACANT);
        debug_assert_ne!(self.state(id), BlockState::Allocated);
        self.vacant_blocks.remove(to);
        let block = self.blocks[id as usize].clone();
        let (prev, next, segment) = (block.prev, block.next, block.segment);
        if prev != NIL {
            self.blocks[prev as usize].next = to;
        } else if self.segments[segment as usize].first == id {
            self.segments[segment as usize].first = to;
        }
        if next != NIL {
            self.blocks[next as usize].prev = to;
        }
        self.blocks[to as usize] = block;
        self.states[to as usize] = self.states[id as usize];
        // The side tables are empty for a block leaving a free list; moved all the same.
        if let Some(streams) = self.take_extra_streams(id) {
            self.extra_streams.insert(to, streams);
        }
        if let Some(events) = self.pending_events.remove(&id) {
            self.pending_events.insert(to, events);
        }
        self.drop_block(id);
        to
    }

    /// The slot of the allocated block at `addr` in its home bucket: the slot whose byte holds
    /// the allocated state and the address's tag, and whose record holds the address.
    #[inline(always)]
    fn find_home(&self, addr: u64) -> Option<BlockId> {
        let hash = home_hash(addr);
        let home = Self::home_in(hash, self.home_slots);
        let mut m = slot_byte::matches(self.bucket(home), slot_byte::allocated(hash));
        while m != 0 {
            let id = home + m.trailing_zeros() / 8;
            // A false match (another address's tag, or the bit trick's) is rare.
            if self.blocks[id as usize].addr == addr && self.states[id as usize] == slot_byte::allocated(hash) {
                return Some(id);
            }
            m &= m - 1;
        }
        None
    }

    /// The allocated block at `addr`.
    #[inline]
    pub fn find_allocated(&self, addr: u64) -> Option<BlockId> {
        self.find_home(addr).or_else(|| self.displaced.get(&self.blocks, addr))
    }

    /// Finds the allocated block at `addr` for its free, when `accept` agrees (the free's
    /// checks), and stops filing it: the caller marks it pending or free at once. `Ok(id)`
    /// when taken, `Err(Some(id))` when refused (it stays allocated), `Err(None)` when no block
    /// is allocated there.
    #[inline]
    pub fn take_allocated(
        &mut self,
        addr: u64,
        accept: impl FnOnce(&Block) -> bool,
    ) -> Result<BlockId, Option<BlockId>> {
        if let Some(id) = self.find_home(addr) {
            return if accept(&self.blocks[id as usize]) { Ok(id) } else { Err(Some(id)) };
        }
        if self.displaced.len() == 0 {
            return Err(None);
        }
        self.displaced.remove_if(&self.blocks, addr, accept)
    }

    /// Files block `id`, just marked allocated, for `find_allocated`: tags its byte when it is
    /// home, else files it as displaced.
    #[inline]
    pub fn file_allocated(&mut self, id: BlockId) {
        debug_assert_eq!(self.state(id), BlockState::Allocated);
        if self.is_home(id) {
            self.states[id as usize] = slot_byte::allocated(home_hash(self.blocks[id as usize].addr));
        } else {
            self.displaced.insert(&self.blocks, id);
        }
    }

    /// Whether allocated block `id` is filed at home (its byte tagged), not as displaced.
    pub fn filed_at_home(&self, id: BlockId) -> bool {
        self.states[id as usize] & 7 == BlockState::Allocated as u8
    }

    /// Allocated blocks filed as displaced (what `displaced` holds).
    pub fn displaced_blocks(&self) -> usize {
        self.displaced.len()
    }

    #[cfg(test)]
    pub fn displaced_capacity(&self) -> usize {
        self.displaced.capacity()
    }

    /// Block slots holding a block (not vacant).
    pub fn blocks_in_use(&self) -> usize {
        self.blocks.len() - self.vacant_blocks.len
    }

    pub fn drop_block(&mut self, id: BlockId) {
        self.states[id as usize] = slot_byte::VACANT;
        if self.home_slots > FIRST_SLOTS && self.blocks_in_use() * 8 < self.home_slots {
            self.resize_homes(self.home_slots / 2);
        }
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
        slot_byte::state(self.states[id as usize])
    }

    /// Sets a block's state (an allocated one untagged: `file_allocated` tags it).
    #[inline]
    pub fn set_state(&mut self, id: BlockId, state: BlockState) {
        self.states[id as usize] = slot_byte::of(state);
    }

    /// Ids of the block slots in `state` (a scan of the dense state array).
    pub fn blocks_in_state(&self, state: BlockState) -> impl Iterator<Item = BlockId> + '_ {
        self.states.iter().enumerate().filter(move |(_, &s)| slot_byte::state(s) == state).map(|(i, _)| i as BlockId)
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

    /// The streams `record_stream` added to block `id` (empty when none).
    pub fn extra_streams(&self, id: BlockId) -> &[Stream] {
        self.extra_streams.get(&id).map_or(&[], Vec::as_slice)
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

    /// Files the unmapped block `id` in the index of unmapped blocks (at its address).
    pub fn add_unmapped(&mut self, id: BlockId) {
        debug_assert_eq!(self.state(id), BlockState::Unmapped);
        let previous = self.unmapped.insert(self.block(id).addr, id);
        debug_assert!(previous.is_none(), "two unmapped blocks at {:#x}", self.block(id).addr);
    }

    /// Takes block `id` out of the index of unmapped blocks (before its state or address changes,
    /// or it is dropped).
    pub fn remove_unmapped(&mut self, id: BlockId) {
        let addr = self.block(id).addr;
        let removed = self.unmapped.remove(&addr);
        debug_assert_eq!(removed, Some(id), "unmapped block {id} was not filed at its address");
    }

    /// The unmapped blocks of segment `id` in address order.
    pub fn unmapped_in(&self, id: SegmentId) -> impl Iterator<Item = BlockId> + '_ {
        let seg = self.segment(id);
        self.unmapped.range(seg.addr..seg.addr.saturating_add(seg.size)).map(|(_, &b)| b)
    }

    /// Unmapped blocks filed in the index, and the one filed at `addr` (for the heap's
    /// invariant check).
    pub fn unmapped_filed(&self) -> usize {
        self.unmapped.len()
    }

    pub fn unmapped_at(&self, addr: u64) -> Option<BlockId> {
        self.unmapped.get(&addr).copied()
    }

    pub fn live_segment_ids(&self) -> impl Iterator<Item = SegmentId> + '_ {
        self.segments.iter().enumerate().filter(|(_, s)| s.live).map(|(i, _)| i as SegmentId)
    }
}

/// Asks the kernel to back the whole 2 MiB pages of a large array with huge pages (Linux
/// transparent huge pages in `madvise` mode): at 100 k blocks the slots span 16-32 MB, and a
/// random free then costs an address-translation miss as well as a cache miss. Called on a new
/// array before it is written (once per doubling); a refusal changes nothing.
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

    /// Takes slot `id`, which must be vacant.
    fn remove(&mut self, id: BlockId) {
        let i = id as usize;
        let (w, m, t) = (i / 64, i / 4096, i / 262_144);
        debug_assert!(self.slots[w] & (1 << (i % 64)) != 0, "slot {id} is not vacant");
        self.slots[w] &= !(1 << (i % 64));
        self.len -= 1;
        if self.slots[w] == 0 {
            self.mid[m] &= !(1 << (w % 64));
            if self.mid[m] == 0 {
                self.top[t] &= !(1 << (m % 64));
            }
        }
    }

    fn pop_lowest(&mut self) -> Option<BlockId> {
        let t = self.top.iter().position(|&x| x != 0)?;
        let m = t * 64 + self.top[t].trailing_zeros() as usize;
        let w = m * 64 + self.mid[m].trailing_zeros() as usize;
        let id = (w * 64 + self.slots[w].trailing_zeros() as usize) as BlockId;
        self.remove(id);
        Some(id)
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

    proptest::proptest! {
        /// The lowest flagged byte of `matches` is the first byte equal to the one sought, and
        /// no flag is set when none is (higher flags may be false; the lookup checks them).
        #[test]
        fn slot_byte_matches_flags_the_first_equal_byte(bucket: [u8; 4], byte: u8) {
            let m = slot_byte::matches(bucket, byte);
            let first = bucket.iter().position(|&b| b == byte);
            proptest::prop_assert_eq!(first, (m != 0).then(|| (m.trailing_zeros() / 8) as usize));
            for (i, &b) in bucket.iter().enumerate() {
                if b == byte {
                    proptest::prop_assert!(m & (0x80 << (8 * i)) != 0, "byte {} not flagged", i);
                }
            }
        }
    }

    /// Every state survives the slot byte, tagged or not.
    #[test]
    fn slot_bytes_keep_the_state() {
        for state in
            [BlockState::Allocated, BlockState::Pending, BlockState::Free, BlockState::Unmapped, BlockState::Vacant]
        {
            assert_eq!(slot_byte::state(state as u8), state);
        }
        for hash in [0, u64::MAX, 0x9E37_79B9_7F4A_7C15] {
            assert_eq!(slot_byte::state(slot_byte::allocated(hash)), BlockState::Allocated);
        }
    }

    /// The arena finds allocated blocks at home and displaced ones alike, across the doublings
    /// of its home table (each of which displaces half the blocks at home: they stay where they
    /// are, filed in the index, so no id changes); blocks made again in a table that no longer
    /// grows find their homes; and the table halves as the blocks go.
    #[test]
    fn allocated_blocks_are_found_at_home_or_displaced() {
        let mut arena = Arena::default();
        let class = BlockClass::new(0, true, false);
        let make = |arena: &mut Arena, i: u64| {
            let id = arena.new_block(Block::unlinked(i * 512, 512, 0, class, Stream(0), 0), BlockState::Allocated);
            arena.file_allocated(id);
            (i * 512, id)
        };
        let check = |arena: &Arena, ids: &[(u64, BlockId)]| {
            for &(addr, id) in ids {
                assert_eq!(arena.find_allocated(addr), Some(id), "block at {addr:#x}");
                assert_eq!(arena.find_allocated(addr + 512 * 5_000), None);
                assert!(!arena.filed_at_home(id) || arena.is_home(id), "block {id} filed at home elsewhere");
            }
            let displaced = ids.iter().filter(|&&(_, id)| !arena.filed_at_home(id)).count();
            assert_eq!(displaced, arena.displaced_blocks());
            displaced
        };
        let mut ids: Vec<_> = (0..5_000).map(|i| make(&mut arena, i)).collect();
        assert!(arena.home_slots >= 10_000, "{} home slots for 5 000 blocks", arena.home_slots);
        assert!(check(&arena, &ids) > 0, "growth displaced no block");
        // A free takes a block once; the second time it is unknown. Half go and come back.
        for i in (0..5_000).step_by(2) {
            let (addr, id) = ids[i];
            assert_eq!(arena.take_allocated(addr, |_| false), Err(Some(id)), "a refused take keeps it");
            assert_eq!(arena.take_allocated(addr, |_| true), Ok(id));
            arena.drop_block(id);
            assert_eq!(arena.take_allocated(addr, |_| true), Err(None));
            ids[i] = make(&mut arena, i as u64);
        }
        check(&arena, &ids);
        let remade: Vec<_> = ids.iter().step_by(2).copied().collect();
        let not_home = remade.iter().filter(|&&(_, id)| !arena.is_home(id)).count();
        assert!(not_home * 20 <= remade.len(), "{not_home} of {} blocks made again not home", remade.len());
        for &(addr, id) in &ids {
            assert_eq!(arena.take_allocated(addr, |_| true), Ok(id));
            arena.drop_block(id);
        }
        assert_eq!(arena.displaced_blocks(), 0);
        assert_eq!(arena.home_slots, FIRST_SLOTS, "the home table after every block went");
    }

    #[test]
    fn block_record_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Block>(), 64);
        assert_eq!(std::mem::align_of::<Block>(), 64);
    }
}
