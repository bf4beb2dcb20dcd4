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
//! - stepalloc's pause and resume: not modelled here. The library runs on the simulated device
//!   with its cost model and its copy engine at the link's rate (`sim_copy_mb_s`, set from
//!   `link_gbps`): the host's clock moves by each driver call's cost and to an event's
//!   completion when the library waits for one, the copy engine moves the bytes as the library
//!   queues them. The switch is the host's clock over the calls (`run.rs`), so whether the
//!   driver calls run under the copies or after them is what the library's own order of calls
//!   makes it.
//! - `empty_cache`: its driver time alone.

use serde::Serialize;

pub const PCIE4_X16_GBPS: f64 = 25.0;
pub const PCIE5_X16_GBPS: f64 = 50.0;
/// One synchronous `cudaMemcpy` beyond its bytes: the launch and the host's wait for it.
pub const SYNC_COPY_LATENCY_S: f64 = 10e-6;
/// The simulated device's per-call costs (`src/backend/sim.rs`), for vLLM's pool.
const VM_UNMAP_RELEASE_S: f64 = 20e-6;
const VM_CREATE_MAP_S: f64 = 30e-6;

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

    /// The link as the simulated device's `sim_copy_mb_s` (10^6 bytes per second).
    pub fn sim_copy_mb_s(&self) -> u64 {
        (self.link_gbps * 1e3).round() as u64
    }

    /// vLLM's sleep or wake of a pool: `copies` synchronous copies of `copied` bytes in all,
    /// `allocations` allocations unmapped and released (sleep) or created and mapped (wake).
    pub fn vllm_s(&self, copies: u64, copied: u64, allocations: u64, wake: bool) -> f64 {
        let driver = if wake { VM_CREATE_MAP_S } else { VM_UNMAP_RELEASE_S };
        copies as f64 * self.sync_copy_latency_s + self.link_s(copied) + allocations as f64 * driver
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_link_sets_the_floor_and_the_simulated_copy_rate() {
        let m = CostModel::new(25.0).unwrap();
        assert!((m.link_s(25_000_000_000) - 1.0).abs() < 1e-12);
        assert_eq!((m.sim_copy_mb_s(), CostModel::new(50.0).unwrap().sim_copy_mb_s()), (25_000, 50_000));
        assert_eq!(CostModel::new(0.1).unwrap().sim_copy_mb_s(), 100);
        // vLLM: per copy its latency, the bytes at link speed, per allocation its calls.
        let v = m.vllm_s(2, 25_000_000_000, 3, false);
        assert!((v - (2.0 * SYNC_COPY_LATENCY_S + 1.0 + 3.0 * VM_UNMAP_RELEASE_S)).abs() < 1e-12);
        assert!(m.vllm_s(2, 0, 3, true) > m.vllm_s(2, 0, 3, false));
    }
}
