//! The configuration string parser (`PYTORCH_CUDA_ALLOC_CONF` / `STEPALLOC_CONF` syntax):
//! any text is accepted or refused with an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = stepalloc::Config::parse(text);
    }
});
