//! User memory pools under process-wide stepalloc (`torch.cuda.MemPool`, which the Python
//! package's `patch_torch` replaces: PyTorch's own `MemPool` asks the pluggable allocator for
//! `createOrIncrefPool`, which it refuses). Pools are the private pools of CUDA graphs; the
//! capture hooks in `trampoline.cpp` route allocations to them as for a graph.
//! Layer: the boundary. Each export runs under `guard` and returns a status (or a count).
//!
//! Invariant: another library's alloc / free functions given for a pool's segments are called
//! under the device lock, with PyTorch's signatures, and only for that pool's segments.

use crate::guard::guard_status;
use crate::{allocator, cudaStream_t, device_index, AbiError};
use std::ffi::{c_int, c_void};
use stepalloc::{SegmentSource, Stream};

/// Another library's segment allocator, PyTorch's pluggable signatures.
#[allow(non_camel_case_types)]
pub type stepalloc_segment_alloc_fn = Option<unsafe extern "C" fn(usize, c_int, cudaStream_t) -> *mut c_void>;
/// Its free function, called with the size, device and stream given to its alloc.
#[allow(non_camel_case_types)]
pub type stepalloc_segment_free_fn = Option<unsafe extern "C" fn(*mut c_void, usize, c_int, cudaStream_t)>;

struct ForeignSource {
    alloc: unsafe extern "C" fn(usize, c_int, cudaStream_t) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, usize, c_int, cudaStream_t),
}

impl SegmentSource for ForeignSource {
    fn alloc(&mut self, device: usize, bytes: u64, stream: Stream) -> Option<u64> {
        let (Ok(size), Ok(device)) = (usize::try_from(bytes), c_int::try_from(device)) else { return None };
        // Safety: the caller of `stepalloc_pool_set_segment_allocator` promised a function of
        // this signature that stays loaded; the stream is the caller's opaque handle.
        let ptr = unsafe { (self.alloc)(size, device, stream.0 as usize as cudaStream_t) };
        (!ptr.is_null()).then_some(ptr as usize as u64)
    }

    fn free(&mut self, device: usize, addr: u64, bytes: u64, stream: Stream) {
        let device = c_int::try_from(device).unwrap_or(c_int::MAX);
        // Safety: as for `alloc`; `addr` came from that alloc with this size and stream.
        unsafe { (self.free)(addr as usize as *mut c_void, bytes as usize, device, stream.0 as usize as cudaStream_t) }
    }
}

/// `torch.cuda.MemPool()`: creates pool `(id0, id1)` on `device` with one reference, or takes
/// another reference to it. Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_pool_create(device: c_int, id0: u64, id1: u64) -> c_int {
    guard_status(|| {
        let index = device_index(device)?;
        allocator()?.with_heap(index, |heap| heap.create_pool((id0, id1)))?;
        Ok(())
    })
}

/// `MemPool.use_count()`: the references to pool `(id0, id1)` on `device` (0: no such pool);
/// -1 on an error (left in the last error).
#[no_mangle]
pub extern "C" fn stepalloc_pool_use_count(device: c_int, id0: u64, id1: u64) -> c_int {
    let mut answer = -1;
    guard_status(|| {
        let index = device_index(device)?;
        let count = allocator()?.with_heap(index, |heap| heap.pool_use_count((id0, id1)))?;
        answer = c_int::try_from(count).unwrap_or(c_int::MAX);
        Ok(())
    });
    answer
}

/// `MemPool(allocator=...)`: the segments of pool `(id0, id1)` on `device` come from
/// `alloc_fn` and go back through `free_fn` (both NULL: from the device again). The pool must
/// exist and hold no segment yet. Returns a status.
///
/// The functions have PyTorch's pluggable signatures, must stay loaded while the pool has
/// segments, and must not call into stepalloc (they run under its device lock).
#[no_mangle]
pub extern "C" fn stepalloc_pool_set_segment_allocator(
    device: c_int,
    id0: u64,
    id1: u64,
    alloc_fn: stepalloc_segment_alloc_fn,
    free_fn: stepalloc_segment_free_fn,
) -> c_int {
    guard_status(|| {
        let index = device_index(device)?;
        let source: Option<Box<dyn SegmentSource>> = match (alloc_fn, free_fn) {
            (Some(alloc), Some(free)) => Some(Box::new(ForeignSource { alloc, free })),
            (None, None) => None,
            _ => return Err(AbiError::invalid("a pool's segment allocator needs both alloc_fn and free_fn".into())),
        };
        allocator()?.with_heap(index, |heap| heap.set_pool_segment_source((id0, id1), source))??;
        Ok(())
    })
}

/// `MemPool(use_on_oom=True)`: with `on` non-zero, a general allocation on `device` that finds
/// no memory may take a free block of pool `(id0, id1)`. Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_pool_set_use_on_oom(device: c_int, id0: u64, id1: u64, on: c_int) -> c_int {
    guard_status(|| {
        let index = device_index(device)?;
        allocator()?.with_heap(index, |heap| heap.set_pool_use_on_oom((id0, id1), on != 0))??;
        Ok(())
    })
}

/// `MemPool(no_split=True)`: with `on` non-zero, each block of pool `(id0, id1)` on `device`
/// takes a whole segment and is never split. Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_pool_set_no_split(device: c_int, id0: u64, id1: u64, on: c_int) -> c_int {
    guard_status(|| {
        let index = device_index(device)?;
        allocator()?.with_heap(index, |heap| heap.set_pool_no_split((id0, id1), on != 0))??;
        Ok(())
    })
}
