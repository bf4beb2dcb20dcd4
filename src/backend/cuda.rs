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
//! - cuMemAlloc, cuMemAddressReserve, cuMemCreate and cuMemMap run in relaxed stream-capture
//!   mode (see `RelaxedCapture`), so a CUDA graph's private pool (plain, or paged under a tag)
//!   can grow while the graph is being captured, as with PyTorch's allocator.
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
//!
//! Parts: this file opens the devices and implements `Backend` (memory, virtual memory,
//! streams, events, captures); `driver.rs` loads the driver and reads its results (with the
//! context and capture-mode guards), `codes.rs` names result codes, `host.rs` holds pinned host
//! buffers and the copy stream (sleep/wake backups), `ipc.rs` shares memory with other
//! processes, `tools.rs` drives a device beside the allocator (tools and tests), `tests.rs` the
//! tests.

mod codes;
mod driver;
mod host;
mod ipc;
pub mod tools;

use super::{Backend, DeviceInfo, DriverTime, Event, PhysHandle, Stream};
use crate::error::{Error, Result};
use rustc_hash::FxHashMap;
use std::ffi::{c_char, c_int, c_uint};
use std::time::Instant;

use driver::*;

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
        // A tagged CUDA-graph pool grows through these calls during its capture: relaxed mode,
        // as for cuMemAlloc in `reserve` (heap/graphs.rs).
        let _relaxed = RelaxedCapture::enter(self.api)?;
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
        let _relaxed = RelaxedCapture::enter(self.api)?; // see `reserve_address`
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
        let _relaxed = RelaxedCapture::enter(self.api)?; // see `reserve_address`
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

    fn ipc_open(&mut self, handle: &[u8; 64]) -> Result<(u64, u64)> {
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
    fn host_readable(&self) -> bool {
        true
    }

    fn host_alloc(&mut self, bytes: u64) -> Result<u64> {
        self.host_alloc_pinned(bytes)
    }

    fn host_free(&mut self, ptr: u64, _bytes: u64) -> Result<()> {
        self.host_free_pinned(ptr)
    }

    fn host_alloc_pageable(&mut self, bytes: u64) -> Result<u64> {
        self.host_alloc_mmap(bytes)
    }

    fn host_free_pageable(&mut self, ptr: u64, bytes: u64) -> Result<()> {
        self.host_free_mmap(ptr, bytes)
    }

    fn host_to_file(&mut self, host: u64, bytes: u64, file: &std::fs::File, offset: u64) -> Result<()> {
        self.write_host_to_file(host, bytes, file, offset)
    }

    fn file_to_host(&mut self, file: &std::fs::File, offset: u64, host: u64, bytes: u64) -> Result<()> {
        self.read_file_to_host(file, offset, host, bytes)
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
mod tests;
