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
//! - stepalloc's pause and resume (`Schedule`): asynchronous copies on a copy stream of their
//!   own, in batches of `COPY_BATCH` (256 MiB) with an event after each, while the host thread
//!   makes the driver calls. The calls' times are the simulated device's driver time over each
//!   call less its waits for the copies (the device's own copy rate, which the link figure here
//!   replaces); copies and calls are then laid on two timelines, batch by batch:
//!   - pause: the copies start at once; the host first makes the calls that wait for no copy,
//!     then unmaps and releases the backed-up pages batch by batch, each batch once its copy
//!     completed (`pause_pipeline`);
//!   - resume: the host creates and maps the pages of a batch, then queues its copy; the copy
//!     engine runs each batch once it is queued and the one before it is done; the host goes
//!     on with the next batch meanwhile (`resume_pipeline`).
//! - `empty_cache`: its driver time alone.
//!
//! stepalloc's two schedules: `Schedule::Serial` is the library as `src/heap/sleep.rs` orders
//! it today: one tag per call, each call waiting for its copies; a resume creates all its pages
//! before the first map and copy; the loop's `empty_cache` and the cache tag's unmaps (maps)
//! run before (after) the weights' copies. `Schedule::Overlapped` is one pause and one resume of
//! all the engine's tags: at pause the cache tag's unmaps and the idle cached pages run under
//! the weights' copies; at resume the idle cached pages (what the loop's `empty_cache` gives
//! back) are released, and the pages created and mapped, one batch at a time ahead of its copy,
//! and the cache tag's pages mapped while the last copies run. docs/performance.md gives the
//! change to `heap/sleep.rs` this needs and the figures of both.

use serde::Serialize;

/// How stepalloc's pause and resume are laid out in time (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    /// One pause and one resume of all the engine's tags, the driver calls under the copies.
    Overlapped,
    /// One tag per call, each waiting for its copies; a resume creates every page first.
    Serial,
}

pub const PCIE4_X16_GBPS: f64 = 25.0;
pub const PCIE5_X16_GBPS: f64 = 50.0;
/// One synchronous `cudaMemcpy` beyond its bytes: the launch and the host's wait for it.
pub const SYNC_COPY_LATENCY_S: f64 = 10e-6;
/// The simulated device's per-call costs (`src/backend/sim.rs`), for vLLM's pool.
const VM_UNMAP_RELEASE_S: f64 = 20e-6;
const VM_CREATE_MAP_S: f64 = 30e-6;
/// stepalloc's copy batch: the unit in which unmaps follow copies (`heap/sleep.rs`).
const COPY_BATCH: u64 = 256 << 20;

/// The host link, the per-copy latency and stepalloc's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CostModel {
    /// Effective host-link bandwidth, GB/s (10^9 bytes per second).
    pub link_gbps: f64,
    pub sync_copy_latency_s: f64,
    pub schedule: Schedule,
}

/// The driver time of stepalloc's calls at one pause of the engine (seconds, waits excluded).
#[derive(Clone, Copy, Debug, Default)]
pub struct PauseCalls {
    /// Bytes the backed-up tags copy to the host.
    pub copied: u64,
    /// The calls that wait for no copy: the discarded tags' unmaps and releases.
    pub free_s: f64,
    /// The backed-up tags' calls: copy launches, events, unmaps and releases of their pages.
    pub gated_s: f64,
}

/// The driver time of stepalloc's calls at one resume of the engine (seconds, waits excluded).
#[derive(Clone, Copy, Debug, Default)]
pub struct ResumeCalls {
    /// Bytes the backed-up tags copy back.
    pub copied: u64,
    /// The idle cached pages given back first (the loop's `empty_cache`).
    pub release_cached_s: f64,
    /// The backed-up tags' page creations.
    pub create_s: f64,
    /// The backed-up tags' maps, copy launches and events.
    pub map_s: f64,
    /// The discarded tags' creations and maps (nothing to copy into them).
    pub after_s: f64,
}

impl CostModel {
    pub fn new(link_gbps: f64) -> Result<CostModel, String> {
        if !(link_gbps.is_finite() && (0.1..=10_000.0).contains(&link_gbps)) {
            return Err(format!(
                "--link-gbps {link_gbps}: must be in 0.1..=10000 (PCIe 4 x16 about {PCIE4_X16_GBPS}, PCIe 5 x16 \
                 about {PCIE5_X16_GBPS})"
            ));
        }
        Ok(CostModel { link_gbps, sync_copy_latency_s: SYNC_COPY_LATENCY_S, schedule: Schedule::Serial })
    }

    pub fn with_schedule(self, schedule: Schedule) -> CostModel {
        CostModel { schedule, ..self }
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

    /// stepalloc's pause of the engine under `self.schedule`.
    pub fn pause_s(&self, c: &PauseCalls) -> f64 {
        let (copy_s, n) = (self.link_s(c.copied), batches(c.copied));
        match self.schedule {
            // The discarded tags' call first, then the backed-up tags' (unmaps after copies).
            Schedule::Serial => c.free_s + pause_pipeline(copy_s, n, 0.0, c.gated_s),
            Schedule::Overlapped => pause_pipeline(copy_s, n, c.free_s, c.gated_s),
        }
    }

    /// stepalloc's resume of the engine under `self.schedule`.
    pub fn resume_s(&self, c: &ResumeCalls) -> f64 {
        let (copy_s, n) = (self.link_s(c.copied), batches(c.copied));
        match self.schedule {
            // empty_cache; every page created; maps each followed by its copies; the cache tag.
            Schedule::Serial => c.release_cached_s + resume_pipeline(copy_s, n, c.create_s, c.map_s, 0.0) + c.after_s,
            Schedule::Overlapped => {
                resume_pipeline(copy_s, n, 0.0, c.release_cached_s + c.create_s + c.map_s, c.after_s)
            }
        }
    }
}

/// Batches of `COPY_BATCH` in `copied` bytes (0 when nothing is copied).
fn batches(copied: u64) -> u64 {
    copied.div_ceil(COPY_BATCH)
}

/// A pause's end: the copies (`copy_s` in `n` equal batches) start at 0; the host makes the
/// calls that wait for no copy (`free_s`), then unmaps batch i's pages (`gated_s / n`) once
/// batch i's copy completed.
fn pause_pipeline(copy_s: f64, n: u64, free_s: f64, gated_s: f64) -> f64 {
    if n == 0 {
        return free_s + gated_s;
    }
    let mut host = free_s;
    for i in 1..=n {
        host = host.max(copy_s * i as f64 / n as f64) + gated_s / n as f64;
    }
    host
}

/// A resume's end: after `before_s`, the host prepares each of `n` equal batches
/// (`per_batch_s / n`: pages created, mapped, copy queued); the copy engine copies a batch
/// (`copy_s / n`) once it is queued and the batch before is done; then the host makes the calls
/// of `after_s` while the copies finish.
fn resume_pipeline(copy_s: f64, n: u64, before_s: f64, per_batch_s: f64, after_s: f64) -> f64 {
    if n == 0 {
        return before_s + per_batch_s + after_s;
    }
    let (mut host, mut engine) = (before_s, 0.0f64);
    for _ in 0..n {
        host += per_batch_s / n as f64;
        engine = engine.max(host) + copy_s / n as f64;
    }
    (host + after_s).max(engine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipelines_hide_the_shorter_stage_but_one_batch() {
        // Copies 10 s in 10 batches; host work 5 s: the host's last batch (0.5 s) follows the
        // last copy (pause) or the first batch's preparation (0.5 s) precedes the first copy.
        assert!((pause_pipeline(10.0, 10, 0.0, 5.0) - 10.5).abs() < 1e-9);
        assert!((resume_pipeline(10.0, 10, 0.0, 5.0, 0.0) - 10.5).abs() < 1e-9);
        // Host work longer than the copies: it sets the pace.
        assert!((pause_pipeline(10.0, 10, 0.0, 20.0) - 21.0).abs() < 1e-9);
        assert!((resume_pipeline(10.0, 10, 0.0, 20.0, 0.0) - 21.0).abs() < 1e-9);
        // Work that waits for no copy runs under the copies; work before them does not.
        assert!((pause_pipeline(10.0, 10, 4.0, 1.0) - 10.1).abs() < 1e-9);
        assert!((resume_pipeline(10.0, 10, 4.0, 1.0, 0.0) - 14.1).abs() < 1e-9);
        assert!((resume_pipeline(10.0, 10, 0.0, 1.0, 4.0) - 10.1).abs() < 1e-9);
        // Nothing to copy: the calls alone.
        assert_eq!(pause_pipeline(0.0, 0, 1.0, 2.0), 3.0);
        assert_eq!(resume_pipeline(0.0, 0, 1.0, 2.0, 3.0), 6.0);
    }

    #[test]
    fn serial_never_beats_overlapped() {
        let m = CostModel::new(25.0).unwrap();
        let (serial, overlapped) = (m, m.with_schedule(Schedule::Overlapped));
        assert_eq!(m.schedule, Schedule::Serial, "the default is the library's order");
        let p = PauseCalls { copied: 4 << 30, free_s: 0.01, gated_s: 0.005 };
        let r = ResumeCalls { copied: 4 << 30, release_cached_s: 0.02, create_s: 0.003, map_s: 0.004, after_s: 0.01 };
        assert!(overlapped.pause_s(&p) < serial.pause_s(&p));
        assert!(overlapped.resume_s(&r) < serial.resume_s(&r));
        // Neither beats the copies at link speed.
        assert!(overlapped.pause_s(&p) >= m.link_s(4 << 30));
        assert!(overlapped.resume_s(&r) >= m.link_s(4 << 30));
    }
}
