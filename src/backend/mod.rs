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
}

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

    /// Lets simulated time pass (the stress tool's model of kernel time). A no-op on real
    /// devices, where time passes by itself.
    fn advance_time(&mut self, _ns: u64) {}
}
