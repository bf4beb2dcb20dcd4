//! Free lists: the free blocks of one (pool, small/large, stream), filed by size class.
//!
//! Blocks below `max_split_size` sit in doubly linked lists, one per bin, with a two-level
//! bitmap over the bins (see `sizeclass` and `bitmap`): a lookup is a couple of bit scans,
//! however many blocks are cached. The block filed last (`top`) is the head of its bin for
//! every lookup but is linked into the bin's list only when another block is filed: a free
//! followed by a malloc that takes the same block back (the common churn) then writes no other
//! block's record (linking writes the old head's record, a cache miss in a large heap). Blocks at or above `max_split_size` ("oversize") are rare
//! and large, never split, and must fit within `max_non_split_rounding`, so they are kept
//! exactly ordered in a `BTreeSet` instead.

use crate::backend::Stream;
use crate::bitmap::BinBitmap;
use crate::segment::{Block, BlockClass, BlockId, NIL};
use crate::sizeclass::{bin_down, bin_up, BIN_COUNT};
use std::collections::BTreeSet;

/// Which list a free block belongs in: its pool, size class (small or large pool), lane
/// (`param_lane`'s blocks are listed apart) and tag (each tag's blocks are listed apart), packed as a `BlockClass` with the expandable bit
/// clear, and the stream that may reuse it. Two words, so the heap's one-entry cache of the
/// last list found compares in two instructions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ListKey {
    class: BlockClass,
    pub stream: Stream,
}

impl ListKey {
    #[inline]
    pub fn new(pool: u32, small: bool, stream: Stream, lane: bool, tag: u8) -> ListKey {
        ListKey { class: BlockClass::new(pool, small, false).in_lane(lane).with_tag(tag), stream }
    }

    /// The key of the list a free block with `class` and `stream` belongs in.
    #[inline]
    pub fn of(class: BlockClass, stream: Stream) -> ListKey {
        ListKey { class: class.not_expandable(), stream }
    }

    pub fn pool(self) -> u32 {
        self.class.pool()
    }

    pub fn small(self) -> bool {
        self.class.small()
    }
}

pub struct FreeList {
    pub key: ListKey,
    bitmap: BinBitmap,
    /// First linked block of each bin's list. Invariant: bit `b` of `bitmap` is set iff
    /// `heads[b] != NIL` (`top` is not in the bitmap: `first_from` adds it).
    heads: Box<[BlockId]>,
    /// The block filed last, below `max_split_size`, when it is still listed (else `NIL`): the
    /// logical head of bin `top_bin`, before `heads[top_bin]`, not linked (its links are NIL).
    top: BlockId,
    top_bin: usize,
    /// Oversize free blocks ordered by (size, address).
    oversize: BTreeSet<(u64, u64, BlockId)>,
    pub bytes: u64,
    pub count: u64,
}

impl FreeList {
    pub fn new(key: ListKey) -> FreeList {
        FreeList {
            key,
            bitmap: BinBitmap::default(),
            heads: vec![NIL; BIN_COUNT].into_boxed_slice(),
            top: NIL,
            top_bin: 0,
            oversize: BTreeSet::new(),
            bytes: 0,
            count: 0,
        }
    }

    #[inline(always)]
    pub fn insert(&mut self, blocks: &mut [Block], id: BlockId, oversize: bool) {
        let b = &mut blocks[id as usize];
        self.bytes += b.size;
        self.count += 1;
        if oversize {
            return self.insert_oversize(b, id);
        }
        let bin = bin_down(b.size);
        b.link_prev = NIL;
        b.link_next = NIL;
        if self.top != NIL {
            self.link_top(blocks);
        }
        self.top = id;
        self.top_bin = bin;
    }

    /// Links `top` at the head of its bin's list (it stays that bin's first block).
    #[inline]
    fn link_top(&mut self, blocks: &mut [Block]) {
        let (id, bin) = (self.top, self.top_bin);
        let head = self.heads[bin];
        blocks[id as usize].link_next = head;
        if head != NIL {
            blocks[head as usize].link_prev = id;
        }
        self.heads[bin] = id;
        self.bitmap.set(bin);
        self.top = NIL;
    }

    /// The first non-empty bin at or after `bin`: the bitmap's, or `top`'s when it is earlier.
    #[inline(always)]
    fn first_from(&self, bin: usize) -> Option<usize> {
        let linked = self.bitmap.find_from(bin);
        if self.top != NIL && self.top_bin >= bin && linked.is_none_or(|l| self.top_bin <= l) {
            return Some(self.top_bin);
        }
        linked
    }

    /// The first block of `bin` (`NIL` when it is empty).
    #[inline(always)]
    fn first(&self, bin: usize) -> BlockId {
        if self.top != NIL && self.top_bin == bin {
            self.top
        } else {
            self.heads[bin]
        }
    }

    #[cold]
    fn insert_oversize(&mut self, b: &mut Block, id: BlockId) {
        b.link_prev = NIL;
        b.link_next = NIL;
        self.oversize.insert((b.size, b.addr, id));
    }

    #[inline(always)]
    pub fn remove(&mut self, blocks: &mut [Block], id: BlockId, oversize: bool) {
        let (size, addr, prev, next) = {
            let b = &blocks[id as usize];
            (b.size, b.addr, b.link_prev, b.link_next)
        };
        self.bytes -= size;
        self.count -= 1;
        if oversize {
            return self.remove_oversize(size, addr, id);
        }
        if id == self.top {
            self.top = NIL;
            return;
        }
        if prev != NIL {
            blocks[prev as usize].link_next = next;
        } else {
            let bin = bin_down(size);
            self.heads[bin] = next;
            if next == NIL {
                self.bitmap.clear(bin);
            }
        }
        if next != NIL {
            blocks[next as usize].link_prev = prev;
        }
    }

    /// The blocks of `bin` in list order (`top` first when it is in this bin).
    fn bin_blocks<'a>(&self, blocks: &'a [Block], bin: usize) -> impl Iterator<Item = (BlockId, &'a Block)> + 'a {
        let top = (self.top != NIL && self.top_bin == bin).then_some(self.top);
        let mut cursor = self.heads[bin];
        let linked = std::iter::from_fn(move || {
            if cursor == NIL {
                return None;
            }
            let current = cursor;
            cursor = blocks[current as usize].link_next;
            Some(current)
        });
        top.into_iter().chain(linked).map(move |id| (id, &blocks[id as usize]))
    }

    #[cold]
    fn remove_oversize(&mut self, size: u64, addr: u64, id: BlockId) {
        self.oversize.remove(&(size, addr, id));
    }

    /// A free block below `max_split_size` that holds `size` bytes. First the head of the bin
    /// `size` falls in, if it is large enough (a near-exact fit); else the head of the first
    /// non-empty bin whose blocks all fit.
    #[inline(always)]
    pub fn find(&self, blocks: &[Block], size: u64) -> Option<BlockId> {
        let exact = self.first(bin_down(size));
        if exact != NIL && blocks[exact as usize].size >= size {
            return Some(exact);
        }
        self.first_from(bin_up(size)).map(|bin| self.first(bin))
    }

    /// The smallest free block below `max_split_size` that holds `size` bytes, the lowest
    /// address among equal sizes: PyTorch's choice (its free blocks are a set ordered by
    /// (size, address)). Scans at most two bins: the one `size` falls in (for blocks at least
    /// `size`), else the first non-empty bin above, whose blocks all fit and are all smaller
    /// than any block further up.
    pub fn find_exact(&self, blocks: &[Block], size: u64) -> Option<BlockId> {
        let best_in = |bin: usize| {
            let mut best: Option<(u64, u64, BlockId)> = None;
            for (id, b) in self.bin_blocks(blocks, bin) {
                if b.size >= size && best.is_none_or(|x| (b.size, b.addr) < (x.0, x.1)) {
                    best = Some((b.size, b.addr, id));
                }
            }
            best.map(|x| x.2)
        };
        best_in(bin_down(size)).or_else(|| self.first_from(bin_up(size)).and_then(best_in))
    }

    /// The block that follows `(size, addr)` in PyTorch's order of free blocks below
    /// `max_split_size` (size, then address): the smallest `(size, address)` above it. Scans
    /// the bin of `size`, else the first non-empty bin above (all of whose blocks are larger).
    pub fn next_exact(&self, blocks: &[Block], size: u64, addr: u64) -> Option<BlockId> {
        let after_in = |bin: usize| {
            let mut best: Option<(u64, u64, BlockId)> = None;
            for (id, b) in self.bin_blocks(blocks, bin) {
                if (b.size, b.addr) > (size, addr) && best.is_none_or(|x| (b.size, b.addr) < (x.0, x.1)) {
                    best = Some((b.size, b.addr, id));
                }
            }
            best.map(|x| x.2)
        };
        let bin = bin_down(size);
        after_in(bin).or_else(|| (bin + 1 < BIN_COUNT).then(|| self.first_from(bin + 1)).flatten().and_then(after_in))
    }

    /// The smallest oversize block of at least `size` bytes and below `size + max_extra`.
    pub fn find_oversize(&self, size: u64, max_extra: u64) -> Option<BlockId> {
        let &(found, _, id) = self.oversize.range((size, 0, 0)..).next()?;
        (found < size.saturating_add(max_extra)).then_some(id)
    }

    /// Appends `(size, id)` of every block of at least `min` bytes (a scan of the large bins,
    /// for the slow path).
    pub fn collect_at_least(&self, blocks: &[Block], min: u64, out: &mut Vec<(u64, BlockId)>) {
        out.extend(self.oversize.iter().filter(|e| e.0 >= min).map(|&(size, _, id)| (size, id)));
        let mut bin = bin_down(min);
        while let Some(found) = self.first_from(bin) {
            for (id, b) in self.bin_blocks(blocks, found) {
                if b.size >= min {
                    out.push((b.size, id));
                }
            }
            bin = found + 1;
            if bin >= BIN_COUNT {
                break;
            }
        }
    }

    /// The largest free block's size.
    pub fn largest(&self, blocks: &[Block]) -> u64 {
        let mut largest = self.oversize.last().map_or(0, |&(size, _, _)| size);
        let top_bin = (self.top != NIL).then_some(self.top_bin);
        if let Some(bin) = self.bitmap.last().max(top_bin) {
            for (_, b) in self.bin_blocks(blocks, bin) {
                largest = largest.max(b.size);
            }
        }
        largest
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::ANY_STREAM;

    /// The unlinked `top` reads as the head of its bin: lookups return what a list that linked
    /// every block at its bin's head would return, through inserts, removals and linking.
    #[test]
    fn the_last_filed_block_is_its_bins_head() {
        let class = BlockClass::new(0, true, false);
        let sizes = [4096u64, 4096, 65536, 4096, 1 << 20];
        let mut blocks: Vec<Block> = sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| Block::unlinked(i as u64 * (1 << 24), s, 0, class, ANY_STREAM, 0))
            .collect();
        let mut list = FreeList::new(ListKey::of(class, ANY_STREAM));
        assert_eq!(list.find(&blocks, 512), None);
        list.insert(&mut blocks, 0, false);
        assert_eq!(list.find(&blocks, 4096), Some(0));
        assert_eq!(list.find(&blocks, 1024), Some(0), "a larger bin's top serves a smaller request");
        list.insert(&mut blocks, 1, false); // 0 is linked now, 1 is the top
        assert_eq!(list.find(&blocks, 4096), Some(1));
        list.insert(&mut blocks, 2, false); // 1 linked before 0
        assert_eq!(list.find(&blocks, 4096), Some(1));
        assert_eq!(list.find(&blocks, 8192), Some(2), "only the top is in the larger bin");
        assert_eq!(list.find_exact(&blocks, 4096), Some(0), "lowest address among equal sizes");
        assert_eq!(list.next_exact(&blocks, 4096, 0), Some(1), "then the next address of that size");
        assert_eq!(list.next_exact(&blocks, 4096, 1 << 24), Some(2), "then the next size up");
        assert_eq!(list.next_exact(&blocks, 65536, 2 << 24), None);
        assert_eq!(list.largest(&blocks), 65536);
        list.remove(&mut blocks, 2, false);
        assert_eq!(list.find(&blocks, 8192), None);
        assert_eq!(list.largest(&blocks), 4096);
        list.remove(&mut blocks, 1, false);
        assert_eq!(list.find(&blocks, 4096), Some(0));
        list.insert(&mut blocks, 4, false); // 1 MiB top above the linked 4 KiB bin
        list.insert(&mut blocks, 3, false);
        let mut found = Vec::new();
        list.collect_at_least(&blocks, 4096, &mut found);
        found.sort();
        assert_eq!(found, vec![(4096, 0), (4096, 3), (1 << 20, 4)]);
        assert_eq!(list.find(&blocks, 1 << 20), Some(4));
        assert_eq!((list.count, list.bytes), (3, 4096 * 2 + (1 << 20)));
        for id in [3, 0, 4] {
            list.remove(&mut blocks, id, false);
        }
        assert_eq!((list.find(&blocks, 512), list.count, list.bytes), (None, 0, 0));
    }
}
