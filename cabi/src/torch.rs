//! The entry points PyTorch calls, with PyTorch's exact signatures (the C part; the C++ part,
//! `stepalloc_torch_malloc` and the CUDA-graph pool hooks, is in `trampoline.cpp`).
//! Layer: the boundary. Each export runs under `guard`; a failure sets the thread's last error.
//!
//! Hot path: `stepalloc_malloc` and `stepalloc_free` do no heap allocation and no formatting
//! unless they fail: one atomic load for the process-wide allocator, one of the C++ unit's
//! count of captures underway (its filters are called only while a CUDA graph is being
//! captured), the device lock, the heap operation; no thread-local access until a call has
//! failed or a region has been entered.

use crate::guard::{guard, guard_status};
use crate::{allocator, cudaStream_t, device_index, AbiError};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;
use stepalloc::{Error, OomReport, PoolId, Stream};

extern "C" {
    /// Defined in trampoline.cpp. When a CUDA graph capture is underway on `device` and one of
    /// its filters claims `stream`, writes the capture's pool id to `pool[0..2]` and returns 1;
    /// otherwise returns 0 (first checking an atomic count, so this is cheap with no capture).
    /// Never throws.
    fn stepalloc_internal_capture_pool(device: c_int, stream: cudaStream_t, pool: *mut u64) -> c_int;
    /// Defined in trampoline.cpp (hidden): capture table entries; 0 when no capture is underway.
    static stepalloc_internal_captures: AtomicI32;
}

/// The pool of the capture that claims `stream` on `device`, if any (a capture is underway).
#[inline(never)]
fn capture_pool(device: c_int, stream: cudaStream_t) -> Option<PoolId> {
    let mut pool = [0u64; 2];
    // Safety: defined in trampoline.cpp; writes at most two integers into `pool`, never throws.
    let captured = unsafe { stepalloc_internal_capture_pool(device, stream, pool.as_mut_ptr()) } != 0;
    captured.then_some((pool[0], pool[1]))
}

fn stream_of(stream: cudaStream_t) -> Stream {
    Stream(stream as usize as u64)
}

/// Allocates `size` bytes on `device` for use on `stream`; returns NULL when it fails (out of
/// memory after the whole out-of-memory path, or a bad argument) and sets the last error.
///
/// Size 0 returns a valid, unique pointer (a 512-byte block) that must be freed like any
/// other, so a non-NULL result always means success. While a CUDA graph capture is underway
/// (`stepalloc_begin_allocate_to_pool`), allocations on the capturing stream go to the graph's
/// private pool. This is the function for `torch.cuda.MemPool` mode, where NULL is the
/// supported out-of-memory signal; process-wide mode uses `stepalloc_torch_malloc`.
#[no_mangle]
// The stream is an opaque handle passed on to the filters; nothing dereferences it.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub extern "C" fn stepalloc_malloc(size: usize, device: c_int, stream: cudaStream_t) -> *mut c_void {
    guard(|| {
        let index = device_index(device)?;
        let allocator = allocator()?;
        // Safety: an atomic integer defined in trampoline.cpp, never moved or freed.
        let pool = if unsafe { stepalloc_internal_captures.load(Ordering::Relaxed) } == 0 {
            None
        } else {
            capture_pool(device, stream)
        };
        let ptr = allocator.malloc_in_pool(index, size as u64, stream_of(stream), pool);
        if let Err(Error::OutOfMemory(report)) = &ptr {
            notify_oom_observers(device, report);
        }
        Ok(ptr? as usize as *mut c_void)
    })
}

/// An out-of-memory observer, PyTorch's signature: device, bytes asked for, the bytes the
/// process may use on the device (its memory fraction's share, else the device's total), and
/// the device's free bytes.
#[allow(non_camel_case_types)]
pub type stepalloc_oom_observer_fn = Option<unsafe extern "C" fn(i64, usize, usize, usize)>;

static OOM_OBSERVERS: Mutex<Vec<unsafe extern "C" fn(i64, usize, usize, usize)>> = Mutex::new(Vec::new());

/// Calls every observer. Runs after the allocation failed and its device lock was released, so
/// an observer may allocate or take a snapshot.
fn notify_oom_observers(device: c_int, report: &OomReport) {
    let observers = OOM_OBSERVERS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let limit = report.allowed.unwrap_or(report.device_total);
    let size = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    for observer in observers {
        // Safety: `stepalloc_attach_oom_observer`'s caller promised a function of this signature
        // that stays callable for the life of the process.
        unsafe { observer(i64::from(device), size(report.requested), size(limit), size(report.device_free)) };
    }
}

/// `torch._C._cuda_attach_out_of_memory_observer`: `observer` is called on every out-of-memory
/// of `stepalloc_malloc` / `stepalloc_torch_malloc`, before the failure is returned (PyTorch
/// calls its observers before it raises). Observers stay for the life of the process and must
/// not unwind. Returns a status (`STEPALLOC_INVALID_ARGUMENT` for NULL).
#[no_mangle]
pub extern "C" fn stepalloc_attach_oom_observer(observer: stepalloc_oom_observer_fn) -> c_int {
    guard_status(|| {
        let Some(observer) = observer else {
            return Err(AbiError::invalid("stepalloc_attach_oom_observer: observer is NULL".into()));
        };
        OOM_OBSERVERS.lock().unwrap_or_else(|e| e.into_inner()).push(observer);
        Ok(())
    })
}

/// Asks the caches for the lines `free(ptr)` reads first, the freed block's home bucket (its
/// state bytes and four records, `Allocator::home_lines`), before the device lock is taken: in
/// a large heap the record is a miss, which then overlaps the lock's atomic instruction.
#[inline(always)]
fn prefetch_home(allocator: &stepalloc::Allocator, device: usize, ptr: u64) {
    #[cfg(target_arch = "x86_64")]
    if let Some((states, records)) = allocator.home_lines(device, ptr) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // Safety: a prefetch is a hint that never faults and changes no memory, whatever the
        // address (these may be stale: the hint is read without the lock); SSE is part of x86-64.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(states as *const i8);
            for line in 0..4 {
                _mm_prefetch::<_MM_HINT_T0>(records.wrapping_add(64 * line) as *const i8);
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (allocator, device, ptr);
}

/// Frees a pointer from `stepalloc_malloc` / `stepalloc_torch_malloc`. `size` is the size
/// asked for at allocation (0: not checked) and `device` the device it was allocated on; the
/// stream is the one given at allocation and is not needed. Freeing NULL does nothing.
/// An unknown pointer, a double free, or a wrong size or device changes nothing and sets the
/// last error (`STEPALLOC_UNKNOWN_POINTER` or `STEPALLOC_INVALID_ARGUMENT`).
#[no_mangle]
pub extern "C" fn stepalloc_free(ptr: *mut c_void, size: usize, device: c_int, stream: cudaStream_t) {
    let _ = stream;
    guard(|| {
        if ptr.is_null() {
            return Ok(());
        }
        let index = device_index(device)?;
        let allocator = allocator()?;
        prefetch_home(allocator, index, ptr as usize as u64);
        allocator.free(index, ptr as usize as u64, size as u64)?;
        Ok(())
    })
}

/// PyTorch's init hook: creates the allocator (reading `STEPALLOC_CONF` or the string given to
/// `stepalloc_configure`). Sets the last error when that fails or when PyTorch sees more
/// devices than the allocator has.
#[no_mangle]
pub extern "C" fn stepalloc_init(device_count: c_int) {
    guard(|| {
        let allocator = allocator()?;
        let have = allocator.device_count();
        if device_count < 0 || device_count as usize > have {
            return Err(AbiError::invalid(format!(
                "PyTorch reports {device_count} devices but stepalloc has {have} (backend {:?})",
                allocator.config().backend
            )));
        }
        Ok(())
    })
}

/// `torch.cuda.empty_cache()`: returns every unused cached segment on every device.
#[no_mangle]
pub extern "C" fn stepalloc_empty_cache() {
    guard(|| {
        allocator()?.empty_cache()?;
        Ok(())
    })
}

/// `torch.cuda.set_per_process_memory_fraction(fraction, device)`; `fraction` in [0, 1]
/// (0, as PyTorch accepts it: nothing may be reserved).
#[no_mangle]
pub extern "C" fn stepalloc_set_memory_fraction(fraction: f64, device: c_int) {
    guard(|| {
        let index = device_index(device)?;
        allocator()?.set_memory_fraction(index, fraction)?;
        Ok(())
    })
}

/// `torch.cuda.get_per_process_memory_fraction(device)`: the fraction in [0, 1] last set for
/// `device` (1.0 when none was); -1.0 on an error (left in the last error).
#[no_mangle]
pub extern "C" fn stepalloc_memory_fraction(device: c_int) -> f64 {
    let mut answer = -1.0;
    guard_status(|| {
        let index = device_index(device)?;
        answer = allocator()?.memory_fraction(index)?;
        Ok(())
    });
    answer
}

/// `torch.cuda.memory._set_allocator_settings("expandable_segments:True")` (or `False`): with
/// `on` non-zero the general pool's new segments are expandable on every device, else plain;
/// segments already made keep their kind. Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_set_expandable_segments(on: c_int) -> c_int {
    guard_status(|| {
        allocator()?.set_expandable_segments(on != 0);
        Ok(())
    })
}

/// `torch.cuda.caching_allocator_enable(enabled)`: with `enabled` zero, a general request on
/// any device takes a device allocation of its own (a segment, never split) that goes back to
/// the device when freed, until caching is enabled again. Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_set_caching_enabled(enabled: c_int) -> c_int {
    guard_status(|| {
        allocator()?.set_caching_enabled(enabled != 0);
        Ok(())
    })
}

/// `torch._C._cuda_cudaCachingAllocator_is_enabled()`: 1 when caching is enabled, 0 when not,
/// -1 on an error (left in the last error).
#[no_mangle]
pub extern "C" fn stepalloc_caching_enabled() -> c_int {
    let mut answer = -1;
    guard_status(|| {
        answer = c_int::from(allocator()?.caching_enabled());
        Ok(())
    });
    answer
}

/// The segment holding `ptr` (anywhere inside it): returns its base address and writes its size
/// to `*size`. NULL when `ptr` is in no segment or `size` is NULL, and (as PyTorch's
/// `getBaseAllocation` refuses) when `ptr` is in an expandable segment (status
/// `STEPALLOC_INVALID_ARGUMENT`; the last error says why).
///
/// # Safety
/// `size` must be NULL or point to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_base_alloc(ptr: *mut c_void, size: *mut usize) -> *mut c_void {
    guard(|| {
        if size.is_null() {
            return Err(AbiError::invalid("stepalloc_base_alloc: size is NULL".into()));
        }
        let addr = ptr as usize as u64;
        let (base, bytes) = allocator()?.base_allocation(addr)?.ok_or(AbiError::UnknownPointer(addr))?;
        // Safety: checked non-NULL above; the caller guarantees it points to a size_t.
        unsafe { *size = bytes as usize };
        Ok(base as usize as *mut c_void)
    })
}

/// MemPool mode (`torch.cuda.MemPool`, `stepalloc.mempool()`): PyTorch's caching allocator
/// caches in front of stepalloc and frees a segment only to give it back, so with `on` non-zero
/// a free that leaves one of stepalloc's segments entirely free returns it to the device
/// (`torch.cuda.empty_cache()` then gives memory back). Applies to every device. Returns a
/// status.
#[no_mangle]
pub extern "C" fn stepalloc_set_mempool_mode(on: c_int) -> c_int {
    crate::guard::guard_status(|| {
        allocator()?.set_mempool_mode(on != 0);
        Ok(())
    })
}

/// `Tensor.record_stream(stream)`: the block at `ptr` is reused only after the work queued on
/// `stream` before its free has completed.
#[no_mangle]
pub extern "C" fn stepalloc_record_stream(ptr: *mut c_void, stream: cudaStream_t) {
    guard(|| {
        let addr = ptr as usize as u64;
        let allocator = allocator()?;
        let device = allocator.device_of(addr).ok_or(AbiError::UnknownPointer(addr))?;
        allocator.record_stream(device, addr, stream_of(stream))?;
        Ok(())
    })
}

// ----- called by trampoline.cpp only (exported as a side effect of `no_mangle`; not in the
// ----- header, not part of the interface) ------------------------------------------------

/// A CUDA graph capture (`route` 0) or a route (`route` 1: `use_mem_pool`, whose filter
/// claims the default stream) begins allocating to pool `(id0, id1)` on `device`. Returns a
/// status.
#[no_mangle]
pub extern "C" fn stepalloc_internal_pool_begin(device: c_int, id0: u64, id1: u64, route: c_int) -> c_int {
    crate::guard::guard_status(|| {
        let index = device_index(device)?;
        if route != 0 {
            allocator()?.begin_route_to_pool(index, (id0, id1))?;
        } else {
            allocator()?.begin_allocate_to_pool(index, (id0, id1))?;
        }
        Ok(())
    })
}

/// The capture (`route` 0) or route (`route` 1) into pool `(id0, id1)` on `device` ends.
/// Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_internal_pool_end(device: c_int, id0: u64, id1: u64, route: c_int) -> c_int {
    crate::guard::guard_status(|| {
        let index = device_index(device)?;
        if route != 0 {
            allocator()?.end_route_to_pool(index, (id0, id1))?;
        } else {
            allocator()?.end_allocate_to_pool(index, (id0, id1))?;
        }
        Ok(())
    })
}

/// The graph owning pool `(id0, id1)` is destroyed. Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_internal_pool_release(device: c_int, id0: u64, id1: u64) -> c_int {
    crate::guard::guard_status(|| {
        let index = device_index(device)?;
        allocator()?.release_pool(index, (id0, id1))?;
        Ok(())
    })
}

/// A capture into pool `(id0, id1)` on `device` will never end (it failed): count it as ended.
/// Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_internal_pool_abandon(device: c_int, id0: u64, id1: u64) -> c_int {
    crate::guard::guard_status(|| {
        let index = device_index(device)?;
        allocator()?.abandon_capture(index, (id0, id1))?;
        Ok(())
    })
}

/// Whether `stream` on `device` is being captured: 1 yes, 0 no, -1 unknown (an error, left in
/// the last error).
#[no_mangle]
// The stream is an opaque handle passed on to the backend; nothing dereferences it.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub extern "C" fn stepalloc_internal_stream_is_capturing(device: c_int, stream: cudaStream_t) -> c_int {
    let mut answer = -1;
    crate::guard::guard_status(|| {
        let index = device_index(device)?;
        answer = c_int::from(allocator()?.stream_is_capturing(index, stream_of(stream))?);
        Ok(())
    });
    answer
}

/// Captures into pool `(id0, id1)` on `device` that the core counts as underway; -1 on an
/// error (left in the last error).
#[no_mangle]
pub extern "C" fn stepalloc_internal_pool_captures(device: c_int, id0: u64, id1: u64) -> c_int {
    let mut answer = -1;
    crate::guard::guard_status(|| {
        let index = device_index(device)?;
        let count = allocator()?.pool_captures(index, (id0, id1))?;
        answer = c_int::try_from(count).unwrap_or(c_int::MAX);
        Ok(())
    });
    answer
}
