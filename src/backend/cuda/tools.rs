//! Driver calls for programs that drive a CUDA device beside the allocator: the stress tool's
//! `random` workload (its streams, and the tags it writes into every block and reads back) and
//! tests. The allocator never creates streams or touches the memory it hands out; these helpers
//! do, through the same loader, results-as-integers and error mapping as the backend.
//!
//! Every call runs in the device's primary context (the one the allocator and PyTorch use),
//! made current for the call and then restored, like the backend's own calls. The primary
//! context is retained when `DeviceTools::open` is called and never released (the allocator
//! keeps it alive anyway). Device addresses are checked by the driver: an address range that is
//! not device memory is an `Error::Driver` (`CUDA_ERROR_INVALID_VALUE`), not undefined behaviour.

use super::{api, check, driver_present, stream_handle, Api, CuContext, CuStream, CurrentContext};
use crate::backend::Stream;
use crate::error::{Error, Result};
use std::ffi::{c_int, c_uint};

/// `CU_STREAM_NON_BLOCKING`.
const CU_STREAM_NON_BLOCKING: c_uint = 1;

/// One device's primary context, for stream, memset and copy calls.
pub struct DeviceTools {
    api: &'static Api,
    context: CuContext,
}

// Safety: a primary context may be made current on any thread; `DeviceTools` holds no other
// state, and every call makes the context current on the calling thread first.
unsafe impl Send for DeviceTools {}
// Safety: as for `Send`; the driver's calls are thread-safe.
unsafe impl Sync for DeviceTools {}

impl DeviceTools {
    /// Opens device `ordinal` (initialising the driver) and retains its primary context.
    pub fn open(ordinal: usize) -> Result<DeviceTools> {
        if !driver_present() {
            return Err(Error::Unavailable(
                "the CUDA driver library (libcuda.so) was not found; is an NVIDIA driver installed?".into(),
            ));
        }
        let api = api()?;
        // Safety: a plain value argument.
        check("cuInit", unsafe { (api.init)(0) })?;
        let ordinal = c_int::try_from(ordinal).map_err(|_| Error::InvalidArgument(format!("device {ordinal}")))?;
        let mut device: c_int = 0;
        // Safety: one out-pointer to a local.
        check("cuDeviceGet", unsafe { (api.device_get)(&mut device, ordinal) })?;
        let mut context: CuContext = std::ptr::null_mut();
        // Safety: `device` came from cuDeviceGet; the reference is never released.
        check("cuDevicePrimaryCtxRetain", unsafe { (api.primary_ctx_retain)(&mut context, device) })?;
        Ok(DeviceTools { api, context })
    }

    fn enter(&self) -> Result<CurrentContext> {
        CurrentContext::enter(self.api, self.context)
    }

    /// A new stream of the device's primary context (`non_blocking`: `CU_STREAM_NON_BLOCKING`,
    /// no implicit synchronization with the legacy default stream).
    pub fn create_stream(&self, non_blocking: bool) -> Result<Stream> {
        let _current = self.enter()?;
        let mut stream: CuStream = std::ptr::null_mut();
        let flags = if non_blocking { CU_STREAM_NON_BLOCKING } else { 0 };
        // Safety: one out-pointer to a local; the primary context is current.
        check("cuStreamCreate", unsafe { (self.api.stream_create)(&mut stream, flags) })?;
        Ok(Stream(stream as usize as u64))
    }

    /// Destroys a stream made by `create_stream` (work still queued on it completes first, as
    /// the driver documents).
    pub fn destroy_stream(&self, stream: Stream) -> Result<()> {
        let _current = self.enter()?;
        // Safety: the driver checks the handle; the caller does not use the stream again.
        check("cuStreamDestroy", unsafe { (self.api.stream_destroy)(stream_handle(stream)) })
    }

    /// Waits until the work queued on `stream` so far has completed.
    pub fn synchronize_stream(&self, stream: Stream) -> Result<()> {
        let _current = self.enter()?;
        // Safety: the driver checks the handle.
        check("cuStreamSynchronize", unsafe { (self.api.stream_synchronize)(stream_handle(stream)) })
    }

    /// Sets `words` 32-bit words from device address `ptr` (a multiple of 4) to `value`, queued
    /// on `stream`.
    pub fn memset_d32_async(&self, ptr: u64, value: u32, words: usize, stream: Stream) -> Result<()> {
        let _current = self.enter()?;
        // Safety: device memory only; the driver checks the range and the stream handle.
        check("cuMemsetD32Async", unsafe { (self.api.memset_d32_async)(ptr, value, words, stream_handle(stream)) })
    }

    /// As `memset_d32_async`, on the legacy default stream, synchronously with earlier work of
    /// the blocking streams.
    pub fn memset_d32(&self, ptr: u64, value: u32, words: usize) -> Result<()> {
        let _current = self.enter()?;
        // Safety: device memory only; the driver checks the range.
        check("cuMemsetD32", unsafe { (self.api.memset_d32)(ptr, value, words) })
    }

    /// Copies `dst.len()` bytes from device address `src` into `dst` (synchronous, on the legacy
    /// default stream).
    pub fn copy_to_host(&self, dst: &mut [u8], src: u64) -> Result<()> {
        let _current = self.enter()?;
        // Safety: the driver writes at most `dst.len()` bytes into `dst`, which is ours for the
        // call; it checks that the source range is device memory.
        check("cuMemcpyDtoH", unsafe { (self.api.memcpy_dtoh)(dst.as_mut_ptr().cast(), src, dst.len()) })
    }
}
