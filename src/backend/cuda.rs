//! The CUDA backend: the driver API, loaded at run time through cudarc's `dynamic-loading`
//! (so the crate builds and runs on machines without CUDA). Layer: below the heap, one value
//! per device.
//!
//! Invariants and rules:
//! - Nothing here runs at library load or at exit. `open_all` is the first driver call, made
//!   when the allocator is created on first use; a `CudaDevice` is never dropped with the
//!   process-wide allocator (it leaks at exit by design: PyTorch may still free tensors while the
//!   process tears down, and the driver may already be gone).
//! - Driver results are read as plain integers, never as cudarc's `CUresult` enum: a driver
//!   newer than the enum returns codes it does not list (226 `CUDA_ERROR_CONTAINED`, 46, 810,
//!   916, ...), and such a value in the enum is undefined behaviour (observed: SIGILL). So the
//!   driver functions are called through our own pointers (`Api`) typed to return `i32`,
//!   resolved by exact name from the library cudarc opened; known codes are named from a table
//!   (`codes.rs`), unknown ones are reported by number. cudarc panics when `libcuda` is missing,
//!   so `open_all` checks `is_culib_present()` first and loads under `catch_unwind`; a missing
//!   symbol is `Error::Unavailable`, not a panic.
//! - Each device works in its primary context (the one PyTorch's runtime uses), retained on the
//!   device's first driver call (not at open: a process that uses one GPU of eight must not
//!   create contexts, about 500 MiB each, on the other seven) and never released. Every call
//!   makes it current and then restores the caller's context, because PyTorch reads the
//!   current device from the thread and does not set it before free. `mem_info` on a device
//!   whose primary context is not active creates none (it is an OOM report's detail only).
//! - cuMemAlloc runs in relaxed stream-capture mode (see `RelaxedCapture`), so a CUDA graph's
//!   private pool can grow while the graph is being captured, as with PyTorch's allocator.
//! - Events are created once with `CU_EVENT_DISABLE_TIMING` and pooled per context; `Event`
//!   holds the `CUevent` handle itself (`Event(0)` is an event that has already completed).
//!   An event is recorded in the context of the stream it is recorded on (`cuStreamGetCtx`):
//!   `record_stream` may name a stream of another device. When recording fails, the stream is
//!   synchronized instead and the already-completed event returned.
//! - Virtual memory (`cuMem*`): a device without support is `Error::Unavailable`; `map` maps
//!   and grants this device read-write access; `unmap` does not synchronize (the caller does,
//!   with `synchronize_stream`).
//! - Physical memory is created with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` requested where
//!   the device supports it, so expandable segments can be shared with other processes as
//!   PyTorch shares its own (`ipc.rs`); an exported descriptor is closed when its chunk is released.
//! - `CUDA_ERROR_OUT_OF_MEMORY` becomes `Error::OutOfMemory` (the heap fills in the report);
//!   every other failure becomes `Error::Driver` with the call, the error's name and number.

mod codes;
mod host;
mod ipc;
pub mod tools;

use super::{Backend, DeviceInfo, DriverTime, Event, PhysHandle, Stream};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use rustc_hash::FxHashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::panic::catch_unwind;
use std::sync::OnceLock;
use std::time::Instant;

type CuContext = *mut c_void;
type CuStream = *mut c_void;
type CuEvent = *mut c_void;
type CuGraph = *mut c_void;

const CUDA_SUCCESS: i32 = 0;
const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
const CUDA_ERROR_NOT_READY: i32 = 600;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
const CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: c_int = 102;
const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
struct MemLocation {
    kind: c_int,
    id: c_int,
}

/// `CUmemAllocationProp` (the enums as the `int`s they are in C).
#[repr(C)]
struct AllocationProp {
    kind: c_int,
    requested_handle_types: c_int,
    location: MemLocation,
    win32_handle_meta_data: *mut c_void,
    compression_type: u8,
    gpu_direct_rdma_capable: u8,
    usage: u16,
    reserved: [u8; 4],
}

/// `CUmemAccessDesc`.
#[repr(C)]
struct AccessDesc {
    location: MemLocation,
    flags: c_int,
}

macro_rules! driver_api {
    ($( $field:ident = $symbol:literal: fn($($arg:ty),*); )*) => {
        /// The driver functions this crate calls, each typed as in the CUDA driver API reference
        /// except that every result is a plain `i32`. Some are used only by the tests (captures) or
        /// by `tools` (streams, memsets, copies for tools and tests that drive a device beside
        /// the allocator).
        #[cfg_attr(not(test), allow(dead_code))]
        struct Api {
            $( $field: unsafe extern "C" fn($($arg),*) -> i32, )*
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
    mem_export_to_shareable_handle = "cuMemExportToShareableHandle": fn(*mut c_void, u64, c_int, u64);
    mem_import_from_shareable_handle = "cuMemImportFromShareableHandle": fn(*mut u64, *mut c_void, c_int);
}

/// One driver function from the library cudarc opened, by its exact name.
fn symbol<F: Copy>(name: &str) -> std::result::Result<F, String> {
    // Safety: called only after `is_culib_present()` (so `culib` opens the library rather than
    // panicking); `F` is the function's C signature from the driver API reference, with the
    // `CUresult` return read as the `int` it is.
    let found = unsafe { sys::culib().get::<F>(name.as_bytes()) };
    found.map(|f| *f).map_err(|e| format!("the CUDA driver library has no {name} ({e}); is the driver too old?"))
}

/// The driver's functions, loaded once. Precondition: `is_culib_present()`.
fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        catch_unwind(Api::load).unwrap_or_else(|_| Err("loading the CUDA driver library panicked".into()))
    })
    .as_ref()
    .map_err(|e| Error::Unavailable(e.clone()))
}

fn driver_present() -> bool {
    // Safety: only tries to dlopen the driver library and closes it again.
    catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

/// Maps a driver result once, at the boundary: out of memory is retryable; the rest is named
/// (or numbered, when the code is one this crate does not know).
fn map_error(call: &'static str, code: i32) -> Error {
    if code == CUDA_ERROR_OUT_OF_MEMORY {
        Error::OutOfMemory(Box::default())
    } else {
        Error::Driver { call, code: codes::describe(code) }
    }
}

/// A driver result as `Result`.
fn check(call: &'static str, code: i32) -> Result<()> {
    if code == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(map_error(call, code))
    }
}

/// Makes `context` current for the duration of a call and restores the caller's context.
struct CurrentContext {
    api: &'static Api,
    /// The caller's context (null: none) when we replaced it; `None` when it was already ours.
    restore: Option<CuContext>,
}

impl CurrentContext {
    fn enter(api: &'static Api, context: CuContext) -> Result<CurrentContext> {
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
struct RelaxedCapture {
    api: &'static Api,
    previous: c_int,
}

impl RelaxedCapture {
    fn enter(api: &'static Api) -> Result<RelaxedCapture> {
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

/// Opens every CUDA device, or says why it cannot.
pub fn open_all() -> Result<Vec<Box<dyn Backend>>> {
    Ok(open_devices()?.into_iter().map(|d| Box::new(d) as Box<dyn Backend>).collect())
}

fn open_devices() -> Result<Vec<CudaDevice>> {
    if !driver_present() {
        return Err(Error::Unavailable(
            "the CUDA driver library (libcuda.so) was not found; is an NVIDIA driver installed?".into(),
        ));
    }
    let api = api()?;
    // Safety: plain value arguments and one out-pointer to a local.
    check("cuInit", unsafe { (api.init)(0) })?;
    let mut count: c_int = 0;
    // Safety: one out-pointer to a local.
    check("cuDeviceGetCount", unsafe { (api.device_get_count)(&mut count) })?;
    if count <= 0 {
        return Err(Error::Unavailable("the CUDA driver reports no device".into()));
    }
    (0..count).map(|ordinal| CudaDevice::open(api, ordinal)).collect()
}

/// One CUDA device, driven in its primary context.
pub struct CudaDevice {
    api: &'static Api,
    ordinal: usize,
    device: c_int,
    /// The primary context, once retained (see the top of the file).
    context: Option<CuContext>,
    name: String,
    total_bytes: u64,
    /// Events of our context not in use, ready to record again.
    idle_events: Vec<CuEvent>,
    /// Events recorded in another device's context (streams of that device), by handle, with
    /// their context; and those not in use.
    foreign_events: FxHashMap<usize, CuContext>,
    idle_foreign_events: Vec<(CuContext, CuEvent)>,
    /// The virtual-memory granularity, once asked (`None`: not asked yet).
    vm_granularity: Option<u64>,
    /// Physical memory is created shareable as a POSIX file descriptor (the device supports it).
    posix_fd: bool,
    /// Descriptors exported for other processes (`ipc.rs`), by physical handle.
    exported: FxHashMap<u64, c_int>,
    time: DriverTime,
    /// The stream host backups are copied on (`host.rs`), once created.
    copy_stream: Option<CuStream>,
}

// Safety: driver handles (contexts, events) may be used from any thread; the allocator uses a
// `CudaDevice` only under its device lock, so no two threads use it at once.
unsafe impl Send for CudaDevice {}

/// An event that has already completed (recording failed and the stream was synchronized).
const COMPLETED: Event = Event(0);

fn elapsed_ns(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

fn stream_handle(stream: Stream) -> CuStream {
    // A cudaStream_t and a CUstream are the same handle; 0 is the legacy default stream.
    stream.0 as usize as CuStream
}

fn event_handle(event: Event) -> CuEvent {
    event.0 as usize as CuEvent
}

impl CudaDevice {
    fn open(api: &'static Api, ordinal: c_int) -> Result<CudaDevice> {
        let mut device: c_int = 0;
        // Safety: one out-pointer to a local.
        check("cuDeviceGet", unsafe { (api.device_get)(&mut device, ordinal) })?;
        let mut name = [0 as c_char; 256];
        // Safety: the driver writes at most `len` bytes into the buffer; `len` leaves out the
        // last byte, so it stays 0.
        check("cuDeviceGetName", unsafe {
            (api.device_get_name)(name.as_mut_ptr(), (name.len() - 1) as c_int, device)
        })?;
        // Safety: the buffer is NUL-terminated (its last byte, at the latest).
        let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        let mut total: usize = 0;
        // Safety: one out-pointer to a local.
        check("cuDeviceTotalMem", unsafe { (api.device_total_mem)(&mut total, device) })?;
        Ok(CudaDevice {
            api,
            ordinal: ordinal as usize,
            device,
            context: None,
            name,
            total_bytes: total as u64,
            idle_events: Vec::new(),
            foreign_events: FxHashMap::default(),
            idle_foreign_events: Vec::new(),
            vm_granularity: None,
            posix_fd: false,
            exported: FxHashMap::default(),
            time: DriverTime::default(),
            copy_stream: None,
        })
    }

    /// This device's primary context, retained on the device's first driver call.
    fn context(&mut self) -> Result<CuContext> {
        if let Some(context) = self.context {
            return Ok(context);
        }
        let mut context: CuContext = std::ptr::null_mut();
        // Safety: `device` came from cuDeviceGet. The reference is never released.
        check("cuDevicePrimaryCtxRetain", unsafe { (self.api.primary_ctx_retain)(&mut context, self.device) })?;
        self.context = Some(context);
        Ok(context)
    }

    /// Makes this device's primary context current until the guard drops.
    fn enter(&mut self) -> Result<CurrentContext> {
        let context = self.context()?;
        CurrentContext::enter(self.api, context)
    }

    /// Whether this device's primary context exists (retained by us or by anyone else).
    fn primary_context_active(&self) -> Result<bool> {
        let (mut flags, mut active): (c_uint, c_int) = (0, 0);
        // Safety: two out-pointers to locals.
        check("cuDevicePrimaryCtxGetState", unsafe {
            (self.api.primary_ctx_get_state)(self.device, &mut flags, &mut active)
        })?;
        Ok(active != 0)
    }

    /// The context `stream` belongs to. Precondition: our context is current (the default
    /// stream handles name the current context's stream).
    fn stream_context(&self, stream: Stream) -> Result<CuContext> {
        let mut context: CuContext = std::ptr::null_mut();
        // Safety: the stream handle is the caller's (live while it has work on it); one
        // out-pointer to a local.
        check("cuStreamGetCtx", unsafe { (self.api.stream_get_ctx)(stream_handle(stream), &mut context) })?;
        Ok(context)
    }

    /// An idle event of `context` (current), or a new one.
    fn take_event(&mut self, context: CuContext, ours: bool) -> Result<CuEvent> {
        let pooled = if ours {
            self.idle_events.pop()
        } else {
            let found = self.idle_foreign_events.iter().position(|&(c, _)| c == context);
            found.map(|i| self.idle_foreign_events.swap_remove(i).1)
        };
        if let Some(event) = pooled {
            return Ok(event);
        }
        let mut event: CuEvent = std::ptr::null_mut();
        // Safety: one out-pointer to a local; `context` is current.
        check("cuEventCreate", unsafe { (self.api.event_create)(&mut event, CU_EVENT_DISABLE_TIMING) })?;
        Ok(event)
    }

    fn put_event(&mut self, context: CuContext, event: CuEvent, ours: bool) {
        if ours {
            self.idle_events.push(event);
        } else {
            self.idle_foreign_events.push((context, event));
        }
    }

    /// Records an event on `stream`, in the stream's context (current).
    fn record_in(&mut self, context: CuContext, ours: bool, stream: Stream) -> Result<Event> {
        let event = self.take_event(context, ours)?;
        // Safety: `event` is a live event of `context`, the stream's context; the stream
        // handle is the caller's.
        let recorded = check("cuEventRecord", unsafe { (self.api.event_record)(event, stream_handle(stream)) });
        match recorded {
            Ok(()) => {
                if !ours {
                    self.foreign_events.insert(event as usize, context);
                }
                Ok(Event(event as usize as u64))
            }
            Err(e) => {
                self.put_event(context, event, ours);
                Err(e)
            }
        }
    }

    /// The virtual-memory granularity, or `Unavailable` when the device has no VMM support.
    fn vmm(&mut self) -> Result<u64> {
        if let Some(granularity) = self.vm_granularity {
            return Ok(granularity);
        }
        let mut supported: c_int = 0;
        // Safety: one out-pointer to a local.
        check("cuDeviceGetAttribute", unsafe {
            (self.api.device_get_attribute)(
                &mut supported,
                CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                self.device,
            )
        })?;
        if supported == 0 {
            return Err(Error::Unavailable(format!(
                "virtual memory: device {} ({}) does not support CUDA virtual memory management \
                 (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0); turn off expandable_segments",
                self.ordinal, self.name
            )));
        }
        self.posix_fd = ipc::posix_fd_supported(self)?;
        let prop = self.allocation_prop();
        let mut granularity: usize = 0;
        // Safety: `prop` is a valid CUmemAllocationProp for the call's duration.
        check("cuMemGetAllocationGranularity", unsafe {
            (self.api.mem_get_allocation_granularity)(&mut granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        })?;
        self.vm_granularity = Some(granularity as u64);
        Ok(granularity as u64)
    }

    fn allocation_prop(&self) -> AllocationProp {
        AllocationProp {
            kind: CU_MEM_ALLOCATION_TYPE_PINNED,
            requested_handle_types: if self.posix_fd { ipc::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR } else { 0 },
            location: MemLocation { kind: CU_MEM_LOCATION_TYPE_DEVICE, id: self.device },
            win32_handle_meta_data: std::ptr::null_mut(),
            compression_type: 0,
            gpu_direct_rdma_capable: 0,
            usage: 0,
            reserved: [0; 4],
        }
    }
}

fn to_usize(bytes: u64) -> Result<usize> {
    usize::try_from(bytes).map_err(|_| Error::InvalidArgument(format!("{bytes} bytes do not fit this platform")))
}

impl Backend for CudaDevice {
    fn info(&self) -> DeviceInfo {
        DeviceInfo { name: format!("{} (cuda:{})", self.name, self.ordinal), total_bytes: self.total_bytes }
    }

    fn mem_info(&mut self) -> Result<(u64, u64)> {
        // Asking a never-used device would create its primary context (hundreds of MiB) just
        // to fill in an out-of-memory report; use it only if it exists already.
        if self.context.is_none() && !self.primary_context_active()? {
            return Err(Error::Unavailable(format!(
                "device {} has no CUDA context yet; its free memory is not queried (that would create one)",
                self.ordinal
            )));
        }
        let _current = self.enter()?;
        let (mut free, mut total): (usize, usize) = (0, 0);
        // Safety: two out-pointers to locals; our context is current.
        check("cuMemGetInfo", unsafe { (self.api.mem_get_info)(&mut free, &mut total) })?;
        Ok((free as u64, total as u64))
    }

    fn reserve(&mut self, bytes: u64) -> Result<u64> {
        let bytes = usize::try_from(bytes).map_err(|_| Error::OutOfMemory(Box::default()))?;
        let _current = self.enter()?;
        let start = Instant::now();
        // Growing a CUDA graph's private pool happens while its stream is being captured, and
        // the global and thread-local capture modes refuse cuMemAlloc on the capturing thread.
        // As PyTorch's own allocator does, allocate in relaxed mode: the graph gets new
        // addresses, and replays do not allocate again. The mode is restored right after.
        let _relaxed = RelaxedCapture::enter(self.api)?;
        let mut ptr: u64 = 0;
        // Safety: cuMemAlloc only writes the new address; the memory is handed to the heap.
        let done = check("cuMemAlloc", unsafe { (self.api.mem_alloc)(&mut ptr, bytes) });
        self.time.reserve_ns += elapsed_ns(start);
        done.map(|()| ptr)
    }

    fn release(&mut self, ptr: u64, _bytes: u64) -> Result<()> {
        let _current = self.enter()?;
        let start = Instant::now();
        // Safety: the heap's precondition: `ptr` came from `reserve` and no queued work uses it.
        let freed = check("cuMemFree", unsafe { (self.api.mem_free)(ptr) });
        self.time.release_ns += elapsed_ns(start);
        freed
    }

    fn record_event(&mut self, stream: Stream) -> Result<Event> {
        let ours = self.enter()?;
        let start = Instant::now();
        let own = self.context()?;
        let context = self.stream_context(stream)?;
        let recorded = if context == own {
            self.record_in(own, true, stream)
        } else {
            // A stream of another device (record_stream with a peer's stream): record there.
            CurrentContext::enter(self.api, context).and_then(|_theirs| self.record_in(context, false, stream))
        };
        let result = match recorded {
            Ok(event) => Ok(event),
            Err(e) => {
                // Cannot order the reuse after the stream's work: wait for that stream (not the
                // whole device) instead; the block is then free to reuse at once.
                let synced = CurrentContext::enter(self.api, context).and_then(|_theirs| {
                    // Safety: the caller's stream handle, in its own context.
                    check("cuStreamSynchronize", unsafe { (self.api.stream_synchronize)(stream_handle(stream)) })
                });
                synced.map(|()| COMPLETED).map_err(|_| e)
            }
        };
        drop(ours);
        self.time.event_ns += elapsed_ns(start);
        result
    }

    fn event_done(&mut self, event: Event) -> Result<bool> {
        if event == COMPLETED {
            return Ok(true);
        }
        let _current = self.enter()?;
        let start = Instant::now();
        // Safety: the heap queries only live events it got from `record_event`.
        let status = unsafe { (self.api.event_query)(event_handle(event)) };
        self.time.event_ns += elapsed_ns(start);
        match status {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(map_error("cuEventQuery", other)),
        }
    }

    fn wait_event(&mut self, event: Event) -> Result<()> {
        if event == COMPLETED {
            return Ok(());
        }
        let _current = self.enter()?;
        let start = Instant::now();
        // Safety: the heap waits only on live events it got from `record_event`.
        let waited = check("cuEventSynchronize", unsafe { (self.api.event_synchronize)(event_handle(event)) });
        self.time.sync_ns += elapsed_ns(start);
        waited
    }

    fn free_event(&mut self, event: Event) {
        if event == COMPLETED {
            return;
        }
        // Pooled, not destroyed: a later record in the same context reuses it (recording again
        // resets it).
        let handle = event_handle(event);
        match self.foreign_events.remove(&(handle as usize)) {
            Some(context) => self.idle_foreign_events.push((context, handle)),
            None => self.idle_events.push(handle),
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        let _current = self.enter()?;
        let start = Instant::now();
        // Safety: no arguments; our context is current.
        let done = check("cuCtxSynchronize", unsafe { (self.api.ctx_synchronize)() });
        self.time.sync_ns += elapsed_ns(start);
        done
    }

    fn driver_time(&self) -> DriverTime {
        self.time
    }

    fn vm_granularity(&mut self) -> Result<u64> {
        let _current = self.enter()?;
        self.vmm()
    }

    fn reserve_address(&mut self, bytes: u64) -> Result<u64> {
        let _current = self.enter()?;
        let granularity = self.vmm()?;
        let (size, align) = (to_usize(bytes)?, to_usize(granularity)?);
        let start = Instant::now();
        let mut addr: u64 = 0;
        // Safety: one out-pointer to a local; no fixed address requested.
        let done =
            check("cuMemAddressReserve", unsafe { (self.api.mem_address_reserve)(&mut addr, size, align, 0, 0) });
        self.time.map_ns += elapsed_ns(start);
        done.map(|()| addr)
    }

    fn free_address(&mut self, addr: u64, bytes: u64) -> Result<()> {
        let _current = self.enter()?;
        self.vmm()?;
        let size = to_usize(bytes)?;
        let start = Instant::now();
        // Safety: the caller's precondition: a range from `reserve_address` with nothing mapped.
        let done = check("cuMemAddressFree", unsafe { (self.api.mem_address_free)(addr, size) });
        self.time.map_ns += elapsed_ns(start);
        done
    }

    fn create_physical(&mut self, bytes: u64) -> Result<PhysHandle> {
        let _current = self.enter()?;
        self.vmm()?;
        let size = to_usize(bytes).map_err(|_| Error::OutOfMemory(Box::default()))?;
        let prop = self.allocation_prop();
        let start = Instant::now();
        let mut handle: u64 = 0;
        // Safety: one out-pointer to a local; `prop` lives for the call.
        let done = check("cuMemCreate", unsafe { (self.api.mem_create)(&mut handle, size, &prop, 0) });
        self.time.create_ns += elapsed_ns(start);
        done.map(|()| PhysHandle(handle))
    }

    fn release_physical(&mut self, handle: PhysHandle) -> Result<()> {
        let _current = self.enter()?;
        self.vmm()?;
        let start = Instant::now();
        ipc::forget_export(self, handle);
        // Safety: the caller's precondition: a handle from `create_physical`, released once.
        let done = check("cuMemRelease", unsafe { (self.api.mem_release)(handle.0) });
        self.time.create_ns += elapsed_ns(start);
        done
    }

    fn map(&mut self, addr: u64, bytes: u64, handle: PhysHandle) -> Result<()> {
        let _current = self.enter()?;
        self.vmm()?;
        let size = to_usize(bytes)?;
        let start = Instant::now();
        // Safety: plain values; the driver checks the range and the handle.
        let mapped = check("cuMemMap", unsafe { (self.api.mem_map)(addr, size, 0, handle.0, 0) });
        let done = mapped.and_then(|()| {
            let access = AccessDesc {
                location: MemLocation { kind: CU_MEM_LOCATION_TYPE_DEVICE, id: self.device },
                flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // Safety: one descriptor that lives for the call; the range was just mapped.
            let access = check("cuMemSetAccess", unsafe { (self.api.mem_set_access)(addr, size, &access, 1) });
            if access.is_err() {
                // Safety: the range this call mapped; nothing can use it yet.
                let _ = unsafe { (self.api.mem_unmap)(addr, size) };
            }
            access
        });
        self.time.map_ns += elapsed_ns(start);
        done
    }

    fn unmap(&mut self, addr: u64, bytes: u64) -> Result<()> {
        let _current = self.enter()?;
        self.vmm()?;
        let size = to_usize(bytes)?;
        let start = Instant::now();
        // Safety: the caller's precondition: exactly one `map`'s range, no queued work using it.
        let done = check("cuMemUnmap", unsafe { (self.api.mem_unmap)(addr, size) });
        self.time.map_ns += elapsed_ns(start);
        done
    }

    fn synchronize_stream(&mut self, stream: Stream) -> Result<()> {
        let _ours = self.enter()?;
        let start = Instant::now();
        let context = self.stream_context(stream)?;
        let done = CurrentContext::enter(self.api, context).and_then(|_theirs| {
            // Safety: the caller's stream handle, in its own context.
            check("cuStreamSynchronize", unsafe { (self.api.stream_synchronize)(stream_handle(stream)) })
        });
        self.time.sync_ns += elapsed_ns(start);
        done
    }

    fn ipc_handle(&mut self, base: u64) -> Result<[u8; 64]> {
        ipc::mem_handle(self, base)
    }

    fn export_physical(&mut self, handle: PhysHandle) -> Result<i32> {
        ipc::export(self, handle)
    }

    fn ipc_open(&mut self, handle: &[u8; 64]) -> Result<u64> {
        ipc::open(self, handle)
    }

    fn ipc_close(&mut self, addr: u64) -> Result<()> {
        ipc::close(self, addr)
    }

    fn import_physical(&mut self, pid: i32, fd: i32) -> Result<PhysHandle> {
        ipc::import(self, pid, fd)
    }

    fn stream_is_capturing(&mut self, stream: Stream) -> Result<bool> {
        let _ours = self.enter()?;
        let context = self.stream_context(stream)?;
        CurrentContext::enter(self.api, context).and_then(|_theirs| {
            let mut status: c_int = 0;
            // Safety: the caller's stream handle, in its own context; the driver writes one enum.
            check("cuStreamIsCapturing", unsafe {
                (self.api.stream_is_capturing)(stream_handle(stream), &mut status)
            })?;
            // CU_STREAM_CAPTURE_STATUS_NONE is 0; ACTIVE and INVALIDATED both mean "capturing".
            Ok(status != 0)
        })
    }

    // Host backups: `host.rs`.
    fn host_alloc(&mut self, bytes: u64) -> Result<u64> {
        self.host_alloc_pinned(bytes)
    }

    fn host_free(&mut self, ptr: u64, _bytes: u64) -> Result<()> {
        self.host_free_pinned(ptr)
    }

    fn copy_to_host(&mut self, dst: u64, src: u64, bytes: u64) -> Result<()> {
        self.queue_copy(src, dst, bytes, true)
    }

    fn copy_to_device(&mut self, dst: u64, src: u64, bytes: u64) -> Result<()> {
        self.queue_copy(dst, src, bytes, false)
    }

    fn record_copy_event(&mut self) -> Result<Event> {
        self.record_on_copy_stream()
    }
}

#[cfg(test)]
mod tests {
    //! Tests on a CUDA driver run when `STEPALLOC_GPU_TESTS=1` (a real device) or
    //! `STEPALLOC_HOSTCUDA=1` (the host-memory driver of `testdrv/`, found through
    //! `LD_LIBRARY_PATH`; the test command runs them so, with `--test-threads=1`); otherwise they
    //! print why they were skipped. Tests named `host_` need the host driver's controls (failure
    //! injection, capacity) and skip on a real driver. The no-driver tests run everywhere else.
    use super::*;
    use crate::allocator::Allocator;
    use crate::config::Config;
    use crate::units::MIB;
    use std::ffi::CString;
    use std::panic::AssertUnwindSafe;

    fn wanted(test: &str) -> bool {
        let on = |name: &str| std::env::var(name).as_deref() == Ok("1");
        if !on("STEPALLOC_GPU_TESTS") && !on("STEPALLOC_HOSTCUDA") {
            eprintln!(
                "skipped {test}: set STEPALLOC_GPU_TESTS=1 (a CUDA device) or STEPALLOC_HOSTCUDA=1 (testdrv) to run it"
            );
            return false;
        }
        if !driver_present() {
            // Asked for, but impossible: fail rather than pass silently.
            assert!(
                !on("STEPALLOC_HOSTCUDA"),
                "STEPALLOC_HOSTCUDA=1 but no libcuda.so: run testdrv/build.sh and set LD_LIBRARY_PATH=target/hostcuda"
            );
            eprintln!("skipped {test}: no CUDA driver library (libcuda.so) on this machine");
            return false;
        }
        true
    }

    /// The devices when driver tests are enabled and possible, else `None` after printing why.
    fn devices(test: &str) -> Option<Vec<CudaDevice>> {
        if !wanted(test) {
            return None;
        }
        match open_devices() {
            Ok(devices) => Some(devices),
            Err(e) => {
                eprintln!("skipped {test}: no usable CUDA device: {e}");
                None
            }
        }
    }

    fn gpu(test: &str) -> Option<Vec<Box<dyn Backend>>> {
        devices(test).map(|ds| ds.into_iter().map(|d| Box::new(d) as Box<dyn Backend>).collect())
    }

    /// The host driver's test controls (`hostcuda_set`), or `None` on a real driver.
    struct HostCuda {
        set: unsafe extern "C" fn(*const c_char, *const c_char) -> c_int,
        used: unsafe extern "C" fn(c_int) -> i64,
    }

    impl HostCuda {
        fn get(test: &str) -> Option<HostCuda> {
            if !wanted(test) {
                return None;
            }
            match (symbol("hostcuda_set"), symbol("hostcuda_used")) {
                (Ok(set), Ok(used)) => Some(HostCuda { set, used }),
                _ => {
                    eprintln!("skipped {test}: needs the host-memory driver's controls (testdrv), not a real driver");
                    None
                }
            }
        }

        fn set(&self, key: &str, value: &str) {
            let (k, v) = (CString::new(key).expect("key"), CString::new(value).expect("value"));
            // Safety: two NUL-terminated strings that live for the call.
            assert_eq!(unsafe { (self.set)(k.as_ptr(), v.as_ptr()) }, 0, "hostcuda_set({key}, {value})");
        }

        fn used(&self, device: c_int) -> u64 {
            // Safety: plain value.
            unsafe { (self.used)(device) as u64 }
        }
    }

    /// Runs `f` with `key` set, and resets it afterwards even when `f` panics.
    fn with_setting(host: &HostCuda, key: &str, value: &str, reset: &str, f: impl FnOnce()) {
        host.set(key, value);
        let outcome = catch_unwind(AssertUnwindSafe(f));
        host.set(key, reset);
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    }

    fn current(api: &Api) -> CuContext {
        let mut c: CuContext = std::ptr::null_mut();
        // Safety: one out-pointer to a local.
        check("cuCtxGetCurrent", unsafe { (api.ctx_get_current)(&mut c) }).expect("cuCtxGetCurrent");
        c
    }

    /// A new non-blocking stream of `dev`'s context; the caller's context is restored.
    fn new_stream(dev: &mut CudaDevice) -> CuStream {
        let api = dev.api;
        let _current = dev.enter().expect("enter");
        let mut stream: CuStream = std::ptr::null_mut();
        // Safety: one out-pointer to a local; the device's context is current.
        check("cuStreamCreate", unsafe { (api.stream_create)(&mut stream, 1) }).expect("cuStreamCreate");
        stream
    }

    #[test]
    fn without_a_driver_open_all_says_why() {
        if driver_present() {
            eprintln!("skipped without_a_driver_open_all_says_why: a CUDA driver is present");
            return;
        }
        let e = open_all().err().expect("no driver, so no devices");
        assert!(matches!(e, Error::Unavailable(_)), "{e}");
        assert!(e.to_string().contains("libcuda.so"), "{e}");
        let auto = Allocator::new(Config::parse("backend:auto").expect("valid")).err().expect("no driver");
        assert!(auto.to_string().contains("backend:auto found no usable CUDA device"), "{auto}");
        assert!(auto.to_string().contains("backend:sim"), "{auto}");
        let cuda = Allocator::new(Config::parse("backend:cuda").expect("valid")).err().expect("no driver");
        assert!(matches!(cuda, Error::Unavailable(_)), "{cuda}");
    }

    #[test]
    fn error_mapping() {
        let oom = map_error("cuMemAlloc", CUDA_ERROR_OUT_OF_MEMORY);
        assert!(oom.is_out_of_memory());
        let other = map_error("cuMemFree", 1);
        assert_eq!(other, Error::Driver { call: "cuMemFree", code: "CUDA_ERROR_INVALID_VALUE (1)".into() });
        assert_eq!(other.to_string(), "CUDA driver call cuMemFree failed: CUDA_ERROR_INVALID_VALUE (1)");
        // Codes newer than cudarc's enum are plain numbers here, never the enum.
        let newer = map_error("cuEventQuery", 226);
        assert_eq!(newer.to_string(), "CUDA driver call cuEventQuery failed: CUDA_ERROR_CONTAINED (226)");
        let unknown = map_error("cuEventQuery", 7777);
        assert!(unknown.to_string().contains("CUresult 7777"), "{unknown}");
    }

    #[test]
    fn our_structs_have_the_drivers_layout() {
        assert_eq!(std::mem::size_of::<AllocationProp>(), std::mem::size_of::<sys::CUmemAllocationProp>());
        assert_eq!(std::mem::size_of::<AccessDesc>(), std::mem::size_of::<sys::CUmemAccessDesc>());
        assert_eq!(std::mem::size_of::<MemLocation>(), std::mem::size_of::<sys::CUmemLocation>());
    }

    #[test]
    fn gpu_reserve_release_and_mem_info() {
        let Some(mut devices) = gpu("gpu_reserve_release_and_mem_info") else { return };
        for dev in &mut devices {
            let info = dev.info();
            assert!(info.total_bytes > 0);
            let ptr = dev.reserve(2 * MIB).expect("the first call makes the context");
            dev.release(ptr, 2 * MIB).expect("cuMemFree");
            let (free_before, total) = dev.mem_info().expect("cuMemGetInfo");
            assert_eq!(total, info.total_bytes);
            let ptr = dev.reserve(64 * MIB).expect("cuMemAlloc 64 MiB");
            assert!(ptr != 0 && ptr % 512 == 0, "{ptr:#x}");
            let (free_during, _) = dev.mem_info().expect("cuMemGetInfo");
            assert!(free_during + 64 * MIB <= free_before + 8 * MIB, "{free_before} -> {free_during}");
            dev.release(ptr, 64 * MIB).expect("cuMemFree");
            assert!(dev.driver_time().reserve_ns > 0);
        }
    }

    #[test]
    fn gpu_out_of_memory_is_retryable() {
        let Some(mut devices) = gpu("gpu_out_of_memory_is_retryable") else { return };
        let dev = &mut devices[0];
        let too_much = dev.info().total_bytes * 2;
        let e = dev.reserve(too_much).expect_err("twice the device cannot be reserved");
        assert!(e.is_out_of_memory(), "{e}");
        // The device still works afterwards.
        let ptr = dev.reserve(2 * MIB).expect("cuMemAlloc after OOM");
        dev.release(ptr, 2 * MIB).expect("cuMemFree");
    }

    #[test]
    fn gpu_events_are_pooled_and_complete() {
        let Some(mut devices) = gpu("gpu_events_are_pooled_and_complete") else { return };
        let dev = &mut devices[0];
        let first = dev.record_event(Stream::DEFAULT).expect("record");
        dev.wait_event(first).expect("synchronize");
        assert!(dev.event_done(first).expect("query"));
        dev.free_event(first);
        let second = dev.record_event(Stream::DEFAULT).expect("record");
        assert_eq!(first, second, "a freed event is reused, not recreated");
        dev.synchronize().expect("cuCtxSynchronize");
        assert!(dev.event_done(second).expect("query"));
        dev.free_event(second);
        dev.synchronize_stream(Stream::DEFAULT).expect("cuStreamSynchronize");
    }

    #[test]
    fn gpu_calls_restore_the_callers_context() {
        let Some(mut devices) = devices("gpu_calls_restore_the_callers_context") else { return };
        let api = devices[0].api;
        let before = current(api);
        for dev in &mut devices {
            let ptr = dev.reserve(2 * MIB).expect("cuMemAlloc");
            dev.release(ptr, 2 * MIB).expect("cuMemFree");
            let event = dev.record_event(Stream::DEFAULT).expect("record");
            dev.wait_event(event).expect("wait");
            dev.free_event(event);
        }
        assert_eq!(current(api), before);
    }

    #[test]
    fn gpu_reserve_during_stream_capture() {
        let Some(mut devices) = devices("gpu_reserve_during_stream_capture") else { return };
        let dev = &mut devices[0];
        let api = dev.api;
        let stream = new_stream(dev);
        let _current = CurrentContext::enter(api, dev.context.expect("retained")).expect("enter");
        for mode in [0, 1] {
            // Safety: `stream` is a live stream of the current context.
            check("cuStreamBeginCapture", unsafe { (api.stream_begin_capture)(stream, mode) }).expect("begin capture");
            let reserved = dev.reserve(2 * MIB);
            let mut status: c_int = 0;
            // Safety: as above; one out-pointer to a local.
            check("cuStreamIsCapturing", unsafe { (api.stream_is_capturing)(stream, &mut status) })
                .expect("is capturing");
            assert_eq!(status, 1, "the capture is still active (not invalidated) after cuMemAlloc");
            assert!(dev.stream_is_capturing(Stream(stream as u64)).expect("backend query"));
            let mut graph: CuGraph = std::ptr::null_mut();
            // Safety: as above; one out-pointer to a local.
            let ended = check("cuStreamEndCapture", unsafe { (api.stream_end_capture)(stream, &mut graph) });
            let ptr = reserved.unwrap_or_else(|e| panic!("cuMemAlloc during a mode {mode} capture: {e}"));
            ended.unwrap_or_else(|e| panic!("the mode {mode} capture was invalidated: {e}"));
            // Safety: the graph just captured, destroyed once.
            let _ = unsafe { (api.graph_destroy)(graph) };
            dev.release(ptr, 2 * MIB).expect("cuMemFree after the capture");
            assert!(!dev.stream_is_capturing(Stream(stream as u64)).expect("backend query"));
        }
        // Safety: the stream made above, destroyed once.
        let _ = unsafe { (api.stream_destroy)(stream) };
    }

    #[test]
    fn gpu_allocator_on_cuda() {
        if !wanted("gpu_allocator_on_cuda") {
            return;
        }
        let a = Allocator::new(Config::parse("backend:cuda").expect("valid")).expect("CUDA allocator");
        let mut ptrs = Vec::new();
        for i in 0..200u64 {
            let size = 1 + (i * 7919) % (4 * MIB);
            ptrs.push((a.malloc(0, size, Stream::DEFAULT).expect("malloc"), size));
        }
        for (ptr, size) in ptrs.drain(..) {
            a.free(0, ptr, size).expect("free");
        }
        a.check_invariants().expect("invariants");
        let stats = a.stats(0).expect("stats").to_map();
        assert_eq!(stats.get("allocated_bytes.all.current").and_then(|v| v.as_u64()), Some(0));
        assert!(a.empty_cache().expect("empty_cache") > 0);
    }

    #[test]
    fn gpu_record_on_a_stream_of_another_device() {
        let Some(mut devices) = devices("gpu_record_on_a_stream_of_another_device") else { return };
        if devices.len() < 2 {
            eprintln!("skipped gpu_record_on_a_stream_of_another_device: needs two devices");
            return;
        }
        let peer = new_stream(&mut devices[1]);
        let dev = &mut devices[0];
        let before = current(dev.api);
        // record_stream with device 1's stream on a block of device 0: the event is recorded in
        // device 1's context (in device 0's it is CUDA_ERROR_INVALID_HANDLE).
        let event = dev.record_event(Stream(peer as usize as u64)).expect("record on the peer's stream");
        dev.wait_event(event).expect("wait");
        assert!(dev.event_done(event).expect("query"));
        dev.free_event(event);
        let again = dev.record_event(Stream(peer as usize as u64)).expect("record again");
        assert_eq!(again, event, "the peer context's event is pooled");
        dev.free_event(again);
        dev.synchronize_stream(Stream(peer as usize as u64)).expect("synchronize the peer's stream");
        // Our own events stay in our context.
        let own = dev.record_event(Stream::DEFAULT).expect("record on our stream");
        assert_ne!(own, event);
        dev.free_event(own);
        assert_eq!(current(dev.api), before);
        // Safety: the stream made above, destroyed once.
        let _ = unsafe { (dev.api.stream_destroy)(peer) };
    }

    #[test]
    fn gpu_virtual_memory_map_rules_and_shared_data() {
        let Some(mut devices) = devices("gpu_virtual_memory_map_rules_and_shared_data") else { return };
        let host = symbol::<unsafe extern "C" fn(c_int) -> i64>("hostcuda_used").ok();
        let dev = &mut devices[0];
        let g = match dev.vm_granularity() {
            Ok(g) => g,
            Err(e) => {
                eprintln!("skipped gpu_virtual_memory_map_rules_and_shared_data: {e}");
                return;
            }
        };
        assert!(g.is_power_of_two() && g >= 2 * MIB, "{g}");
        let a = dev.reserve_address(4 * g).expect("reserve a");
        let b = dev.reserve_address(4 * g).expect("reserve b");
        assert!(a % g == 0 && b % g == 0);
        let (free0, _) = dev.mem_info().expect("mem_info");
        let h = dev.create_physical(2 * g).expect("create");
        let (free1, _) = dev.mem_info().expect("mem_info");
        assert!(free1 + 2 * g <= free0 + 8 * MIB, "physical memory counts: {free0} -> {free1}");
        dev.map(a, 2 * g, h).expect("map at a");
        assert!(dev.map(a + g, 2 * g, h).is_err(), "mapped over mapped bytes");
        assert!(dev.unmap(a, g).is_err(), "unmapped part of a mapping");
        // Write through a, read through a second mapping of the same memory at b.
        let api = dev.api;
        let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut back = vec![0u8; pattern.len()];
        {
            let _current = dev.enter().expect("enter");
            // Safety: `a` is mapped read-write for at least 4096 bytes; the buffer lives.
            check("cuMemcpyHtoD", unsafe { (api.memcpy_htod)(a + g, pattern.as_ptr().cast(), pattern.len()) })
                .expect("write a");
        }
        dev.map(b, 2 * g, h).expect("map the same memory at b");
        dev.unmap(a, 2 * g).expect("unmap a");
        assert!(dev.unmap(a, 2 * g).is_err(), "unmapped twice");
        {
            let _current = dev.enter().expect("enter");
            // Safety: `b` is mapped read-write; the buffer has room.
            check("cuMemcpyDtoH", unsafe { (api.memcpy_dtoh)(back.as_mut_ptr().cast(), b + g, back.len()) })
                .expect("read b");
        }
        assert_eq!(back, pattern, "data written through a is read through b");
        // Release while mapped: deferred until the last mapping goes.
        dev.release_physical(h).expect("release while mapped at b");
        if let Some(used) = host {
            // Safety: plain value.
            assert_eq!(unsafe { used(0) } as u64 % g, 0);
            assert!(dev.free_address(b, 4 * g).is_err(), "freed a range that is still mapped");
        }
        {
            let _current = dev.enter().expect("enter");
            back.fill(0);
            // Safety: as above: still mapped at b after the release.
            check("cuMemcpyDtoH", unsafe { (api.memcpy_dtoh)(back.as_mut_ptr().cast(), b + g, back.len()) })
                .expect("read b");
        }
        assert_eq!(back, pattern, "the memory lives while mapped");
        dev.synchronize_stream(Stream::DEFAULT).expect("sync before unmap");
        dev.unmap(b, 2 * g).expect("unmap b");
        let (free2, _) = dev.mem_info().expect("mem_info");
        assert!(free2 + 8 * MIB >= free0, "released after the last unmap: {free0} -> {free2}");
        dev.free_address(a, 4 * g).expect("free a");
        dev.free_address(b, 4 * g).expect("free b");
        assert!(dev.driver_time().map_ns > 0 && dev.driver_time().create_ns > 0);
    }

    #[test]
    fn host_mapping_outside_a_reserved_range_fails() {
        let Some(_host) = HostCuda::get("host_mapping_outside_a_reserved_range_fails") else { return };
        let mut devices = open_devices().expect("devices");
        let dev = &mut devices[0];
        let g = dev.vm_granularity().expect("granularity");
        let a = dev.reserve_address(2 * g).expect("reserve");
        let h = dev.create_physical(2 * g).expect("create");
        assert!(dev.map(a + g, 2 * g, h).is_err(), "mapped past the end of the range");
        dev.map(a, 2 * g, h).expect("map inside");
        dev.unmap(a, 2 * g).expect("unmap");
        dev.release_physical(h).expect("release");
        assert!(dev.release_physical(h).is_err(), "released twice");
        dev.free_address(a, 2 * g).expect("free");
    }

    #[test]
    fn host_no_virtual_memory_support_is_unavailable() {
        let Some(host) = HostCuda::get("host_no_virtual_memory_support_is_unavailable") else { return };
        with_setting(&host, "vmm", "0", "1", || {
            let mut devices = open_devices().expect("devices");
            let e = devices[0].vm_granularity().expect_err("no VMM support");
            assert!(matches!(e, Error::Unavailable(_)), "{e}");
            assert!(e.to_string().contains("virtual memory management"), "{e}");
            let e = devices[0].reserve_address(2 * MIB).expect_err("no VMM support");
            assert!(matches!(e, Error::Unavailable(_)), "{e}");
        });
    }

    #[test]
    fn host_events_complete_when_the_streams_work_does() {
        let Some(host) = HostCuda::get("host_events_complete_when_the_streams_work_does") else { return };
        let delay = std::env::var("HOSTCUDA_DELAY_US").unwrap_or("0".into());
        with_setting(&host, "delay_us", "30000", &delay, || {
            let mut devices = open_devices().expect("devices");
            let dev = &mut devices[0];
            let event = dev.record_event(Stream::DEFAULT).expect("record");
            assert!(!dev.event_done(event).expect("query"), "30 ms of queued work completed at once");
            dev.wait_event(event).expect("wait");
            assert!(dev.event_done(event).expect("query"));
            dev.free_event(event);
            let event = dev.record_event(Stream::DEFAULT).expect("record");
            dev.synchronize_stream(Stream::DEFAULT).expect("stream sync");
            assert!(dev.event_done(event).expect("query"), "a stream sync waits for the stream's work");
            dev.free_event(event);
        });
    }

    #[test]
    fn host_unknown_error_codes_are_reported_by_number() {
        let Some(host) = HostCuda::get("host_unknown_error_codes_are_reported_by_number") else { return };
        let mut devices = open_devices().expect("devices");
        let dev = &mut devices[0];
        let event = dev.record_event(Stream::DEFAULT).expect("record");
        // 226 is CUDA_ERROR_CONTAINED (Hopper), newer than cudarc's cuda-11040 enum: reading
        // it as that enum was undefined behaviour (SIGILL). 7777 is known to nobody.
        for (code, expect) in [("226", "CUDA_ERROR_CONTAINED (226)"), ("7777", "CUresult 7777")] {
            with_setting(&host, "fail", &format!("cuEventQuery:{code}:count=1"), "", || {
                let e = dev.event_done(event).expect_err("injected failure");
                assert!(e.to_string().contains(expect), "{e}");
                assert!(e.to_string().contains("cuEventQuery"), "{e}");
            });
        }
        dev.wait_event(event).expect("wait after the failures");
        assert!(dev.event_done(event).expect("query after the failures"));
        dev.free_event(event);
        // The same through the allocator: a failed cuMemAlloc with an unknown code.
        let a = Allocator::new(Config::parse("backend:cuda").expect("valid")).expect("allocator");
        with_setting(&host, "fail", "cuMemAlloc_v2:916", "", || {
            let e = a.malloc(0, 64 * MIB, Stream::DEFAULT).expect_err("injected failure");
            assert!(e.to_string().contains("916"), "{e}");
        });
        let p = a.malloc(0, 64 * MIB, Stream::DEFAULT).expect("malloc after the failure");
        a.free(0, p, 64 * MIB).expect("free");
    }

    #[test]
    fn host_failed_record_on_another_device_waits_for_that_stream() {
        let Some(host) = HostCuda::get("host_failed_record_on_another_device_waits_for_that_stream") else { return };
        let mut devices = open_devices().expect("devices");
        let peer = new_stream(&mut devices[1]);
        let dev = &mut devices[0];
        dev.mem_info().ok();
        with_setting(&host, "fail", "cuEventRecord:999:count=1", "", || {
            let event = dev.record_event(Stream(peer as usize as u64)).expect("falls back to a stream sync");
            assert!(dev.event_done(event).expect("query"), "the stream was synchronized");
            dev.free_event(event);
        });
        with_setting(&host, "fail", "cuEventRecord:999:count=1,cuStreamSynchronize:999:count=1", "", || {
            let e = dev.record_event(Stream(peer as usize as u64)).expect_err("both failed");
            assert!(e.to_string().contains("cuEventRecord") && e.to_string().contains("999"), "{e}");
        });
    }

    #[test]
    fn host_out_of_memory_at_the_configured_capacity() {
        let Some(host) = HostCuda::get("host_out_of_memory_at_the_configured_capacity") else { return };
        with_setting(
            &host,
            "capacity_mb",
            "256",
            &std::env::var("HOSTCUDA_CAPACITY_MB").unwrap_or("1024".into()),
            || {
                let mut devices = open_devices().expect("devices");
                let dev = &mut devices[0];
                assert_eq!(dev.info().total_bytes, 256 * MIB);
                let base = host.used(0);
                let p = dev.reserve(256 * MIB - base).expect("the rest of the device");
                assert!(dev.reserve(2 * MIB).expect_err("full").is_out_of_memory());
                assert_eq!(dev.mem_info().expect("mem_info").0, 0);
                dev.release(p, 256 * MIB - base).expect("release");
                // Through the allocator: fill until out of memory; the report names the capacity.
                let a = Allocator::new(Config::parse("backend:cuda").expect("valid")).expect("allocator");
                let mut live = Vec::new();
                let e = loop {
                    match a.malloc(0, 50 * MIB, Stream::DEFAULT) {
                        Ok(p) => live.push(p),
                        Err(e) => break e,
                    }
                    assert!(live.len() < 10, "more than the capacity allocated");
                };
                assert!(e.is_out_of_memory(), "{e}");
                assert!(e.to_string().starts_with("CUDA out of memory."), "{e}");
                assert!(e.to_string().contains("256.00 MiB"), "{e}");
                for p in live {
                    a.free(0, p, 50 * MIB).expect("free");
                }
                a.empty_cache().expect("empty_cache");
                assert_eq!(host.used(0), base);
            },
        );
    }

    /// A tag for the block at `ptr` (its first and last 8 bytes hold it while it is live).
    fn tag(ptr: u64, size: u64) -> u64 {
        (ptr ^ size.rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
    }

    fn write_tags(api: &Api, ptr: u64, size: u64) {
        let t = tag(ptr, size).to_ne_bytes();
        for at in [ptr, ptr + size - 8] {
            // Safety: `at..at+8` lies inside a live block of `size` >= 16 bytes; the bytes live.
            check("cuMemcpyHtoD", unsafe { (api.memcpy_htod)(at, t.as_ptr().cast(), 8) }).expect("write tag");
        }
    }

    fn tags_intact(api: &Api, ptr: u64, size: u64) -> bool {
        [ptr, ptr + size - 8].iter().all(|&at| {
            let mut b = [0u8; 8];
            // Safety: as in `write_tags`; the buffer has room for 8 bytes.
            check("cuMemcpyDtoH", unsafe { (api.memcpy_dtoh)(b.as_mut_ptr().cast(), at, 8) }).expect("read tag");
            u64::from_ne_bytes(b) == tag(ptr, size)
        })
    }

    /// Random operation programs on backend:cuda: threads x streams of both devices (record_stream
    /// across devices) x injected driver failures, including codes unknown to CUDA 11.4. No
    /// crash, no overlap, no corrupted tag, every driver error named with its number, and the
    /// heap's invariants and statistics consistent at the end.
    #[test]
    fn host_random_programs_with_injected_failures() {
        let Some(host) = HostCuda::get("host_random_programs_with_injected_failures") else { return };
        let mut devices = open_devices().expect("devices");
        let api = devices[0].api;
        let mut streams = vec![0u64];
        for d in 0..devices.len().min(2) {
            for _ in 0..2 {
                streams.push(new_stream(&mut devices[d]) as usize as u64);
            }
        }
        let context = devices[0].context().expect("context") as usize;
        let a = Allocator::new(Config::parse("backend:cuda").expect("valid")).expect("allocator");
        let live = parking_lot::Mutex::new(std::collections::BTreeMap::<u64, u64>::new());
        let rules = "cuMemAlloc_v2:2:prob=0.03,cuMemAlloc_v2:226:prob=0.01,cuEventQuery:226:prob=0.02,\
                     cuEventRecord:7777:prob=0.05";
        let errors = std::sync::atomic::AtomicU64::new(0);
        with_setting(&host, "fail", rules, "", || {
            std::thread::scope(|scope| {
                for t in 0..4u64 {
                    let (a, live, streams, errors) = (&a, &live, &streams, &errors);
                    scope.spawn(move || {
                        // Safety: device 0's primary context, retained above and never released.
                        check("cuCtxSetCurrent", unsafe { (api.ctx_set_current)(context as CuContext) }).expect("ctx");
                        let mut rng = 0x2545_F491_4F6C_DD1Du64 ^ (t + 1).wrapping_mul(0x1000_0000_01B3);
                        let mut next = move || {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            rng
                        };
                        let mut mine: Vec<(u64, u64)> = Vec::new();
                        let is_reported = |e: &Error| match e {
                            Error::OutOfMemory(_) => true,
                            Error::Driver { code, .. } => code.chars().any(|c| c.is_ascii_digit()),
                            _ => false,
                        };
                        for _ in 0..1500 {
                            if !mine.is_empty() && next() % 2 == 0 {
                                let (ptr, size) = mine.swap_remove((next() % mine.len() as u64) as usize);
                                if size >= 16 {
                                    assert!(tags_intact(api, ptr, size), "block {ptr:#x}+{size} was overwritten");
                                }
                                live.lock().remove(&ptr);
                                if next() % 4 == 0 {
                                    let s = streams[(next() % streams.len() as u64) as usize];
                                    if let Err(e) = a.record_stream(0, ptr, Stream(s)) {
                                        assert!(is_reported(&e), "{e}");
                                    }
                                }
                                if let Err(e) = a.free(0, ptr, size) {
                                    assert!(is_reported(&e), "{e}");
                                    errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                }
                            } else {
                                let size = match next() % 10 {
                                    0 => next() % (8 * MIB),
                                    _ => next() % MIB,
                                };
                                let s = streams[(next() % streams.len() as u64) as usize];
                                match a.malloc(0, size, Stream(s)) {
                                    Ok(ptr) => {
                                        let mut map = live.lock();
                                        let before = map.range(..=ptr).next_back().map(|(&p, &n)| (p, n));
                                        if let Some((p, n)) = before {
                                            assert!(p + n.max(1) <= ptr, "{ptr:#x} overlaps {p:#x}+{n}");
                                        }
                                        if let Some((&p, _)) = map.range(ptr + 1..).next() {
                                            assert!(ptr + size.max(1) <= p, "{ptr:#x}+{size} overlaps {p:#x}");
                                        }
                                        map.insert(ptr, size);
                                        drop(map);
                                        if size >= 16 {
                                            write_tags(api, ptr, size);
                                        }
                                        mine.push((ptr, size));
                                    }
                                    Err(e) => {
                                        assert!(is_reported(&e), "{e}");
                                        errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                    }
                                }
                            }
                        }
                        for (ptr, size) in mine {
                            if size >= 16 {
                                assert!(tags_intact(api, ptr, size), "block {ptr:#x}+{size} was overwritten");
                            }
                            live.lock().remove(&ptr);
                            if let Err(e) = a.free(0, ptr, size) {
                                assert!(is_reported(&e), "{e}");
                            }
                        }
                    });
                }
            });
        });
        assert!(errors.into_inner() > 0, "no injected failure reached the allocator");
        a.check_invariants().expect("invariants");
        let stats = a.stats(0).expect("stats").to_map();
        assert_eq!(stats.get("allocated_bytes.all.current").and_then(|v| v.as_u64()), Some(0));
        // Pending events (records that succeeded) complete; then the cache empties fully.
        devices[0].synchronize().expect("sync");
        a.empty_cache().expect("empty_cache");
        assert_eq!(
            a.stats(0).expect("stats").to_map().get("reserved_bytes.all.current").and_then(|v| v.as_u64()),
            Some(0)
        );
        for s in streams.into_iter().skip(1) {
            // Safety: the streams made above, destroyed once, after every thread finished.
            let _ = unsafe { (api.stream_destroy)(s as usize as CuStream) };
        }
    }

    /// Found by the random programs: when waiting for a pending free's event failed, the heap
    /// had already taken the event off its queue, so the block stayed pending for good and its
    /// segment could never be released.
    #[test]
    fn host_a_failed_wait_does_not_leak_the_block() {
        let Some(host) = HostCuda::get("host_a_failed_wait_does_not_leak_the_block") else { return };
        let mut devices = open_devices().expect("devices");
        let side = new_stream(&mut devices[0]) as usize as u64;
        let a = Allocator::new(Config::parse("backend:cuda").expect("valid")).expect("allocator");
        let p = a.malloc(0, 4 * MIB, Stream::DEFAULT).expect("malloc");
        a.record_stream(0, p, Stream(side)).expect("record_stream");
        a.free(0, p, 4 * MIB).expect("free: pending on two events");
        with_setting(&host, "fail", "cuEventSynchronize:46:count=1", "", || {
            let _ = a.empty_cache();
        });
        a.empty_cache().expect("empty_cache once the driver works again");
        let reserved = a.stats(0).expect("stats").to_map().get("reserved_bytes.all.current").and_then(|v| v.as_u64());
        assert_eq!(reserved, Some(0), "the block whose wait failed was never freed");
    }

    #[test]
    fn gpu_mem_info_on_an_unused_device_creates_no_context() {
        let Some(mut devices) = devices("gpu_mem_info_on_an_unused_device_creates_no_context") else { return };
        let dev = devices.last_mut().expect("a device");
        if dev.primary_context_active().expect("state") {
            eprintln!(
                "skipped gpu_mem_info_on_an_unused_device_creates_no_context: the last device's context is in use"
            );
            return;
        }
        assert!(dev.mem_info().is_err());
        assert!(!dev.primary_context_active().expect("state"), "mem_info created a context");
        // An oversize request's OOM report on an unused device: no context either.
        let a = Allocator::new(Config::parse("backend:cuda").expect("valid")).expect("allocator");
        let last = a.device_count() - 1;
        let e = a.malloc(last, dev.info().total_bytes * 2, Stream::DEFAULT).expect_err("too large");
        assert!(e.is_out_of_memory(), "{e}");
        assert!(!dev.primary_context_active().expect("state"), "an OOM report created a context");
    }
}
