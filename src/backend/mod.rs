//! The boundary between the allocator and a device. Everything above this trait is the same
//! code on every backend: the CUDA driver (`cuda.rs`) or the simulated device (`sim.rs`).
//!
//! One backend value serves one device and is only ever used under that device's lock, so
//! methods take `&mut self` and need no locking of their own.

#[allow(unsafe_code)] // the driver API: each unsafe block says why it is sound
pub mod cuda;
pub mod sim;

use crate::error::Result;

/// A stream handle owned by the caller (PyTorch's `cudaStream_t`; 0 is the default stream).
/// The allocator never creates or destroys streams.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct Stream(pub u64);

impl Stream {
    pub const DEFAULT: Stream = Stream(0);
}

/// An event recorded by a backend, opaque to the allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event(pub u64);

/// What a device is.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DeviceInfo {
    pub name: String,
    pub total_bytes: u64,
}

/// Cumulative time spent in driver calls, in nanoseconds: measured on CUDA, modelled on the
/// simulated device (zero unless its cost model is on).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct DriverTime {
    pub reserve_ns: u64,
    pub release_ns: u64,
    pub event_ns: u64,
    pub sync_ns: u64,
    /// Virtual memory: `create_physical` and `release_physical`.
    pub create_ns: u64,
    /// Virtual memory: `map` (map and set access) and `unmap`.
    pub map_ns: u64,
}

/// A physical memory chunk created by `Backend::create_physical` (`CUmemGenericAllocationHandle`
/// on CUDA), opaque to the allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PhysHandle(pub u64);

/// A device as the allocator needs it. Preconditions are the caller's (the heap's) duty;
/// a backend may assume them and must not panic when they hold.
pub trait Backend: Send {
    fn info(&self) -> DeviceInfo;

    /// Free and total device memory now, in bytes (`cuMemGetInfo`).
    fn mem_info(&mut self) -> Result<(u64, u64)>;

    /// Reserves `bytes` of device memory. Precondition: `bytes > 0` and a multiple of 512.
    /// Returns a non-zero address aligned to at least 512 bytes that overlaps no other live
    /// reservation. Out of device memory is `Error::OutOfMemory` (with an empty report, which
    /// the heap fills in); any other failure is `Error::Driver`.
    fn reserve(&mut self, bytes: u64) -> Result<u64>;

    /// Returns a whole reservation. Precondition: `(ptr, bytes)` came from `reserve` and no
    /// queued work still uses it (every event recorded after its last use has completed).
    fn release(&mut self, ptr: u64, bytes: u64) -> Result<()>;

    /// Records an event on `stream` that completes when the work queued there so far does.
    fn record_event(&mut self, stream: Stream) -> Result<Event>;

    /// Whether `event` has completed. Precondition: `event` is live (recorded, not yet freed).
    fn event_done(&mut self, event: Event) -> Result<bool>;

    /// Blocks the host until `event` completes. Precondition: `event` is live.
    fn wait_event(&mut self, event: Event) -> Result<()>;

    /// Returns an event to the backend (events are pooled, not destroyed).
    fn free_event(&mut self, event: Event);

    /// Blocks until all work on the device completes.
    fn synchronize(&mut self) -> Result<()>;

    fn driver_time(&self) -> DriverTime;

    // ----- virtual memory (CUDA's cuMem* API) ----------------------------------------------
    // The rules are the driver's; a backend enforces them or relies on the driver to: sizes
    // and addresses are multiples of `vm_granularity`; `map` only inside a reserved range and
    // never over a mapped byte; `unmap` only exactly what one `map` mapped; physical memory
    // counts against the device's capacity from `create_physical` until `release_physical`;
    // a reserved range is freed only when nothing in it is mapped.

    /// The granularity of every virtual-memory size and address (2 MiB on current GPUs), or
    /// `Error::Unavailable` when the device does not support virtual memory management.
    fn vm_granularity(&mut self) -> Result<u64>;

    /// Reserves `bytes` of virtual address space (no memory behind it).
    fn reserve_address(&mut self, bytes: u64) -> Result<u64>;

    /// Frees a range from `reserve_address`. Precondition: nothing in it is mapped.
    fn free_address(&mut self, addr: u64, bytes: u64) -> Result<()>;

    /// Creates `bytes` of physical memory. Out of device memory is `Error::OutOfMemory`.
    fn create_physical(&mut self, bytes: u64) -> Result<PhysHandle>;

    /// Releases a chunk from `create_physical`. Precondition: it is mapped nowhere.
    fn release_physical(&mut self, handle: PhysHandle) -> Result<()>;

    /// Maps the whole chunk `handle` (of `bytes`) at `addr` inside a reserved range and makes
    /// it readable and writable by this device.
    fn map(&mut self, addr: u64, bytes: u64, handle: PhysHandle) -> Result<()>;

    /// Unmaps `bytes` at `addr`, exactly what one `map` mapped. Precondition: no queued work
    /// still uses it (the caller synchronized the streams that used it).
    fn unmap(&mut self, addr: u64, bytes: u64) -> Result<()>;

    /// Blocks the host until the work queued on `stream` so far completes.
    fn synchronize_stream(&mut self, stream: Stream) -> Result<()>;

    /// Lets simulated time pass (the stress tool's model of kernel time). A no-op on real
    /// devices, where time passes by itself.
    fn advance_time(&mut self, _ns: u64) {}

    /// Whether `stream` is being captured into a CUDA graph now (`cuStreamIsCapturing`), for
    /// finding captures that ended without `endAllocateToPool` (a failed capture). Safe to call
    /// during a capture. The default (the simulated device, which has no captures) says no.
    fn stream_is_capturing(&mut self, _stream: Stream) -> Result<bool> {
        Ok(false)
    }

    // ----- host backups (`pause` / `resume`) -------------------------------------------------
    // Pinned host buffers and asynchronous copies on a copy stream the backend creates and owns
    // (one per device). Copies on it run in the order queued; `record_copy_event` orders the
    // caller after them. The defaults say the backend cannot back memory up.

    /// Whether `host_alloc`'s addresses are memory this process may read (a real driver's
    /// pinned buffers); the simulated device's are addresses only.
    fn host_readable(&self) -> bool {
        false
    }

    /// Allocates `bytes` of pinned host memory (`cuMemHostAlloc`); returns its address.
    fn host_alloc(&mut self, _bytes: u64) -> Result<u64> {
        Err(crate::error::Error::Unavailable("this device cannot back memory up to the host".into()))
    }

    /// Frees a buffer from `host_alloc`. Precondition: no queued copy still uses it.
    fn host_free(&mut self, _ptr: u64, _bytes: u64) -> Result<()> {
        Err(crate::error::Error::Unavailable("this device cannot back memory up to the host".into()))
    }

    /// Queues a copy of `bytes` from device address `src` (mapped) to host address `dst`
    /// (inside a `host_alloc` buffer) on the copy stream.
    fn copy_to_host(&mut self, _dst: u64, _src: u64, _bytes: u64) -> Result<()> {
        Err(crate::error::Error::Unavailable("this device cannot back memory up to the host".into()))
    }

    /// Queues a copy of `bytes` from host address `src` to device address `dst` (mapped) on
    /// the copy stream.
    fn copy_to_device(&mut self, _dst: u64, _src: u64, _bytes: u64) -> Result<()> {
        Err(crate::error::Error::Unavailable("this device cannot back memory up to the host".into()))
    }

    /// Records an event on the copy stream: it completes when the copies queued so far do.
    fn record_copy_event(&mut self) -> Result<Event> {
        Err(crate::error::Error::Unavailable("this device cannot back memory up to the host".into()))
    }

    /// Allocates `bytes` of pageable host memory (anonymous `mmap`, neither pinned nor
    /// registered with the driver: the `mmap` backup store); returns its address. The copy
    /// calls take its addresses as they take `host_alloc`'s (the driver stages pageable copies).
    fn host_alloc_pageable(&mut self, _bytes: u64) -> Result<u64> {
        Err(crate::error::Error::Unavailable("this device cannot back memory up to the host".into()))
    }

    /// Frees a buffer from `host_alloc_pageable` (`munmap`). Precondition: no queued copy uses it.
    fn host_free_pageable(&mut self, _ptr: u64, _bytes: u64) -> Result<()> {
        Err(crate::error::Error::Unavailable("this device cannot back memory up to the host".into()))
    }

    /// Writes `bytes` of the host buffer at `host` (inside a `host_alloc` buffer, no copy into
    /// it pending) to `file` at `offset` (the disk backup store).
    fn host_to_file(&mut self, _host: u64, _bytes: u64, _file: &std::fs::File, _offset: u64) -> Result<()> {
        Err(crate::error::Error::Unavailable("this device cannot back memory up to disk".into()))
    }

    /// Reads `bytes` of `file` at `offset` into the host buffer at `host` (inside a `host_alloc`
    /// buffer, no copy from it pending). A file shorter than that is an error.
    fn file_to_host(&mut self, _file: &std::fs::File, _offset: u64, _host: u64, _bytes: u64) -> Result<()> {
        Err(crate::error::Error::Unavailable("this device cannot back memory up to disk".into()))
    }
    // ----- sharing memory with other processes (CUDA IPC; the formats are `crate::ipc`'s) -----
    // The defaults say the device cannot; the simulated device names what it would share (so
    // the heap's side is tested) but opens nothing, having no other processes.

    /// The `cudaIpcMemHandle_t` of a reservation from `reserve`, named by its base.
    fn ipc_handle(&mut self, _base: u64) -> Result<[u8; 64]> {
        Err(no_ipc())
    }

    /// A POSIX file descriptor of a chunk from `create_physical` (created shareable): the same
    /// number on every call, open in this process until the chunk is released.
    fn export_physical(&mut self, _handle: PhysHandle) -> Result<i32> {
        Err(no_ipc())
    }

    /// Maps another process's `cudaIpcMemHandle_t` here; returns its address and the length of
    /// what was mapped (the whole allocation the handle names), which bounds what a receiver
    /// may read there.
    fn ipc_open(&mut self, _handle: &[u8; 64]) -> Result<(u64, u64)> {
        Err(no_ipc())
    }

    /// Unmaps what `ipc_open` mapped.
    fn ipc_close(&mut self, _addr: u64) -> Result<()> {
        Err(no_ipc())
    }

    /// A physical chunk of process `pid`'s descriptor `fd` (exported by `export_physical` there),
    /// to map with `map` and release with `release_physical`.
    fn import_physical(&mut self, _pid: i32, _fd: i32) -> Result<PhysHandle> {
        Err(no_ipc())
    }
}

fn no_ipc() -> crate::error::Error {
    crate::error::Error::Unavailable("this device cannot share memory with other processes (CUDA IPC)".into())
}
