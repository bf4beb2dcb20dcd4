//! User memory pools (`torch.cuda.MemPool` under process-wide stepalloc, `heap/pools.rs`) on the
//! simulated device: use counts as PyTorch keeps them, a pool's segments from another
//! allocator (and back to it, with the size and stream it was asked for), `use_on_oom`, and
//! snapshots naming a segment's pool by its id.

mod common;

use common::{sim, S0, S1};
use parking_lot::Mutex;
use std::sync::Arc;
use stepalloc::stats::ReleaseReason;
use stepalloc::units::MIB;
use stepalloc::{Allocator, SegmentSource, Stream};

const POOL: (u64, u64) = (0, 7);

fn create(a: &Allocator, id: (u64, u64)) {
    a.with_heap(0, |h| h.create_pool(id)).unwrap();
}

fn use_count(a: &Allocator, id: (u64, u64)) -> u32 {
    a.with_heap(0, |h| h.pool_use_count(id)).unwrap()
}

/// Another library's allocator: addresses from its own range (the heap keeps no metadata in
/// device memory), every call recorded, `room` bytes in all.
#[derive(Default)]
struct Calls {
    allocs: Vec<(usize, u64, Stream)>,
    frees: Vec<(usize, u64, u64, Stream)>,
    outstanding: u64,
}

struct Foreign {
    calls: Arc<Mutex<Calls>>,
    next: u64,
    room: u64,
}

impl SegmentSource for Foreign {
    fn alloc(&mut self, device: usize, bytes: u64, stream: Stream) -> Option<u64> {
        let mut c = self.calls.lock();
        c.allocs.push((device, bytes, stream));
        if c.outstanding + bytes > self.room {
            return None;
        }
        c.outstanding += bytes;
        let addr = self.next;
        self.next += bytes.next_multiple_of(1 << 30);
        Some(addr)
    }

    fn free(&mut self, device: usize, addr: u64, bytes: u64, stream: Stream) {
        let mut c = self.calls.lock();
        c.outstanding -= bytes;
        c.frees.push((device, addr, bytes, stream));
    }
}

fn foreign(a: &Allocator, id: (u64, u64), room: u64) -> Arc<Mutex<Calls>> {
    let calls = Arc::new(Mutex::new(Calls::default()));
    let source = Foreign { calls: calls.clone(), next: 0x7000_0000_0000, room };
    a.with_heap(0, |h| h.set_pool_segment_source(id, Some(Box::new(source)))).unwrap().unwrap();
    calls
}

#[test]
fn use_counts_follow_pytorchs_create_begin_end_release() {
    let a = sim("");
    assert_eq!(use_count(&a, POOL), 0);
    create(&a, POOL); // MemPool()
    assert_eq!(use_count(&a, POOL), 1);
    a.begin_allocate_to_pool(0, POOL).unwrap(); // use_mem_pool enters
    assert_eq!(use_count(&a, POOL), 2);
    let p = a.malloc_in_pool(0, 3 * MIB, S0, Some(POOL)).unwrap();
    a.end_allocate_to_pool(0, POOL).unwrap();
    a.release_pool(0, POOL).unwrap(); // use_mem_pool leaves
    assert_eq!(use_count(&a, POOL), 1);
    a.free(0, p, 3 * MIB).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats(0).unwrap().heap.reserved_bytes.all.current, 20 * MIB, "a referenced pool keeps its segment");
    a.release_pool(0, POOL).unwrap(); // the MemPool goes
    assert_eq!(use_count(&a, POOL), 0);
    assert_eq!(a.stats(0).unwrap().heap.reserved_bytes.all.current, 0);
    a.check_invariants().unwrap();
}

#[test]
fn a_pools_segments_come_from_its_source_and_go_back_to_it() {
    let a = sim("");
    create(&a, POOL);
    let calls = foreign(&a, POOL, u64::MAX);
    let general = a.malloc(0, 3 * MIB, S0).unwrap();
    let small = a.malloc_in_pool(0, 1000, S1, Some(POOL)).unwrap();
    let large = a.malloc_in_pool(0, 3 * MIB, S1, Some(POOL)).unwrap();
    assert!(small >= 0x7000_0000_0000 && large >= 0x7000_0000_0000, "{small:#x} {large:#x}");
    assert!(general < 0x7000_0000_0000);
    assert_eq!(calls.lock().allocs, vec![(0, 2 * MIB, S1), (0, 20 * MIB, S1)]);
    // Cached by stepalloc: a second block of the pool needs no new segment.
    let again = a.malloc_in_pool(0, MIB, S1, Some(POOL)).unwrap();
    assert_eq!(calls.lock().allocs.len(), 2);
    for (ptr, size) in [(small, 1000), (large, 3 * MIB), (again, MIB)] {
        a.free(0, ptr, size).unwrap();
    }
    a.empty_cache().unwrap();
    // The pool is referenced but no graph captured into it: its free segments go back (issue
    // 33, release while a pool is active), through its source.
    let frees = calls.lock().frees.clone();
    a.release_pool(0, POOL).unwrap();
    assert_eq!(calls.lock().frees.len(), 2, "nothing left for the release");
    assert_eq!(frees.len(), 2);
    for (device, _, bytes, stream) in &frees {
        assert_eq!((*device, *stream), (0, S1));
        assert!(*bytes == 2 * MIB || *bytes == 20 * MIB);
    }
    assert_eq!(calls.lock().outstanding, 0);
    a.free(0, general, 3 * MIB).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn a_source_out_of_memory_is_an_out_of_memory_error_and_loses_nothing() {
    let a = sim("");
    create(&a, POOL);
    let calls = foreign(&a, POOL, 20 * MIB);
    let first = a.malloc_in_pool(0, 15 * MIB, S0, Some(POOL)).unwrap();
    let err = a.malloc_in_pool(0, 15 * MIB, S0, Some(POOL)).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(calls.lock().outstanding, 16 * MIB, "one 16 MiB segment (15 MiB rounded to 2 MiB)");
    a.free(0, first, 15 * MIB).unwrap();
    let second = a.malloc_in_pool(0, 15 * MIB, S0, Some(POOL)).unwrap();
    assert_eq!(second, first);
    a.check_invariants().unwrap();
}

#[test]
fn a_source_is_refused_for_a_missing_pool_or_one_that_holds_segments() {
    let a = sim("");
    let err = a.with_heap(0, |h| h.set_pool_segment_source(POOL, None)).unwrap().unwrap_err();
    assert!(err.to_string().contains("no memory pool (0, 7)"), "{err}");
    create(&a, POOL);
    let p = a.malloc_in_pool(0, MIB, S0, Some(POOL)).unwrap();
    let err = a.with_heap(0, |h| h.set_pool_segment_source(POOL, None)).unwrap().unwrap_err();
    assert!(err.to_string().contains("already holds segments"), "{err}");
    a.free(0, p, MIB).unwrap();
}

#[test]
fn use_on_oom_lends_a_free_block_of_the_pool_to_a_general_allocation() {
    for on in [false, true] {
        let a = sim("sim_capacity_mb:128");
        create(&a, POOL);
        a.with_heap(0, |h| h.set_pool_use_on_oom(POOL, on)).unwrap().unwrap();
        let block = a.malloc_in_pool(0, 60 * MIB, S0, Some(POOL)).unwrap();
        a.free(0, block, 60 * MIB).unwrap();
        let fill = a.malloc(0, 60 * MIB, S0).unwrap();
        let result = a.malloc(0, 50 * MIB, S0);
        let heap = a.stats(0).unwrap().heap;
        let released = heap.released_bytes[ReleaseReason::Oom as usize];
        if on {
            assert_eq!(result.unwrap(), block, "served from the pool's free block, which stays the pool's");
            assert_eq!((heap.num_ooms, released), (0, 0));
        } else {
            // Not a lender: the out-of-memory path gives its free segment back, as empty_cache
            // would, and the request gets a segment of its own.
            let p = result.unwrap();
            assert_eq!((heap.num_ooms, released), (0, 60 * MIB));
            a.free(0, p, 50 * MIB).unwrap();
        }
        a.free(0, fill, 60 * MIB).unwrap();
        a.check_invariants().unwrap();
    }
}

/// Out of memory inside an active pool (`use_mem_pool`, no capture): the out-of-memory path
/// releases what `empty_cache` releases, the pool's own free segments included, and the
/// request is served (768 MiB freed in the pool, then 896 MiB on a 1 GiB device). Under
/// `exact_fit` (the stress tool's PyTorch presets) it stays PyTorch's: a pool in use keeps its
/// free memory and the request fails, "768.00 MiB ... reserved ... but unallocated".
#[test]
fn oom_path_releases_an_active_pools_free_segments_as_empty_cache_does() {
    for (conf, served) in [("", true), (",exact_fit:True", false)] {
        let a = sim(&format!("sim_capacity_mb:1024{conf}"));
        create(&a, POOL);
        a.begin_route_to_pool(0, POOL).unwrap();
        let first = a.malloc_in_pool(0, 768 * MIB, S0, Some(POOL)).unwrap();
        a.free(0, first, 768 * MIB).unwrap();
        let result = a.malloc_in_pool(0, 896 * MIB, S0, Some(POOL));
        let heap = a.stats(0).unwrap().heap;
        if served {
            let p = result.unwrap();
            assert_eq!(heap.released_bytes[ReleaseReason::Oom as usize], 768 * MIB);
            assert_eq!((heap.num_ooms, heap.reserved_bytes.all.current), (0, 896 * MIB));
            a.free(0, p, 896 * MIB).unwrap();
        } else {
            let err = result.unwrap_err();
            assert!(err.to_string().contains("768.00 MiB is reserved by PyTorch but unallocated"), "{err}");
        }
        a.end_route_to_pool(0, POOL).unwrap();
        a.release_pool(0, POOL).unwrap();
        a.release_pool(0, POOL).unwrap();
        assert_eq!(a.stats(0).unwrap().heap.reserved_bytes.all.current, 0);
        a.check_invariants().unwrap();
    }
}

/// A `use_on_oom` pool lends its free blocks first; when none fits, the out-of-memory path
/// gives its free segments back too (what `empty_cache` would) and retries the device.
#[test]
fn a_lenders_free_segments_go_back_when_none_of_its_blocks_fits() {
    let a = sim("sim_capacity_mb:128");
    create(&a, POOL);
    a.with_heap(0, |h| h.set_pool_use_on_oom(POOL, true)).unwrap().unwrap();
    let block = a.malloc_in_pool(0, 40 * MIB, S0, Some(POOL)).unwrap();
    a.free(0, block, 40 * MIB).unwrap();
    let fill = a.malloc(0, 60 * MIB, S0).unwrap();
    let p = a.malloc(0, 60 * MIB, S0).expect("the lender's 40 MiB segment released, 68 MiB free");
    let heap = a.stats(0).unwrap().heap;
    assert_eq!((heap.num_ooms, heap.released_bytes[ReleaseReason::Oom as usize]), (0, 40 * MIB));
    assert_eq!(use_count(&a, POOL), 1, "the pool itself stays");
    a.free(0, p, 60 * MIB).unwrap();
    a.free(0, fill, 60 * MIB).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn snapshots_name_a_segments_pool_by_its_id() {
    let a = sim("");
    create(&a, POOL);
    let p = a.malloc_in_pool(0, MIB, S0, Some(POOL)).unwrap();
    let q = a.malloc(0, MIB, S0).unwrap();
    let segments = a.snapshot()["segments"].as_array().unwrap().clone();
    let pool_of = |ptr: u64| {
        segments
            .iter()
            .find(|s| {
                let base = s["address"].as_u64().unwrap();
                base <= ptr && ptr < base + s["total_size"].as_u64().unwrap()
            })
            .map(|s| (s["segment_pool_id"][0].as_u64().unwrap(), s["segment_pool_id"][1].as_u64().unwrap()))
    };
    assert_eq!(pool_of(p), Some(POOL));
    assert_eq!(pool_of(q), Some((0, 0)));
}

/// Issue 33, release while a pool is active: PyTorch's `empty_cache` frees nothing while a pool
/// is in use (vLLM PR #49151). Here a `use_mem_pool` route is no capture: `empty_cache` and a
/// step release give back the free segments of every pool, the active one included, and leave
/// its live blocks alone; a pool a graph captured into keeps its segments until released.
#[test]
fn empty_cache_and_step_release_return_free_memory_of_an_active_pool() {
    let a = sim("release_idle_steps:1");
    create(&a, POOL);
    a.begin_route_to_pool(0, POOL).unwrap(); // use_mem_pool enters, and stays
    let live = a.malloc_in_pool(0, 3 * MIB, S0, Some(POOL)).unwrap();
    let big = a.malloc_in_pool(0, 30 * MIB, S0, Some(POOL)).unwrap();
    let general = a.malloc(0, 30 * MIB, S0).unwrap();
    a.free(0, big, 30 * MIB).unwrap();
    a.free(0, general, 30 * MIB).unwrap();
    assert_eq!(a.stats(0).unwrap().heap.reserved_bytes.all.current, 20 * MIB + 30 * MIB + 30 * MIB);
    let released = a.empty_cache().unwrap();
    assert_eq!(released, 60 * MIB, "the pool's free segment and the general one");
    assert_eq!(a.stats(0).unwrap().heap.reserved_bytes.all.current, 20 * MIB, "the live block's segment stays");
    // Step release while the route lasts.
    let again = a.malloc_in_pool(0, 30 * MIB, S0, Some(POOL)).unwrap();
    a.step_begin("train").unwrap();
    a.free(0, again, 30 * MIB).unwrap();
    a.step_end().unwrap();
    a.step_begin("train").unwrap();
    a.step_end().unwrap();
    assert_eq!(a.stats(0).unwrap().heap.reserved_bytes.all.current, 20 * MIB, "step release reached the pool");
    a.end_route_to_pool(0, POOL).unwrap();
    a.release_pool(0, POOL).unwrap();
    a.free(0, live, 3 * MIB).unwrap();
    a.check_invariants().unwrap();

    // A graph's pool: its free blocks may be replayed into, so they stay while it is referenced.
    let graph = (0, 8);
    a.begin_allocate_to_pool(0, graph).unwrap();
    let scratch = a.malloc_in_pool(0, 30 * MIB, S1, Some(graph)).unwrap();
    a.free(0, scratch, 30 * MIB).unwrap();
    a.end_allocate_to_pool(0, graph).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.with_heap(0, |h| h.pool_use_count(graph)).unwrap(), 1);
    assert!(a.stats(0).unwrap().heap.reserved_bytes.all.current >= 30 * MIB, "the graph's segment stays");
    a.release_pool(0, graph).unwrap();
    a.check_invariants().unwrap();
}

/// Issue 33 / 31 item 4: an allocation inside a region routed to a `use_mem_pool` pool is
/// refused, naming the region and the pool (before: it went to the pool untagged, and a pause
/// of the tag reported it paused while its bytes stayed on the device). A capture's pool inside
/// a region stays untagged (torch_memory_saver's `cuda_graph`).
#[test]
fn a_region_inside_use_mem_pool_is_refused_and_a_capture_inside_one_is_untagged() {
    let a = sim("");
    create(&a, POOL);
    a.begin_route_to_pool(0, POOL).unwrap();
    stepalloc::tags::enter("pools_region", false).unwrap();
    let err = a.malloc_in_pool(0, MIB, S0, Some(POOL)).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("pools_region") && text.contains("(0, 7)") && text.contains("use_mem_pool"), "{text}");
    assert!(!err.is_out_of_memory());
    // Nothing of the tag is anywhere, so a pause releases nothing and says so.
    let tagged = a.malloc(0, 2 * MIB, S0).unwrap();
    stepalloc::tags::exit().unwrap();
    a.end_route_to_pool(0, POOL).unwrap();
    a.release_pool(0, POOL).unwrap();
    let report = a.pause(Some("pools_region"), Some(false)).unwrap();
    assert!(report.released_bytes >= 2 * MIB, "{report:?}");
    a.resume(Some("pools_region")).unwrap();
    a.free(0, tagged, 2 * MIB).unwrap();

    let graph = (0, 9);
    stepalloc::tags::enter("pools_region", false).unwrap();
    a.begin_allocate_to_pool(0, graph).unwrap();
    let in_graph = a.malloc_in_pool(0, MIB, S1, Some(graph)).unwrap();
    a.end_allocate_to_pool(0, graph).unwrap();
    stepalloc::tags::exit().unwrap();
    a.free(0, in_graph, MIB).unwrap();
    a.release_pool(0, graph).unwrap();
    a.check_invariants().unwrap();
}
