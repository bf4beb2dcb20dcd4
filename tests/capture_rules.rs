//! CUDA-graph capture rules and the heap's duties around them, on the simulated device
//! through a watching backend. During a global-mode capture any event record, query or wait,
//! device free or synchronization invalidates the capture (a device reserve is allowed: PyTorch
//! makes it in relaxed mode). The `Watched` backend delegates to `SimDevice` and records a
//! violation for each such call made while the test has marked a capture in progress, so each
//! test here states one rule and fails if the heap breaks it.

mod common;

use common::watched::{watched, Watch};
use common::{reserved, S0, S1, S2};
use parking_lot::Mutex;
use std::sync::Arc;
use stepalloc::units::MIB;
use stepalloc::Allocator;

const POOL: (u64, u64) = (1, 1);
const OTHER_POOL: (u64, u64) = (2, 1);

/// Begins a capture into `pool` as PyTorch does: the allocator hook, then the stream's capture.
fn begin_capture(a: &Allocator, watch: &Mutex<Watch>, pool: (u64, u64)) {
    a.begin_allocate_to_pool(0, pool).unwrap();
    watch.lock().capturing = true;
}

/// Ends a capture as PyTorch does: the stream's capture ends, then the allocator hook.
fn end_capture(a: &Allocator, watch: &Mutex<Watch>, pool: (u64, u64)) {
    watch.lock().capturing = false;
    a.end_allocate_to_pool(0, pool).unwrap();
}

fn no_violations(watch: &Mutex<Watch>) {
    let w = watch.lock();
    assert!(w.violations.is_empty(), "calls during a capture: {:?}\nall calls: {:?}", w.violations, w.log);
}

#[test]
fn no_event_is_queried_while_a_capture_is_underway() {
    let (a, watch) = watched("sim_event_delay_us:1000");
    // A record_stream'd block freed before the capture leaves events pending.
    let p = a.malloc(0, 4096, S0).unwrap();
    a.record_stream(0, p, S1).unwrap();
    a.free(0, p, 4096).unwrap();
    begin_capture(&a, &watch, POOL);
    let q = a.malloc_in_pool(0, 4096, S2, Some(POOL)).unwrap();
    let r = a.malloc(0, 4096, S0).unwrap();
    end_capture(&a, &watch, POOL);
    no_violations(&watch);
    // After the capture the pending free completes as usual.
    a.advance_time(2_000_000);
    let s = a.malloc(0, 4096, S1).unwrap();
    assert!(watch.lock().log.iter().any(|c| c == "event_done"), "events are processed after the capture");
    for (ptr, size) in [(q, 4096), (r, 4096), (s, 4096)] {
        a.free(0, ptr, size).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn events_of_frees_during_a_capture_are_recorded_after_it() {
    let (a, watch) = watched("sim_event_delay_us:1000");
    begin_capture(&a, &watch, POOL);
    let p = a.malloc_in_pool(0, 4096, S1, Some(POOL)).unwrap();
    a.record_stream(0, p, S2).unwrap();
    a.free(0, p, 4096).unwrap();
    // Not reusable during the capture: it waits for its events, which are not recorded yet.
    let q = a.malloc_in_pool(0, 4096, S1, Some(POOL)).unwrap();
    assert_ne!(q, p, "a block freed with other streams' work pending was reused");
    a.free(0, q, 4096).unwrap();
    a.check_invariants().unwrap();
    end_capture(&a, &watch, POOL);
    no_violations(&watch);
    let recorded: Vec<String> = watch.lock().log.iter().filter(|c| c.starts_with("record_event")).cloned().collect();
    assert_eq!(recorded, ["record_event 0x2222", "record_event 0x1111"], "events recorded when the capture ended");
    a.check_invariants().unwrap();
    a.release_pool(0, POOL).unwrap();
    a.advance_time(2_000_000);
    a.empty_cache().unwrap();
    assert_eq!(reserved(&a), 0, "the deferred free completed and the pool's memory went back");
    a.check_invariants().unwrap();
}

#[test]
fn a_free_during_a_capture_never_frees_device_memory_for_the_cache_limit() {
    let (a, watch) = watched("cache_limit_mb:10");
    let keep = a.malloc(0, 4096, S0).unwrap();
    begin_capture(&a, &watch, POOL);
    let p = a.malloc(0, 30 * MIB, S0).unwrap();
    a.free(0, p, 30 * MIB).unwrap();
    assert_eq!(reserved(&a), 2 * MIB + 30 * MIB, "released during the capture");
    end_capture(&a, &watch, POOL);
    no_violations(&watch);
    assert_eq!(reserved(&a), 2 * MIB, "the cache limit applies once the capture ended");
    a.free(0, keep, 4096).unwrap();
    a.release_pool(0, POOL).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn released_graph_pools_give_memory_back_only_outside_captures() {
    let (a, watch) = watched("");
    begin_capture(&a, &watch, POOL);
    let g = a.malloc_in_pool(0, 3 * MIB, S1, Some(POOL)).unwrap();
    end_capture(&a, &watch, POOL);
    a.release_pool(0, POOL).unwrap();
    // The released pool's block is freed while another graph is captured.
    begin_capture(&a, &watch, OTHER_POOL);
    a.free(0, g, 3 * MIB).unwrap();
    end_capture(&a, &watch, OTHER_POOL);
    no_violations(&watch);
    assert_eq!(reserved(&a), 0, "the released pool's segment goes back after the capture");
    // A pool released while another graph is captured: its free segments go back afterwards.
    begin_capture(&a, &watch, POOL);
    let g = a.malloc_in_pool(0, 3 * MIB, S1, Some(POOL)).unwrap();
    a.free(0, g, 3 * MIB).unwrap();
    end_capture(&a, &watch, POOL);
    begin_capture(&a, &watch, OTHER_POOL);
    a.release_pool(0, POOL).unwrap();
    end_capture(&a, &watch, OTHER_POOL);
    no_violations(&watch);
    assert_eq!(reserved(&a), 0);
    a.release_pool(0, OTHER_POOL).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn garbage_collection_waits_for_the_capture_to_end() {
    let (a, watch) = watched("sim_capacity_mb:200,per_process_memory_fraction:0.5,garbage_collection_threshold:0.5");
    // As in heap_policy's GC test: 64 MiB reserved above the 50 MiB threshold, 48 MiB cached.
    let old: Vec<u64> = (0..3).map(|_| a.malloc(0, 15 * MIB, S0).unwrap()).collect();
    let busy = a.malloc(0, 15 * MIB, S0).unwrap();
    for p in old {
        a.free(0, p, 15 * MIB).unwrap();
    }
    begin_capture(&a, &watch, POOL);
    let big = a.malloc_in_pool(0, 30 * MIB, S1, Some(POOL)).unwrap();
    end_capture(&a, &watch, POOL);
    no_violations(&watch);
    a.free(0, big, 30 * MIB).unwrap();
    a.free(0, busy, 15 * MIB).unwrap();
    a.release_pool(0, POOL).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn empty_cache_during_a_capture_is_done_after_it() {
    let (a, watch) = watched("");
    let p = a.malloc(0, 30 * MIB, S0).unwrap();
    a.free(0, p, 30 * MIB).unwrap();
    begin_capture(&a, &watch, POOL);
    a.empty_cache().unwrap();
    end_capture(&a, &watch, POOL);
    no_violations(&watch);
    assert_eq!(reserved(&a), 0, "the empty_cache asked for during the capture ran after it");
    a.release_pool(0, POOL).unwrap();
}

/// A failed capture: PyTorch's `cudaStreamEndCapture` fails, so `end_allocate_to_pool` never
/// comes. The out-of-memory path (which needs device frees) must work again afterwards.
fn cache_60mib_then_fail_a_capture() -> (Allocator, Arc<Mutex<Watch>>) {
    let (a, watch) = watched("sim_capacity_mb:100,max_split_size_mb:32");
    let cached = a.malloc(0, 60 * MIB, S0).unwrap();
    a.free(0, cached, 60 * MIB).unwrap();
    begin_capture(&a, &watch, POOL);
    let _ = a.malloc_in_pool(0, 4096, S1, Some(POOL)).unwrap();
    watch.lock().capturing = false; // the capture failed; no end hook
    (a, watch)
}

#[test]
fn releasing_the_pool_of_a_failed_capture_ends_it() {
    let (a, _watch) = cache_60mib_then_fail_a_capture();
    a.release_pool(0, POOL).unwrap();
    // 40 MiB left on the device: the OOM path must release the cached 60 MiB for 70 MiB.
    let p = a.malloc(0, 70 * MIB, S0).expect("the OOM path is on again");
    a.free(0, p, 70 * MIB).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn a_new_capture_into_the_pool_of_a_failed_one_ends_it() {
    let (a, watch) = cache_60mib_then_fail_a_capture();
    begin_capture(&a, &watch, POOL);
    end_capture(&a, &watch, POOL);
    let p = a.malloc(0, 70 * MIB, S0).expect("the OOM path is on again");
    a.free(0, p, 70 * MIB).unwrap();
    a.release_pool(0, POOL).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn an_abandoned_capture_counts_as_ended() {
    let (a, _watch) = cache_60mib_then_fail_a_capture();
    assert!(a.abandon_capture(0, POOL).unwrap());
    assert!(!a.abandon_capture(0, POOL).unwrap(), "only once");
    // A late end of the abandoned capture must not end some other capture.
    a.end_allocate_to_pool(0, POOL).unwrap();
    assert_eq!(a.with_heap(0, |h| h.captures_underway()).unwrap(), 0);
    let p = a.malloc(0, 70 * MIB, S0).expect("the OOM path is on again");
    a.free(0, p, 70 * MIB).unwrap();
    a.release_pool(0, POOL).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn a_late_end_of_an_abandoned_capture_leaves_other_captures_underway() {
    let (a, watch) = cache_60mib_then_fail_a_capture();
    a.release_pool(0, POOL).unwrap();
    begin_capture(&a, &watch, OTHER_POOL);
    a.end_allocate_to_pool(0, POOL).unwrap();
    assert_eq!(a.with_heap(0, |h| h.captures_underway()).unwrap(), 1);
    assert!(a.malloc_in_pool(0, 50 * MIB, S1, Some(OTHER_POOL)).unwrap_err().is_out_of_memory());
    end_capture(&a, &watch, OTHER_POOL);
    no_violations(&watch);
    a.release_pool(0, OTHER_POOL).unwrap();
}

#[test]
fn releasing_a_shared_pool_during_a_capture_into_it_keeps_that_capture() {
    let (a, watch) = watched("");
    // Graph 1 was captured into POOL; graph 2 shares the pool and is being captured when graph
    // 1 is destroyed. Graph 2's capture still holds a reference: it is not abandoned.
    begin_capture(&a, &watch, POOL);
    let g1 = a.malloc_in_pool(0, 3 * MIB, S1, Some(POOL)).unwrap();
    end_capture(&a, &watch, POOL);
    begin_capture(&a, &watch, POOL);
    a.release_pool(0, POOL).unwrap();
    assert_eq!(a.with_heap(0, |h| h.captures_underway()).unwrap(), 1);
    a.free(0, g1, 3 * MIB).unwrap();
    end_capture(&a, &watch, POOL);
    no_violations(&watch);
    a.release_pool(0, POOL).unwrap();
    assert_eq!(reserved(&a), 0, "the pool's memory goes back once its last reference is released");
    a.check_invariants().unwrap();
}

#[test]
fn mempool_mode_gives_freed_segments_back() {
    let (a, _watch) = watched("");
    a.set_mempool_mode(true);
    // PyTorch's MemPool asks for whole segments: 2 MiB, 20 MiB, or larger multiples of 2 MiB.
    let small = a.malloc(0, 2 * MIB, S0).unwrap();
    let large = a.malloc(0, 20 * MIB, S0).unwrap();
    let huge = a.malloc(0, 64 * MIB, S0).unwrap();
    a.free(0, large, 20 * MIB).unwrap();
    a.free(0, huge, 64 * MIB).unwrap();
    assert_eq!(reserved(&a), 20 * MIB, "only the segment still in use stays");
    a.free(0, small, 2 * MIB).unwrap();
    assert_eq!(reserved(&a), 0, "PyTorch's empty_cache frees segments: they reach the device");
    a.check_invariants().unwrap();
    // Off again: frees are cached.
    a.set_mempool_mode(false);
    let p = a.malloc(0, 20 * MIB, S0).unwrap();
    a.free(0, p, 20 * MIB).unwrap();
    assert_eq!(reserved(&a), 20 * MIB);
}

#[test]
fn a_memory_fraction_of_zero_is_accepted_and_reserves_nothing() {
    let (a, _watch) = watched("");
    let p = a.malloc(0, 4096, S0).unwrap();
    a.free(0, p, 4096).unwrap();
    a.set_memory_fraction(0, 0.0).expect("PyTorch accepts 0");
    a.empty_cache().unwrap();
    assert!(a.malloc(0, 4096, S0).unwrap_err().is_out_of_memory());
    assert_eq!(reserved(&a), 0);
    assert!(a.set_memory_fraction(0, -0.1).is_err());
    assert!(a.set_memory_fraction(0, f64::NAN).is_err());
}

#[test]
fn a_segment_goes_back_only_after_its_stream_work_completed() {
    // `Backend::release` needs every use of the segment finished: the heap waits for the
    // stream its free block belongs to (cuMemFree's implicit sync is not to be relied on).
    let (a, watch) = watched("");
    let p = a.malloc(0, 30 * MIB, S1).unwrap();
    a.free(0, p, 30 * MIB).unwrap();
    a.empty_cache().unwrap();
    let log = watch.lock().log.clone();
    let release = log.iter().position(|c| c.starts_with("release")).expect("released");
    assert!(
        log[..release].iter().any(|c| c == "synchronize_stream 0x1111" || c == "synchronize"),
        "released without waiting for stream 0x1111: {log:?}"
    );
}

#[test]
fn page_release_waits_for_the_capture_to_end() {
    // A grace of 0: the free asks for the release at once, which the capture holds back.
    let (a, watch) = watched(
        "expandable_segments:True,large_segment_size_mb:2,page_release:True,cache_limit_mb:4,page_release_grace:0",
    );
    let p = a.malloc(0, 20 * MIB, S0).unwrap();
    let q = a.malloc(0, 2 * MIB, S0).unwrap();
    begin_capture(&a, &watch, POOL);
    a.free(0, p, 20 * MIB).unwrap();
    assert_eq!(reserved(&a), 22 * MIB, "no page unmapped during the capture");
    end_capture(&a, &watch, POOL);
    no_violations(&watch);
    let s = a.stats(0).unwrap();
    assert!(s.cached_free <= 4 * MIB, "the cache limit unmaps free pages once the capture ended: {}", s.cached_free);
    assert!(watch.lock().log.iter().any(|c| c == "unmap"));
    a.free(0, q, 2 * MIB).unwrap();
    a.release_pool(0, POOL).unwrap();
    a.check_invariants().unwrap();
}
