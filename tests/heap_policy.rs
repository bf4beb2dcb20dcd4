//! Policy tests of the heap on the simulated device: splitting, `max_split_size_mb`, the
//! out-of-memory sequence, stream reuse, memory fraction, garbage collection, cache limit,
//! CUDA-graph pools, bad input, and threads. Each test states the rule it checks.

mod common;

use common::{sim, stats, S0, S1, S2};
use stepalloc::units::MIB;
use stepalloc::{Allocator, Error, Stream};

fn block_size(a: &Allocator, ptr: u64) -> u64 {
    a.with_heap(0, |h| h.live_blocks().into_iter().find(|b| b.0 == ptr).map(|b| b.1)).unwrap().expect("live block")
}

/// The inactive-split statistics change once per operation, by its net effect, as PyTorch's
/// `alloc_found_block` and `free_block` change them: taking 1 KiB from an already split free
/// block shrinks it (1 KiB freed, no block count change), not a block leaving and a smaller one
/// arriving; so the lifetime totals are PyTorch's.
#[test]
fn inactive_split_totals_count_net_changes_as_pytorch() {
    let a = sim("");
    let p = a.malloc(0, 1000, S0).unwrap(); // an unsplit segment leaves a new free piece
    let q = a.malloc(0, 1000, S0).unwrap(); // the piece shrinks by 1 KiB
    a.free(0, q, 1000).unwrap(); // the piece grows back by 1 KiB
    a.free(0, p, 1000).unwrap(); // the segment is whole again: the piece leaves
    let s = stats(&a).heap;
    assert_eq!((s.inactive_split.all.allocated, s.inactive_split.all.freed), (1, 1));
    assert_eq!((s.inactive_split_bytes.all.allocated, s.inactive_split_bytes.all.freed), (2 * MIB, 2 * MIB));
    assert_eq!(s.inactive_split_bytes.small_pool.current, 0);
    a.check_invariants().unwrap();
}

#[test]
fn small_requests_split_a_2mib_segment() {
    let a = sim("");
    let p = a.malloc(0, 1000, S0).unwrap();
    let q = a.malloc(0, 1000, S0).unwrap();
    assert_eq!(q, p + 1024, "the second block comes from the rest of the same segment");
    let s = stats(&a);
    assert_eq!(s.heap.segment.small_pool.current, 1);
    assert_eq!(s.heap.reserved_bytes.small_pool.current, 2 * MIB);
    assert_eq!(s.heap.allocated_bytes.small_pool.current, 2048);
    assert_eq!(s.heap.requested_bytes.small_pool.current, 2000);
    assert_eq!(s.heap.inactive_split_bytes.small_pool.current, 2 * MIB - 2048);
    a.free(0, p, 1000).unwrap();
    a.free(0, q, 1000).unwrap();
    let s = stats(&a);
    assert_eq!(s.heap.inactive_split.all.current, 0, "the pieces merged back into one block");
    assert_eq!(s.largest_free_block, 2 * MIB);
    a.check_invariants().unwrap();
}

#[test]
fn large_blocks_split_only_when_more_than_1mib_remains() {
    let a = sim("");
    let p = a.malloc(0, 5 * MIB, S0).unwrap();
    assert_eq!(stats(&a).heap.reserved_bytes.large_pool.current, 20 * MIB, "1-10 MiB requests get 20 MiB segments");
    assert_eq!(block_size(&a, p), 5 * MIB);
    // 15 MiB remain; a 14.5 MiB request would leave 0.5 MiB: the block is not split.
    let q = a.malloc(0, 14 * MIB + MIB / 2, S0).unwrap();
    assert_eq!(block_size(&a, q), 15 * MIB);
    assert_eq!(stats(&a).heap.reserved_bytes.all.current, 20 * MIB);
    assert_eq!(stats(&a).heap.allocated_bytes.all.current, 20 * MIB);
    // Requests of 10 MiB and more get a segment of their own size, rounded to 2 MiB.
    let r = a.malloc(0, 11 * MIB, S0).unwrap();
    assert_eq!(block_size(&a, r), 12 * MIB, "12 MiB segment; the 1 MiB rest is not split off");
    assert_eq!(stats(&a).heap.reserved_bytes.all.current, 32 * MIB);
}

#[test]
fn max_split_size_keeps_large_blocks_whole() {
    let a = sim("max_split_size_mb:64");
    let big = a.malloc(0, 100 * MIB, S0).unwrap();
    a.free(0, big, 100 * MIB).unwrap();
    assert_eq!(stats(&a).heap.oversize_segments.current, 1);
    // Below the limit: an oversize block never serves it, a new segment does.
    let small = a.malloc(0, 50 * MIB, S0).unwrap();
    assert_ne!(small, big);
    assert_eq!(stats(&a).heap.segment.all.current, 2);
    // At or above the limit and within max_non_split_rounding (20 MiB): served whole.
    let fits = a.malloc(0, 90 * MIB, S0).unwrap();
    assert_eq!(fits, big);
    assert_eq!(block_size(&a, fits), 100 * MIB, "oversize blocks are never split");
    assert_eq!(stats(&a).heap.oversize_allocations.current, 1);
    a.free(0, fits, 90 * MIB).unwrap();
    // 100 MiB >= 70 + 20: too wasteful, so a new segment.
    let other = a.malloc(0, 70 * MIB, S0).unwrap();
    assert_ne!(other, big);
    assert_eq!(stats(&a).max_split_size, 64 * MIB);
    a.check_invariants().unwrap();
}

#[test]
fn oom_path_releases_oversize_blocks_first() {
    let a = sim("sim_capacity_mb:80,max_split_size_mb:32");
    let big = a.malloc(0, 60 * MIB, S0).unwrap();
    a.free(0, big, 60 * MIB).unwrap();
    // 30 MiB < max_split_size cannot use the cached 60 MiB block; the device has 20 MiB left.
    let p = a.malloc(0, 30 * MIB, S0).unwrap();
    let s = stats(&a);
    assert_eq!(s.heap.released_bytes[stepalloc::stats::ReleaseReason::Oom as usize], 60 * MIB);
    assert_eq!(s.heap.num_alloc_retries, 0, "the first step is not counted as a retry, as in PyTorch");
    assert_eq!(s.heap.num_device_free, 1);
    assert_eq!(s.heap.reserved_bytes.all.current, 30 * MIB);
    a.free(0, p, 30 * MIB).unwrap();
}

/// PyTorch's first step (`release_available_cached_blocks`) looks for oversize blocks in the
/// request's pool and on its stream only: a small request, or a request on another stream,
/// goes straight to the second step, which releases every unsplit cached segment (the 12 MiB
/// one too) and counts a retry. (PyTorch 2.15 over testdrv/ agrees: `scripts/torch_replay.py`.)
#[test]
fn oom_first_step_looks_only_in_the_requests_pool_and_stream() {
    for (size, stream) in [(512 * 1024, S0), (30 * MIB, S1)] {
        let a = sim("sim_capacity_mb:73,max_split_size_mb:32");
        let big = a.malloc(0, 60 * MIB, S0).unwrap(); // oversize: a segment of its own
        let mid = a.malloc(0, 12 * MIB, S0).unwrap();
        a.free(0, big, 60 * MIB).unwrap();
        a.free(0, mid, 12 * MIB).unwrap();
        // 1 MiB of the device is free: the request needs a new segment.
        let p = a.malloc(0, size, stream).unwrap();
        let s = stats(&a).heap;
        assert_eq!(s.num_alloc_retries, 1, "{size}: the second step ran");
        assert_eq!(s.num_device_free, 2, "{size}: both cached segments went back");
        a.free(0, p, size).unwrap();
    }
}

#[test]
fn oom_path_then_releases_every_unsplit_cached_segment_and_retries() {
    let a = sim("sim_capacity_mb:64");
    let p = a.malloc(0, 40 * MIB, S0).unwrap();
    a.free(0, p, 40 * MIB).unwrap();
    // Another stream cannot reuse the cached block; growing fails; the cache is released.
    let q = a.malloc(0, 40 * MIB, S1).unwrap();
    let s = stats(&a);
    assert_eq!(s.heap.num_alloc_retries, 1);
    assert_eq!(s.heap.num_device_free, 1);
    assert_eq!(s.heap.reserved_bytes.all.current, 40 * MIB);
    assert_eq!(s.heap.num_ooms, 0);
    a.free(0, q, 40 * MIB).unwrap();
}

/// A block freed after `record_stream` waits for its events. With the device otherwise full,
/// the out-of-memory path waits for them, and the freed block then fits the request: it is
/// served from it instead of failing. The rest of its segment is allocated, so no release can
/// make room. Under `exact_fit` (the stress tool's PyTorch presets) the path stays PyTorch's:
/// after the wait it only releases and retries the device, and raises, as PyTorch 2.15 does.
#[test]
fn oom_path_serves_a_request_from_the_block_its_wait_for_events_freed() {
    for (conf, served) in [("", true), (",exact_fit:True", false)] {
        let a = sim(&format!("sim_capacity_mb:100,sim_event_delay_us:1000000{conf}"));
        let whole = a.malloc(0, 60 * MIB, S1).unwrap();
        a.free(0, whole, 60 * MIB).unwrap();
        let x = a.malloc(0, 30 * MIB, S1).unwrap();
        let y = a.malloc(0, 30 * MIB, S1).unwrap();
        assert_eq!(y, x + 30 * MIB, "both halves of the one 60 MiB segment");
        let fill = a.malloc(0, 40 * MIB, S1).unwrap(); // the device is full
        a.record_stream(0, x, S2).unwrap();
        a.free(0, x, 30 * MIB).unwrap(); // pending on its events
        let result = a.malloc(0, 30 * MIB, S1);
        let s = stats(&a).heap;
        assert_eq!(s.num_sync_all_streams, 1, "{conf}: the path waited for the events once");
        if served {
            assert_eq!(result.unwrap(), x, "served from the block the wait freed");
            assert_eq!((s.num_ooms, s.num_alloc_retries, s.num_device_free), (0, 1, 0));
            a.free(0, x, 30 * MIB).unwrap();
        } else {
            assert!(result.unwrap_err().is_out_of_memory(), "PyTorch's sequence raises");
            assert_eq!(s.num_ooms, 1);
        }
        a.free(0, y, 30 * MIB).unwrap();
        a.free(0, fill, 40 * MIB).unwrap();
        a.check_invariants().unwrap();
    }
}

#[test]
fn oom_reports_what_a_person_needs_and_loses_nothing() {
    let a = sim("sim_capacity_mb:100");
    let keep = a.malloc(0, 30 * MIB, S0).unwrap();
    let err = a.malloc(0, 80 * MIB, S0).unwrap_err();
    let Error::OutOfMemory(report) = &err else { panic!("expected OOM, got {err}") };
    assert_eq!(report.requested, 80 * MIB);
    assert_eq!(report.device_total, 100 * MIB);
    assert_eq!(report.reserved, 30 * MIB);
    assert_eq!(report.allocated, 30 * MIB);
    assert_eq!(report.device_free, 70 * MIB);
    let text = err.to_string();
    assert!(
        text.starts_with(
            "CUDA out of memory. Tried to allocate 80.00 MiB. GPU 0 has a total capacity of 100.00 MiB of which \
             70.00 MiB is free. Of the allocated memory 30.00 MiB is allocated by PyTorch, and 0 bytes is reserved \
             by PyTorch but unallocated."
        ),
        "{text}"
    );
    assert!(text.contains("30.00 MiB reserved"), "{text}");
    let s = stats(&a);
    assert_eq!(s.heap.num_ooms, 1);
    assert_eq!(s.heap.num_alloc_retries, 1);
    // Nothing was lost: the live block is intact and the allocator keeps working.
    assert_eq!(block_size(&a, keep), 30 * MIB);
    let more = a.malloc(0, 60 * MIB, S0).unwrap();
    a.free(0, more, 60 * MIB).unwrap();
    a.free(0, keep, 30 * MIB).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn oom_hint_names_fragmentation_when_the_cache_could_have_served() {
    let a = sim("sim_capacity_mb:100");
    // Fill the device with 20 MiB segments, keep every other 5 MiB block: 60 MiB cached but
    // scattered in 15 MiB holes.
    let blocks: Vec<u64> = (0..20).map(|_| a.malloc(0, 5 * MIB, S0).unwrap()).collect();
    for (i, &p) in blocks.iter().enumerate() {
        if i % 4 != 0 {
            a.free(0, p, 5 * MIB).unwrap();
        }
    }
    let err = a.malloc(0, 40 * MIB, S0).unwrap_err();
    let Error::OutOfMemory(report) = err else { panic!("expected OOM") };
    assert_eq!(report.largest_free_block, 15 * MIB);
    assert!(report.hint.contains(stepalloc::config::RECOMMENDED), "{}", report.hint);
    assert!(report.reserved_unallocated() >= 40 * MIB);
    // And the hint is right: the recommended configuration serves the same program.
    let a = sim(&format!("sim_capacity_mb:100,{}", stepalloc::config::RECOMMENDED));
    let blocks: Vec<u64> = (0..20).map(|_| a.malloc(0, 5 * MIB, S0).unwrap()).collect();
    for (i, &p) in blocks.iter().enumerate() {
        if i % 4 != 0 {
            a.free(0, p, 5 * MIB).unwrap();
        }
    }
    a.malloc(0, 40 * MIB, S0).expect("free pages moved into place");
}

#[test]
fn absurd_sizes_are_out_of_memory_without_touching_the_device() {
    let a = sim("");
    for size in [u64::MAX, 1 << 50, 81920 * MIB + 1] {
        assert!(a.malloc(0, size, S0).unwrap_err().is_out_of_memory());
    }
    let s = stats(&a);
    assert_eq!((s.heap.num_ooms, s.heap.num_device_alloc, s.heap.reserved_bytes.all.current), (3, 0, 0));
}

#[test]
fn free_blocks_are_reused_by_their_own_stream_only() {
    let a = sim("sim_cost_model:True");
    let p = a.malloc(0, 4096, S1).unwrap();
    a.free(0, p, 4096).unwrap();
    let q = a.malloc(0, 4096, S2).unwrap();
    assert!(q < p || q >= p + 2 * MIB, "another stream gets a new segment, not the freed block");
    let r = a.malloc(0, 4096, S1).unwrap();
    assert_eq!(r, p, "the same stream reuses its block");
    assert_eq!(stats(&a).driver_time.event_ns, 0, "single-stream frees record no event");
    for (ptr, size) in [(q, 4096), (r, 4096)] {
        a.free(0, ptr, size).unwrap();
    }
}

#[test]
fn record_stream_delays_reuse_until_every_stream_is_done() {
    let a = sim("sim_event_delay_us:100");
    let p = a.malloc(0, 4 * MIB, S1).unwrap();
    a.record_stream(0, p, S2).unwrap();
    a.free(0, p, 4 * MIB).unwrap();
    let s = stats(&a);
    assert_eq!(s.heap.allocation.all.current, 0);
    assert_eq!(s.heap.active.all.current, 1, "the block stays active until its events complete");
    // Before the events complete, even the allocating stream cannot have it back.
    let q = a.malloc(0, 4 * MIB, S1).unwrap();
    assert_ne!(q, p);
    a.advance_time(100_000);
    // Completed: any stream may reuse it now.
    let r = a.malloc(0, 4 * MIB, Stream(0x3333)).unwrap();
    assert_eq!(r, p);
    a.free(0, q, 4 * MIB).unwrap();
    a.free(0, r, 4 * MIB).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn memory_fraction_caps_reserved_bytes() {
    let a = sim("sim_capacity_mb:100");
    a.set_memory_fraction(0, 0.5).unwrap();
    let err = a.malloc(0, 60 * MIB, S0).unwrap_err();
    let Error::OutOfMemory(report) = err else { panic!("expected OOM") };
    assert_eq!(report.allowed, Some(50 * MIB));
    assert!(report.hint.contains("per_process_memory_fraction"));
    // Refused up front, twice: the first attempt and the retry after releasing the cache.
    assert_eq!(stats(&a).heap.num_oom_rejections, 2);
    assert_eq!(stats(&a).heap.num_device_alloc, 0);
    let p = a.malloc(0, 40 * MIB, S0).unwrap();
    a.free(0, p, 40 * MIB).unwrap();
    assert!(a.set_memory_fraction(0, 1.5).is_err());
    assert!(a.set_memory_fraction(3, 0.5).is_err(), "unknown device");
    let b = sim("sim_capacity_mb:100,per_process_memory_fraction:0.25");
    assert!(b.malloc(0, 30 * MIB, S0).unwrap_err().is_out_of_memory());
}

#[test]
fn garbage_collection_releases_old_blocks_above_the_threshold() {
    let a = sim("sim_capacity_mb:200,per_process_memory_fraction:0.5,garbage_collection_threshold:0.5");
    // Four 16 MiB segments (64 MiB > the 50 MiB threshold of the 100 MiB allowed), three cached.
    let old: Vec<u64> = (0..3).map(|_| a.malloc(0, 15 * MIB, S0).unwrap()).collect();
    let _ = a.malloc(0, 15 * MIB, S0).unwrap(); // keeps one segment busy
    for p in old {
        a.free(0, p, 15 * MIB).unwrap();
    }
    // A request no cached block serves: the heap must grow, and collects garbage first.
    let big = a.malloc(0, 30 * MIB, S0).unwrap();
    let s = stats(&a);
    // 14 MiB over the threshold: one old 16 MiB segment goes, the others stay cached.
    assert_eq!(s.heap.released_bytes[stepalloc::stats::ReleaseReason::Limit as usize], 16 * MIB);
    assert_eq!(s.heap.reserved_bytes.all.current, 64 * MIB - 16 * MIB + 30 * MIB);
    a.free(0, big, 30 * MIB).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn cache_limit_releases_whole_free_segments() {
    let a = sim("cache_limit_mb:30");
    let ps: Vec<u64> = (0..3).map(|_| a.malloc(0, 20 * MIB, S0).unwrap()).collect();
    for p in ps {
        a.free(0, p, 20 * MIB).unwrap();
    }
    let s = stats(&a);
    assert!(s.cached_free <= 30 * MIB, "cached {}", s.cached_free);
    assert_eq!(s.heap.released_bytes[stepalloc::stats::ReleaseReason::Limit as usize], 40 * MIB);
}

#[test]
fn size_zero_gets_a_unique_freeable_pointer() {
    let a = sim("");
    let p = a.malloc(0, 0, S0).unwrap();
    let q = a.malloc(0, 0, S0).unwrap();
    assert!(p != 0 && q != 0 && p != q);
    assert_eq!(stats(&a).heap.requested_bytes.all.current, 0);
    a.free(0, p, 0).unwrap();
    a.free(0, q, 0).unwrap();
}

#[test]
fn bad_frees_are_refused_and_change_nothing() {
    let a = sim("sim_devices:2");
    let p = a.malloc(0, 1000, S0).unwrap();
    let before = stats(&a);
    assert!(matches!(a.free(0, p + 512, 1000), Err(Error::UnknownPointer { .. })), "inside a block");
    assert!(matches!(a.free(0, 0xdead_0000, 1000), Err(Error::UnknownPointer { .. })));
    assert!(matches!(a.free(1, p, 1000), Err(Error::UnknownPointer { device: 1, .. })), "wrong device");
    assert!(matches!(a.free(0, p, 999), Err(Error::InvalidArgument(_))), "wrong size");
    assert!(matches!(a.free(7, p, 1000), Err(Error::InvalidArgument(_))), "no such device");
    assert_eq!(stats(&a), before);
    a.free(0, p, 1000).unwrap();
    assert!(matches!(a.free(0, p, 1000), Err(Error::UnknownPointer { .. })), "double free");
    assert!(a.record_stream(0, p, S1).is_err(), "record_stream of a freed pointer");
    a.check_invariants().unwrap();
}

#[test]
fn graph_pools_keep_their_memory_until_released() {
    let a = sim("");
    let pool = (1, 7);
    a.begin_allocate_to_pool(0, pool).unwrap();
    let g = a.malloc_in_pool(0, 3 * MIB, S1, Some(pool)).unwrap();
    a.end_allocate_to_pool(0, pool).unwrap();
    a.free(0, g, 3 * MIB).unwrap();
    // The graph's memory is not reused by ordinary allocations, nor emptied.
    let p = a.malloc(0, 3 * MIB, S1).unwrap();
    assert_ne!(p, g);
    a.empty_cache().unwrap();
    assert_eq!(stats(&a).heap.segment.all.current, 2);
    // Reused within the same pool.
    a.begin_allocate_to_pool(0, pool).unwrap();
    let g2 = a.malloc_in_pool(0, 3 * MIB, S1, Some(pool)).unwrap();
    assert_eq!(g2, g);
    a.end_allocate_to_pool(0, pool).unwrap();
    a.release_pool(0, pool).unwrap();
    assert_eq!(stats(&a).heap.segment.all.current, 2, "still in use: kept until freed");
    a.release_pool(0, pool).unwrap();
    a.free(0, g2, 3 * MIB).unwrap();
    assert_eq!(stats(&a).heap.segment.all.current, 1, "a released pool returns memory as it frees");
    assert!(a.release_pool(0, (9, 9)).is_err());
    a.free(0, p, 3 * MIB).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn concurrent_threads_on_several_devices() {
    let a = std::sync::Arc::new(sim("sim_devices:2,sim_capacity_mb:4096"));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let device = (t % 2) as usize;
                let stream = Stream(t % 3);
                let mut live = Vec::new();
                let mut x = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                for i in 0..20_000u64 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if live.len() < 64 && (x % 3 != 0 || live.is_empty()) {
                        let size = 1 + x % (4 * MIB);
                        live.push((a.malloc(device, size, stream).unwrap(), size));
                    } else {
                        let (p, size) = live.swap_remove((x as usize / 3) % live.len());
                        a.free(device, p, size).unwrap();
                    }
                    if i % 5000 == 0 {
                        a.empty_cache().unwrap();
                    }
                }
                for (p, size) in live {
                    a.free(device, p, size).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    for d in 0..2 {
        assert_eq!(a.stats(d).unwrap().heap.reserved_bytes.all.current, 0);
        assert_eq!(a.stats(d).unwrap().heap.num_mallocs, a.stats(d).unwrap().heap.num_frees);
    }
}

#[test]
fn stats_map_uses_torch_keys() {
    let a = sim("");
    let p = a.malloc(0, 3000, S0).unwrap();
    let map = stats(&a).to_map();
    assert_eq!(map["allocated_bytes.all.current"], 3072);
    assert_eq!(map["requested_bytes.small_pool.current"], 3000);
    assert_eq!(map["segment.small_pool.current"], 1);
    assert_eq!(map["num_device_alloc"], 1);
    a.free(0, p, 3000).unwrap();
    let json: serde_json::Value = serde_json::from_str(&a.stats_json(0).unwrap()).unwrap();
    assert_eq!(json["allocated_bytes.all.freed"], 3072);
}

#[test]
fn no_memory_is_freed_or_waited_for_during_a_graph_capture() {
    let a = sim("sim_capacity_mb:100,max_split_size_mb:32");
    let cached = a.malloc(0, 60 * MIB, S0).unwrap();
    a.free(0, cached, 60 * MIB).unwrap();
    a.begin_allocate_to_pool(0, (1, 1)).unwrap();
    // The device has 40 MiB left: while capturing, the cached 60 MiB is not released for this.
    assert!(a.malloc_in_pool(0, 50 * MIB, S1, Some((1, 1))).unwrap_err().is_out_of_memory());
    let s = stats(&a);
    assert_eq!((s.heap.num_device_free, s.heap.num_alloc_retries, s.heap.num_sync_all_streams), (0, 0, 0));
    a.end_allocate_to_pool(0, (1, 1)).unwrap();
    // After the capture the same request runs the whole OOM path and succeeds.
    let p = a.malloc_in_pool(0, 50 * MIB, S1, Some((1, 1))).unwrap();
    assert_eq!(stats(&a).heap.num_device_free, 1);
    a.free(0, p, 50 * MIB).unwrap();
    a.release_pool(0, (1, 1)).unwrap();
}

/// `exact_fit` takes PyTorch's choice: the smallest fitting free block, the lowest address among
/// equal sizes; the default takes the head of the size class (the most recently freed there).
#[test]
fn exact_fit_takes_the_smallest_block_then_the_lowest_address() {
    for (conf, exact) in [("", false), ("exact_fit:True", true)] {
        let a = sim(conf);
        // Two equal free blocks, the lower one freed first.
        let low = a.malloc(0, 4096, S0).unwrap();
        let sep1 = a.malloc(0, 512, S0).unwrap();
        let high = a.malloc(0, 4096, S0).unwrap();
        let sep2 = a.malloc(0, 512, S0).unwrap();
        // Two free blocks in one size class (41472 and 40960 bytes), the larger freed last.
        let larger = a.malloc(0, 41472, S0).unwrap();
        let sep3 = a.malloc(0, 512, S0).unwrap();
        let smaller = a.malloc(0, 40960, S0).unwrap();
        let _sep4 = a.malloc(0, 512, S0).unwrap();
        a.free(0, low, 4096).unwrap();
        a.free(0, high, 4096).unwrap();
        a.free(0, smaller, 40960).unwrap();
        a.free(0, larger, 41472).unwrap();
        let equal = a.malloc(0, 4096, S0).unwrap();
        let within = a.malloc(0, 40960, S0).unwrap();
        if exact {
            assert_eq!((equal, within), (low, smaller), "{conf}");
        } else {
            assert_eq!((equal, within), (high, larger), "{conf}");
        }
        for (p, n) in [(sep1, 512), (sep2, 512), (sep3, 512)] {
            a.free(0, p, n).unwrap();
        }
        a.check_invariants().unwrap();
    }
}

/// PyTorch's `_set_allocator_settings("expandable_segments:...")` at run time: the general pool's
/// new segments take the new kind, the old ones keep theirs and keep serving, and everything
/// still goes back to the device.
#[test]
fn expandable_segments_switched_at_run_time_apply_to_new_segments() {
    let a = sim("sim_capacity_mb:256");
    let kinds = |a: &Allocator| -> Vec<bool> {
        let snap: serde_json::Value = serde_json::from_str(&a.snapshot_json()).unwrap();
        snap["segments"].as_array().unwrap().iter().map(|s| s["is_expandable"].as_bool().unwrap()).collect()
    };
    let plain = a.malloc(0, 30 * MIB, S0).unwrap();
    assert_eq!(kinds(&a), [false]);
    a.set_expandable_segments(true);
    let grown = a.malloc(0, 30 * MIB, S0).unwrap();
    assert_eq!(kinds(&a).iter().filter(|&&e| e).count(), 1, "{:?}", kinds(&a));
    a.free(0, plain, 30 * MIB).unwrap();
    // The plain segment's free block still serves a request of its size.
    let again = a.malloc(0, 30 * MIB, S0).unwrap();
    assert_eq!(again, plain);
    a.set_expandable_segments(false);
    let third = a.malloc(0, 30 * MIB, S0).unwrap();
    assert_eq!(kinds(&a).iter().filter(|&&e| !e).count(), 2, "{:?}", kinds(&a));
    for (p, n) in [(again, 30 * MIB), (grown, 30 * MIB), (third, 30 * MIB)] {
        a.free(0, p, n).unwrap();
    }
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(stats(&a).heap.reserved_bytes.all.current, 0);
}

/// `caching_allocator_enable(False)`, as PyTorch's allocator then calls cudaMalloc / cudaFree
/// directly: each general request gets a segment of its own, which goes back to the device when
/// freed; cached blocks stay, and caching resumes when enabled again.
#[test]
fn caching_disabled_gives_each_request_its_own_segment_released_at_free() {
    let a = sim("sim_capacity_mb:256");
    let cached = a.malloc(0, 30 * MIB, S0).unwrap();
    a.free(0, cached, 30 * MIB).unwrap();
    assert_eq!(stats(&a).heap.reserved_bytes.all.current, 30 * MIB);
    a.set_caching_enabled(false);
    assert!(!a.caching_enabled());
    let p = a.malloc(0, 1000, S0).unwrap();
    let q = a.malloc(0, 1000, S0).unwrap();
    let big = a.malloc(0, 20 * MIB, S0).unwrap();
    assert_ne!(big, cached, "the cache is not used");
    let s = stats(&a).heap;
    assert_eq!(s.segment.all.current, 4, "one segment per request, none split");
    assert_eq!(block_size(&a, p), 2 * MIB);
    for (ptr, n) in [(p, 1000), (q, 1000), (big, 20 * MIB)] {
        a.free(0, ptr, n).unwrap();
    }
    assert_eq!(stats(&a).heap.reserved_bytes.all.current, 30 * MIB, "freed straight back to the device");
    a.set_caching_enabled(true);
    let again = a.malloc(0, 30 * MIB, S0).unwrap();
    assert_eq!(again, cached, "caching resumes");
    a.free(0, again, 30 * MIB).unwrap();
    a.check_invariants().unwrap();
}
