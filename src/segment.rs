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
//! free blocks of compatible streams are always merged; `busy` counts the blocks of a segment
//! that are allocated or pending.

use crate::backend::Stream;

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

#[derive(Clone, Debug)]
pub struct Block {
    pub addr: u64,
    pub size: u64,
    /// Bytes the caller asked for (0 while free).
    pub requested: u64,
    pub segment: SegmentId,
    pub prev: BlockId,
    pub next: BlockId,
    /// Links in the free list's bin (valid while `Free` and not oversize).
    pub link_prev: BlockId,
    pub link_next: BlockId,
    /// Index of the free list holding the block (valid while `Free`).
    pub list: u16,
    /// The stream the block was allocated on; for a free block, the stream that may reuse it
    /// (`ANY_STREAM` once nothing can be in flight).
    pub stream: Stream,
    pub state: BlockState,
    /// Other streams that used the block (`record_stream`); allocated only when there are any.
    pub extra_streams: Option<Box<Vec<Stream>>>,
    /// Events still to complete before a pending block is free.
    pub pending_events: u32,
    /// The allocation counter when the block was last freed (garbage-collection age).
    pub freed_at: u64,
}

impl Block {
    /// A block not linked to neighbours or a list, with nothing requested.
    pub fn unlinked(
        addr: u64,
        size: u64,
        segment: SegmentId,
        stream: Stream,
        state: BlockState,
        freed_at: u64,
    ) -> Block {
        Block {
            addr,
            size,
            requested: 0,
            segment,
            prev: NIL,
            next: NIL,
            link_prev: NIL,
            link_next: NIL,
            list: 0,
            stream,
            state,
            extra_streams: None,
            pending_events: 0,
            freed_at,
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
    /// Blocks that are allocated or pending.
    pub busy: u32,
    /// Step number of the last allocation from this segment.
    pub last_used_step: u64,
    /// Bit per phase (phase index mod 64) that allocated from this segment.
    pub phase_mask: u64,
    /// The reserve was at or above `max_split_size`.
    pub oversize: bool,
    pub live: bool,
    /// Page size of an expandable segment (`size` is then its virtual range); 0 for a plain one.
    pub page: u64,
    /// Bytes mapped (the whole size for a plain segment).
    pub mapped: u64,
}

impl Segment {
    pub fn expandable(&self) -> bool {
        self.page != 0
    }
}

/// Slot storage for blocks and segments, with reuse of vacant slots.
#[derive(Default)]
pub struct Arena {
    pub blocks: Vec<Block>,
    vacant_blocks: Vec<BlockId>,
    pub segments: Vec<Segment>,
    vacant_segments: Vec<SegmentId>,
    pub live_segments: usize,
}

impl Arena {
    pub fn new_block(&mut self, block: Block) -> BlockId {
        match self.vacant_blocks.pop() {
            Some(id) => {
                self.blocks[id as usize] = block;
                id
            }
            None => {
                self.blocks.push(block);
                (self.blocks.len() - 1) as BlockId
            }
        }
    }

    pub fn drop_block(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        b.state = BlockState::Vacant;
        b.extra_streams = None;
        self.vacant_blocks.push(id);
    }

    pub fn new_segment(&mut self, segment: Segment) -> SegmentId {
        self.live_segments += 1;
        match self.vacant_segments.pop() {
            Some(id) => {
                self.segments[id as usize] = segment;
                id
            }
            None => {
                self.segments.push(segment);
                (self.segments.len() - 1) as SegmentId
            }
        }
    }

    pub fn drop_segment(&mut self, id: SegmentId) {
        self.live_segments -= 1;
        self.segments[id as usize].live = false;
        self.vacant_segments.push(id);
    }

    pub fn block(&self, id: BlockId) -> &Block {
        &self.blocks[id as usize]
    }

    pub fn block_mut(&mut self, id: BlockId) -> &mut Block {
        &mut self.blocks[id as usize]
    }

    pub fn segment(&self, id: SegmentId) -> &Segment {
        &self.segments[id as usize]
    }

    pub fn segment_mut(&mut self, id: SegmentId) -> &mut Segment {
        &mut self.segments[id as usize]
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
