//! The CUDA backend: cudarc's driver API, loaded at run time (`dynamic-loading`), so the crate
//! builds and runs on machines without CUDA. Layer: below the heap, one value per device.
//!
//! Invariants and rules:
//! - Nothing here runs at library load or at exit. `open_all` is the first driver call, made
//!   when the allocator is created on first use; a `CudaDevice` is never dropped with the
//!   process-wide allocator (it leaks at exit by design: PyTorch may still free tensors while the
//!   process tears down, and the driver may already be gone).
//! - cudarc panics when `libcuda` or one of its symbols is missing, so `open_all` checks
//!   `is_culib_present()` first and every driver call runs under `catch_unwind` (`driver`).
//! - Each device works in its primary context (the one PyTorch's runtime uses), retained on the
//!   device's first driver call (not at open: a process that uses one GPU of eight must not
//!   create contexts, about 500 MiB each, on the other seven) and never released. Every call
//!   makes it current and then restores the caller's context, because PyTorch reads the
//!   current device from the thread and does not set it before free.
//! - cuMemAlloc runs in relaxed stream-capture mode (see `RelaxedCapture`), so a CUDA graph's
//!   private pool can grow while the graph is being captured, as with PyTorch's allocator.
//! - Events are created once with `CU_EVENT_DISABLE_TIMING` and pooled; `Event` holds the
//!   `CUevent` handle itself. The heap guarantees an event is live when it queries it.
//! - `CUDA_ERROR_OUT_OF_MEMORY` becomes `Error::OutOfMemory` (the heap fills in the report);
//!   every other failure becomes `Error::Driver` with the call and the error's name.

use super::{Backend, DeviceInfo, DriverTime, Event, PhysHandle, Stream};
use crate::error::{Error, Result};
use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

/// One CUDA device, driven in its primary context.
pub struct CudaDevice {
    ordinal: usize,
    device: sys::CUdevice,
    /// The primary context, once retained (see the top of the file).
    context: Option<sys::CUcontext>,
    name: String,
    total_bytes: u64,
    /// Events not in use, ready to record again.
    idle_events: Vec<sys::CUevent>,
    time: DriverTime,
}

// Safety: driver handles (contexts, events) may be used from any thread; the allocator uses a
// `CudaDevice` only under its device lock, so no two threads use it at once.
unsafe impl Send for CudaDevice {}

/// Maps a driver error once, at the boundary: out of memory is retryable, the rest is named.
fn map_error(call: &'static str, e: DriverError) -> Error {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        Error::OutOfMemory(Box::default())
    } else {
        // The enum's name is the driver's error name; no further driver call is needed.
        Error::Driver { call, code: format!("{:?}", e.0) }
    }
}

/// Runs driver calls under a panic guard: cudarc panics on a missing symbol (an old driver).
fn driver<T>(call: &'static str, f: impl FnOnce() -> std::result::Result<T, DriverError>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(map_error(call, e)),
        Err(payload) => {
            let what = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(Error::Driver { call, code: format!("driver library failure: {what}") })
        }
    }
}

/// Makes `context` current for the duration of a call and restores the caller's context.
struct CurrentContext {
    /// The caller's context (null: none) when we replaced it; `None` when it was already ours.
    restore: Option<sys::CUcontext>,
}

impl CurrentContext {
    fn enter(context: sys::CUcontext) -> Result<CurrentContext> {
        driver("cuCtxSetCurrent", || {
            let previous = result::ctx::get_current()?.unwrap_or(std::ptr::null_mut());
            if previous == context {
                return Ok(CurrentContext { restore: None });
            }
            // Safety: `context` is a primary context retained by `CudaDevice::enter`, never released.
            unsafe { result::ctx::set_current(context)? };
            Ok(CurrentContext { restore: Some(previous) })
        })
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        if let Some(previous) = self.restore {
            // Safety: `previous` was current on this thread a moment ago (or null, which unbinds);
            // a failure leaves our context current, which the next call handles the same way.
            let _ = driver("cuCtxSetCurrent", || unsafe { result::ctx::set_current(previous) });
        }
    }
}

/// Switches this thread's stream-capture mode to relaxed for a call and restores it after.
struct RelaxedCapture {
    previous: sys::CUstreamCaptureMode,
}

impl RelaxedCapture {
    fn enter() -> Result<RelaxedCapture> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // Safety: the driver reads and writes one enum through the pointer.
        driver("cuThreadExchangeStreamCaptureMode", || unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode).result()
        })?;
        Ok(RelaxedCapture { previous: mode })
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // Safety: as in `enter`; restores the mode this thread had.
        let _ = driver("cuThreadExchangeStreamCaptureMode", || unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode).result()
        });
    }
}

/// Opens every CUDA device, or says why it cannot.
pub fn open_all() -> Result<Vec<Box<dyn Backend>>> {
    // Safety: only tries to dlopen the driver library and closes it again.
    let present = catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
    if !present {
        return Err(Error::Unavailable(
            "the CUDA driver library (libcuda.so) was not found; is an NVIDIA driver installed?".into(),
        ));
    }
    driver("cuInit", result::init)?;
    let count = driver("cuDeviceGetCount", result::device::get_count)?;
    if count <= 0 {
        return Err(Error::Unavailable("the CUDA driver reports no device".into()));
    }
    let mut devices: Vec<Box<dyn Backend>> = Vec::with_capacity(count as usize);
    for ordinal in 0..count {
        devices.push(Box::new(CudaDevice::open(ordinal)?));
    }
    Ok(devices)
}

impl CudaDevice {
    fn open(ordinal: i32) -> Result<CudaDevice> {
        let device = driver("cuDeviceGet", || result::device::get(ordinal))?;
        let name = driver("cuDeviceGetName", || result::device::get_name(device))?;
        // Safety: `device` came from cuDeviceGet.
        let total = driver("cuDeviceTotalMem", || unsafe { result::device::total_mem(device) })?;
        Ok(CudaDevice {
            ordinal: ordinal as usize,
            device,
            context: None,
            name,
            total_bytes: total as u64,
            idle_events: Vec::new(),
            time: DriverTime::default(),
        })
    }

    /// Makes this device's primary context current until the guard drops, retaining it first
    /// if this is the device's first driver call.
    fn enter(&mut self) -> Result<CurrentContext> {
        let context = match self.context {
            Some(context) => context,
            None => {
                let device = self.device;
                // Safety: `device` came from cuDeviceGet. The reference is never released.
                let context = driver("cuDevicePrimaryCtxRetain", || unsafe { result::primary_ctx::retain(device) })?;
                self.context = Some(context);
                context
            }
        };
        CurrentContext::enter(context)
    }

    fn stream(stream: Stream) -> sys::CUstream {
        // A cudaStream_t and a CUstream are the same handle; 0 is the legacy default stream.
        stream.0 as usize as sys::CUstream
    }

    fn event(event: Event) -> sys::CUevent {
        event.0 as usize as sys::CUevent
    }
}

fn elapsed_ns(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

impl Backend for CudaDevice {
    fn info(&self) -> DeviceInfo {
        DeviceInfo { name: format!("{} (cuda:{})", self.name, self.ordinal), total_bytes: self.total_bytes }
    }

    fn mem_info(&mut self) -> Result<(u64, u64)> {
        let _current = self.enter()?;
        let (free, total) = driver("cuMemGetInfo", result::mem_get_info)?;
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
        let _relaxed = RelaxedCapture::enter()?;
        // Safety: cuMemAlloc only writes the new address; the memory is handed to the heap.
        let ptr = driver("cuMemAlloc", || unsafe { result::malloc_sync(bytes) });
        self.time.reserve_ns += elapsed_ns(start);
        ptr
    }

    fn release(&mut self, ptr: u64, _bytes: u64) -> Result<()> {
        let _current = self.enter()?;
        let start = Instant::now();
        // Safety: the heap's precondition: `ptr` came from `reserve` and no queued work uses it.
        let freed = driver("cuMemFree", || unsafe { result::free_sync(ptr) });
        self.time.release_ns += elapsed_ns(start);
        freed
    }

    fn record_event(&mut self, stream: Stream) -> Result<Event> {
        let _current = self.enter()?;
        let start = Instant::now();
        let event = match self.idle_events.pop() {
            Some(event) => event,
            None => driver("cuEventCreate", || result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?,
        };
        // Safety: `event` is a live event of this context; the stream handle is the caller's.
        let recorded = driver("cuEventRecord", || unsafe { result::event::record(event, Self::stream(stream)) });
        self.time.event_ns += elapsed_ns(start);
        match recorded {
            Ok(()) => Ok(Event(event as usize as u64)),
            Err(e) => {
                self.idle_events.push(event);
                Err(e)
            }
        }
    }

    fn event_done(&mut self, event: Event) -> Result<bool> {
        let _current = self.enter()?;
        let start = Instant::now();
        // Safety: the heap queries only live events it got from `record_event`.
        let status = catch_unwind(|| unsafe { sys::cuEventQuery(Self::event(event)) })
            .unwrap_or(sys::CUresult::CUDA_ERROR_UNKNOWN);
        self.time.event_ns += elapsed_ns(start);
        match status {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(map_error("cuEventQuery", DriverError(other))),
        }
    }

    fn wait_event(&mut self, event: Event) -> Result<()> {
        let _current = self.enter()?;
        let start = Instant::now();
        // Safety: the heap waits only on live events it got from `record_event`.
        let waited = driver("cuEventSynchronize", || unsafe { result::event::synchronize(Self::event(event)) });
        self.time.sync_ns += elapsed_ns(start);
        waited
    }

    fn free_event(&mut self, event: Event) {
        // Pooled, not destroyed: a later record reuses it (recording again resets it).
        self.idle_events.push(Self::event(event));
    }

    fn synchronize(&mut self) -> Result<()> {
        let _current = self.enter()?;
        let start = Instant::now();
        let done = driver("cuCtxSynchronize", result::ctx::synchronize);
        self.time.sync_ns += elapsed_ns(start);
        done
    }

    fn driver_time(&self) -> DriverTime {
        self.time
    }

    fn vm_granularity(&mut self) -> Result<u64> {
        Err(Error::Unavailable("virtual memory: not implemented on this backend yet".into()))
    }

    fn reserve_address(&mut self, _bytes: u64) -> Result<u64> {
        Err(Error::Unavailable("virtual memory: not implemented on this backend yet".into()))
    }

    fn free_address(&mut self, _addr: u64, _bytes: u64) -> Result<()> {
        Err(Error::Unavailable("virtual memory: not implemented on this backend yet".into()))
    }

    fn create_physical(&mut self, _bytes: u64) -> Result<PhysHandle> {
        Err(Error::Unavailable("virtual memory: not implemented on this backend yet".into()))
    }

    fn release_physical(&mut self, _handle: PhysHandle) -> Result<()> {
        Err(Error::Unavailable("virtual memory: not implemented on this backend yet".into()))
    }

    fn map(&mut self, _addr: u64, _bytes: u64, _handle: PhysHandle) -> Result<()> {
        Err(Error::Unavailable("virtual memory: not implemented on this backend yet".into()))
    }

    fn unmap(&mut self, _addr: u64, _bytes: u64) -> Result<()> {
        Err(Error::Unavailable("virtual memory: not implemented on this backend yet".into()))
    }

    fn synchronize_stream(&mut self, _stream: Stream) -> Result<()> {
        self.synchronize()
    }
}

#[cfg(test)]
mod tests {
    //! Tests on a real device run when `STEPALLOC_GPU_TESTS=1` and a device is present; otherwise
    //! they print why they were skipped. The no-driver tests run everywhere else.
    use super::*;
    use crate::allocator::Allocator;
    use crate::config::Config;
    use crate::units::MIB;

    fn driver_present() -> bool {
        // Safety: only tries to dlopen the driver library.
        catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
    }

    /// The devices when GPU tests are enabled and possible, else `None` after printing why.
    fn gpu(test: &str) -> Option<Vec<Box<dyn Backend>>> {
        if std::env::var("STEPALLOC_GPU_TESTS").as_deref() != Ok("1") {
            eprintln!("skipped {test}: set STEPALLOC_GPU_TESTS=1 to run it on a CUDA device");
            return None;
        }
        if !driver_present() {
            eprintln!("skipped {test}: no CUDA driver library (libcuda.so) on this machine");
            return None;
        }
        match open_all() {
            Ok(devices) => Some(devices),
            Err(e) => {
                eprintln!("skipped {test}: no usable CUDA device: {e}");
                None
            }
        }
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
        let oom = map_error("cuMemAlloc", DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(oom.is_out_of_memory());
        let other = map_error("cuMemFree", DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
        assert_eq!(other, Error::Driver { call: "cuMemFree", code: "CUDA_ERROR_INVALID_VALUE".into() });
        assert_eq!(other.to_string(), "CUDA driver call cuMemFree failed: CUDA_ERROR_INVALID_VALUE");
    }

    #[test]
    fn gpu_reserve_release_and_mem_info() {
        let Some(mut devices) = gpu("gpu_reserve_release_and_mem_info") else { return };
        for dev in &mut devices {
            let info = dev.info();
            assert!(info.total_bytes > 0);
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
    }

    #[test]
    fn gpu_calls_restore_the_callers_context() {
        let Some(mut devices) = gpu("gpu_calls_restore_the_callers_context") else { return };
        let before = result::ctx::get_current().expect("cuCtxGetCurrent");
        for dev in &mut devices {
            let ptr = dev.reserve(2 * MIB).expect("cuMemAlloc");
            dev.release(ptr, 2 * MIB).expect("cuMemFree");
        }
        assert_eq!(result::ctx::get_current().expect("cuCtxGetCurrent"), before);
    }

    #[test]
    fn gpu_reserve_during_stream_capture() {
        if gpu("gpu_reserve_during_stream_capture").is_none() {
            return;
        }
        let mut dev = CudaDevice::open(0).expect("open device 0");
        dev.mem_info().expect("first call retains the primary context");
        let context = dev.context.expect("retained");
        // Safety: the primary context retained by the first call.
        unsafe { result::ctx::set_current(context) }.expect("cuCtxSetCurrent");
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking).expect("cuStreamCreate");
        use sys::CUstreamCaptureMode::{CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL};
        for mode in [CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL] {
            // Safety: `stream` is a live stream of the current context.
            unsafe { result::stream::begin_capture(stream, mode) }.expect("cuStreamBeginCapture");
            let reserved = dev.reserve(2 * MIB);
            // Safety: as above.
            let graph = unsafe { result::stream::end_capture(stream) };
            let ptr = reserved.unwrap_or_else(|e| panic!("cuMemAlloc during a {mode:?} capture: {e}"));
            let graph = graph.unwrap_or_else(|e| panic!("the {mode:?} capture was invalidated: {e:?}"));
            // Safety: the graph just captured, destroyed once.
            let _ = unsafe { result::graph::destroy(graph) };
            dev.release(ptr, 2 * MIB).expect("cuMemFree after the capture");
        }
    }

    #[test]
    fn gpu_allocator_on_cuda() {
        if gpu("gpu_allocator_on_cuda").is_none() {
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
}
