//! Format detection from the first bytes, then whichever reader it picks: every input parses or gives a
//! positioned error, never a panic, an abort or unbounded memory.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stepalloc_stress::trace;

fuzz_target!(|data: &[u8]| {
    let _ = trace::parse(data);
});
