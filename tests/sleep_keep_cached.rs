//! A pause that keeps a tag's free cached pages (`tags::set_keep_cached`, what the
//! torch_memory_saver room turns on for its tags): the resume maps them again, after the live
//! pages, as the tag's free cached memory, so the device memory a resume takes back equals what
//! the pause gave (torch_memory_saver remaps PyTorch's whole segments). Without the setting a
//! pause releases them for good and the resume maps only the live pages (stepalloc's default).
//! On the simulated device, which checks every map and unmap against the driver's rules.

mod common;

use common::{reserved, sim_4gib, used, S0};
use stepalloc::units::MIB;
use stepalloc::{tags, Allocator};

fn creates(a: &Allocator) -> u64 {
    a.stats(0).unwrap().heap.num_create
}

/// In a region of `tag`: 200, 300 and 100 MiB, then the 300 MiB block freed (cached, mapped),
/// and a 40 MiB block freed while paused comes later. Returns (first, freed, last, late).
fn layout(a: &Allocator, tag: &str) -> (u64, u64, u64, u64) {
    tags::enter(tag, true).unwrap();
    let p = [200 * MIB, 300 * MIB, 100 * MIB, 40 * MIB].map(|s| a.malloc(0, s, S0).unwrap());
    tags::exit().unwrap();
    a.free(0, p[1], 300 * MIB).unwrap();
    (p[0], p[1], p[2], p[3])
}

#[test]
fn with_keep_cached_a_resume_maps_the_cached_pages_again_for_the_tag_to_reuse() {
    for conf in ["", ",expandable_segments:True", ",expandable_segments:True,page_reuse:True"] {
        let tag = "kc_on";
        tags::set_keep_cached(tag, true).unwrap();
        let a = sim_4gib(conf);
        let (first, freed, last, late) = layout(&a, tag);
        a.check_invariants().unwrap();
        let (reserved_before, used_before) = (reserved(&a), used(&a, 0));
        assert!(reserved_before >= 640 * MIB, "{conf}: {reserved_before}");
        let r = a.pause(Some(tag), None).unwrap();
        a.check_invariants().unwrap();
        assert!(r.released_bytes >= 640 * MIB, "{conf}: the cached pages go at the pause too: {r:?}");
        assert!(used(&a, 0) < 8 * MIB, "{conf}: {} still used while paused", used(&a, 0));
        // A block freed while paused: its pages come back as cached memory too.
        a.free(0, late, 40 * MIB).unwrap();
        a.check_invariants().unwrap();
        let r = a.resume(Some(tag)).unwrap();
        a.check_invariants().unwrap();
        assert_eq!(reserved(&a), reserved_before, "{conf}: the resume maps what the pause released");
        assert_eq!(used(&a, 0), used_before, "{conf}: device memory back to the pre-pause figure");
        assert_eq!(r.mapped_bytes, reserved_before, "{conf}: {r:?}");
        assert_eq!(r.copied_bytes, 300 * MIB, "{conf}: only the live blocks are copied");
        // A malloc of the freed size reuses the remapped pages: no new physical memory.
        let creates_before = creates(&a);
        tags::enter(tag, true).unwrap();
        let again = a.malloc(0, 300 * MIB, S0).unwrap();
        let small = a.malloc(0, 40 * MIB, S0).unwrap();
        tags::exit().unwrap();
        assert_eq!(creates(&a), creates_before, "{conf}: the cached pages serve the mallocs");
        assert_eq!(reserved(&a), reserved_before, "{conf}");
        assert_eq!(again, freed, "{conf}: the same cached block");
        a.check_invariants().unwrap();
        a.free(0, again, 300 * MIB).unwrap();
        a.free(0, small, 40 * MIB).unwrap();
        // empty_cache releases the remapped cached pages like any cached page.
        a.empty_cache().unwrap();
        a.check_invariants().unwrap();
        assert!(reserved(&a) <= 300 * MIB + 4 * MIB, "{conf}: {} left after empty_cache", reserved(&a));
        a.free(0, first, 200 * MIB).unwrap();
        a.free(0, last, 100 * MIB).unwrap();
        a.empty_cache().unwrap();
        a.check_invariants().unwrap();
        assert_eq!(used(&a, 0), 0, "{conf}: everything back");
    }
}

#[test]
fn without_keep_cached_the_cached_pages_go_for_good() {
    let tag = "kc_off";
    let a = sim_4gib(",expandable_segments:True");
    let (first, _, last, late) = layout(&a, tag);
    let reserved_before = reserved(&a);
    a.pause(Some(tag), None).unwrap();
    a.free(0, late, 40 * MIB).unwrap();
    let r = a.resume(Some(tag)).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(r.mapped_bytes, reserved(&a));
    assert!(reserved(&a) <= 300 * MIB + 4 * MIB, "only the live pages: {} of {reserved_before}", reserved(&a));
    // Turning the setting on later changes the next pause, not this resume.
    tags::set_keep_cached(tag, true).unwrap();
    tags::set_keep_cached(tag, false).unwrap();
    assert!(!tags::keeps_cached(tags::lookup(tag).unwrap()));
    assert!(tags::set_keep_cached("default", true).is_err());
    a.free(0, first, 200 * MIB).unwrap();
    a.free(0, last, 100 * MIB).unwrap();
}

#[test]
fn a_resume_without_room_for_the_cached_pages_fails_whole_and_a_retry_works() {
    let tag = "kc_room";
    tags::set_keep_cached(tag, true).unwrap();
    let a = sim_4gib(",sim_capacity_mb:1024,expandable_segments:True");
    tags::enter(tag, false).unwrap();
    let p = [100 * MIB, 500 * MIB, 100 * MIB].map(|s| a.malloc(0, s, S0).unwrap());
    tags::exit().unwrap();
    a.free(0, p[1], 500 * MIB).unwrap();
    let reserved_before = reserved(&a);
    a.pause(Some(tag), None).unwrap();
    // Room for the live 200 MiB but not for the 500 MiB cached: the resume fails whole.
    let hog = a.malloc(0, 600 * MIB, S0).unwrap();
    let e = a.resume(Some(tag)).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(a.with_heap(0, |h| h.tag_paused(tags::lookup(tag).unwrap())).unwrap(), "still paused");
    a.check_invariants().unwrap();
    a.free(0, hog, 600 * MIB).unwrap();
    a.empty_cache().unwrap();
    a.resume(Some(tag)).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(reserved(&a), reserved_before, "the retry maps everything");
}
