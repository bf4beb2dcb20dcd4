//! Input extremes on the core API: sizes, times, fractions and division
//! counts at the ends of their types give an error or a saturated figure, never an overflow
//! (the tests run with overflow checks, in the debug and the release profile alike) and never
//! a silently wrong result.

mod common;

use common::sim;
use stepalloc::units::MIB;
use stepalloc::Stream;

#[test]
fn extreme_sizes_are_out_of_memory_not_overflows() {
    for conf in ["", "roundup_power2_divisions:9223372036854775808", "expandable_segments:True", "max_split_size_mb:20"]
    {
        let a = sim(conf);
        for size in [u64::MAX, u64::MAX - 511, (1 << 48) + 1, 1 << 63] {
            let e = a.malloc(0, size, Stream(0)).expect_err("cannot fit");
            assert!(e.is_out_of_memory(), "{conf} {size}: {e}");
        }
        let p = a.malloc(0, 3 * MIB + 1, Stream(0)).expect("an ordinary request still works");
        assert!(a.free(0, p, u64::MAX).is_err(), "a size that disagrees with the allocation");
        a.free(0, p, 0).expect("free");
        a.check_invariants().expect("invariants");
    }
}

#[test]
fn a_block_is_not_reused_while_a_huge_event_delay_runs() {
    // `sim_event_delay_us` near its limit with the cost model: the event recorded at the free
    // (another stream used the block) must stay pending, so the block is not handed out again.
    let a = sim("sim_event_delay_us:18446744073709551,sim_cost_model:True");
    let (s1, s2) = (Stream(1), Stream(2));
    let p = a.malloc(0, MIB, s1).expect("malloc");
    a.record_stream(0, p, s2).expect("record_stream");
    a.free(0, p, MIB).expect("free");
    for _ in 0..8 {
        let q = a.malloc(0, MIB, s1).expect("malloc");
        assert_ne!(q, p, "the block was reused while stream 2's event is pending");
    }
    a.check_invariants().expect("invariants");
}

#[test]
fn the_simulated_clock_saturates() {
    let a = sim("sim_event_delay_us:1000,sim_cost_model:True");
    a.advance_time(u64::MAX);
    a.advance_time(u64::MAX);
    let p = a.malloc(0, MIB, Stream(1)).expect("malloc after the clock's end");
    a.free(0, p, MIB).expect("free");
    let stats = a.stats(0).expect("stats");
    assert!(stats.heap.allocated_bytes.all.current == 0);
}

#[test]
fn memory_fractions_outside_zero_to_one_are_refused() {
    let a = sim("");
    for f in [f64::NAN, -0.5, 1.5, f64::INFINITY] {
        assert!(a.set_memory_fraction(0, f).is_err(), "{f}");
    }
    a.set_memory_fraction(0, 0.0).expect("0 is PyTorch's 'nothing may be reserved'");
    assert!(a.malloc(0, 512, Stream(0)).expect_err("nothing allowed").is_out_of_memory());
}

#[test]
fn step_names_with_a_nul_are_refused() {
    let a = sim("");
    let e = a.step_begin("ab\0cd").expect_err("NUL in a phase name");
    assert!(e.to_string().contains("phase"), "{e}");
}
