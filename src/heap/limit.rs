//! `page_release` with a cache limit: whole free pages over the limit go back to the device.
//!
//! The limit counts the free bytes a release could give back: the whole pages inside free
//! blocks of expandable segments. Free bytes in pages that also hold live blocks cannot be given
//! back without moving those blocks, so they do not count; counting them would, once they alone
//! exceed the limit, unmap every page a free leaves whole and map it again at the next
//! allocation.
//!
//! A free that takes those bytes over the limit schedules a release `page_release_grace`
//! allocations later (at the free itself with a grace of 0): a block freed and asked for again
//! soon after (a training step's activations, layer after layer) is taken from the cache rather
//! than unmapped and mapped again. Step end and the end of a capture apply the limit at once.
//!
//! The release takes the blocks filed longest ago first, from `FreePages`: the free blocks that
//! hold whole pages, in a list linked through a side table, so that filing a block, taking it
//! out and finding what to release cost the same however many blocks the heap holds.

use super::Heap;
use crate::error::Result;
use crate::segment::{BlockId, NIL};
use crate::stats::ReleaseReason;

/// The free blocks of expandable segments that hold whole pages, oldest filed first, and the
/// bytes of those pages. Kept by the free lists' `enlist` and `unlist`; page reuse and
/// `empty_cache` take their pages from these blocks too.
#[derive(Debug)]
pub(crate) struct FreePages {
    /// Bytes of the whole pages inside the filed blocks.
    pub(crate) bytes: u64,
    /// Per block slot: `[previous, next]` in the list while the block is filed.
    links: Vec<[BlockId; 2]>,
    head: BlockId,
    tail: BlockId,
}

impl Default for FreePages {
    fn default() -> FreePages {
        FreePages { bytes: 0, links: Vec::new(), head: NIL, tail: NIL }
    }
}

impl FreePages {
    /// Files block `id`, which holds `bytes` of whole pages, at the tail.
    pub(crate) fn file(&mut self, id: BlockId, bytes: u64) {
        let slot = id as usize;
        if slot >= self.links.len() {
            // Grows with the arena's block slots: no allocation once they stopped growing.
            self.links.resize(slot + 1, [NIL, NIL]);
        }
        self.links[slot] = [self.tail, NIL];
        match self.tail {
            NIL => self.head = id,
            tail => self.links[tail as usize][1] = id,
        }
        self.tail = id;
        self.bytes += bytes;
    }

    /// Takes out block `id`, filed with `bytes` of whole pages.
    pub(crate) fn unfile(&mut self, id: BlockId, bytes: u64) {
        let [prev, next] = self.links[id as usize];
        match prev {
            NIL => self.head = next,
            p => self.links[p as usize][1] = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.links[n as usize][0] = prev,
        }
        self.links[id as usize] = [NIL, NIL];
        self.bytes -= bytes;
    }

    /// The block filed longest ago.
    pub(crate) fn oldest(&self) -> Option<BlockId> {
        (self.head != NIL).then_some(self.head)
    }

    /// The filed blocks, oldest first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        std::iter::successors(self.oldest(), |&id| Some(self.links[id as usize][1]).filter(|&n| n != NIL))
    }

    /// The filed blocks, oldest first (for the invariant check), or why the links are broken.
    fn walk(&self) -> std::result::Result<Vec<BlockId>, String> {
        let mut out = Vec::new();
        let (mut prev, mut at) = (NIL, self.head);
        while at != NIL {
            // More blocks than slots: the links go round in a circle.
            if out.len() == self.links.len() || self.links[at as usize][0] != prev {
                return Err(format!("the list of free blocks with whole pages is broken at block {at}"));
            }
            out.push(at);
            (prev, at) = (at, self.links[at as usize][1]);
        }
        if prev != self.tail {
            return Err("the list of free blocks with whole pages does not end at its tail".into());
        }
        Ok(out)
    }
}

impl Heap {
    /// Unmaps whole free pages, from the blocks filed longest ago first (each block's top pages
    /// first, so that its start stays mapped for requests that fit there), until the bytes a
    /// release could give back are within the cache limit.
    pub(crate) fn release_pages_over_limit(&mut self, reason: ReleaseReason) -> Result<u64> {
        let limit = self.cache_limit();
        if !self.page_limit || self.free_pages.bytes <= limit {
            return Ok(0);
        }
        if self.captures_underway > 0 {
            // No unmap during a capture: `run_deferred_work` applies the limit after it.
            self.deferred_work = true;
            return Ok(0);
        }
        let mut synced = Vec::new();
        let mut released = 0;
        while self.free_pages.bytes > limit {
            let Some(id) = self.free_pages.oldest() else { break };
            // A filed block holds whole pages (`check_free_pages`); the unmap takes it out.
            let Some((lo, hi)) = self.whole_pages(id) else { break };
            let page = self.arena.segment(self.arena.block(id).segment).page;
            let take = (hi - lo).min((self.free_pages.bytes - limit).div_ceil(page) * page);
            self.unmap_range(id, hi - take, hi, super::expandable::Unmapped::Release(reason), &mut synced)?;
            released += take;
        }
        self.free_unmapped_segments()?;
        Ok(released)
    }

    /// A free took the whole free pages over the cache limit: they go back once
    /// `page_release_grace` allocations have run, or now with a grace of 0.
    #[cold]
    pub(super) fn schedule_page_release(&mut self) -> Result<()> {
        if self.config.page_release_grace == 0 {
            self.release_pages_over_limit(ReleaseReason::Limit)?;
        } else if self.page_release_due == u64::MAX {
            self.page_release_due = self.alloc_clock.saturating_add(self.config.page_release_grace);
        }
        Ok(())
    }

    /// The release `schedule_page_release` left to this allocation, which succeeded whatever
    /// happens here: a failed release is due again at the next allocation.
    #[cold]
    pub(super) fn release_due_pages(&mut self) {
        self.page_release_due = match self.release_pages_over_limit(ReleaseReason::Limit) {
            Ok(_) => u64::MAX,
            Err(_) => self.alloc_clock.saturating_add(1),
        };
    }

    /// Whether `FreePages` holds exactly the free blocks with whole pages and their bytes (for
    /// the heap's invariant check).
    pub(super) fn check_free_pages(&self) -> std::result::Result<(), String> {
        let mut expect: Vec<BlockId> = self
            .arena
            .blocks_in_state(crate::segment::BlockState::Free)
            .filter(|&id| self.whole_page_bytes(id) > 0)
            .collect();
        let mut filed = self.free_pages.walk()?;
        if let Some(&id) = filed.iter().find(|&&id| self.whole_pages(id).is_none()) {
            return Err(format!("block {id} is filed as holding whole free pages, but holds none it could release"));
        }
        let bytes: u64 = filed.iter().map(|&id| self.whole_page_bytes(id)).sum();
        expect.sort_unstable();
        filed.sort_unstable();
        if filed != expect {
            return Err(format!(
                "{} free blocks hold whole pages, {} are filed as holding them",
                expect.len(),
                filed.len()
            ));
        }
        if bytes != self.free_pages.bytes {
            return Err(format!("free blocks hold {bytes} bytes of whole pages, {} counted", self.free_pages.bytes));
        }
        Ok(())
    }
}
