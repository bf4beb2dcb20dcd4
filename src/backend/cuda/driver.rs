//! Loading the CUDA driver and reading its results: the driver functions resolved by exact name
//! from the library cudarc opened (`Api`), each result read as a plain `i32` and mapped once to
//! the crate's error (`check`, `map_error`), the C structs of the virtual-memory calls, and the
//! two guards every call runs under (`CurrentContext`, `RelaxedCapture`). Layer: the CUDA
//! backend's boundary with the driver; nothing here holds device state.

use super::{codes, ipc};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::panic::catch_unwind;
use std::sync::OnceLock;

pub(super) type CuContext = *mut c_void;
pub(super) type CuStream = *mut c_void;
pub(super) type CuEvent = *mut c_void;
pub(super) type CuGraph = *mut c_void;

pub(super) const CUDA_SUCCESS: i32 = 0;
pub(super) const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
pub(super) const CUDA_ERROR_NOT_READY: i32 = 600;
pub(super) const CU_EVENT_DISABLE_TIMING: c_uint = 2;
pub(super) const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
pub(super) const CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: c_int = 102;
pub(super) const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
pub(super) const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
pub(super) const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
pub(super) const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct MemLocation {
    pub(super) kind: c_int,
    pub(super) id: c_int,
}

/// `CUmemAllocationProp` (the enums as the `int`s they are in C).
#[repr(C)]
pub(super) struct AllocationProp {
    pub(super) kind: c_int,
    pub(super) requested_handle_types: c_int,
    pub(super) location: MemLocation,
    pub(super) win32_handle_meta_data: *mut c_void,
    pub(super) compression_type: u8,
    pub(super) gpu_direct_rdma_capable: u8,
    pub(super) usage: u16,
    pub(super) reserved: [u8; 4],
}

/// `CUmemAccessDesc`.
#[repr(C)]
pub(super) struct AccessDesc {
    pub(super) location: MemLocation,
    pub(super) flags: c_int,
}

macro_rules! driver_api {
    ($( $field:ident = $symbol:literal: fn($($arg:ty),*); )*) => {
        /// The driver functions this crate calls, each typed as in the CUDA driver API reference
        /// except that every result is a plain `i32`. Some are used only by the tests (captures) or
        /// by `tools` (streams, memsets, copies for tools and tests that drive a device beside
        /// the allocator).
        #[cfg_attr(not(test), allow(dead_code))]
        pub(super) struct Api {
            $( pub(super) $field: unsafe extern "C" fn($($arg),*) -> i32, )*
        }

        impl Api {
            fn load() -> std::result::Result<Api, String> {
                Ok(Api { $( $field: symbol::<unsafe extern "C" fn($($arg),*) -> i32>($symbol)?, )* })
            }
        }
    };
}

driver_api! {
    init = "cuInit": fn(c_uint);
    device_get_count = "cuDeviceGetCount": fn(*mut c_int);
    device_get = "cuDeviceGet": fn(*mut c_int, c_int);
    device_get_name = "cuDeviceGetName": fn(*mut c_char, c_int, c_int);
    device_total_mem = "cuDeviceTotalMem_v2": fn(*mut usize, c_int);
    device_get_attribute = "cuDeviceGetAttribute": fn(*mut c_int, c_int, c_int);
    primary_ctx_retain = "cuDevicePrimaryCtxRetain": fn(*mut CuContext, c_int);
    primary_ctx_get_state = "cuDevicePrimaryCtxGetState": fn(c_int, *mut c_uint, *mut c_int);
    ctx_get_current = "cuCtxGetCurrent": fn(*mut CuContext);
    ctx_set_current = "cuCtxSetCurrent": fn(CuContext);
    ctx_synchronize = "cuCtxSynchronize": fn();
    mem_get_info = "cuMemGetInfo_v2": fn(*mut usize, *mut usize);
    mem_alloc = "cuMemAlloc_v2": fn(*mut u64, usize);
    mem_free = "cuMemFree_v2": fn(u64);
    memcpy_htod = "cuMemcpyHtoD_v2": fn(u64, *const c_void, usize);
    memcpy_dtoh = "cuMemcpyDtoH_v2": fn(*mut c_void, u64, usize);
    memset_d32 = "cuMemsetD32_v2": fn(u64, c_uint, usize);
    memset_d32_async = "cuMemsetD32Async": fn(u64, c_uint, usize, CuStream);
    event_create = "cuEventCreate": fn(*mut CuEvent, c_uint);
    event_record = "cuEventRecord": fn(CuEvent, CuStream);
    event_query = "cuEventQuery": fn(CuEvent);
    event_synchronize = "cuEventSynchronize": fn(CuEvent);
    stream_create = "cuStreamCreate": fn(*mut CuStream, c_uint);
    stream_destroy = "cuStreamDestroy_v2": fn(CuStream);
    stream_synchronize = "cuStreamSynchronize": fn(CuStream);
    stream_get_ctx = "cuStreamGetCtx": fn(CuStream, *mut CuContext);
    stream_begin_capture = "cuStreamBeginCapture_v2": fn(CuStream, c_int);
    stream_end_capture = "cuStreamEndCapture": fn(CuStream, *mut CuGraph);
    stream_is_capturing = "cuStreamIsCapturing": fn(CuStream, *mut c_int);
    graph_destroy = "cuGraphDestroy": fn(CuGraph);
    thread_exchange_capture_mode = "cuThreadExchangeStreamCaptureMode": fn(*mut c_int);
    mem_get_allocation_granularity = "cuMemGetAllocationGranularity": fn(*mut usize, *const AllocationProp, c_int);
    mem_address_reserve = "cuMemAddressReserve": fn(*mut u64, usize, usize, u64, u64);
    mem_address_free = "cuMemAddressFree": fn(u64, usize);
    mem_create = "cuMemCreate": fn(*mut u64, usize, *const AllocationProp, u64);
    mem_release = "cuMemRelease": fn(u64);
    mem_map = "cuMemMap": fn(u64, usize, usize, u64, u64);
    mem_set_access = "cuMemSetAccess": fn(u64, usize, *const AccessDesc, usize);
    mem_unmap = "cuMemUnmap": fn(u64, usize);
    ipc_get_mem_handle = "cuIpcGetMemHandle": fn(*mut ipc::IpcMemHandle, u64);
    ipc_open_mem_handle = "cuIpcOpenMemHandle_v2": fn(*mut u64, ipc::IpcMemHandle, c_uint);
    ipc_close_mem_handle = "cuIpcCloseMemHandle": fn(u64);
    mem_get_address_range = "cuMemGetAddressRange_v2": fn(*mut u64, *mut usize, u64);
    mem_export_to_shareable_handle = "cuMemExportToShareableHandle": fn(*mut c_void, u64, c_int, u64);
    mem_import_from_shareable_handle = "cuMemImportFromShareableHandle": fn(*mut u64, *mut c_void, c_int);
}

/// One driver function from the library cudarc opened, by its exact name.
pub(super) fn symbol<F: Copy>(name: &str) -> std::result::Result<F, String> {
    // Safety: called only after `is_culib_present()` (so `culib` opens the library rather than
    // panicking); `F` is the function's C signature from the driver API reference, with the
    // `CUresult` return read as the `int` it is.
    let found = unsafe { sys::culib().get::<F>(name.as_bytes()) };
    found.map(|f| *f).map_err(|e| format!("the CUDA driver library has no {name} ({e}); is the driver too old?"))
}

/// The driver's functions, loaded once. Precondition: `is_culib_present()`.
pub(super) fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        catch_unwind(Api::load).unwrap_or_else(|_| Err("loading the CUDA driver library panicked".into()))
    })
    .as_ref()
    .map_err(|e| Error::Unavailable(e.clone()))
}

pub(super) fn driver_present() -> bool {
    // Safety: only tries to dlopen the driver library and closes it again.
    catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

/// Maps a driver result once, at the boundary: out of memory is retryable; the rest is named
/// (or numbered, when the code is one this crate does not know).
pub(super) fn map_error(call: &'static str, code: i32) -> Error {
    if code == CUDA_ERROR_OUT_OF_MEMORY {
        Error::OutOfMemory(Box::default())
    } else {
        Error::Driver { call, code: codes::describe(code) }
    }
}

/// A driver result as `Result`.
pub(super) fn check(call: &'static str, code: i32) -> Result<()> {
    if code == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(map_error(call, code))
    }
}

/// Makes `context` current for the duration of a call and restores the caller's context.
pub(super) struct CurrentContext {
    api: &'static Api,
    /// The caller's context (null: none) when we replaced it; `None` when it was already ours.
    restore: Option<CuContext>,
}

impl CurrentContext {
    pub(super) fn enter(api: &'static Api, context: CuContext) -> Result<CurrentContext> {
        let mut previous: CuContext = std::ptr::null_mut();
        // Safety: the driver writes one handle through the pointer.
        check("cuCtxGetCurrent", unsafe { (api.ctx_get_current)(&mut previous) })?;
        if previous == context {
            return Ok(CurrentContext { api, restore: None });
        }
        // Safety: `context` is a retained primary context (ours, or a stream's that is live).
        check("cuCtxSetCurrent", unsafe { (api.ctx_set_current)(context) })?;
        Ok(CurrentContext { api, restore: Some(previous) })
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        if let Some(previous) = self.restore {
            // Safety: `previous` was current on this thread a moment ago (or null, which unbinds);
            // a failure leaves our context current, which the next call handles the same way.
            let _ = unsafe { (self.api.ctx_set_current)(previous) };
        }
    }
}

/// Switches this thread's stream-capture mode to relaxed for a call and restores it after.
pub(super) struct RelaxedCapture {
    api: &'static Api,
    previous: c_int,
}

impl RelaxedCapture {
    pub(super) fn enter(api: &'static Api) -> Result<RelaxedCapture> {
        let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        // Safety: the driver reads and writes one int through the pointer.
        check("cuThreadExchangeStreamCaptureMode", unsafe { (api.thread_exchange_capture_mode)(&mut mode) })?;
        Ok(RelaxedCapture { api, previous: mode })
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // Safety: as in `enter`; restores the mode this thread had.
        let _ = unsafe { (self.api.thread_exchange_capture_mode)(&mut mode) };
    }
}
