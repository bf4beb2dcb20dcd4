//! A pool's segments registered with another library as they come and go: NCCL's user buffer
//! registration (`ProcessGroupNCCL.register_mem_pool`, which the Python package replaces with
//! this, since PyTorch's own needs its allocator's snapshot and trace hooks). Layer: the
//! boundary. Each export runs under `guard`.
//!
//! The register / deregister functions have NCCL's signatures (`ncclCommRegister`,
//! `ncclCommDeregister`) with the communicator as `ctx`; they are called under the device lock,
//! on the thread that creates or releases a segment, and must not call back into stepalloc.

use crate::guard::guard_status;
use crate::{allocator, device_index, AbiError};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use stepalloc::SegmentListener;

/// `int register(void *ctx, void *addr, size_t size, void **handle)`: 0 on success, as
/// `ncclCommRegister`.
#[allow(non_camel_case_types)]
pub type stepalloc_segment_register_fn =
    Option<unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *mut *mut c_void) -> c_int>;
/// `int deregister(void *ctx, void *handle)`, as `ncclCommDeregister`.
#[allow(non_camel_case_types)]
pub type stepalloc_segment_deregister_fn = Option<unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int>;

struct Registrar {
    ctx: usize,
    register: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *mut *mut c_void) -> c_int,
    deregister: unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int,
    /// The handle of each registered segment, by address.
    handles: HashMap<u64, usize>,
}

impl SegmentListener for Registrar {
    fn added(&mut self, _device: usize, addr: u64, size: u64) -> Result<(), String> {
        let size = usize::try_from(size).map_err(|_| format!("size {size} does not fit size_t"))?;
        let mut handle: *mut c_void = std::ptr::null_mut();
        // Safety: the caller of `stepalloc_pool_register_segments` promised a function of this
        // signature that stays loaded; `ctx` is its own opaque value; `handle` is a valid slot.
        let code = unsafe { (self.register)(self.ctx as *mut c_void, addr as usize as *mut c_void, size, &mut handle) };
        if code != 0 {
            return Err(format!("the register function returned {code}"));
        }
        self.handles.insert(addr, handle as usize);
        Ok(())
    }

    fn removed(&mut self, _device: usize, addr: u64, _size: u64) {
        if let Some(handle) = self.handles.remove(&addr) {
            // Safety: as for `added`; `handle` is what the register function gave for `addr`.
            // A failure has no one to report to: the segment is going either way.
            let _ = unsafe { (self.deregister)(self.ctx as *mut c_void, handle as *mut c_void) };
        }
    }
}

/// Registers every segment of private pool `(id0, id1)` on `device` with `register(ctx, ...)`,
/// and from now on each segment the pool creates; each is deregistered with `deregister(ctx,
/// handle)` before it is released. With both functions NULL, deregisters the pool's segments
/// registered under `ctx` and stops. Returns a status: `STEPALLOC_INVALID_ARGUMENT` for one
/// function NULL, a pool that does not exist or has paged segments, a `ctx` already registered
/// (or, to stop, not registered), or a register call that failed (the segments registered
/// before it are deregistered again).
///
/// # Safety
/// `register` and `deregister` must be functions of those signatures that stay loaded while the
/// pool is registered; `ctx` is passed to them unchanged.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_pool_register_segments(
    device: c_int,
    id0: u64,
    id1: u64,
    ctx: *mut c_void,
    register: stepalloc_segment_register_fn,
    deregister: stepalloc_segment_deregister_fn,
) -> c_int {
    guard_status(|| {
        let index = device_index(device)?;
        let key = ctx as usize as u64;
        match (register, deregister) {
            (Some(register), Some(deregister)) => {
                let registrar = Registrar { ctx: ctx as usize, register, deregister, handles: HashMap::new() };
                allocator()?.with_heap(index, |heap| heap.listen_to_pool((id0, id1), key, Box::new(registrar)))??;
                Ok(())
            }
            (None, None) => {
                if allocator()?.with_heap(index, |heap| heap.stop_listening((id0, id1), key))? {
                    Ok(())
                } else {
                    Err(AbiError::invalid(format!(
                        "memory pool ({id0}, {id1}) on device {device} is not registered with {key:#x}"
                    )))
                }
            }
            _ => Err(AbiError::invalid("stepalloc_pool_register_segments: give both functions, or neither".into())),
        }
    })
}
