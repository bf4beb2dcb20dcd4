//! The switch-time model of the colocated loop: what moving the engine's memory out of the way
//! and back costs, from the host link's bandwidth and the driver's per-call costs.
//!
//! Host link (effective host<->device copy bandwidth of pinned memory, one direction at a
//! time, as measured by bandwidth tests; the raw link rates are 32 and 64 GB/s):
//! - PCIe 4.0 x16: about 25 GB/s (`PCIE4_X16_GBPS`, the default of `--link-gbps`);
//! - PCIe 5.0 x16: about 50 GB/s (`PCIE5_X16_GBPS`).
//!
//! Driver costs (unmap, release, create, map, events) are the simulated device's cost model
//! (`sim_cost_model:True`), read from the allocator's driver-time statistics around each call;
//! vLLM's pool, which the simulated device does not run, is charged the same per-call figures
//! (`VM_*` below).
//!
//! How each way of sharing pays:
//! - vLLM's sleep (`vllm/device_allocator/cumem.py`): per allocation of its pool, one
//!   synchronous `cudaMemcpy` (a launch and a host wait, `SYNC_COPY_LATENCY_S`, then the bytes
//!   at link speed) before its unmap and release, nothing overlapped; wake creates and maps each
//!   allocation again and copies back the same way. Its pinned host buffers come from PyTorch's
//!   caching host allocator, so after the first cycle they cost nothing.
//! - stepalloc's pause and resume: chunked asynchronous copies on a copy stream of their own,
//!   with unmaps (maps) following each 256 MiB batch: a call costs the longer of its copies and
//!   its driver calls, plus the shorter of the two for one batch (the pipeline's fill). The
//!   driver calls' time is the simulated device's driver time over the call less its waits for
//!   the copies (the device's own copy model, which the link figure here replaces).
//! - `empty_cache`: its driver time alone.

use serde::Serialize;

pub const PCIE4_X16_GBPS: f64 = 25.0;
pub const PCIE5_X16_GBPS: f64 = 50.0;
/// One synchronous `cudaMemcpy` beyond its bytes: the launch and the host's wait for it.
pub const SYNC_COPY_LATENCY_S: f64 = 10e-6;
/// The simulated device's per-call costs (`src/backend/sim.rs`), for vLLM's pool.
const VM_UNMAP_RELEASE_S: f64 = 20e-6;
const VM_CREATE_MAP_S: f64 = 30e-6;
/// stepalloc's copy batch: the unit in which unmaps follow copies (`heap/sleep.rs`).
const COPY_BATCH: u64 = 256 << 20;

/// The host link and the per-copy latency.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CostModel {
    /// Effective host-link bandwidth, GB/s (10^9 bytes per second).
    pub link_gbps: f64,
    pub sync_copy_latency_s: f64,
}

impl CostModel {
    pub fn new(link_gbps: f64) -> Result<CostModel, String> {
        if !(link_gbps.is_finite() && (0.1..=10_000.0).contains(&link_gbps)) {
            return Err(format!(
                "--link-gbps {link_gbps}: must be in 0.1..=10000 (PCIe 4 x16 about {PCIE4_X16_GBPS}, PCIe 5 x16 \
                 about {PCIE5_X16_GBPS})"
            ));
        }
        Ok(CostModel { link_gbps, sync_copy_latency_s: SYNC_COPY_LATENCY_S })
    }

    /// Seconds to move `bytes` over the link: the floor of any switch that copies them.
    pub fn link_s(&self, bytes: u64) -> f64 {
        bytes as f64 / (self.link_gbps * 1e9)
    }

    /// vLLM's sleep or wake of a pool: `copies` synchronous copies of `copied` bytes in all,
    /// `allocations` allocations unmapped and released (sleep) or created and mapped (wake).
    pub fn vllm_s(&self, copies: u64, copied: u64, allocations: u64, wake: bool) -> f64 {
        let driver = if wake { VM_CREATE_MAP_S } else { VM_UNMAP_RELEASE_S };
        copies as f64 * self.sync_copy_latency_s + self.link_s(copied) + allocations as f64 * driver
    }

    /// stepalloc's pause or resume of `copied` bytes whose driver calls (unmaps, maps, events)
    /// took `calls_s`: copies and calls run as a two-stage pipeline over batches of
    /// `COPY_BATCH`, so the call costs the longer stage in all plus the shorter stage of one
    /// batch (the pipeline's fill).
    pub fn pipelined_s(&self, copied: u64, calls_s: f64) -> f64 {
        if copied == 0 {
            return calls_s;
        }
        let batches = copied.div_ceil(COPY_BATCH) as f64;
        let copy_s = self.link_s(copied);
        copy_s.max(calls_s) + (copy_s / batches).min(calls_s / batches)
    }
}
