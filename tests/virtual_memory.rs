//! Virtual memory on the simulated device: PyTorch's expandable segments with exact figures,
//! then stepalloc's page policies (`page_reuse`, `page_release`) and what they buy. Each test
//! states the rule it checks. The simulated device enforces the driver's mapping rules, so a
//! wrong map or unmap fails here as it would on a GPU.

mod common;

use common::{sim, stats, S0, S1};
use stepalloc::config::RECOMMENDED;
use stepalloc::units::MIB;
use stepalloc::{Allocator, Config, Stream};

#[test]
fn expandable_segments_map_pages_on_demand() {
    let a = sim("sim_capacity_mb:1024,expandable_segments:True");
    // 30 MiB: two 20 MiB pages of the large pool, mapped in one map operation.
    let p = a.malloc(0, 30 * MIB, S0).unwrap();
    let s = stats(&a);
    assert_eq!(s.heap.reserved_bytes.large_pool.current, 40 * MIB, "reserved counts mapped bytes");
    assert_eq!(s.heap.num_device_alloc, 1, "num_device_alloc counts maps");
    assert_eq!((s.heap.num_create, s.heap.num_map), (2, 2));
    assert_eq!(s.heap.virtual_reserved_bytes, 1160 * MIB, "1.125 x device memory of address space, in whole pages");
    // 5 MiB fits in the mapped rest: no map. Then 20 MiB needs one more page, merged with the
    // free 5 MiB before it: contiguous with the 5 MiB block.
    let q = a.malloc(0, 5 * MIB, S0).unwrap();
    assert_eq!(q, p + 30 * MIB);
    let r = a.malloc(0, 20 * MIB, S0).unwrap();
    assert_eq!(r, q + 5 * MIB, "mapped at the lowest unmapped address, merged with the free tail");
    let s = stats(&a);
    assert_eq!(s.heap.reserved_bytes.large_pool.current, 60 * MIB);
    assert_eq!(s.heap.num_device_alloc, 2);
    // Small requests live in a segment of their own, with 2 MiB pages.
    let t = a.malloc(0, 1000, S0).unwrap();
    assert_eq!(stats(&a).heap.reserved_bytes.small_pool.current, 2 * MIB);
    for (ptr, size) in [(p, 30 * MIB), (q, 5 * MIB), (r, 20 * MIB), (t, 1000)] {
        a.free(0, ptr, size).unwrap();
    }
    a.check_invariants().unwrap();
    assert_eq!(stats(&a).heap.reserved_bytes.all.current, 62 * MIB, "freeing unmaps nothing");
    a.empty_cache().unwrap();
    let s = stats(&a);
    assert_eq!(s.heap.reserved_bytes.all.current, 0, "empty_cache unmaps every free page");
    assert_eq!(s.heap.virtual_reserved_bytes, 0, "and frees the ranges left empty");
    assert_eq!(s.heap.segment.all.current, 0);
    assert_eq!(s.heap.num_release_physical, s.heap.num_create);
    assert_eq!(s.mapped_bytes, 0);
}

/// Under PyTorch's rules (`exact_fit`, the stress tool's PyTorch presets) the choice is
/// PyTorch's `get_free_block`: from the best fit, the next free block in (size, address) order
/// is taken only while its expandable size (size plus the unmapped room after it) is smaller.
/// The 4 MiB tail can grow by the segment's last 20 MiB page (80 MiB of address space for a
/// 64 MiB device): 24 MiB, no more than the 24 MiB hole, so it serves the 3 MiB request (as
/// PyTorch 2.15 does over testdrv/: offset 56 MiB).
#[test]
fn pytorchs_rules_keep_the_tail_unless_a_hole_has_less_room() {
    let a = sim("sim_capacity_mb:64,expandable_segments:True,exact_fit:True");
    let first = a.malloc(0, 16 * MIB, S0).unwrap();
    let hole = a.malloc(0, 24 * MIB, S0).unwrap();
    let _last = a.malloc(0, 16 * MIB, S0).unwrap();
    a.free(0, hole, 24 * MIB).unwrap();
    let p = a.malloc(0, 3 * MIB, S0).unwrap();
    assert_eq!(p, first + 56 * MIB, "the tail, as PyTorch");
    a.check_invariants().unwrap();
    // stepalloc's own choice (without exact_fit) takes the hole: see the next test.
    let b = sim("sim_capacity_mb:64,expandable_segments:True");
    let first = b.malloc(0, 16 * MIB, S0).unwrap();
    let hole = b.malloc(0, 24 * MIB, S0).unwrap();
    let _last = b.malloc(0, 16 * MIB, S0).unwrap();
    b.free(0, hole, 24 * MIB).unwrap();
    assert_eq!(b.malloc(0, 3 * MIB, S0).unwrap(), first + 16 * MIB);
}

#[test]
fn expandable_segments_take_the_free_tail_last() {
    let a = sim("sim_capacity_mb:1024,expandable_segments:True");
    let x = a.malloc(0, 4 * MIB, S0).unwrap();
    let y = a.malloc(0, 4 * MIB, S0).unwrap();
    a.free(0, x, 4 * MIB).unwrap();
    // Free: x's 4 MiB hole, and the 12 MiB tail before the unmapped end. The hole is used.
    let z = a.malloc(0, 3 * MIB, S0).unwrap();
    assert_eq!(z, x, "a free block that is not the tail comes first");
    // A block that fits only in the tail goes there.
    let w = a.malloc(0, 10 * MIB, S0).unwrap();
    assert_eq!(w, y + 4 * MIB);
    assert_eq!(stats(&a).heap.num_device_alloc, 1);
    // A small remainder is split off whenever a granule remains, as PyTorch does here.
    let v = a.malloc(0, 2 * MIB - 512, S0).unwrap();
    assert_eq!(v, w + 10 * MIB);
}

#[test]
fn streams_get_their_own_segments() {
    let a = sim("sim_capacity_mb:1024,expandable_segments:True");
    let p = a.malloc(0, 8 * MIB, S0).unwrap();
    let q = a.malloc(0, 8 * MIB, S1).unwrap();
    let s = stats(&a);
    assert_eq!(s.heap.segment.large_pool.current, 2, "one segment per stream and pool");
    assert!(q.abs_diff(p) >= 1024 * MIB, "separate ranges");
    a.free(0, p, 8 * MIB).unwrap();
    // Stream 1 does not reuse stream 0's free block: it maps its own page.
    let r = a.malloc(0, 8 * MIB, S1).unwrap();
    assert_eq!(r, q + 8 * MIB);
}

#[test]
fn page_reuse_moves_idle_pages_instead_of_creating_memory() {
    let conf = "sim_capacity_mb:1024,expandable_segments:True,large_segment_size_mb:2";
    for reuse in [false, true] {
        let a = sim(&format!("{conf},page_reuse:{}", if reuse { "True" } else { "False" }));
        let x = a.malloc(0, 10 * MIB, S0).unwrap();
        let y = a.malloc(0, 10 * MIB, S0).unwrap();
        a.free(0, x, 10 * MIB).unwrap();
        // 12 MiB does not fit x's hole; it maps 6 pages after y.
        let z = a.malloc(0, 12 * MIB, S0).unwrap();
        assert_eq!(z, y + 10 * MIB);
        let s = stats(&a);
        a.check_invariants().unwrap();
        if reuse {
            assert_eq!(s.heap.reserved_bytes.all.current, 22 * MIB, "x's pages moved: mapped = live");
            assert_eq!(s.heap.moved_bytes, 10 * MIB);
            assert_eq!(s.heap.num_create, 11, "10 pages for x and y, one more for z");
        } else {
            assert_eq!(s.heap.reserved_bytes.all.current, 32 * MIB);
            assert_eq!((s.heap.moved_bytes, s.heap.num_create), (0, 16));
        }
        let device_free = a.with_heap(0, |h| h.device_mem_info()).unwrap().unwrap().0;
        assert_eq!(s.device_total - device_free, s.heap.reserved_bytes.all.current, "the device agrees");
    }
}

/// `close_holes`: a request that fills an unmapped hole up to the free block after it goes
/// there before PyTorch's first fit (a lower hole with more room), so the two mapped runs join
/// and one pair of partly used end pages goes with them. PyTorch's expandable segments keep
/// their first fit.
#[test]
fn close_holes_fills_a_hole_before_first_fit() {
    let conf = "sim_capacity_mb:1024,expandable_segments:True,large_segment_size_mb:2,page_reuse:True";
    let half = MIB / 2;
    for close in [false, true] {
        let a = sim(&format!("{conf},close_holes:{}", if close { "True" } else { "False" }));
        // Offsets in MiB: a [0, 3), b [3, 10.5), c [10.5, 12), d [12, 17.5), e [17.5, 20.5).
        let sizes = [3 * MIB, 7 * MIB + half, MIB + half, 5 * MIB + half, 3 * MIB];
        let ptrs: Vec<u64> = sizes.iter().map(|&s| a.malloc(0, s, S0).unwrap()).collect();
        let base = ptrs[0];
        a.free(0, ptrs[1], sizes[1]).unwrap();
        a.free(0, ptrs[3], sizes[3]).unwrap();
        // Unmaps the whole pages of b and d: holes [4, 10) (room 7.5 MiB with the free pieces
        // [3, 4) and [10, 10.5)) and [12, 16) (room 5.5 MiB with the free piece [16, 17.5)).
        a.empty_cache().unwrap();
        let runs = |a: &Allocator| a.with_heap(0, |h| h.segments().len()).unwrap();
        assert_eq!(runs(&a), 3);
        let z = a.malloc(0, 5 * MIB, S0).unwrap();
        a.check_invariants().unwrap();
        if close {
            assert_eq!(z, base + 12 * MIB, "the hole that 5 MiB closes");
            assert_eq!(runs(&a), 2, "[0, 4) and [10, 20.5)");
        } else {
            assert_eq!(z, base + 3 * MIB, "PyTorch: the first hole with room");
            assert_eq!(runs(&a), 3);
        }
        assert_eq!(stats(&a).heap.reserved_bytes.all.current, 16 * MIB, "12 MiB of pages left mapped, two more");
    }
}

/// `big_page_mb`: once the peak of mapped bytes reaches `big_page_after_mb`, the large pool
/// grows in a segment of its own with the big pages; a big page needed while fine pages are
/// idle gives as many fine bytes back, so mapped bytes still track live ones.
#[test]
fn big_pages_past_the_threshold_and_fine_idle_pages_given_back() {
    let conf = "sim_capacity_mb:1024,expandable_segments:True,large_segment_size_mb:2,page_reuse:True";
    let a = sim(&format!("{conf},big_page_mb:16,big_page_after_mb:64"));
    let x = a.malloc(0, 30 * MIB, S0).unwrap();
    let y = a.malloc(0, 40 * MIB, S0).unwrap();
    assert_eq!(y, x + 30 * MIB, "below the threshold when asked for: 2 MiB pages, same segment");
    let s = stats(&a);
    assert_eq!((s.heap.num_create, s.heap.reserved_bytes.all.current, s.heap.segment.all.current), (35, 70 * MIB, 1));
    // The peak (70 MiB) has passed 64 MiB: 20 MiB takes two 16 MiB pages in a new segment.
    let z = a.malloc(0, 20 * MIB, S0).unwrap();
    let s = stats(&a);
    assert_eq!((s.heap.num_create, s.heap.reserved_bytes.all.current, s.heap.segment.all.current), (37, 102 * MIB, 2));
    assert_eq!(z % (16 * MIB), 0);
    assert!(z < x || z >= x + 70 * MIB, "not in the fine segment");
    // x's 15 fine pages go idle. 44 MiB fits neither x's hole nor z's free 12 MiB: it takes
    // z's free 12 MiB and two more big pages; fine pages cannot be mapped there, so x's are
    // released instead (all 30 MiB of them, short of the 32 MiB created).
    a.free(0, x, 30 * MIB).unwrap();
    let w = a.malloc(0, 44 * MIB, S0).unwrap();
    assert_eq!(w, z + 20 * MIB);
    a.check_invariants().unwrap();
    let s = stats(&a);
    assert_eq!((s.heap.num_create, s.heap.num_release_physical), (39, 15));
    assert_eq!(s.heap.reserved_bytes.all.current, 104 * MIB, "mapped: y's 40 fine + 64 big");
    let device_free = a.with_heap(0, |h| h.device_mem_info()).unwrap().unwrap().0;
    assert_eq!(s.device_total - device_free, 104 * MIB, "the device agrees");
    for (ptr, size) in [(y, 40 * MIB), (z, 20 * MIB), (w, 44 * MIB)] {
        a.free(0, ptr, size).unwrap();
    }
    a.empty_cache().unwrap();
    let s = stats(&a);
    assert_eq!((s.heap.reserved_bytes.all.current, s.heap.virtual_reserved_bytes), (0, 0));
    assert_eq!(s.heap.num_release_physical, s.heap.num_create);
}

/// `pack_small`: a small request that finds no free small-pool block takes free space in the
/// large pool's mapped pages before the small pool maps a page of its own.
#[test]
fn pack_small_fills_the_large_pools_pages_first() {
    let conf = "sim_capacity_mb:1024,expandable_segments:True,large_segment_size_mb:2";
    for pack in [false, true] {
        let a = sim(&format!("{conf},pack_small:{}", if pack { "True" } else { "False" }));
        // 3 MiB maps two 2 MiB pages: 1 MiB of the second stays free.
        let x = a.malloc(0, 3 * MIB, S0).unwrap();
        let t = a.malloc(0, 100 * 1024, S0).unwrap();
        let u = a.malloc(0, 1000, S0).unwrap();
        let s = stats(&a);
        a.check_invariants().unwrap();
        if pack {
            assert_eq!((t, u), (x + 3 * MIB, x + 3 * MIB + 100 * 1024), "in the large pool's free page end");
            assert_eq!(s.heap.reserved_bytes.all.current, 4 * MIB, "no small-pool page");
            assert_eq!(s.heap.reserved_bytes.small_pool.current, 0);
            assert_eq!(s.heap.allocated_bytes.large_pool.current, 3 * MIB + 100 * 1024 + 1024);
        } else {
            assert_eq!(s.heap.reserved_bytes.small_pool.current, 2 * MIB);
            assert_eq!(s.heap.reserved_bytes.all.current, 6 * MIB);
        }
        for (ptr, size) in [(x, 3 * MIB), (t, 100 * 1024), (u, 1000)] {
            a.free(0, ptr, size).unwrap();
        }
        a.check_invariants().unwrap();
        a.empty_cache().unwrap();
        assert_eq!(stats(&a).heap.reserved_bytes.all.current, 0);
    }
    // With a small-pool page already mapped and room in it, the small pool serves first.
    let a = sim(&format!("{conf},pack_small:True"));
    let x = a.malloc(0, 3 * MIB, S0).unwrap();
    let big = a.malloc(0, MIB, S0).unwrap(); // fills x's page: the next small request maps a small page
    let t = a.malloc(0, 4096, S0).unwrap();
    assert_eq!(stats(&a).heap.reserved_bytes.small_pool.current, 2 * MIB);
    a.free(0, big, MIB).unwrap();
    let u = a.malloc(0, 4096, S0).unwrap();
    assert_eq!(u, t + 4096, "the small pool's free space before the large pool's");
    for (ptr, size) in [(x, 3 * MIB), (t, 4096), (u, 4096)] {
        a.free(0, ptr, size).unwrap();
    }
    a.check_invariants().unwrap();
}

/// Free memory in holes that PyTorch can neither release (its segments are split, its pages
/// half used) nor reuse (no hole is large enough): both PyTorch configurations run out of
/// memory; stepalloc's recommended one moves the holes' pages and serves the request.
#[test]
fn out_of_memory_that_page_reuse_avoids() {
    let run = |conf: &str| {
        let a = sim(&format!("sim_capacity_mb:64,{conf}"));
        let blocks: Vec<u64> = (0..9).map(|_| a.malloc(0, 6 * MIB, S0).unwrap()).collect();
        for &b in blocks.iter().step_by(2) {
            a.free(0, b, 6 * MIB).unwrap();
        }
        let result = a.malloc(0, 24 * MIB, S0);
        a.check_invariants().unwrap();
        (result, stats(&a))
    };
    let (default, _) = run("");
    assert!(default.unwrap_err().is_out_of_memory(), "PyTorch's default rules");
    let (expandable, _) = run("expandable_segments:True");
    let e = expandable.unwrap_err();
    assert!(e.is_out_of_memory(), "PyTorch's expandable segments");
    let text = e.to_string();
    assert!(text.contains("unmapped 0 bytes of free pages; 36.00 MiB stays mapped but free"), "{text}");
    let (ours, s) = run(RECOMMENDED);
    ours.expect("stepalloc serves it");
    assert_eq!(s.heap.num_alloc_retries, 0, "without running the out-of-memory path");
    assert_eq!(s.heap.reserved_bytes.all.current, 54 * MIB, "24 live + 6 in the tail + 24 new");
    assert!(s.heap.moved_bytes >= 18 * MIB);
}

#[test]
fn page_release_unmaps_pages_idle_for_a_step() {
    let a = sim("sim_capacity_mb:1024,expandable_segments:True,large_segment_size_mb:2,page_release:True");
    a.step_begin("train").unwrap();
    let p = a.malloc(0, 10 * MIB, S0).unwrap();
    let q = a.malloc(0, 10 * MIB, S0).unwrap();
    a.free(0, p, 10 * MIB).unwrap();
    a.step_end().unwrap();
    // p was freed during the step: it stays mapped for the next step.
    assert_eq!(stats(&a).heap.reserved_bytes.all.current, 20 * MIB);
    a.step_begin("train").unwrap();
    a.step_end().unwrap();
    // Idle for a whole step: its pages go back.
    let s = stats(&a);
    assert_eq!(s.heap.reserved_bytes.all.current, 10 * MIB);
    assert_eq!(s.heap.released_bytes[stepalloc::stats::ReleaseReason::Step as usize], 10 * MIB);
    a.free(0, q, 10 * MIB).unwrap();
    a.check_invariants().unwrap();
}

/// `page_release` with a 4 MiB cache limit and a grace of `grace` allocations.
fn limited(grace: u64) -> Allocator {
    sim(&format!(
        "sim_capacity_mb:1024,expandable_segments:True,large_segment_size_mb:2,page_release:True,cache_limit_mb:4,page_release_grace:{grace}"
    ))
}

fn released_for_the_limit(a: &Allocator) -> u64 {
    stats(a).heap.released_bytes[stepalloc::stats::ReleaseReason::Limit as usize]
}

#[test]
fn cache_limit_unmaps_free_pages_with_page_release_at_the_free_with_no_grace() {
    let a = limited(0);
    let p = a.malloc(0, 10 * MIB, S0).unwrap();
    let q = a.malloc(0, 10 * MIB, S0).unwrap();
    a.free(0, p, 10 * MIB).unwrap();
    let s = stats(&a);
    assert!(s.cached_free <= 4 * MIB, "cached free {} over the limit", s.cached_free);
    assert_eq!(released_for_the_limit(&a), 6 * MIB, "down to the limit: the block's top three pages");
    a.free(0, q, 10 * MIB).unwrap();
    assert!(stats(&a).cached_free <= 4 * MIB);
    a.check_invariants().unwrap();
}

#[test]
fn free_pages_over_the_cache_limit_go_back_after_the_grace() {
    let a = limited(3);
    let p = a.malloc(0, 10 * MIB, S0).unwrap();
    let _q = a.malloc(0, 10 * MIB, S0).unwrap();
    a.free(0, p, 10 * MIB).unwrap();
    assert_eq!(stats(&a).cached_free, 10 * MIB, "kept through the grace");
    // Two allocations on another stream, which cannot take the freed block: still kept.
    let small: Vec<u64> = (0..2).map(|_| a.malloc(0, 2 * MIB, S1).unwrap()).collect();
    assert_eq!(stats(&a).cached_free, 10 * MIB);
    assert_eq!(released_for_the_limit(&a), 0);
    // The third allocation since the free: the release runs after it took what it needed.
    let r = a.malloc(0, 2 * MIB, S1).unwrap();
    assert!(stats(&a).cached_free <= 4 * MIB, "cached free {} over the limit", stats(&a).cached_free);
    assert_eq!(released_for_the_limit(&a), 6 * MIB);
    for x in small.into_iter().chain([r]) {
        a.free(0, x, 2 * MIB).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn a_block_freed_over_the_cache_limit_and_asked_for_again_is_not_unmapped() {
    let a = limited(16);
    let _kept = a.malloc(0, 10 * MIB, S0).unwrap();
    let before = stats(&a).heap;
    // A training step's activation, freed and asked for again layer after layer.
    for _ in 0..100 {
        let p = a.malloc(0, 64 * MIB, S0).unwrap();
        a.free(0, p, 64 * MIB).unwrap();
    }
    let after = stats(&a).heap;
    assert_eq!(after.num_map - before.num_map, 32, "mapped once (32 pages of 2 MiB)");
    assert_eq!(after.num_unmap, before.num_unmap, "never unmapped within the grace");
    // With no grace, every free gives the pages back and every allocation maps them again.
    let strict = limited(0);
    let _kept = strict.malloc(0, 10 * MIB, S0).unwrap();
    for _ in 0..100 {
        let p = strict.malloc(0, 64 * MIB, S0).unwrap();
        strict.free(0, p, 64 * MIB).unwrap();
    }
    assert!(stats(&strict).heap.num_map >= 100 * 30, "{}", stats(&strict).heap.num_map);
    a.check_invariants().unwrap();
    strict.check_invariants().unwrap();
}

#[test]
fn free_bytes_in_partly_used_pages_do_not_count_against_the_cache_limit() {
    let a = sim(
        "sim_capacity_mb:1024,expandable_segments:True,large_segment_size_mb:2,page_release:True,cache_limit_mb:3,page_release_grace:0",
    );
    // Five 3 MiB blocks end to end over 2 MiB pages: [0,3) [3,6) [6,9) [9,12) [12,15), and
    // 1 MiB free in the last page.
    let b: Vec<u64> = (0..5).map(|_| a.malloc(0, 3 * MIB, S0).unwrap()).collect();
    assert_eq!(b[4], b[0] + 12 * MIB);
    // [3,6) free: one whole page [4,6) and 1 MiB beside B0. 4 MiB cached, over the 3 MiB
    // limit, but only 2 MiB of it could go back: nothing is unmapped.
    a.free(0, b[1], 3 * MIB).unwrap();
    let s = stats(&a);
    assert_eq!(s.cached_free, 4 * MIB);
    assert_eq!(s.heap.num_unmap, 0);
    // [9,12) free too: 4 MiB of whole pages, over the limit. The page freed longest ago goes.
    a.free(0, b[3], 3 * MIB).unwrap();
    assert_eq!(released_for_the_limit(&a), 2 * MIB);
    assert_eq!(stats(&a).heap.reserved_bytes.all.current, 14 * MIB);
    let r = a.malloc(0, 3 * MIB, S0).unwrap();
    assert_eq!(r, b[3], "the block at [9,12) is whole: its page stayed mapped, [4,6) went");
    a.check_invariants().unwrap();
}

#[test]
fn step_end_applies_the_cache_limit_whatever_the_grace() {
    let a = limited(1000);
    a.step_begin("train").unwrap();
    let p = a.malloc(0, 10 * MIB, S0).unwrap();
    let _q = a.malloc(0, 10 * MIB, S0).unwrap();
    a.free(0, p, 10 * MIB).unwrap();
    assert_eq!(stats(&a).cached_free, 10 * MIB);
    a.step_end().unwrap();
    assert!(stats(&a).cached_free <= 4 * MIB, "cached free {} over the limit", stats(&a).cached_free);
    a.check_invariants().unwrap();
}

#[test]
fn memory_fraction_bounds_mapped_bytes() {
    let a = sim("sim_capacity_mb:100,expandable_segments:True,per_process_memory_fraction:0.5");
    let p = a.malloc(0, 40 * MIB, S0).unwrap();
    let e = a.malloc(0, 20 * MIB, S0).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(stats(&a).heap.reserved_bytes.all.current <= 50 * MIB);
    a.free(0, p, 40 * MIB).unwrap();
}

#[test]
fn create_failures_leave_the_heap_consistent() {
    // Every third create fails: requests still succeed through the retry or fail cleanly.
    let a = sim("sim_capacity_mb:256,expandable_segments:True,large_segment_size_mb:2,page_reuse:True,sim_fail_prob:0.3,sim_seed:5");
    let mut live = Vec::new();
    for i in 0..300u64 {
        let size = (i * 7919) % (12 * MIB) + 1;
        if let Ok(p) = a.malloc(0, size, S0) {
            live.push((p, size));
        }
        if i % 3 == 0 && !live.is_empty() {
            let (p, size) = live.swap_remove((i as usize * 31) % live.len());
            a.free(0, p, size).unwrap();
        }
        a.check_invariants().unwrap();
    }
    for (p, size) in live {
        a.free(0, p, size).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(stats(&a).heap.reserved_bytes.all.current, 0);
}

#[test]
fn snapshots_show_mapped_runs_as_expandable_segments() {
    let a = sim("sim_capacity_mb:1024,expandable_segments:True,large_segment_size_mb:2,trace_entries:100");
    let p = a.malloc(0, 10 * MIB, S0).unwrap();
    let q = a.malloc(0, 10 * MIB, S0).unwrap();
    a.free(0, p, 10 * MIB).unwrap();
    a.with_heap(0, |h| h.release_all_cached(stepalloc::stats::ReleaseReason::EmptyCache)).unwrap().unwrap();
    let snapshot = a.snapshot();
    let segments = snapshot["segments"].as_array().unwrap();
    assert_eq!(segments.len(), 1, "p's pages went back: one mapped run is left");
    assert_eq!(segments[0]["is_expandable"], true);
    assert_eq!(segments[0]["address"].as_u64(), Some(q));
    assert_eq!(segments[0]["total_size"].as_u64(), Some(10 * MIB));
    assert_eq!(snapshot["allocator_settings"]["expandable_segments"], true);
    let actions: Vec<&str> =
        snapshot["device_traces"][0].as_array().unwrap().iter().filter_map(|e| e["action"].as_str()).collect();
    assert!(actions.contains(&"segment_map") && actions.contains(&"segment_unmap"), "{actions:?}");
}

#[test]
fn map_failures_roll_back_and_retry() {
    // Half the maps fail: a request maps its pages or undoes the ones it mapped, and the
    // out-of-memory retry runs; nothing stays mapped that no block accounts for.
    let a = sim("sim_capacity_mb:512,expandable_segments:True,large_segment_size_mb:2,page_reuse:True,sim_fail_map_prob:0.5,sim_seed:3");
    let mut live = Vec::new();
    let mut failures = 0;
    for i in 0..200u64 {
        match a.malloc(0, (i * 104_729) % (9 * MIB) + 1, S0) {
            Ok(p) => live.push(p),
            Err(e) => {
                assert!(e.is_out_of_memory(), "{e}");
                failures += 1;
            }
        }
        if i % 2 == 0 && !live.is_empty() {
            a.free(0, live.swap_remove((i as usize * 7) % live.len()), 0).unwrap();
        }
        a.check_invariants().unwrap();
        let s = stats(&a);
        let device_free = a.with_heap(0, |h| h.device_mem_info()).unwrap().unwrap().0;
        assert_eq!(s.device_total - device_free, s.heap.reserved_bytes.all.current, "no page outside the books");
    }
    assert!(failures > 0 && live.len() > 10, "{failures} failures, {} live", live.len());
    for p in live {
        a.free(0, p, 0).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(stats(&a).heap.reserved_bytes.all.current, 0);
}

/// `param_lane`: requests of a parameter's size (a block live when the first step began) have
/// segments of their own. A step in miniature: four 3.5 MiB weights, four 4 MiB activations and
/// 16 MiB of logits; the backward pass frees each activation and takes a gradient, the
/// optimizer creates two states per weight, `zero_grad` frees the gradients. Without the lane
/// the first state fills the activations' hole after the weights and the others follow the
/// last gradient, so once the gradients are gone two mapped runs hold them, each with a partly
/// used end page (the 0.5 MiB after the first state, 1.5 MiB before the second); in the lane
/// the gradients' pages are whole and the states pack behind them, page-aligned.
#[test]
fn param_lane_packs_optimizer_states_apart_from_activations() {
    let conf = "sim_capacity_mb:1024,expandable_segments:True,large_segment_size_mb:2,page_reuse:True";
    let (p, act, logits) = (3 * MIB + MIB / 2, 4 * MIB, 16 * MIB);
    for lane in [false, true] {
        let a = sim(&format!("{conf},param_lane:{}", if lane { "True" } else { "False" }));
        let weights: Vec<u64> = (0..4).map(|_| a.malloc(0, p, S0).unwrap()).collect();
        a.step_begin("train").unwrap();
        let acts: Vec<u64> = (0..4).map(|_| a.malloc(0, act, S0).unwrap()).collect();
        let x = a.malloc(0, logits, S0).unwrap();
        a.free(0, x, logits).unwrap();
        let mut grads = Vec::new();
        for &ptr in acts.iter().rev() {
            grads.push(a.malloc(0, p, S0).unwrap());
            a.free(0, ptr, act).unwrap();
        }
        let states: Vec<u64> = (0..8).map(|_| a.malloc(0, p, S0).unwrap()).collect();
        for &g in &grads {
            a.free(0, g, p).unwrap();
        }
        a.step_end().unwrap();
        a.check_invariants().unwrap();
        let base = weights[0];
        let segment_of = |ptr: u64| a.with_heap(0, |h| h.segment_holding(ptr)).unwrap().unwrap().0;
        assert_eq!(segment_of(grads[0]) != segment_of(base), lane, "the gradients' segment is the lane's");
        if lane {
            let lane_base = *grads.iter().min().unwrap();
            for (i, &s) in states.iter().enumerate() {
                assert_eq!(s, lane_base + (4 + i as u64) * p, "state {i} packed behind the gradients");
            }
        } else {
            // In half MiB from the first weight: the hole at 14 MiB, then after the last
            // gradient (33.5 MiB).
            let offsets: Vec<u64> = states.iter().map(|&s| (s - base) / (MIB / 2)).collect();
            assert_eq!(offsets, [28, 67, 74, 81, 88, 95, 102, 109]);
        }
        // The next step's peak: every free whole page moves to one large activation.
        a.step_begin("train").unwrap();
        let big = a.malloc(0, 64 * MIB, S0).unwrap();
        let mapped = stats(&a).heap.reserved_bytes.all.current;
        let live = 4 * p + 8 * p + 64 * MIB;
        let waste = if lane { 0 } else { 2 * MIB };
        assert_eq!(mapped - live, waste, "mapped bytes at the peak beyond live bytes: partly used pages");
        a.free(0, big, 64 * MIB).unwrap();
        a.check_invariants().unwrap();
    }
}

/// `param_lane` notes the parameters' sizes at the first step's begin (before it, a request of
/// the same size stays with the others) and stops once the large pool's pages are big: past
/// `big_page_after_mb` a parameter-sized request is served like any other.
#[test]
fn param_lane_starts_at_the_first_step_and_stops_at_big_pages() {
    let conf = "sim_capacity_mb:1024,expandable_segments:True,large_segment_size_mb:2,page_reuse:True";
    let a = sim(&format!("{conf},big_page_mb:16,big_page_after_mb:64,param_lane:True"));
    let p = 3 * MIB + MIB / 2;
    let segment_of = |ptr: u64| a.with_heap(0, |h| h.segment_holding(ptr)).unwrap().unwrap().0;
    let weight = a.malloc(0, p, S0).unwrap();
    let before = a.malloc(0, p, S0).unwrap();
    assert_eq!(segment_of(before), segment_of(weight), "no step has begun: no lane");
    a.free(0, before, p).unwrap();
    a.step_begin("train").unwrap();
    let grad = a.malloc(0, p, S0).unwrap();
    assert_ne!(segment_of(grad), segment_of(weight), "a parameter's size: the lane");
    let other = a.malloc(0, p + MIB, S0).unwrap();
    assert_eq!(segment_of(other), segment_of(weight), "another size: not the lane");
    // 70 MiB: the peak of mapped bytes passes 64 MiB, and the large pool's pages are big.
    let big = a.malloc(0, 70 * MIB, S0).unwrap();
    let big_segment = segment_of(big);
    a.free(0, big, 70 * MIB).unwrap();
    let late = a.malloc(0, p, S0).unwrap();
    assert_eq!(segment_of(late), big_segment, "big pages: the lane has stopped, the free big pages serve it");
    for (ptr, size) in [(weight, p), (grad, p), (other, p + MIB), (late, p)] {
        a.free(0, ptr, size).unwrap();
    }
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(stats(&a).heap.reserved_bytes.all.current, 0, "every lane's pages unmapped");
}

/// Address space is not memory: 1,000 streams with one 4 KiB block each on an 80 GiB device
/// would reserve 1,000 PyTorch-size ranges (90 GiB each) in a 16 TiB window. Past what the
/// window holds, new ranges take only the pages they map, so every request is served.
#[test]
fn a_thousand_streams_do_not_run_out_of_address_space() {
    let a = sim("expandable_segments:True");
    let mut live = Vec::new();
    for s in 0..1000u64 {
        let stream = Stream(0x1000 + s);
        live.push((a.malloc(0, 4096, stream).unwrap_or_else(|e| panic!("stream {s}: {e}")), stream));
    }
    let st = stats(&a);
    assert_eq!(st.heap.num_ooms, 0);
    assert_eq!(st.heap.reserved_bytes.all.current, 1000 * 2 * MIB, "one small page per stream");
    a.check_invariants().unwrap();
    for (p, _) in live {
        a.free(0, p, 4096).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(stats(&a).heap.virtual_reserved_bytes, 0, "every range freed");
}

/// While the address space has room, a new range is PyTorch's 1.125 x device memory (so the
/// layout and figures are PyTorch's); past it, ranges grow in chunks (twice the stream's widest)
/// or take the request's pages; when even those find no room, the out-of-memory error says
/// that the address space ran out, not memory, and the out-of-memory path freed empty ranges.
#[test]
fn address_space_runs_out_after_memory_and_says_so() {
    // 1 GiB device, 2.5 GiB of address space: two PyTorch-size ranges (1,152 MiB) fit.
    let a = sim("sim_capacity_mb:1024,sim_address_space_mb:2560,expandable_segments:True,large_segment_size_mb:2");
    let p = a.malloc(0, 4 * MIB, S0).unwrap();
    assert_eq!(stats(&a).heap.virtual_reserved_bytes, 1152 * MIB, "PyTorch's range first");
    let q = a.malloc(0, 4 * MIB, S1).unwrap();
    assert_eq!(stats(&a).heap.virtual_reserved_bytes, 2304 * MIB);
    // A third stream: no room for 1,152 MiB; the range is the request's pages (it has none yet).
    let s2 = Stream(0x2222);
    let r = a.malloc(0, 6 * MIB, s2).unwrap();
    assert_eq!(stats(&a).heap.virtual_reserved_bytes, 2310 * MIB, "a range of the request's pages");
    // Its next request doubles its widest range.
    let t = a.malloc(0, 3 * MIB, s2).unwrap();
    assert_eq!(stats(&a).heap.virtual_reserved_bytes, 2322 * MIB, "twice the widest range");
    // 2560 - 2322 = 238 MiB of address space left, 1 GiB - 18 MiB of memory: a 300 MiB request
    // finds memory but no range.
    let e = a.malloc(0, 300 * MIB, s2).unwrap_err();
    let text = e.to_string();
    assert!(text.starts_with("CUDA out of memory."), "{text}");
    assert!(text.contains("address space ran out, not its memory"), "{text}");
    let stepalloc::Error::OutOfMemory(report) = e else { panic!("not an out-of-memory error") };
    let short = report.address_space.expect("address space named in the report");
    assert_eq!((short.range, short.ranges), (300 * MIB, 4));
    assert!(report.device_free > 900 * MIB, "memory was free: {}", report.device_free);
    a.check_invariants().unwrap();
    // Memory itself still serves requests that fit the space left.
    let u = a.malloc(0, 200 * MIB, s2).unwrap();
    for (ptr, size) in [(p, 4 * MIB), (q, 4 * MIB), (r, 6 * MIB), (t, 3 * MIB), (u, 200 * MIB)] {
        a.free(0, ptr, size).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(stats(&a).heap.virtual_reserved_bytes, 0);
}

/// A device smaller than a page or segment: the simulated one is refused when configured; a
/// request whose segment or page is larger than the device says so instead of "memory is free".
#[test]
fn a_device_smaller_than_a_page_is_refused_or_named() {
    for (conf, key) in [
        ("backend:sim,sim_capacity_mb:1", "sim_capacity_mb"),
        ("backend:sim,sim_capacity_mb:64,expandable_segments:True,large_segment_size_mb:1024", "large_segment_size_mb"),
    ] {
        let e = Config::parse(conf).unwrap_err().to_string();
        assert!(e.contains(&format!("`{key}`")), "{conf}: {e}");
    }
    // 16 MiB device, plain segments: 3 MiB needs a 20 MiB segment.
    let a = sim("sim_capacity_mb:16");
    let e = a.malloc(0, 3 * MIB, S0).unwrap_err().to_string();
    assert!(e.contains("segment or page of 20.00 MiB, more than the device's whole memory"), "{e}");
    // 100 MiB device, expandable segments with 64 MiB pages: one fits; 65 MiB needs two.
    let a = sim("sim_capacity_mb:100,expandable_segments:True,large_segment_size_mb:64");
    let p = a.malloc(0, 3 * MIB, S0).unwrap();
    a.free(0, p, 3 * MIB).unwrap();
    let e = a.malloc(0, 65 * MIB, S0).unwrap_err().to_string();
    assert!(e.contains("segment or page of 128.00 MiB"), "{e}");
}
