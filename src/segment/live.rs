//! Allocated blocks by address, for those not in their home slot (`segment::Arena` finds the
//! rest with no table): a hash table of 4-byte block ids, each verified against its block's
//! address, rather than a map of (address, id) pairs. A quarter of the memory of such a map,
//! and it shrinks when the heap does, so a heap that once held many displaced blocks does not
//! keep a large, cache-missing table.

use super::{Block, BlockId};
use hashbrown::HashTable;
use std::hash::BuildHasher;

/// Capacity below which the table is never shrunk (shrinking it would save little).
const MIN_SHRINK_CAPACITY: usize = 1024;

#[derive(Default)]
pub struct LiveIndex {
    table: HashTable<BlockId>,
}

#[inline]
fn hash(addr: u64) -> u64 {
    rustc_hash::FxBuildHasher.hash_one(addr)
}

impl LiveIndex {
    /// The allocated block at `addr`.
    #[inline]
    pub fn get(&self, blocks: &[Block], addr: u64) -> Option<BlockId> {
        self.table.find(hash(addr), |&id| blocks[id as usize].addr == addr).copied()
    }

    /// Files block `id`, whose record must already hold its address. The address must not be
    /// in the index.
    #[inline]
    pub fn insert(&mut self, blocks: &[Block], id: BlockId) {
        let addr = blocks[id as usize].addr;
        self.table.insert_unique(hash(addr), id, |&other| hash(blocks[other as usize].addr));
    }

    /// Removes the block at `addr` when `accept` agrees (the free's checks). `Ok(id)` when
    /// removed, `Err(Some(id))` when refused, `Err(None)` when no block is allocated there.
    #[inline]
    pub fn remove_if(
        &mut self,
        blocks: &[Block],
        addr: u64,
        accept: impl FnOnce(&Block) -> bool,
    ) -> Result<BlockId, Option<BlockId>> {
        let Ok(entry) = self.table.find_entry(hash(addr), |&id| blocks[id as usize].addr == addr) else {
            return Err(None);
        };
        let id = *entry.get();
        if !accept(&blocks[id as usize]) {
            return Err(Some(id));
        }
        entry.remove();
        // Shrink once the entries and a quarter more fit in half the capacity, to that size:
        // the table then has the size growing to this many entries would have given it (a
        // larger one is a history effect: more cache lines for the same lookups). Growing again
        // takes a quarter of the entries in inserts, shrinking again as many removals, so the
        // rehashing stays amortised.
        let capacity = self.table.capacity();
        let wanted = self.table.len() + self.table.len() / 4;
        if capacity > MIN_SHRINK_CAPACITY && wanted * 2 <= capacity {
            self.table.shrink_to(wanted, |&other| hash(blocks[other as usize].addr));
        }
        Ok(id)
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    #[cfg(test)]
    pub fn capacity(&self) -> usize {
        self.table.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Stream;
    use crate::segment::BlockClass;

    fn blocks(n: u32) -> Vec<Block> {
        (0..n)
            .map(|i| Block::unlinked(u64::from(i) * 512, 512, 0, BlockClass::new(0, true, false), Stream(0), 0))
            .collect()
    }

    #[test]
    fn finds_verifies_and_refuses() {
        let blocks = blocks(10);
        let mut live = LiveIndex::default();
        for id in 0..10 {
            live.insert(&blocks, id);
        }
        assert_eq!(live.get(&blocks, 3 * 512), Some(3));
        assert_eq!(live.get(&blocks, 3 * 512 + 1), None);
        assert_eq!(live.remove_if(&blocks, 4 * 512, |_| false), Err(Some(4)));
        assert_eq!(live.get(&blocks, 4 * 512), Some(4), "a refused removal keeps the entry");
        assert_eq!(live.remove_if(&blocks, 4 * 512, |_| true), Ok(4));
        assert_eq!(live.remove_if(&blocks, 4 * 512, |_| true), Err(None));
        assert_eq!(live.len(), 9);
        for id in [0, 1, 2, 3, 5, 6, 7, 8, 9] {
            assert_eq!(live.get(&blocks, u64::from(id) * 512), Some(id));
        }
    }

    #[test]
    fn shrinks_after_the_heap_does() {
        let blocks = blocks(100_000);
        let mut live = LiveIndex::default();
        for id in 0..100_000 {
            live.insert(&blocks, id);
        }
        let large = live.capacity();
        assert!(large >= 100_000);
        for id in 1_000..100_000 {
            assert_eq!(live.remove_if(&blocks, u64::from(id) * 512, |_| true), Ok(id));
        }
        assert!(live.capacity() <= 8 * 1_000, "capacity {} after shrinking to 1 000 of {large}", live.capacity());
        for id in 0..1_000 {
            assert_eq!(live.get(&blocks, u64::from(id) * 512), Some(id));
        }
    }

    /// A table that shrank from 100 k entries to 10 k is no larger than one that grew to 10 k:
    /// the heap's past leaves no larger table behind.
    #[test]
    fn shrinks_to_the_size_growing_would_give() {
        let blocks = blocks(100_000);
        let mut grown = LiveIndex::default();
        for id in 0..10_000 {
            grown.insert(&blocks, id);
        }
        let mut shrunk = LiveIndex::default();
        for id in 0..100_000 {
            shrunk.insert(&blocks, id);
        }
        for id in 10_000..100_000 {
            assert_eq!(shrunk.remove_if(&blocks, u64::from(id) * 512, |_| true), Ok(id));
        }
        assert!(
            shrunk.capacity() <= grown.capacity(),
            "capacity {} after shrinking to 10 k, {} after growing to 10 k",
            shrunk.capacity(),
            grown.capacity()
        );
    }
}
