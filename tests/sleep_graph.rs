//! A CUDA graph's private pool under a tag, on the simulated device (src/heap/graphs.rs): a
//! capture begun inside a region puts the pool under the region's tag; pausing the tag gives
//! the pool's pages back (the live outputs' and the free intermediates' alike), resuming maps
//! every one of them again at the same addresses, so the graph needs no recapture; while
//! awake, nothing (`empty_cache`, a pause of another tag) takes the graph's free pages; a
//! released pool gives its memory back. The device's own count (`device_mem_info`) is the
//! measure throughout.

mod common;

use common::{sim_4gib, used, S0};
use stepalloc::units::MIB;
use stepalloc::{tags, Allocator, Stream};

const CAPTURE: Stream = Stream(7);

/// A capture into `pool`, as PyTorch makes one (begin, allocations on the capture stream, the
/// intermediates freed inside, end), under a region of `tag` when given. Returns the outputs
/// (address, size) and the intermediates' addresses.
fn capture(a: &Allocator, pool: (u64, u64), tag: Option<&str>, backup: bool) -> (Vec<(u64, u64)>, Vec<u64>) {
    if let Some(tag) = tag {
        tags::enter(tag, backup).unwrap();
    }
    a.begin_allocate_to_pool(0, pool).unwrap();
    let mut outputs = Vec::new();
    let mut intermediates = Vec::new();
    for (i, &size) in [48 * MIB, 3 * MIB + 5, 100 * MIB, 700_000, 20 * MIB].iter().enumerate() {
        let p = a.malloc_in_pool(0, size, CAPTURE, Some(pool)).unwrap();
        if i % 2 == 0 {
            intermediates.push((p, size));
        } else {
            outputs.push((p, size));
        }
    }
    let out = a.malloc_in_pool(0, 8 * MIB, CAPTURE, Some(pool)).unwrap();
    outputs.push((out, 8 * MIB));
    for &(p, size) in &intermediates {
        a.free(0, p, size).unwrap();
    }
    a.end_allocate_to_pool(0, pool).unwrap();
    if tag.is_some() {
        tags::exit().unwrap();
    }
    (outputs, intermediates.iter().map(|&(p, _)| p).collect())
}

#[test]
fn a_tagged_graph_pool_pauses_whole_and_resumes_at_the_same_addresses() {
    for conf in ["", ",expandable_segments:True", ",expandable_segments:True,page_reuse:True,big_page_mb:64"] {
        let a = sim_4gib(conf);
        let other = a.malloc(0, 30 * MIB, S0).unwrap();
        let pool = (1, 0);
        let base = used(&a, 0);
        let (outputs, intermediates) = capture(&a, pool, Some("graph_t1"), false);
        a.check_invariants().unwrap();
        let graph_bytes = used(&a, 0) - base;
        assert!(graph_bytes >= 179 * MIB, "{conf}: the graph holds its intermediates too: {graph_bytes}");
        // Awake, nothing takes the graph's free pages: they are its intermediates.
        a.empty_cache().unwrap();
        assert_eq!(used(&a, 0) - base, graph_bytes, "{conf}: empty_cache left the graph's pool alone");
        let figures = a.tag_figures();
        let f = figures.iter().find(|f| f.tag == "graph_t1").unwrap();
        assert!(f.live_bytes >= 11 * MIB && f.live_bytes < graph_bytes, "{conf}: the outputs are the live bytes");

        let r = a.pause(Some("graph_t1"), None).unwrap();
        a.check_invariants().unwrap();
        assert_eq!(r.tags, ["graph_t1"]);
        assert!(r.released_bytes >= graph_bytes, "{conf}: {} of {graph_bytes} released", r.released_bytes);
        assert!(used(&a, 0) <= base, "{conf}: the whole pool is back on the device: {} over", used(&a, 0) - base);
        // The pool refuses allocations while paused (a replay would need its memory).
        assert!(a.malloc_in_pool(0, MIB, CAPTURE, Some(pool)).is_err(), "{conf}");

        let r = a.resume(Some("graph_t1")).unwrap();
        a.check_invariants().unwrap();
        assert!(r.mapped_bytes >= graph_bytes, "{conf}: {} of {graph_bytes} mapped", r.mapped_bytes);
        assert_eq!(used(&a, 0) - base, graph_bytes, "{conf}: every page of the pool is mapped again");
        for &(p, _) in &outputs {
            assert!(a.with_heap(0, |h| h.is_live(p)).unwrap(), "{conf}: output {p:#x} kept its address");
        }
        // A second capture into the pool takes the intermediates' blocks again: the pool's
        // free blocks are where they were, mapped.
        a.begin_allocate_to_pool(0, pool).unwrap();
        let again = a.malloc_in_pool(0, 100 * MIB, CAPTURE, Some(pool)).unwrap();
        assert!(intermediates.contains(&again), "{conf}: {again:#x} is not one of the intermediates");
        a.free(0, again, 100 * MIB).unwrap();
        a.end_allocate_to_pool(0, pool).unwrap();
        assert_eq!(used(&a, 0) - base, graph_bytes, "{conf}: no new memory for the second capture");

        // The graph is destroyed: its pool's free pages go back, then its outputs with their frees.
        a.release_pool(0, pool).unwrap();
        a.release_pool(0, pool).unwrap();
        a.check_invariants().unwrap();
        assert!(used(&a, 0) - base < graph_bytes, "{conf}: the released pool's free pages went back");
        for &(p, size) in &outputs {
            a.free(0, p, size).unwrap();
        }
        a.check_invariants().unwrap();
        assert_eq!(used(&a, 0), base, "{conf}: a released pool keeps nothing once its outputs are freed");
        a.free(0, other, 30 * MIB).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(used(&a, 0), 0, "{conf}");
    }
}

#[test]
fn a_paused_graph_pools_freed_output_comes_back_with_the_pool_and_backup_restores_outputs() {
    let a = sim_4gib(",expandable_segments:True");
    let pool = (2, 0);
    let (outputs, _) = capture(&a, pool, Some("graph_t2"), true);
    let graph_bytes = used(&a, 0);
    let r = a.pause(Some("graph_t2"), None).unwrap();
    let output_bytes: u64 = outputs.iter().map(|&(_, s)| s).sum();
    assert_eq!((r.copied_bytes, r.discarded_bytes), (output_bytes, 0), "the tag backs its outputs up");
    assert_eq!(used(&a, 0), 0);
    // An output freed while paused: its block is the pool's again, and still the graph's.
    let (p, size) = outputs[0];
    a.free(0, p, size).unwrap();
    a.check_invariants().unwrap();
    let r = a.resume(Some("graph_t2")).unwrap();
    assert_eq!(r.copied_bytes, output_bytes - size, "the freed output's backup was dropped");
    assert_eq!(used(&a, 0), graph_bytes, "the freed output's pages are mapped again with the pool");
    a.check_invariants().unwrap();
}

#[test]
fn an_untagged_capture_keeps_plain_segments_and_a_pool_keeps_its_first_tag() {
    let a = sim_4gib(",expandable_segments:True");
    // No region: the pool is untagged; pausing another tag leaves it alone.
    let (outputs, _) = capture(&a, (3, 0), None, false);
    let graph_bytes = used(&a, 0);
    tags::enter("graph_t3_other", false).unwrap();
    let x = a.malloc(0, 10 * MIB, S0).unwrap();
    tags::exit().unwrap();
    assert!(used(&a, 0) > graph_bytes);
    a.pause(Some("graph_t3_other"), None).unwrap();
    assert_eq!(used(&a, 0), graph_bytes, "only the other tag's pages went, the graph's pool stayed");
    for &(p, _) in &outputs {
        assert!(a.with_heap(0, |h| h.is_live(p)).unwrap());
    }
    a.resume(None).unwrap();
    a.free(0, x, 10 * MIB).unwrap();
    // A pool holding segments takes no tag later (its segments are plain).
    tags::enter("graph_t3_late", false).unwrap();
    assert_eq!(a.with_heap(0, |h| h.tag_pool((3, 0), 5)).unwrap(), 0);
    tags::exit().unwrap();
    a.check_invariants().unwrap();
}
