//! CUDA IPC: a block handed to another process in PyTorch's format, and ranges another process
//! handed to this one (`stepalloc.ipc` in Python calls these from its patched
//! `torch.UntypedStorage._share_cuda_` / `_new_shared_cuda`). Layer: the boundary; each export
//! runs under `guard`. Not on the hot path.

use crate::guard::{guard, guard_status};
use crate::{allocator, device_index, AbiError};
use std::ffi::{c_char, c_int, c_void};

/// Shares the allocation that starts at `ptr`: writes the handle bytes that PyTorch's
/// `rebuild_cuda_tensor` opens (a legacy `cudaIpcMemHandle_t` for a plain segment, the
/// expandable-segment header with POSIX file descriptors for an expandable one) into `buf`
/// when they fit in `cap`, and the block's offset in the shared range into `*offset`.
/// `version` is the receiver's torch's handle version: 2 for torch 2.4 to 2.12 (which refuse
/// version 3), 3 (or 0) for the newest. The same block shared again gives the same bytes.
/// Returns the handle's length (a caller whose buffer was too small calls again with one that
/// size), or 0 with the last error set. The descriptors stay open in this process until the
/// pages are released; keeping the block allocated while a receiver holds it is the caller's
/// part.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes; `offset` must point to a `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_ipc_share(
    ptr: *mut c_void,
    version: c_int,
    buf: *mut c_char,
    cap: usize,
    offset: *mut u64,
) -> usize {
    guard(|| {
        if offset.is_null() {
            return Err(AbiError::invalid("stepalloc_ipc_share: offset is NULL".into()));
        }
        let addr = ptr as usize as u64;
        let allocator = allocator()?;
        let device = allocator.device_of(addr).ok_or(AbiError::UnknownPointer(addr))?;
        if !matches!(version, 0 | 2 | 3) {
            return Err(AbiError::invalid(format!(
                "stepalloc_ipc_share: handle version {version}; 2 (torch 2.4 to 2.12), 3 or 0 (the newest)"
            )));
        }
        let (handle, at) = allocator.with_heap(device, |heap| heap.share(addr))??;
        let bytes = handle.encode_as(version as u8);
        if !buf.is_null() && bytes.len() <= cap {
            // Safety: the caller guarantees `cap` writable bytes at `buf`; the length fits.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len()) };
        }
        // Safety: checked non-NULL above; the caller guarantees it points to a uint64_t.
        unsafe { *offset = at };
        Ok(bytes.len())
    })
}

/// Maps on `device` the range another process shared (`handle`, `len` bytes, from PyTorch or
/// stepalloc) for the storage of `size` bytes at `offset` in it (both sent beside the handle),
/// and writes the range's base address here to `*out`: the storage is at `*out + offset`, and
/// `stepalloc_ipc_close` takes the base. A storage that does not lie inside what the handle
/// maps is refused (`STEPALLOC_INVALID_ARGUMENT`, naming offset, size and the mapping's size)
/// and nothing stays mapped. The same handle opened again maps once and is counted. Returns a
/// status.
///
/// # Safety
/// `handle` must point to `len` readable bytes; `out` must point to a `void *`.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_ipc_open(
    device: c_int,
    handle: *const c_char,
    len: usize,
    offset: u64,
    size: u64,
    out: *mut *mut c_void,
) -> c_int {
    guard_status(|| {
        if handle.is_null() || out.is_null() || len > (1 << 24) {
            return Err(AbiError::invalid(
                "stepalloc_ipc_open: handle or out is NULL, or the handle is too long".into(),
            ));
        }
        let device = device_index(device)?;
        // Safety: the caller guarantees `len` readable bytes at `handle`.
        let bytes = unsafe { std::slice::from_raw_parts(handle.cast::<u8>(), len) };
        let base = allocator()?.with_heap(device, |heap| heap.open_shared(bytes, offset, size))??;
        // Safety: checked non-NULL above; the caller guarantees it points to a void *.
        unsafe { *out = base as usize as *mut c_void };
        Ok(())
    })
}

/// Says that the receivers of one `stepalloc_ipc_share` of the allocation at `ptr` let go of
/// it (PyTorch's reference counter fell to zero). Until each share is let go of, a pause of the
/// allocation's tag is refused: a receiver keeps the pages it mapped. Returns a status
/// (`STEPALLOC_UNKNOWN_POINTER` for an allocation not shared).
#[no_mangle]
pub extern "C" fn stepalloc_ipc_unshare(ptr: *mut c_void) -> c_int {
    guard_status(|| {
        let addr = ptr as usize as u64;
        let allocator = allocator()?;
        let device = allocator.device_of(addr).ok_or(AbiError::UnknownPointer(addr))?;
        allocator.with_heap(device, |heap| heap.unshare(addr))??;
        Ok(())
    })
}

/// Closes one `stepalloc_ipc_open` of the range at `base` on `device`; the last close unmaps
/// it. Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_ipc_close(device: c_int, base: *mut c_void) -> c_int {
    guard_status(|| {
        let device = device_index(device)?;
        allocator()?.with_heap(device, |heap| heap.close_shared(base as usize as u64))??;
        Ok(())
    })
}
