//! `fit --pytorch-conf`: a user's `PYTORCH_CUDA_ALLOC_CONF` read as PyTorch reads it; any text
//! (and any device size) is translated into a configuration the core accepts, or refused with
//! an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let capacity_mb = u64::from(u16::from_le_bytes([data[0], data[1]])) + 2;
    let usable_mb = (u64::from(u16::from_le_bytes([data[2], data[3]])) % capacity_mb).max(2);
    if let Ok(text) = std::str::from_utf8(&data[4..]) {
        if let Ok(t) = stepalloc_stress::torch_conf::translate(text, capacity_mb, usable_mb) {
            assert!(stepalloc::Config::parse(&t.conf).is_ok(), "{}", t.conf);
        }
    }
});
