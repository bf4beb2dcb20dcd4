//! `stepalloc-stress replay` end to end: a trace in any format, parsed and, when small, replayed
//! on the simulated device under PyTorch's rules, stepalloc's recommended configuration, a small
//! address space and a tiny device (sizes, streams, devices and time jumps straight from the
//! input reach the allocator).
#![no_main]

use libfuzzer_sys::fuzz_target;
use stepalloc_stress::compare::{self, Base};
use stepalloc_stress::{replay, trace};

/// Programs above this many events are parsed only (a replay per input must stay fast).
const MAX_REPLAYED_OPS: usize = 2000;

fuzz_target!(|data: &[u8]| {
    let Ok(program) = trace::parse(data) else { return };
    if program.ops.len() > MAX_REPLAYED_OPS {
        return;
    }
    let base = Base { cuda: false, capacity_mb: 1024, devices: program.devices };
    let names = [
        "pytorch".to_string(),
        "stepalloc".to_string(),
        // A small address space: PyTorch-size ranges (1.125 GiB) never fit, so every range is
        // sized to its pages, and the input's streams can exhaust it before memory. Free pages
        // over the cache limit go three allocations after the free that went over it.
        "expandable_segments:True,large_segment_size_mb:2,page_reuse:True,page_release:True,cache_limit_mb:1,page_release_grace:3,sim_address_space_mb:256".to_string(),
        // A device of three pages.
        "sim_capacity_mb:6,expandable_segments:True,large_segment_size_mb:2,pack_small:True".to_string(),
    ];
    let Ok(configs) = compare::resolve(&names, &base) else { return };
    for rc in &configs {
        // Refusals are fine; a heap left inconsistent is a bug.
        if let Err(e) = replay::run(&program, rc, None, None) {
            assert!(!e.contains("invariants broken"), "{e}");
        }
    }
});
