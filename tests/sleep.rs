//! Sleep and wake on the simulated device: tags keep their memory apart, `pause` gives a tag's
//! pages back with its addresses kept, `resume` maps them again, and every outcome of the
//! contract (cabi/src/sleep.rs, src/sleep.rs) holds. The simulated device checks every map,
//! unmap and copy against the driver's rules (a copy from an unmapped page fails), and counts
//! the bytes copied each way.

mod common;

use common::{in_region, sim, sim_4gib, used, S0};
use stepalloc::units::MIB;
use stepalloc::{tags, Error, Stream};

#[test]
fn pause_releases_the_tags_memory_and_resume_maps_it_at_the_same_addresses() {
    for conf in ["", ",expandable_segments:True", ",expandable_segments:True,page_reuse:True,big_page_mb:64"] {
        let a = sim_4gib(conf);
        let other = a.malloc(0, 100 * MIB, S0).unwrap();
        let weights = in_region(&a, "sleep_t1_weights", true, &[300 * MIB, 5 * MIB, 1000, 64 * MIB]);
        let kv = in_region(&a, "sleep_t1_kv", false, &[512 * MIB]);
        a.check_invariants().unwrap();
        let before = used(&a, 0);
        let r = a.pause(Some("sleep_t1_weights"), None).unwrap();
        a.check_invariants().unwrap();
        assert_eq!(r.tags, ["sleep_t1_weights"]);
        assert_eq!(r.copied_bytes, 300 * MIB + 5 * MIB + 1000 + 64 * MIB, "{conf}: backed-up bytes");
        assert_eq!(r.discarded_bytes, 0);
        let freed = before - used(&a, 0);
        assert!(freed >= 369 * MIB, "{conf}: {freed} bytes back on the device");
        let r = a.pause(Some("sleep_t1_kv"), None).unwrap();
        assert_eq!((r.copied_bytes, r.discarded_bytes), (0, 512 * MIB), "{conf}: no backup: discarded");
        a.check_invariants().unwrap();
        assert!(used(&a, 0) <= 102 * MIB + 4 * MIB, "{conf}: only the untagged block is left: {}", used(&a, 0));
        let figures = a.tag_figures();
        let w = figures.iter().find(|f| f.tag == "sleep_t1_weights").unwrap();
        assert!(w.paused && w.live_bytes == 0 && w.paused_bytes >= 369 * MIB && w.backup_bytes == r_copied(&weights));
        // Resume maps at the same addresses and copies back.
        let r = a.resume(Some("sleep_t1_weights")).unwrap();
        assert_eq!(r.copied_bytes, r_copied(&weights));
        assert!(r.mapped_bytes >= 369 * MIB);
        a.check_invariants().unwrap();
        for &(p, s) in &weights {
            assert!(a.with_heap(0, |h| h.is_live(p)).unwrap());
            a.free(0, p, s).unwrap();
        }
        a.resume(None).unwrap();
        for &(p, s) in kv.iter().chain([(other, 100 * MIB)].iter()) {
            a.free(0, p, s).unwrap();
        }
        a.check_invariants().unwrap();
        a.empty_cache().unwrap();
        assert_eq!(used(&a, 0), 0, "{conf}: everything back after empty_cache");
    }
}

fn r_copied(blocks: &[(u64, u64)]) -> u64 {
    blocks.iter().map(|&(_, s)| s).sum()
}

#[test]
fn a_paused_tags_region_refuses_allocations_and_frees_drop_blocks() {
    let a = sim_4gib("");
    let blocks = in_region(&a, "sleep_t2", true, &[10 * MIB, 10 * MIB, 10 * MIB]);
    a.pause(Some("sleep_t2"), None).unwrap();
    tags::enter("sleep_t2", true).unwrap();
    let e = a.malloc(0, MIB, S0).unwrap_err();
    tags::exit().unwrap();
    assert!(matches!(&e, Error::Paused(m) if m.contains("sleep_t2")), "{e}");
    // A free while paused drops the block and its backup.
    a.free(0, blocks[1].0, blocks[1].1).unwrap();
    a.check_invariants().unwrap();
    let f = a.tag_figures().into_iter().find(|f| f.tag == "sleep_t2").unwrap();
    assert_eq!((f.paused_bytes, f.backup_bytes), (20 * MIB, 20 * MIB));
    assert!(a.free(0, blocks[1].0, blocks[1].1).is_err(), "no double free");
    // empty_cache while paused touches nothing of the tag.
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    let r = a.resume(Some("sleep_t2")).unwrap();
    assert_eq!(r.copied_bytes, 20 * MIB);
    a.check_invariants().unwrap();
}

#[test]
fn outcomes_of_misuse_are_defined() {
    let a = sim_4gib("");
    let e = a.pause(Some("sleep_never_entered"), None).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("sleep_never_entered")), "{e}");
    let e = a.resume(Some("sleep_never_entered")).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("sleep_never_entered")), "{e}");
    assert!(matches!(a.pause(Some("default"), None), Err(Error::InvalidArgument(_))));
    assert!(matches!(a.pause(Some("bad name"), None), Err(Error::InvalidArgument(_))));
    let blocks = in_region(&a, "sleep_t3", false, &[4 * MIB]);
    // Resume of a tag that is not paused, pause of a paused one: no-ops the report names.
    let r = a.resume(Some("sleep_t3")).unwrap();
    assert_eq!((r.tags.len(), r.skipped.as_slice()), (0, ["sleep_t3".to_string()].as_slice()));
    a.pause(Some("sleep_t3"), None).unwrap();
    let r = a.pause(Some("sleep_t3"), Some(true)).unwrap();
    assert_eq!(r.skipped, ["sleep_t3"]);
    assert_eq!(r.copied_bytes + r.released_bytes, 0);
    // During a capture: refused, naming the tag; the tag stays as it was.
    a.begin_allocate_to_pool(0, (7, 7)).unwrap();
    let e = a.resume(Some("sleep_t3")).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("sleep_t3") && m.contains("capture")), "{e}");
    a.end_allocate_to_pool(0, (7, 7)).unwrap();
    a.release_pool(0, (7, 7)).unwrap();
    a.resume(Some("sleep_t3")).unwrap();
    a.free(0, blocks[0].0, blocks[0].1).unwrap();
    // Regions nest; the innermost tags; exit restores the outer one; depth is bounded.
    let outer = tags::enter("sleep_t3", false).unwrap();
    let inner = tags::enter("sleep_t3_inner", false).unwrap();
    assert_eq!(tags::current(), inner);
    tags::exit().unwrap();
    assert_eq!(tags::current(), outer);
    tags::exit().unwrap();
    assert!(tags::exit().is_err());
    for _ in 0..tags::MAX_DEPTH {
        tags::enter("sleep_t3", false).unwrap();
    }
    assert!(tags::enter("sleep_t3", false).is_err(), "depth 65");
    while tags::depth() > 0 {
        tags::exit().unwrap();
    }
}

#[test]
fn blocks_take_the_tag_of_the_allocation_and_tags_never_share_pages() {
    for conf in ["", ",expandable_segments:True,page_reuse:True,pack_small:True"] {
        let a = sim_4gib(conf);
        let (w, _) = in_region(&a, "sleep_t4_w", false, &[6 * MIB])[0];
        a.free(0, w, 6 * MIB).unwrap();
        // The cached block of another tag is not handed out: a new range.
        let (k, _) = in_region(&a, "sleep_t4_k", false, &[6 * MIB])[0];
        assert_ne!(k, w, "{conf}");
        let d = a.malloc(0, 6 * MIB, S0).unwrap();
        assert_ne!(d, w, "{conf}: the default tag took a tagged block");
        // The same tag gets its cached block back.
        let (w2, _) = in_region(&a, "sleep_t4_w", false, &[6 * MIB])[0];
        assert_eq!(w2, w, "{conf}");
        // Small blocks of two tags never share a page (2 MiB).
        let (x, _) = in_region(&a, "sleep_t4_w", false, &[1000])[0];
        let (y, _) = in_region(&a, "sleep_t4_k", false, &[1000])[0];
        assert_ne!(x >> 21, y >> 21, "{conf}");
        let snapshot = a.snapshot_json();
        assert!(snapshot.contains("\"tag\":\"sleep_t4_w\"") && snapshot.contains("\"tag\":\"sleep_t4_k\""));
        a.pause(Some("sleep_t4_k"), None).unwrap();
        assert!(a.snapshot_json().contains("\"paused\":true"), "paused ranges are marked in snapshots");
        a.check_invariants().unwrap();
        // Pausing one tag leaves the other's bytes alone: its blocks stay live and mapped.
        let figures = a.tag_figures();
        let w_figures = figures.iter().find(|f| f.tag == "sleep_t4_w").unwrap();
        assert!(!w_figures.paused && w_figures.live_bytes >= 6 * MIB);
        a.resume(Some("sleep_t4_k")).unwrap();
        for (p, s) in [(k, 6 * MIB), (d, 6 * MIB), (w2, 6 * MIB), (x, 1000), (y, 1000)] {
            a.free(0, p, s).unwrap();
        }
        a.empty_cache().unwrap();
        assert_eq!(used(&a, 0), 0, "{conf}");
    }
}

#[test]
fn resume_without_memory_fails_clearly_keeps_the_backup_and_retry_works() {
    let a = sim_4gib(",sim_capacity_mb:512,expandable_segments:True");
    let blocks = in_region(&a, "sleep_t5", true, &[100 * MIB, 50 * MIB]);
    a.pause(Some("sleep_t5"), None).unwrap();
    let hog = a.malloc(0, 400 * MIB, S0).unwrap();
    let e = a.resume(Some("sleep_t5")).unwrap_err();
    let Error::OutOfMemory(report) = &e else { panic!("{e}") };
    assert!(report.hint.contains("sleep_t5") && report.hint.contains("more than"), "{e}");
    assert!(e.to_string().starts_with("CUDA out of memory."), "{e}");
    a.check_invariants().unwrap();
    let f = a.tag_figures().into_iter().find(|f| f.tag == "sleep_t5").unwrap();
    assert!(f.paused && f.backup_bytes == 150 * MIB, "{f:?}");
    // Nothing of the failed attempt stays mapped.
    assert_eq!(used(&a, 0), 400 * MIB);
    a.free(0, hog, 400 * MIB).unwrap();
    let r = a.resume(Some("sleep_t5")).unwrap();
    assert_eq!(r.copied_bytes, 150 * MIB);
    a.check_invariants().unwrap();
    for (p, s) in blocks {
        a.free(0, p, s).unwrap();
    }
}

#[test]
fn several_devices_mempool_mode_and_pending_frees() {
    let a = sim_4gib(",sim_devices:2,sim_event_delay_us:50");
    a.set_mempool_mode(true);
    tags::enter("sleep_t6", true).unwrap();
    let p0 = a.malloc(0, 40 * MIB, S0).unwrap();
    let p1 = a.malloc(1, 30 * MIB, S0).unwrap();
    let q0 = a.malloc(0, 8 * MIB, Stream(5)).unwrap();
    tags::exit().unwrap();
    // A free waiting for another stream's work when the pause comes: the pause waits for it.
    a.record_stream(0, q0, Stream(9)).unwrap();
    a.free(0, q0, 8 * MIB).unwrap();
    let syncs = a.stats(0).unwrap().heap.num_device_synchronize;
    let r = a.pause(Some("sleep_t6"), None).unwrap();
    assert_eq!(r.copied_bytes, 70 * MIB);
    assert_eq!(a.stats(0).unwrap().heap.num_device_synchronize, syncs, "no device-wide synchronize");
    assert_eq!(used(&a, 0) + used(&a, 1), 0, "both devices gave everything back");
    a.check_invariants().unwrap();
    let r = a.resume(None).unwrap();
    assert_eq!((r.tags.as_slice(), r.copied_bytes), (["sleep_t6".to_string()].as_slice(), 70 * MIB));
    assert!(used(&a, 0) >= 40 * MIB && used(&a, 1) >= 30 * MIB);
    a.free(0, p0, 40 * MIB).unwrap();
    a.free(1, p1, 30 * MIB).unwrap();
    a.check_invariants().unwrap();
    // MemPool mode: the caller caches in front; what it frees goes back to the device.
    assert_eq!(used(&a, 0) + used(&a, 1), 0, "freed tagged pages stay mapped in MemPool mode");
}

#[test]
fn backups_follow_the_policy_and_host_buffers_are_kept_until_released() {
    let a = sim_4gib(",sim_cost_model:True");
    let blocks = in_region(&a, "sleep_t7", true, &[64 * MIB, 64 * MIB]);
    let r = a.pause(Some("sleep_t7"), Some(false)).unwrap();
    assert_eq!((r.copied_bytes, r.discarded_bytes), (0, 128 * MIB), "an override beats the policy");
    a.resume(Some("sleep_t7")).unwrap();
    assert_eq!(a.with_heap(0, |h| h.backup_host_bytes()).unwrap(), 0, "no backup: no host buffer");
    let r = a.pause(Some("sleep_t7"), None).unwrap();
    assert_eq!(r.copied_bytes, 128 * MIB);
    let host = a.with_heap(0, |h| h.backup_host_bytes()).unwrap();
    assert!(host >= 128 * MIB);
    assert_eq!(a.release_backup().unwrap(), 0, "buffers holding paused bytes stay");
    a.resume(Some("sleep_t7")).unwrap();
    // Kept across pauses: the next pause allocates nothing.
    a.pause(Some("sleep_t7"), None).unwrap();
    assert_eq!(a.with_heap(0, |h| h.backup_host_bytes()).unwrap(), host);
    a.resume(Some("sleep_t7")).unwrap();
    assert_eq!(a.release_backup().unwrap(), host);
    assert_eq!(a.with_heap(0, |h| h.backup_host_bytes()).unwrap(), 0);
    let stats = a.stats(0).unwrap().to_map();
    assert_eq!(stats["stepalloc.tag.sleep_t7.pauses"], 3);
    assert_eq!(stats["stepalloc.tag.sleep_t7.resumes"], 3);
    assert_eq!(stats["stepalloc.tag.sleep_t7.live_bytes"], 128 * MIB);
    for (p, s) in blocks {
        a.free(0, p, s).unwrap();
    }
}

/// CUDA IPC: a block whose tag is paused is refused with the tag's name; once resumed it shares.
#[test]
fn a_paused_tags_block_is_not_shared_with_other_processes() {
    let a = sim_4gib(",expandable_segments:True");
    let weights = in_region(&a, "sleep_ipc_weights", true, &[3 * MIB]);
    let (ptr, _) = weights[0];
    assert!(a.with_heap(0, |h| h.share(ptr)).unwrap().is_ok());
    // Its receivers let go (a tag with a tensor another process holds does not pause).
    a.with_heap(0, |h| h.unshare(ptr)).unwrap().unwrap();
    a.pause(Some("sleep_ipc_weights"), None).unwrap();
    let refused = a.with_heap(0, |h| h.share(ptr)).unwrap().unwrap_err();
    assert!(matches!(refused, Error::Paused(_)), "{refused:?}");
    assert!(refused.to_string().contains("\"sleep_ipc_weights\", which is paused"), "{refused}");
    a.resume(Some("sleep_ipc_weights")).unwrap();
    assert!(a.with_heap(0, |h| h.share(ptr)).unwrap().is_ok());
}

/// A pause of a tag with many blocks (so some allocated ones are filed away from their home
/// bucket) and freed blocks holding whole pages between unmapped ranges: the unmapped blocks
/// stay indexed by address and merged, the paused blocks stay found, under the recommended
/// configuration, through several cycles.
#[test]
fn pausing_many_blocks_with_free_pages_between_keeps_the_heaps_indexes() {
    let a = sim_4gib(&format!(",{}", stepalloc::config::RECOMMENDED));
    let sizes: Vec<u64> = (0..1200u64).map(|i| (1 + i % 3) * MIB + (i % 5) * 4096).collect();
    for cycle in 0..3 {
        let blocks = in_region(&a, "sleep_t9_kv", false, &sizes);
        // Free every third block: free ranges of whole pages between live ones.
        for &(p, s) in blocks.iter().step_by(3) {
            a.free(0, p, s).unwrap();
        }
        a.check_invariants().unwrap();
        let r = a.pause(Some("sleep_t9_kv"), None).unwrap();
        assert!(r.released_bytes > 0, "cycle {cycle}");
        a.check_invariants().unwrap_or_else(|e| panic!("cycle {cycle}, after pause: {e}"));
        a.resume(Some("sleep_t9_kv")).unwrap();
        a.check_invariants().unwrap_or_else(|e| panic!("cycle {cycle}, after resume: {e}"));
        for (i, &(p, s)) in blocks.iter().enumerate().filter(|(i, _)| i % 3 != 0) {
            assert!(a.with_heap(0, |h| h.is_live(p)).unwrap(), "block {i} lost");
            a.free(0, p, s).unwrap();
        }
        a.check_invariants().unwrap();
    }
}

/// A tag's page that only free blocks of different streams share goes whole while paused (their
/// streams' work completed), so with nothing live the resume maps nothing. The two streams meet
/// in one page because a block freed after `record_stream` serves any stream: a request on the
/// second stream takes it beside the first stream's blocks.
#[test]
fn free_blocks_of_different_streams_in_a_paused_tag_go_whole() {
    for conf in ["", ",expandable_segments:True", ",page_release:True,expandable_segments:True,cache_limit_mb:1"] {
        let a = sim_4gib(conf);
        tags::enter("sleep_t10_kv", false).unwrap();
        let x = a.malloc(0, 4096, S0).unwrap();
        let z = a.malloc(0, 4096, S0).unwrap();
        a.record_stream(0, x, Stream(1)).unwrap();
        a.free(0, x, 4096).unwrap();
        a.advance_time(1_000_000);
        let y = a.malloc(0, 4096, Stream(1)).unwrap();
        tags::exit().unwrap();
        assert_eq!(y, x, "{conf}: the second stream takes the block that serves any stream");
        a.free(0, z, 4096).unwrap();
        a.pause(Some("sleep_t10_kv"), None).unwrap();
        a.check_invariants().unwrap();
        // Freed while paused, beside the first stream's free block.
        a.free(0, y, 4096).unwrap();
        a.check_invariants().unwrap();
        let r = a.resume(Some("sleep_t10_kv")).unwrap();
        assert_eq!(r.mapped_bytes, 0, "{conf}: nothing live, nothing to map: {r:?}");
        a.check_invariants().unwrap();
        a.empty_cache().unwrap();
        assert_eq!(used(&a, 0), 0, "{conf}");
    }
}

/// With `page_release` and a cache limit, untagged frees pending on a second stream and a
/// tag's blocks freed while paused (its range left wholly unmapped, which a release over the
/// limit may give back) leave the heap's records whole: the resume maps nothing and every
/// invariant holds.
#[test]
fn pause_and_resume_under_page_release_and_a_cache_limit() {
    let a = sim_4gib(&format!(",{},page_release:True,cache_limit_mb:1", stepalloc::config::RECOMMENDED));
    for cycle in 0..3 {
        let weights = in_region(&a, "sleep_t11_w", true, &[3 * MIB, 4096]);
        let scratch: Vec<u64> = (0..4).map(|i| a.malloc(0, (1 + i) * MIB, S0).unwrap()).collect();
        a.pause(Some("sleep_t11_w"), None).unwrap();
        a.check_invariants().unwrap_or_else(|e| panic!("cycle {cycle}, after pause: {e}"));
        // Untagged frees still pending on a second stream when the resume comes, and the
        // tag's blocks freed while paused.
        for (i, &p) in scratch.iter().enumerate() {
            a.record_stream(0, p, Stream(1)).unwrap();
            a.free(0, p, (1 + i as u64) * MIB).unwrap();
        }
        for &(p, s) in &weights {
            a.free(0, p, s).unwrap();
        }
        a.check_invariants().unwrap_or_else(|e| panic!("cycle {cycle}, paused, after frees: {e}"));
        a.advance_time(1_000_000);
        let r = a.resume(Some("sleep_t11_w")).unwrap();
        assert_eq!(r.mapped_bytes, 0, "cycle {cycle}: nothing live: {r:?}");
        a.check_invariants().unwrap_or_else(|e| panic!("cycle {cycle}, after resume: {e}"));
    }
    a.empty_cache().unwrap();
    assert_eq!(used(&a, 0), 0);
}

/// Issue 32: the backup belongs to the allocation (the region it was made in), not to the tag:
/// two regions of one tag with different backups never change each other's memory, in either
/// order, and an override still covers the whole tag.
#[test]
fn the_backup_belongs_to_the_allocation_not_to_the_tag() {
    for (first_backup, name) in [(true, "sleep_t12_a"), (false, "sleep_t12_b")] {
        let a = sim_4gib(",sim_cost_model:True");
        let first = in_region(&a, name, first_backup, &[64 * MIB, 3 * MIB]);
        let second = in_region(&a, name, !first_backup, &[32 * MIB, 1000]);
        let (kept, gone) = if first_backup { (&first, &second) } else { (&second, &first) };
        let before = used(&a, 0);
        let r = a.pause(Some(name), None).unwrap();
        a.check_invariants().unwrap();
        assert_eq!(r.tags, [name], "one name in the report");
        assert_eq!(r.copied_bytes, r_copied(kept), "exactly the backed-up region's bytes are copied");
        assert_eq!(r.discarded_bytes, r_copied(gone), "exactly the other region's bytes are discarded");
        assert!(before - used(&a, 0) >= 96 * MIB, "both regions' memory goes back");
        let f = a.tag_figures().into_iter().find(|f| f.tag == name).unwrap();
        assert!(f.paused && f.backup && f.backup_bytes == r_copied(kept) && f.live_bytes == 0, "{f:?}");
        // Allocating in either region of the paused name is refused.
        for backup in [true, false] {
            tags::enter(name, backup).unwrap();
            assert!(matches!(a.malloc(0, MIB, S0), Err(Error::Paused(_))));
            tags::exit().unwrap();
        }
        let r = a.resume(Some(name)).unwrap();
        assert_eq!(r.tags, [name]);
        assert_eq!(r.copied_bytes, r_copied(kept), "the backed-up bytes come back");
        a.check_invariants().unwrap();
        assert!(!a.tag_figures().into_iter().find(|f| f.tag == name).unwrap().paused);
        // A second cycle (of every tag: the registry is the process's) behaves the same, and an
        // override still covers both.
        let r = a.pause(None, None).unwrap();
        assert_eq!((r.copied_bytes, r.discarded_bytes), (r_copied(kept), r_copied(gone)));
        assert!(a.resume(None).unwrap().tags.contains(&name.to_string()));
        let r = a.pause(Some(name), Some(true)).unwrap();
        assert_eq!((r.copied_bytes, r.discarded_bytes), (r_copied(kept) + r_copied(gone), 0));
        a.resume(Some(name)).unwrap();
        let r = a.pause(Some(name), Some(false)).unwrap();
        assert_eq!((r.copied_bytes, r.discarded_bytes), (0, r_copied(kept) + r_copied(gone)));
        a.resume(Some(name)).unwrap();
        for &(p, s) in first.iter().chain(second.iter()) {
            a.free(0, p, s).unwrap();
        }
        a.check_invariants().unwrap();
    }
}

/// Issue 32, bad input: no host memory for the backup. The pause fails with an error that says
/// so, before anything is released or discarded: the tag stays resident (the device still holds
/// its memory, its figures say live), a retry with host memory works.
#[test]
fn a_pause_without_host_memory_for_the_backup_fails_and_loses_nothing() {
    let a = sim_4gib(",sim_host_capacity_mb:16");
    let backed = in_region(&a, "sleep_t13", true, &[32 * MIB]);
    let discarded = in_region(&a, "sleep_t13", false, &[8 * MIB]);
    let before = used(&a, 0);
    let e = a.pause(Some("sleep_t13"), None).unwrap_err().to_string();
    assert!(e.contains("pinned host memory") && e.contains("sleep_t13") && e.contains("nothing was released"), "{e}");
    a.check_invariants().unwrap();
    assert_eq!(used(&a, 0), before, "nothing was released");
    let f = a.tag_figures().into_iter().find(|f| f.tag == "sleep_t13").unwrap();
    assert!(!f.paused && f.live_bytes == 40 * MIB && f.paused_bytes == 0, "{f:?}");
    assert_eq!(a.with_heap(0, |h| h.backup_host_bytes()).unwrap(), 0, "no host buffer left behind");
    // Allocations in the tag still work: it is not paused.
    tags::enter("sleep_t13", false).unwrap();
    let more = a.malloc(0, MIB, S0).unwrap();
    tags::exit().unwrap();
    a.free(0, more, MIB).unwrap();
    // Small enough to fit: the pause works, and only the backed-up bytes are copied.
    a.free(0, backed[0].0, backed[0].1).unwrap();
    let small = in_region(&a, "sleep_t13", true, &[8 * MIB]);
    let r = a.pause(Some("sleep_t13"), None).unwrap();
    assert_eq!((r.copied_bytes, r.discarded_bytes), (8 * MIB, 8 * MIB));
    a.resume(Some("sleep_t13")).unwrap();
    for &(p, s) in small.iter().chain(discarded.iter()) {
        a.free(0, p, s).unwrap();
    }
}

/// Issue 32: a name whose backed-up part resumes but whose discarded part finds no memory: the
/// resume fails as a whole (the part it mapped is paused again, with its backup), and a retry
/// once memory is free restores the backed-up bytes.
#[test]
fn a_resume_that_fails_halfway_through_a_name_pauses_it_again_whole() {
    let a = sim_4gib(",sim_capacity_mb:512,expandable_segments:True");
    let kept = in_region(&a, "sleep_t14", true, &[100 * MIB]);
    let gone = in_region(&a, "sleep_t14", false, &[100 * MIB]);
    a.pause(Some("sleep_t14"), None).unwrap();
    let hog = a.malloc(0, 350 * MIB, S0).unwrap();
    let with_hog = used(&a, 0);
    let e = a.resume(Some("sleep_t14")).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    a.check_invariants().unwrap();
    let f = a.tag_figures().into_iter().find(|f| f.tag == "sleep_t14").unwrap();
    assert!(f.paused && f.live_bytes == 0 && f.backup_bytes == 100 * MIB, "{f:?}");
    assert_eq!(used(&a, 0), with_hog, "nothing of the failed resume stays mapped");
    a.free(0, hog, 350 * MIB).unwrap();
    let r = a.resume(Some("sleep_t14")).unwrap();
    assert_eq!(r.copied_bytes, 100 * MIB);
    a.check_invariants().unwrap();
    for &(p, s) in kept.iter().chain(gone.iter()) {
        a.free(0, p, s).unwrap();
    }
}

#[test]
fn a_pause_discards_the_blocks_named_discardable_even_in_a_backed_up_tag() {
    let a = sim("");
    let weights = in_region(&a, "sleep_discardable_w", true, &[8 * MIB, 16 * MIB, 4 * MIB]);
    let kv = in_region(&a, "sleep_discardable_kv", false, &[32 * MIB]);
    // The second weights block is rewritten after waking; an address no block starts at (the
    // middle of the first) changes nothing.
    let discard = [weights[1].0, weights[0].0 + MIB];
    let r =
        a.pause_tags_discarding(&[("sleep_discardable_w", None), ("sleep_discardable_kv", None)], &discard).unwrap();
    assert_eq!(r.copied_bytes, 12 * MIB, "only the blocks not named are copied: {r:?}");
    assert_eq!(r.discarded_bytes, 16 * MIB + 32 * MIB, "the named block and the tag without backup: {r:?}");
    a.check_invariants().unwrap();
    let r = a.resume(None).unwrap();
    assert_eq!(r.copied_bytes, 12 * MIB, "the copies come back: {r:?}");
    for &(p, s) in weights.iter().chain(&kv) {
        a.free(0, p, s).unwrap();
    }
    a.check_invariants().unwrap();
}
