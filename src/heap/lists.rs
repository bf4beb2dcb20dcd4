//! The free lists: one per (pool, size class, stream, lane, tag) key, found through a one-entry
//! cache per pool kind and a hash map; filing a block in its list and taking it out, with the
//! inactive-split statistics that follow a block in and out. Hot path: everything here is
//! inlined into malloc and free.

use super::Heap;
use crate::freelist::{FreeList, ListKey};
use crate::segment::{Block, BlockId, BlockState};
use crate::sizeclass::SMALL_SEGMENT;

impl Heap {
    // ----- free lists ----------------------------------------------------------------------

    /// A comparison with the size class's last list, else one hash lookup however many
    /// streams have lists.
    #[inline]
    pub(super) fn list_index(&self, key: ListKey) -> Option<usize> {
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
    pub(super) fn list_key(b: &Block) -> ListKey {
        ListKey::of(b.class, b.stream)
    }

    /// Files a free block in the list of its (pool, size class, stream).
    #[inline(always)]
    pub(super) fn enlist(&mut self, id: BlockId) {
        let b = self.arena.block(id);
        let key = Self::list_key(b);
        let oversize = b.size >= self.config.max_split_size;
        let li = match self.list_index(key) {
            Some(li) => li,
            None => self.new_list(key),
        };
        self.lists[li].insert(&mut self.arena.blocks, id, oversize);
        let bytes = self.whole_page_bytes(id);
        if bytes > 0 {
            self.free_pages.file(id, bytes);
        }
    }

    #[cold]
    pub(super) fn new_list(&mut self, key: ListKey) -> usize {
        self.lists.push(FreeList::new(key));
        self.list_of.insert(key, (self.lists.len() - 1) as u32);
        self.lists.len() - 1
    }

    /// Takes a free block out of its list (the one its key names: a listed block's stream,
    /// pool and size class do not change).
    #[inline(always)]
    pub(super) fn unlist(&mut self, id: BlockId) {
        let b = self.arena.block(id);
        let oversize = b.size >= self.config.max_split_size;
        let li = self.list_index(Self::list_key(b));
        debug_assert!(li.is_some(), "free block {id} has no list");
        if let Some(li) = li {
            self.lists[li].remove(&mut self.arena.blocks, id, oversize);
        }
        let bytes = self.whole_page_bytes(id);
        if bytes > 0 {
            self.free_pages.unfile(id, bytes);
        }
    }

    /// Bytes of the whole pages inside block `id` when it lies in an expandable segment: what
    /// it gives back if it is free and its pages are released (`heap/limit.rs`). Depends only
    /// on the block's place, which does not change while it is in a list. On the hot path: a
    /// block smaller than the smallest page is answered without loading its segment.
    #[inline(always)]
    pub(super) fn whole_page_bytes(&self, id: BlockId) -> u64 {
        let b = self.arena.block(id);
        // A graph pool's free pages are the graph's until the pool is released (`heap/graphs.rs`).
        if !b.class.expandable() || b.size < SMALL_SEGMENT || b.class.pool() != 0 {
            return 0;
        }
        let (lo, hi) = self.arena.segment(b.segment).whole_pages(b.addr, b.size);
        hi.saturating_sub(lo)
    }

    /// Inactive-split accounting: a free block counts while its segment is split.
    pub(super) fn split_stat_out(&mut self, id: BlockId) {
        let b = self.arena.block(id);
        if self.arena.state(id) == BlockState::Free && b.is_split() {
            let small = b.class.small();
            self.stats.inactive_split.decrease(small, 1);
            self.stats.inactive_split_bytes.decrease(small, b.size);
        }
    }

    pub(super) fn split_stat_in(&mut self, id: BlockId) {
        let b = self.arena.block(id);
        if self.arena.state(id) == BlockState::Free && b.is_split() {
            let small = b.class.small();
            self.stats.inactive_split.increase(small, 1);
            self.stats.inactive_split_bytes.increase(small, b.size);
        }
    }
}
