//! Checkpoints of a private pool (torch.compile's CUDA-graph trees: PyTorch's
//! `_cuda_getCheckpointState` / `_cuda_setCheckpointPoolState`, which the Python package
//! replaces with these). Layer: the boundary. Each export runs under `guard`.
//!
//! A checkpoint is plain data the caller keeps: 64-bit words (`stepalloc::PoolCheckpoint`'s
//! encoding), so nothing here holds state between calls. A restore reports blocks as four words
//! each: address, size, bytes asked for, stream.

use crate::guard::{guard, guard_status};
use crate::{allocator, device_index, AbiError};
use std::ffi::c_int;
use stepalloc::{CheckpointBlock, PoolCheckpoint};

/// `stepalloc_pool_restore` flag: only report what the restore would free and allocate.
pub const STEPALLOC_RESTORE_DRY_RUN: c_int = 1;
/// `stepalloc_pool_restore` flag: the blocks it allocates go, in order, to the pool's next
/// allocations (so a caller can take them through its own allocator layer, e.g. PyTorch's).
pub const STEPALLOC_RESTORE_ADOPT: c_int = 2;

/// Records the state of private pool `(id0, id1)` on `device`: its segments and allocated
/// blocks. Returns the checkpoint's length in 64-bit words (0 on an error, left in the last
/// error) and writes it to `buf` when `cap` is at least that; otherwise writes nothing (call
/// again with a larger buffer).
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable 64-bit words.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_pool_checkpoint(
    device: c_int,
    id0: u64,
    id1: u64,
    buf: *mut u64,
    cap: usize,
) -> usize {
    guard(|| {
        let index = device_index(device)?;
        let words = allocator()?.with_heap(index, |heap| heap.checkpoint_pool((id0, id1)))??.to_words();
        if !buf.is_null() && cap >= words.len() {
            // Safety: the caller promised `cap` writable words at `buf`; `words` fits.
            unsafe { std::ptr::copy_nonoverlapping(words.as_ptr(), buf, words.len()) };
        }
        Ok(words.len())
    })
}

/// Restores a private pool on `device` to a checkpoint from `stepalloc_pool_checkpoint`
/// (`state`, `words` long; the pool is the one recorded in it): frees its blocks allocated
/// since (or there with another size) and allocates again, at their addresses, the recorded
/// blocks freed since. `flags`: `STEPALLOC_RESTORE_DRY_RUN`, `STEPALLOC_RESTORE_ADOPT`.
/// Writes the blocks freed to `freed` and those allocated to `allocated` (four words each, at
/// most `freed_cap` / `allocated_cap` blocks) and their numbers to `counts[0]` / `counts[1]`.
/// Refused with a status, changing nothing, when a recorded segment is gone, a block of the
/// pool still waits for other streams' work, a CUDA graph capture is underway, the checkpoint
/// is malformed, or a list does not fit its buffer (a dry run reports the numbers needed, and
/// fills what fits).
///
/// # Safety
/// `state` must point to `words` readable words; `freed` / `allocated` must be NULL or point to
/// `4 * freed_cap` / `4 * allocated_cap` writable words; `counts` to two writable `size_t`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stepalloc_pool_restore(
    device: c_int,
    state: *const u64,
    words: usize,
    flags: c_int,
    freed: *mut u64,
    freed_cap: usize,
    allocated: *mut u64,
    allocated_cap: usize,
    counts: *mut usize,
) -> c_int {
    guard_status(|| {
        if state.is_null() || counts.is_null() {
            return Err(AbiError::invalid("stepalloc_pool_restore: state or counts is NULL".into()));
        }
        if flags & !(STEPALLOC_RESTORE_DRY_RUN | STEPALLOC_RESTORE_ADOPT) != 0 {
            return Err(AbiError::invalid(format!("stepalloc_pool_restore: unknown flags {flags:#x}")));
        }
        let index = device_index(device)?;
        // Safety: the caller promised `words` readable words at `state`.
        let checkpoint = PoolCheckpoint::from_words(unsafe { std::slice::from_raw_parts(state, words) })?;
        let dry_run = flags & STEPALLOC_RESTORE_DRY_RUN != 0;
        let adopt = flags & STEPALLOC_RESTORE_ADOPT != 0;
        let cap = |buf: *mut u64, cap: usize| if buf.is_null() { 0 } else { cap };
        let (freed_cap, allocated_cap) = (cap(freed, freed_cap), cap(allocated, allocated_cap));
        let delta = allocator()?.with_heap(index, |heap| {
            let plan = heap.restore_pool(&checkpoint, true, adopt)?;
            if dry_run {
                return Ok(plan);
            }
            if plan.freed.len() > freed_cap || plan.allocated.len() > allocated_cap {
                return Err(stepalloc::Error::InvalidArgument(format!(
                    "stepalloc_pool_restore: the restore frees {} and allocates {} blocks, but the buffers hold {} \
                     and {}",
                    plan.freed.len(),
                    plan.allocated.len(),
                    freed_cap,
                    allocated_cap
                )));
            }
            heap.restore_pool(&checkpoint, false, adopt)
        })??;
        let write = |list: &[CheckpointBlock], buf: *mut u64, cap: usize| {
            for (i, b) in list.iter().take(cap).enumerate() {
                // Safety: the caller promised `4 * cap` writable words at `buf`; `i < cap`.
                unsafe {
                    std::ptr::copy_nonoverlapping([b.addr, b.size, b.requested, b.stream.0].as_ptr(), buf.add(4 * i), 4)
                };
            }
        };
        write(&delta.freed, freed, freed_cap);
        write(&delta.allocated, allocated, allocated_cap);
        // Safety: the caller promised two writable `size_t` at `counts`.
        unsafe {
            *counts = delta.freed.len();
            *counts.add(1) = delta.allocated.len();
        }
        Ok(())
    })
}
