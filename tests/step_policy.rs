//! Step-boundary release policies on the simulated device, with a scripted two-phase loop:
//! a rollout phase that leaves KV-cache-shaped blocks (many 6 MiB pieces in 20 MiB segments)
//! and a training phase that needs large activation blocks. Checks what is released, when,
//! and that live blocks and blocks waiting on events are never touched.

mod common;

use common::{reserved, sim};
use stepalloc::stats::ReleaseReason;
use stepalloc::units::MIB;
use stepalloc::{Allocator, Stream};

const S: Stream = Stream(0);

fn released(a: &Allocator, reason: ReleaseReason) -> u64 {
    a.stats(0).unwrap().heap.released_bytes[reason as usize]
}

/// One rollout step: 12 KV blocks of 6 MiB (3 per 20 MiB segment), all freed at its end.
fn rollout(a: &Allocator) {
    a.step_begin("rollout").unwrap();
    let kv: Vec<u64> = (0..12).map(|_| a.malloc(0, 6 * MIB, S).unwrap()).collect();
    for p in kv {
        a.free(0, p, 6 * MIB).unwrap();
    }
    a.step_end().unwrap();
}

/// One training step: two 100 MiB activations, freed at its end.
fn train(a: &Allocator) {
    a.step_begin("train").unwrap();
    let act: Vec<u64> = (0..2).map(|_| a.malloc(0, 100 * MIB, S).unwrap()).collect();
    for p in act {
        a.free(0, p, 100 * MIB).unwrap();
    }
    a.step_end().unwrap();
}

#[test]
fn phase_switch_releases_the_other_phases_segments_first() {
    let a = sim("phase_trim:True,phase_trim_margin:0.1");
    let weights = a.malloc(0, 50 * MIB, S).unwrap(); // live across all steps
    rollout(&a);
    train(&a);
    assert_eq!(released(&a, ReleaseReason::PhaseSwitch), 0, "nothing is known of a phase before its first step");
    assert_eq!(reserved(&a), 330 * MIB);
    // Second rollout: its recorded peak is 50 (weights) + 72 MiB, so it is predicted to need
    // 134 MiB with the margin; the cache holds 330. Train's two 100 MiB segments, which rollout
    // never used, go; rollout's own 20 MiB segments stay although they exceed the target by 4.
    let before = a.stats(0).unwrap().heap.num_device_alloc;
    rollout(&a);
    assert_eq!(released(&a, ReleaseReason::PhaseSwitch), 200 * MIB);
    assert_eq!(a.stats(0).unwrap().heap.num_device_alloc, before, "rollout reused its own segments");
    // Back to training: 130 MiB reserved is under train's predicted 275: nothing to trim, and
    // training reserves its activations again.
    train(&a);
    assert_eq!(released(&a, ReleaseReason::PhaseSwitch), 200 * MIB);
    let last = a.stats(0).unwrap().last_step;
    assert_eq!(last.phase, "train");
    assert_eq!(last.peak_allocated, 250 * MIB);
    assert_eq!(last.device_mallocs, 2);
    assert_eq!(last.reserved_at_end, 330 * MIB);
    // The live block was never touched.
    assert!(a.with_heap(0, |h| h.live_blocks().iter().any(|b| b.0 == weights && b.1 == 50 * MIB)).unwrap());
    a.check_invariants().unwrap();
}

#[test]
fn phase_trim_with_margin_zero_trims_to_the_recorded_peak() {
    let a = sim("phase_trim:True,phase_trim_margin:0");
    let _weights = a.malloc(0, 50 * MIB, S).unwrap();
    rollout(&a);
    train(&a);
    rollout(&a);
    // Target 122 MiB: train's 200 MiB go first, then one rollout segment (least recently used).
    assert_eq!(released(&a, ReleaseReason::PhaseSwitch), 220 * MIB);
    assert_eq!(a.stats(0).unwrap().last_step.device_mallocs, 1);
}

#[test]
fn phase_trim_keeps_what_the_next_phase_needs() {
    // With a 200% margin rollout may keep 3 x 122 MiB and train 3 x 250: nothing is trimmed.
    let a = sim("phase_trim:True,phase_trim_margin:2.0");
    let _weights = a.malloc(0, 50 * MIB, S).unwrap();
    for _ in 0..3 {
        rollout(&a);
        train(&a);
    }
    assert_eq!(released(&a, ReleaseReason::PhaseSwitch), 0);
    assert_eq!(a.stats(0).unwrap().last_step.device_mallocs, 0, "steady state: no device malloc inside a step");
}

#[test]
fn idle_segments_are_released_after_n_steps() {
    let a = sim("release_idle_steps:2");
    rollout(&a); // step 1 uses four 20 MiB segments
    assert_eq!(reserved(&a), 80 * MIB);
    train(&a); // step 2: rollout's segments idle for 1 step
    assert_eq!(released(&a, ReleaseReason::Step), 0);
    assert_eq!(reserved(&a), 280 * MIB);
    train(&a); // step 3: idle for 2 steps -> released; train's are in use
    assert_eq!(released(&a, ReleaseReason::Step), 80 * MIB);
    assert_eq!(reserved(&a), 200 * MIB);
    let figures = a.stats(0).unwrap().last_step;
    assert_eq!((figures.steps, figures.reserved_at_end), (3, 200 * MIB));
}

#[test]
fn cache_limit_is_enforced_at_step_end() {
    let a = sim("cache_limit_mb:100");
    // Inside a step the cache may grow beyond the limit (the rule at free releases only a
    // segment that has just become entirely free, so split segments survive until step end).
    a.step_begin("train").unwrap();
    let blocks: Vec<u64> = (0..10).map(|_| a.malloc(0, 6 * MIB, S).unwrap()).collect();
    let keep = blocks[9];
    for &p in &blocks[..9] {
        a.free(0, p, 6 * MIB).unwrap();
    }
    a.step_end().unwrap();
    let s = a.stats(0).unwrap();
    assert!(s.cached_free <= 100 * MIB, "cached {} after step end", s.cached_free);
    assert!(a.with_heap(0, |h| h.live_blocks().iter().any(|b| b.0 == keep)).unwrap());
    a.free(0, keep, 6 * MIB).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn blocks_waiting_on_events_are_not_released() {
    let a = sim("release_idle_steps:1,sim_event_delay_us:1000");
    a.step_begin("rollout").unwrap();
    let p = a.malloc(0, 30 * MIB, S).unwrap();
    a.record_stream(0, p, Stream(7)).unwrap();
    a.free(0, p, 30 * MIB).unwrap();
    a.step_end().unwrap();
    a.step_begin("rollout").unwrap();
    a.step_end().unwrap();
    // The block's event has not completed: its segment stays.
    assert_eq!(released(&a, ReleaseReason::Step), 0);
    assert_eq!(reserved(&a), 30 * MIB);
    a.advance_time(1_000_000);
    a.step_begin("rollout").unwrap();
    let q = a.malloc(0, 4096, S).unwrap(); // processes completed events
    a.free(0, q, 4096).unwrap();
    a.step_end().unwrap();
    a.step_begin("rollout").unwrap();
    a.step_end().unwrap();
    // Both the 30 MiB segment and the small one of the 4 KiB block are idle now.
    assert_eq!(released(&a, ReleaseReason::Step), 32 * MIB);
    assert_eq!(reserved(&a), 0);
}

#[test]
fn step_api_rejects_bad_use() {
    let a = sim("");
    assert!(a.step_end().is_err(), "no step in progress");
    assert!(a.step_begin("").is_err());
    assert!(a.step_begin("has space").is_err());
    assert!(a.step_begin(&"x".repeat(65)).is_err());
    for i in 0..32 {
        a.step_begin(&format!("phase{i}")).unwrap();
    }
    assert!(a.step_begin("one_too_many").is_err(), "phase labels are a bounded set");
    // A step still open is ended by the next step_begin.
    let s = a.stats(0).unwrap();
    assert_eq!(s.steps_by_phase.len(), 32);
    assert_eq!(s.steps_by_phase["phase0"], 1);
    assert_eq!(s.to_map()["stepalloc.steps.phase0"], 1);
}
