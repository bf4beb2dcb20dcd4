//! The CUDA IPC handle parser (PyTorch's `shareIpcHandle` bytes from another process): any bytes
//! are read or refused with an error, never a panic; what is read encodes back to a handle that
//! reads the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stepalloc::ipc::Shareable;

fuzz_target!(|data: &[u8]| {
    if let Ok(handle) = Shareable::parse(data) {
        assert_eq!(Shareable::parse(&handle.encode()).ok(), Some(handle));
    }
});
