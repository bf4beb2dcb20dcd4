//! The records of segments and blocks: ids, a block's state and class (what it inherits from
//! its segment, packed in one word), the 64-byte block record, the segment record and what every
//! allocation from a segment updates. Plain data with small accessors; the arena (`segment`)
//! stores them and keeps their invariants.

use crate::backend::Stream;

pub type BlockId = u32;
pub type SegmentId = u32;
pub const NIL: u32 = u32::MAX;

/// Marks a free block that any stream may reuse: all its events completed.
pub const ANY_STREAM: Stream = Stream(u64::MAX);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum BlockState {
    /// Handed out to the caller.
    Allocated = 0,
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
/// whether the segment is expandable, its lane (`param_lane`) and its tag (`tags`), packed in
/// one word (`pool << 11 | tag << 3 | lane << 2 | expandable << 1 | small`), so that `free`
/// never loads the segment record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockClass(pub(super) u32);

impl BlockClass {
    /// Pool numbers are indices into the heap's private pools plus one; 2^21 of them would take
    /// far more memory than any process has.
    pub const MAX_POOL: u32 = u32::MAX >> Self::POOL_SHIFT;
    const POOL_SHIFT: u32 = 11;
    const LANE: u32 = 1 << 2;
    const EXPANDABLE: u32 = 1 << 1;
    const TAG_SHIFT: u32 = 3;
    const TAG_MASK: u32 = 0xff << Self::TAG_SHIFT;

    #[inline]
    pub fn new(pool: u32, small: bool, expandable: bool) -> BlockClass {
        debug_assert!(pool <= Self::MAX_POOL);
        BlockClass((pool.min(Self::MAX_POOL) << Self::POOL_SHIFT) | (u32::from(expandable) << 1) | u32::from(small))
    }

    /// The class with tag `tag` (`crate::tags`; 0 is "default").
    pub fn with_tag(self, tag: u8) -> BlockClass {
        debug_assert!(u32::from(tag) <= Self::TAG_MASK >> Self::TAG_SHIFT);
        BlockClass((self.0 & !Self::TAG_MASK) | ((u32::from(tag) << Self::TAG_SHIFT) & Self::TAG_MASK))
    }

    /// The tag of the block's segment.
    #[inline]
    pub fn tag(self) -> u8 {
        ((self.0 & Self::TAG_MASK) >> Self::TAG_SHIFT) as u8
    }

    /// The class of a block in the parameter lane (`param_lane`) when `lane`.
    pub fn in_lane(self, lane: bool) -> BlockClass {
        BlockClass(if lane { self.0 | Self::LANE } else { self.0 & !Self::LANE })
    }

    /// The class with the expandable bit clear.
    #[inline]
    pub fn not_expandable(self) -> BlockClass {
        BlockClass(self.0 & !Self::EXPANDABLE)
    }

    pub fn of(segment: &Segment) -> BlockClass {
        BlockClass::new(segment.pool, segment.small, segment.expandable()).in_lane(segment.lane).with_tag(segment.tag)
    }

    pub fn pool(self) -> u32 {
        self.0 >> Self::POOL_SHIFT
    }

    /// Whether the block is in the parameter lane's segments (`param_lane`).
    pub fn lane(self) -> bool {
        self.0 & Self::LANE != 0
    }

    pub fn small(self) -> bool {
        self.0 & 1 != 0
    }

    pub fn expandable(self) -> bool {
        self.0 & Self::EXPANDABLE != 0
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
    /// Links in the free list's bin (valid while `Free`, not oversize and not the list's
    /// unlinked `top`, whose links are NIL).
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
    /// The tag of every block in it (`crate::tags`; 0: "default"). A tagged segment is always
    /// expandable (a virtual range), so that `pause` can unmap its pages and keep its addresses.
    pub tag: u8,
}

impl Segment {
    pub fn expandable(&self) -> bool {
        self.page != 0
    }

    /// The whole pages of this expandable segment inside `[addr, addr + size)`, as `[lo, hi)`
    /// (empty when `hi <= lo`). On the free lists' path: power-of-two pages (the usual ones)
    /// with shifts, others by dividing.
    #[inline(always)]
    pub fn whole_pages(&self, addr: u64, size: u64) -> (u64, u64) {
        let (page, start, end) = (self.page, addr - self.addr, addr - self.addr + size);
        let (first, last) = if page.is_power_of_two() {
            let shift = page.trailing_zeros();
            ((start + page - 1) >> shift, end >> shift)
        } else {
            (start.div_ceil(page), end / page)
        };
        (self.addr + first * page, self.addr + last * page)
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
