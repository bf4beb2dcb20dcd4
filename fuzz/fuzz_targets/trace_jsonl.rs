//! stepalloc's JSON-lines trace: every input parses or gives a
//! positioned error, never a panic, an abort or unbounded memory. With `module` / `torch_op`
//! on alloc lines (the seed `recorded_sites`), a parsed trace has one site per allocation and
//! each names a recorded site of bounded length.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stepalloc_stress::trace;

fuzz_target!(|data: &[u8]| {
    if let Ok(program) = trace::jsonl::parse(data) {
        if program.has_sites() {
            assert_eq!(program.notes.sites.per_alloc.len(), program.count_allocs());
            assert_eq!(program.notes.sites.names.len(), program.notes.sites.ops.len());
            for n in 0..program.count_allocs() {
                let site = program.site_of(n);
                assert!(program.site_name(site).len() <= trace::jsonl::MAX_SITE_FIELD);
                assert!(program.site_op(site).len() <= trace::jsonl::MAX_SITE_FIELD);
            }
        }
    }
});
