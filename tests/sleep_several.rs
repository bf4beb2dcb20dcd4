//! A pause and a resume of several tags in one call (`Allocator::pause_tags` / `resume_tags`,
//! `pause(None)` / `resume(None)`; one `Heap::pause_tags` / `resume_tags` per device): the
//! driver calls that wait for no copy run under the copies, so on the simulated device's clock
//! (its copy engine at `sim_copy_mb_s`) one call of two tags takes about the copies' time where
//! two calls take the copies plus the other tag's calls; a resume finds room in other tags'
//! idle cached pages and releases them as it maps; and a resume that fails halfway, after some
//! batches were mapped and their copies queued, leaves every tag paused with its backup.

mod common;

use common::{used, S0};
use stepalloc::units::MIB;
use stepalloc::{tags, Allocator, Config, Error};

fn sim(conf: &str) -> Allocator {
    let text = format!("backend:sim,expandable_segments:True,large_segment_size_mb:2{conf}");
    Allocator::new(Config::parse(&text).expect("valid config")).expect("sim backend")
}

/// Allocates `sizes` in a region of `tag` (retrying a map that failed by injection).
fn in_region(a: &Allocator, tag: &str, backup: bool, sizes: &[u64]) -> Vec<(u64, u64)> {
    tags::enter(tag, backup).unwrap();
    let malloc = |s: u64| (0..100).find_map(|_| a.malloc(0, s, S0).ok()).expect("an allocation in 100 tries");
    let blocks = sizes.iter().map(|&s| (malloc(s), s)).collect();
    tags::exit().unwrap();
    blocks
}

/// The simulated host clock: every driver call's modelled time and every wait (ns).
fn clock_ns(a: &Allocator) -> u64 {
    let d = a.stats(0).unwrap().driver_time;
    d.reserve_ns + d.release_ns + d.event_ns + d.sync_ns + d.create_ns + d.map_ns
}

fn paused(a: &Allocator, tag: &str) -> bool {
    a.tag_figures().into_iter().find(|f| f.tag == tag).is_some_and(|f| f.paused)
}

fn backup_bytes(a: &Allocator, tag: &str) -> u64 {
    a.tag_figures().into_iter().find(|f| f.tag == tag).map_or(0, |f| f.backup_bytes)
}

/// 1 GiB backed up (8 blocks, 4 copy batches) and 1 GiB discarded (512 pages of 2 MiB, 20 µs each to
/// unmap and release, 30 µs to create and map), 1 GB/s copies: about 1.07 s of copies each
/// way. Paused and resumed one tag per call, the discarded tag's calls (about 10 ms and
/// 15 ms) come on top of the copies; in one call they run under them.
#[test]
fn one_call_of_two_tags_hides_the_other_tags_driver_calls_under_the_copies() {
    let mut times = Vec::new();
    for together in [false, true] {
        let (w, kv) = if together { ("several_w1", "several_kv1") } else { ("several_w0", "several_kv0") };
        let a = sim(",sim_capacity_mb:8192,sim_cost_model:True,sim_copy_mb_s:1000");
        let weights = in_region(&a, w, true, &[128 * MIB; 8]);
        let cache = in_region(&a, kv, false, &[1024 * MIB]);
        let copies_s = 1024.0 * MIB as f64 / 1e9;
        let t0 = clock_ns(&a);
        let out = if together {
            a.pause_tags(&[w, kv], None).unwrap()
        } else {
            let mut r = a.pause(Some(kv), None).unwrap();
            r.copied_bytes += a.pause(Some(w), None).unwrap().copied_bytes;
            r
        };
        assert_eq!(out.copied_bytes, 1024 * MIB);
        assert!(paused(&a, w) && paused(&a, kv));
        assert_eq!(used(&a, 0), 0, "everything given back");
        let t1 = clock_ns(&a);
        let back = if together {
            a.resume_tags(&[w, kv]).unwrap()
        } else {
            let mut r = a.resume(Some(w)).unwrap();
            r.copied_bytes += a.resume(Some(kv)).unwrap().copied_bytes;
            r
        };
        let t2 = clock_ns(&a);
        assert_eq!(back.copied_bytes, 1024 * MIB);
        assert!(!paused(&a, w) && !paused(&a, kv));
        a.check_invariants().unwrap();
        let (pause_s, resume_s) = ((t1 - t0) as f64 * 1e-9, (t2 - t1) as f64 * 1e-9);
        assert!(pause_s >= copies_s && resume_s >= copies_s, "{pause_s} {resume_s} below the copies");
        times.push((pause_s - copies_s, resume_s - copies_s));
        for (p, s) in weights.into_iter().chain(cache) {
            a.free(0, p, s).unwrap();
        }
    }
    let ((pause_apart, resume_apart), (pause_together, resume_together)) = (times[0], times[1]);
    // Apart: the discarded tag's 512 unmaps and releases (10 ms) and creates and maps (15 ms)
    // come on top of the copies.
    assert!(pause_apart > 0.010 && resume_apart > 0.015, "{times:?}");
    // Together: what is left over the copies is about one batch's calls (128 pages: 2.6 ms to
    // unmap and release after the last copy, 3.8 ms to create and map before the first).
    assert!(pause_together < 0.004 && resume_together < 0.005, "{times:?}");
}

/// A resume finds its room in other tags' idle cached pages (counted up front) and releases
/// them batch by batch as it maps; with that room taken by live memory it fails up front and
/// changes nothing.
#[test]
fn a_resume_makes_room_from_idle_cached_pages_and_fails_up_front_without_room() {
    let a = sim(",sim_capacity_mb:2048");
    let w = in_region(&a, "several_room_w", true, &[600 * MIB]);
    let kv = in_region(&a, "several_room_kv", false, &[400 * MIB]);
    a.pause(None, None).unwrap();
    // The trainer fills the device, then frees: 1.9 GiB of idle cached pages.
    let big = a.malloc(0, 1900 * MIB, S0).unwrap();
    a.free(0, big, 1900 * MIB).unwrap();
    assert!(used(&a, 0) >= 1900 * MIB);
    let r = a.resume(None).unwrap();
    assert_eq!(r.copied_bytes, 600 * MIB);
    assert!(r.released_bytes >= 1000 * MIB - (2048 - 1900) * MIB, "{r:?}");
    assert!(used(&a, 0) <= 2048 * MIB);
    a.check_invariants().unwrap();
    a.pause(None, None).unwrap();
    // Now live memory holds the room: nothing is created, both stay paused with the backup.
    let hog = a.malloc(0, 1500 * MIB, S0).unwrap();
    let before = (used(&a, 0), a.stats(0).unwrap().heap.num_create);
    // One heap call for both names: the error names both.
    let numbers: Vec<u8> =
        ["several_room_w", "several_room_kv"].iter().flat_map(|t| tags::numbers(tags::lookup(t).unwrap())).collect();
    let e = a.with_heap(0, |h| h.resume_tags(&numbers)).unwrap().unwrap_err();
    let Error::OutOfMemory(report) = &e else { panic!("{e}") };
    assert!(report.hint.contains("several_room_w") && report.hint.contains("several_room_kv"), "{e}");
    assert!(report.hint.contains("The tags stay paused with their backup"), "{e}");
    // Through the allocator the names are then tried one at a time: the first that does not
    // fit is the error's.
    let e = a.resume(None).unwrap_err();
    let Error::OutOfMemory(report) = &e else { panic!("{e}") };
    assert!(report.hint.contains("several_room_w") && report.hint.contains("The tag stays paused"), "{e}");
    assert_eq!((used(&a, 0), a.stats(0).unwrap().heap.num_create), before, "the check comes before any create");
    assert!(paused(&a, "several_room_w") && paused(&a, "several_room_kv"));
    assert_eq!(backup_bytes(&a, "several_room_w"), 600 * MIB);
    a.check_invariants().unwrap();
    a.free(0, hog, 1500 * MIB).unwrap();
    assert_eq!(a.resume(None).unwrap().copied_bytes, 600 * MIB);
    for (p, s) in w.into_iter().chain(kv) {
        a.free(0, p, s).unwrap();
    }
}

/// Maps failing at random while two tags resume in one call (600 MiB backed up: three copy
/// batches; 200 MiB discarded): every failed attempt, some of them after a batch was mapped and
/// its copies queued, leaves both tags paused with the whole backup and the device's use as it
/// was; a retry succeeds and copies everything back.
#[test]
fn a_resume_of_several_tags_that_fails_halfway_loses_nothing() {
    let a = sim(",sim_capacity_mb:4096,sim_fail_map_prob:0.008,sim_seed:3");
    let w = in_region(&a, "several_fail_w", true, &[300 * MIB, 300 * MIB]);
    let kv = in_region(&a, "several_fail_kv", false, &[200 * MIB]);
    a.pause(None, None).unwrap();
    let (mut failures, mut late_failures) = (0, 0);
    let r = loop {
        let (use_before, maps_before) = (used(&a, 0), a.stats(0).unwrap().heap.num_map);
        match a.resume(None) {
            Ok(r) => break r,
            Err(e) => {
                assert!(e.is_out_of_memory(), "{e}");
                failures += 1;
                // Past the first batch's 128 pages: its copies were queued when the map failed.
                late_failures += usize::from(a.stats(0).unwrap().heap.num_map - maps_before > 128);
                assert_eq!(used(&a, 0), use_before, "attempt {failures}: the failed resume gave everything back");
                assert!(paused(&a, "several_fail_w") && paused(&a, "several_fail_kv"), "attempt {failures}");
                assert_eq!(backup_bytes(&a, "several_fail_w"), 600 * MIB, "attempt {failures}");
                a.check_invariants().unwrap();
            }
        }
        assert!(failures < 200, "no resume succeeded");
    };
    assert!(late_failures > 0, "{failures} failures, none after the first batch");
    assert_eq!(r.copied_bytes, 600 * MIB);
    assert!(!paused(&a, "several_fail_w") && !paused(&a, "several_fail_kv"));
    a.check_invariants().unwrap();
    for (p, s) in w.into_iter().chain(kv) {
        a.free(0, p, s).unwrap();
    }
}

/// A list with a name never used, or "default", is refused before anything is paused.
#[test]
fn a_list_with_a_bad_name_changes_nothing() {
    let a = sim(",sim_capacity_mb:1024");
    let w = in_region(&a, "several_bad_w", true, &[10 * MIB]);
    let e = a.pause_tags(&["several_bad_w", "several_never_used"], None).unwrap_err();
    assert!(e.to_string().contains("several_never_used"), "{e}");
    assert!(a.pause_tags(&["several_bad_w", "default"], None).is_err());
    assert!(!paused(&a, "several_bad_w"));
    let r = a.pause_tags(&["several_bad_w", "several_bad_w"], None).unwrap();
    assert_eq!((r.tags.len(), r.copied_bytes), (1, 10 * MIB));
    assert_eq!(a.resume_tags(&["several_bad_w"]).unwrap().copied_bytes, 10 * MIB);
    a.free(0, w[0].0, w[0].1).unwrap();
}
