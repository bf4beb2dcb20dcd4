//! The CUDA IPC handle parser (PyTorch's `shareIpcHandle` bytes from another process) and the
//! range check a receiver makes with the offset and size sent beside it: any bytes are read or
//! refused with an error, never a panic; what is read encodes back (in both versions) to a
//! handle that reads the same; a storage is accepted only inside the mapping.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stepalloc::ipc::{check_range, Shareable};

fuzz_target!(|data: &[u8]| {
    if let Ok(handle) = Shareable::parse(data) {
        assert_eq!(Shareable::parse(&handle.encode()).ok(), Some(handle.clone()));
        assert_eq!(Shareable::parse(&handle.encode_as(2)).ok(), Some(handle.clone()));
        if let Shareable::Expandable { page, fds, .. } = &handle {
            let mapped = page.saturating_mul(fds.len() as u64);
            let word =
                |at: usize| data.get(at..at + 8).map_or(0, |b| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8])));
            let (offset, size) = (word(0), word(8));
            let inside = offset.checked_add(size).is_some_and(|end| end <= mapped);
            assert_eq!(check_range(offset, size, mapped).is_ok(), inside);
        }
    }
});
