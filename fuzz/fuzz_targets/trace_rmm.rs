//! RMM's logging CSV: every input parses or gives a
//! positioned error, never a panic, an abort or unbounded memory.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stepalloc_stress::trace;

fuzz_target!(|data: &[u8]| {
    let _ = trace::rmm::parse(data);
});
