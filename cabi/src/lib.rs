//! libstepalloc.so: the C ABI of stepalloc, loaded by PyTorch through
//! `torch.cuda.memory.CUDAPluggableAllocator` and by the Python package through ctypes.
//!
//! Layer: the boundary between C / C++ / PyTorch and the core crate. Files:
//! - `torch.rs`: the entry points PyTorch calls (malloc, free and hooks), hot path;
//! - `trampoline.cpp`: the C++ part: `stepalloc_torch_malloc`, which throws a C++ exception on
//!   out-of-memory, and the CUDA-graph pool hooks, which take C++ types by value;
//! - `pools.rs`: user memory pools (`torch.cuda.MemPool` under process-wide stepalloc);
//! - `checkpoint.rs`: a private pool's state recorded and restored (CUDA-graph trees);
//! - `ipc.rs`: CUDA IPC of blocks in PyTorch's handle format;
//! - `nccl.rs`: a pool's segments registered as they come and go (NCCL buffer registration);
//! - `control.rs`: configuration, steps, statistics, snapshots, traces, metrics, last error;
//! - `sleep.rs`: regions (tags), pause and resume, their report and per-tag figures;
//! - `guard.rs`, `last_error.rs`, `status.rs`: the panic guard, the thread-local last error,
//!   the stable status codes.
//!
//! Invariants: no panic and no Rust error crosses the boundary (every export runs under
//! `guard`); NULL and out-of-range arguments are refused with `STEPALLOC_INVALID_ARGUMENT`;
//! nothing runs at load or at exit (the allocator is created on first use and never dropped).
//! The header `include/stepalloc.h` is generated from these files by cbindgen (see
//! `cbindgen.toml`); `tests/header.rs` fails when it drifts.

// The C ABI needs `unsafe`: each block says why it is sound.
#![allow(unsafe_code)]
#![deny(clippy::unwrap_used)]

mod checkpoint;
mod control;
mod guard;
mod ipc;
mod last_error;
mod nccl;
mod pools;
mod sleep;
mod status;
mod torch;

pub use checkpoint::*;
pub use control::*;
pub use ipc::*;
pub use nccl::*;
pub use pools::*;
pub use sleep::*;
pub use status::*;
pub use torch::*;

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use stepalloc::Allocator;

/// PyTorch's `cudaStream_t`, an opaque handle owned by the caller (NULL: the default stream).
/// The header declares it as `struct CUstream_st *`, the same type as CUDA's runtime headers.
#[allow(non_camel_case_types)]
pub type cudaStream_t = *mut c_void;

/// The process-wide allocator, created on first use (which also starts the endpoint the
/// `metrics_addr` key names, if any).
#[inline]
fn allocator() -> Result<&'static Arc<Allocator>, AbiError> {
    Ok(stepalloc::global()?)
}

/// A device number from C: negative numbers are refused here, too-large ones by the core.
#[inline]
fn device_index(device: c_int) -> Result<usize, AbiError> {
    usize::try_from(device).map_err(|_| AbiError::invalid(format!("device {device} is negative")))
}
