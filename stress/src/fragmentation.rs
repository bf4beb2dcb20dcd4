//! External fragmentation that means the same in every column: of the free mapped bytes the
//! cache holds (reserved minus active), the share that the largest request it could serve
//! without new device memory leaves unused.
//!
//! A request is served from one free block, so for plain segments (and PyTorch's expandable
//! ones) that request is the largest free block: the figure is the classic
//! 1 - largest free block / free bytes. Under `page_reuse` a request also takes the whole idle
//! pages of other free large-pool blocks (up to `MAX_REUSE_SOURCES` of them, largest first)
//! and maps them where it needs them (`src/heap/expandable.rs`), so those pages serve it too:
//! only the partial pages at the ends of free blocks, small-pool blocks and the blocks past the
//! sources' bound are stranded. Unmapped address space is never counted: it holds no memory.
//!
//! Read from the heap's snapshot records (each mapped run of a segment with its blocks). Pages
//! are counted at the configuration's large-pool page size (`big_page_mb` where set, the size
//! steady-state requests map) from the start of each mapped run, which starts on a page.

use stepalloc::snapshot::SnapshotSegment;
use stepalloc::Allocator;

/// `src/heap/expandable.rs`'s bound on the free blocks that give pages to one request.
pub const MAX_REUSE_SOURCES: usize = 64;

/// One free block: the start of its mapped run, its address and size, and whether it may give
/// pages (large pool, tag not paused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FreeBlock {
    pub run: u64,
    pub addr: u64,
    pub size: u64,
    pub lends_pages: bool,
}

/// The free blocks of `records` ("inactive" blocks of mapped runs).
pub fn free_blocks(records: &[SnapshotSegment]) -> Vec<FreeBlock> {
    records
        .iter()
        .flat_map(|s| {
            s.blocks.iter().filter(|b| b.state == "inactive").map(move |b| FreeBlock {
                run: s.address,
                addr: b.address,
                size: b.size,
                lends_pages: s.segment_type == "large" && s.is_expandable && !s.paused,
            })
        })
        .collect()
}

/// Whole pages of `page` bytes inside `b`, counted from the start of its run.
fn whole_pages(b: &FreeBlock, page: u64) -> u64 {
    let lo = b.run + (b.addr - b.run).div_ceil(page) * page;
    let hi = b.run + (b.addr + b.size - b.run) / page * page;
    hi.saturating_sub(lo)
}

/// Bytes of `free` (the free mapped bytes, `free_blocks`' sum) that the largest request the
/// cache could serve leaves unused. `reuse_page`: the page size when `page_reuse` is on.
pub fn stranded(free: &[FreeBlock], reuse_page: Option<u64>) -> u64 {
    let total: u64 = free.iter().map(|b| b.size).sum();
    let Some(largest) = free.iter().map(|b| b.size).max() else { return 0 };
    let servable = match reuse_page {
        Some(page) if page > 0 => {
            // The request sits at the block that serves it best: its bytes, plus the pages of
            // the largest other blocks (as `page_sources` orders them).
            let mut lenders: Vec<&FreeBlock> = free.iter().filter(|b| b.lends_pages).collect();
            lenders.sort_unstable_by_key(|b| std::cmp::Reverse((b.size, b.addr)));
            lenders.truncate(MAX_REUSE_SOURCES + 1);
            let top: u64 = lenders.iter().take(MAX_REUSE_SOURCES).map(|b| whole_pages(b, page)).sum();
            // The one past the bound lends when a block among the first serves the request.
            let next = lenders.get(MAX_REUSE_SOURCES).map_or(0, |b| whole_pages(b, page));
            free.iter()
                .map(|at| {
                    let own = lenders.iter().take(MAX_REUSE_SOURCES).find(|b| b.addr == at.addr);
                    at.size + own.map_or(top, |b| top - whole_pages(b, page) + next)
                })
                .max()
                .unwrap_or(largest)
        }
        _ => largest,
    };
    total - servable.min(total)
}

/// The free mapped bytes of every device of `allocator` and the bytes of them `stranded`.
pub fn of_allocator(allocator: &Allocator) -> (u64, u64) {
    let config = allocator.config();
    let page = (config.expandable_segments && config.page_reuse).then_some(if config.big_page > 0 {
        config.big_page
    } else {
        config.large_page
    });
    let (mut free, mut unused) = (0u64, 0u64);
    for d in 0..allocator.device_count() {
        if let Ok(blocks) = allocator.with_heap(d, |h| free_blocks(&h.snapshot_segment_records())) {
            free += blocks.iter().map(|b| b.size).sum::<u64>();
            unused += stranded(&blocks, page);
        }
    }
    (free, unused)
}

/// `unused` over `free` (0 when nothing is free).
pub fn share(free: u64, unused: u64) -> f64 {
    if free == 0 {
        0.0
    } else {
        unused as f64 / free as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn block(run: u64, addr: u64, size: u64) -> FreeBlock {
        FreeBlock { run, addr, size, lends_pages: true }
    }

    #[test]
    fn without_page_reuse_all_but_the_largest_block_is_stranded() {
        let free = [block(0, 0, 10 * MIB), block(0, 64 * MIB, 30 * MIB), block(0, 128 * MIB, 5 * MIB)];
        assert_eq!(stranded(&free, None), 15 * MIB);
        assert_eq!(stranded(&[], None), 0);
    }

    #[test]
    fn with_page_reuse_only_partial_pages_are_stranded() {
        // Pages of 2 MiB from each run's start: a block at 1 MiB of 6 MiB holds [2, 6) whole.
        let free = [block(0, MIB, 6 * MIB), block(0, 64 * MIB, 30 * MIB), block(0, 128 * MIB, 3 * MIB)];
        // Best served at the 6 MiB block (its partial pages used too): 30 and 2 MiB of pages
        // from the others; the 3 MiB block's last 1 MiB is stranded.
        assert_eq!(stranded(&free, Some(2 * MIB)), MIB);
        // Small-pool blocks lend nothing: served at one of them, the other stays whole.
        let small = |addr| FreeBlock { lends_pages: false, ..block(0, addr, 6 * MIB) };
        assert_eq!(stranded(&[small(MIB), free[1], free[2], small(200 * MIB)], Some(2 * MIB)), 7 * MIB);
        // Pages larger than every block: as without reuse.
        assert_eq!(stranded(&free, Some(64 * MIB)), stranded(&free, None));
    }

    #[test]
    fn page_sources_are_bounded() {
        let free: Vec<FreeBlock> = (0..100).map(|i| block(0, i * 8 * MIB, 4 * MIB)).collect();
        // One block serves; 64 others lend their 4 MiB each; 35 stay stranded.
        assert_eq!(stranded(&free, Some(2 * MIB)), 35 * 4 * MIB);
    }
}
