//! Sleep and wake on the simulated device: tags keep their memory apart, `pause` gives a tag's
//! pages back with its addresses kept, `resume` maps them again, and every outcome of the
//! contract (cabi/src/sleep.rs, src/sleep.rs) holds. The simulated device checks every map,
//! unmap and copy against the driver's rules (a copy from an unmapped page fails), and counts
//! the bytes copied each way.

use stepalloc::units::MIB;
use stepalloc::{tags, Allocator, Config, Error, Stream};

fn sim(conf: &str) -> Allocator {
    let text = format!("backend:sim,sim_capacity_mb:4096{conf}");
    Allocator::new(Config::parse(&text).expect("valid config")).expect("sim backend")
}

const S0: Stream = Stream(0);

/// Device memory in use, as the device reports it.
fn used(a: &Allocator, device: usize) -> u64 {
    let (free, total) = a.with_heap(device, |h| h.device_mem_info()).unwrap().unwrap();
    total - free
}

/// Allocates `sizes` in a region of `tag`.
fn in_region(a: &Allocator, tag: &str, backup: bool, sizes: &[u64]) -> Vec<(u64, u64)> {
    tags::enter(tag, backup).unwrap();
    let blocks = sizes.iter().map(|&s| (a.malloc(0, s, S0).unwrap(), s)).collect();
    tags::exit().unwrap();
    blocks
}

#[test]
fn pause_releases_the_tags_memory_and_resume_maps_it_at_the_same_addresses() {
    for conf in ["", ",expandable_segments:True", ",expandable_segments:True,page_reuse:True,big_page_mb:64"] {
        let a = sim(conf);
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
    let a = sim("");
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

/// CUDA IPC: a block whose tag is paused is refused with the tag's name; once resumed it shares.
#[test]
fn a_paused_tags_block_is_not_shared_with_other_processes() {
    let a = sim(",expandable_segments:True");
    let weights = in_region(&a, "sleep_ipc_weights", true, &[3 * MIB]);
    let (ptr, _) = weights[0];
    assert!(a.with_heap(0, |h| h.share(ptr)).unwrap().is_ok());
    a.pause(Some("sleep_ipc_weights"), None).unwrap();
    let refused = a.with_heap(0, |h| h.share(ptr)).unwrap().unwrap_err();
    assert!(matches!(refused, Error::Paused(_)), "{refused:?}");
    assert!(refused.to_string().contains("\"sleep_ipc_weights\", which is paused"), "{refused}");
    a.resume(Some("sleep_ipc_weights")).unwrap();
    assert!(a.with_heap(0, |h| h.share(ptr)).unwrap().is_ok());
}
