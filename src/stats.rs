//! Statistics in the vocabulary of `torch.cuda.memory_stats()`, plus stepalloc's own figures.
//!
//! The counters live inside the device heap and are updated under the lock the heap already
//! holds, so the hot path pays a few additions. Readers get a copy (`DeviceStats`) and turn it
//! into torch's flat key/value form with `to_map`. The counters themselves, as the hot path
//! updates them, are `counters`'.

mod counters;

pub use counters::{ActiveCounter, PoolCounter};

use crate::backend::DriverTime;
use serde::Serialize;
use std::collections::BTreeMap;

/// One statistic as PyTorch keeps it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stat {
    pub current: u64,
    pub peak: u64,
    pub allocated: u64,
    pub freed: u64,
}

impl Stat {
    // The lifetime totals (`allocated`, `freed`) add up every request ever made and can pass
    // 2^64 in a long run of huge simulated requests: they saturate rather than wrap or panic.
    pub fn increase(&mut self, amount: u64) {
        self.current = self.current.saturating_add(amount);
        self.peak = self.peak.max(self.current);
        self.allocated = self.allocated.saturating_add(amount);
    }

    pub fn decrease(&mut self, amount: u64) {
        debug_assert!(self.current >= amount, "statistic would go negative");
        self.current = self.current.saturating_sub(amount);
        self.freed = self.freed.saturating_add(amount);
    }
}

/// A statistic split by pool: `all`, `small_pool`, `large_pool`, as readers get it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PoolStat {
    pub all: Stat,
    pub small_pool: Stat,
    pub large_pool: Stat,
}

impl PoolStat {
    fn stats(&self) -> [(&'static str, &Stat); 3] {
        [("all", &self.all), ("small_pool", &self.small_pool), ("large_pool", &self.large_pool)]
    }
}

/// Why cached memory went back to the device (a metric label, a small fixed set).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseReason {
    Step = 0,
    PhaseSwitch = 1,
    Limit = 2,
    EmptyCache = 3,
    Oom = 4,
    /// `Allocator::pause`: a paused tag's pages, and idle pages of other tags.
    Pause = 5,
}

impl ReleaseReason {
    pub const ALL: [ReleaseReason; 6] = [
        ReleaseReason::Step,
        ReleaseReason::PhaseSwitch,
        ReleaseReason::Limit,
        ReleaseReason::EmptyCache,
        ReleaseReason::Oom,
        ReleaseReason::Pause,
    ];

    pub fn label(self) -> &'static str {
        match self {
            ReleaseReason::Step => "step",
            ReleaseReason::PhaseSwitch => "phase_switch",
            ReleaseReason::Limit => "limit",
            ReleaseReason::EmptyCache => "empty_cache",
            ReleaseReason::Oom => "oom",
            ReleaseReason::Pause => "pause",
        }
    }
}

/// The counters a device heap keeps. Field names are torch's keys. The heap keeps them as
/// `HeapStats<PoolCounter, ActiveCounter>` (cheap to update); readers get `HeapStats<PoolStat>`
/// (see `read`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct HeapStats<P = PoolStat, A = P> {
    pub allocation: P,
    pub segment: P,
    pub active: A,
    pub inactive_split: P,
    pub allocated_bytes: P,
    pub reserved_bytes: P,
    pub active_bytes: A,
    pub inactive_split_bytes: P,
    pub requested_bytes: P,
    pub oversize_allocations: Stat,
    pub oversize_segments: Stat,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    pub num_device_alloc: u64,
    pub num_device_free: u64,
    pub num_sync_all_streams: u64,
    /// Device reserves refused up front because of `per_process_memory_fraction`.
    pub num_oom_rejections: u64,
    // stepalloc's own counters.
    pub num_mallocs: u64,
    pub num_frees: u64,
    /// Mallocs served from the cache without a device reserve.
    pub num_cache_hits: u64,
    /// Device-wide synchronizations (to merge free blocks of different streams before release).
    pub num_device_synchronize: u64,
    /// Virtual memory (expandable segments): address space reserved now, physical chunks
    /// created / released and pages mapped / unmapped, and bytes of idle pages moved to where a
    /// request needed them (`page_reuse`) instead of creating memory.
    pub virtual_reserved_bytes: u64,
    pub num_create: u64,
    pub num_release_physical: u64,
    pub num_map: u64,
    pub num_unmap: u64,
    pub moved_bytes: u64,
    /// Bytes released to the device, by `ReleaseReason`.
    pub released_bytes: [u64; 6],
    /// Device reserve latencies: counts per bucket of `DEVICE_ALLOC_BUCKETS_S` (last = +Inf).
    pub device_alloc_latency_buckets: [u64; 12],
    pub device_alloc_latency_sum_ns: u64,
}

/// Upper bounds (seconds) of the device-malloc latency histogram buckets.
pub const DEVICE_ALLOC_BUCKETS_S: [f64; 11] = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 1e-1];

impl HeapStats<PoolCounter, ActiveCounter> {
    pub fn record_device_alloc_latency(&mut self, ns: u64) {
        let seconds = ns as f64 * 1e-9;
        let bucket =
            DEVICE_ALLOC_BUCKETS_S.iter().position(|&le| seconds <= le).unwrap_or(DEVICE_ALLOC_BUCKETS_S.len());
        self.device_alloc_latency_buckets[bucket] += 1;
        self.device_alloc_latency_sum_ns += ns;
    }

    fn pool_stats_mut(&mut self) -> [&mut PoolCounter; 7] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// `active_bytes.all.current`.
    pub fn active_bytes_current(&self) -> u64 {
        self.active_bytes.current(&self.allocated_bytes)
    }

    /// A freed block becomes pending (its reuse waits for other streams' work).
    pub fn note_pending(&mut self, small: bool, size: u64) {
        self.active.add_pending(small, 1);
        self.active_bytes.add_pending(small, size);
    }

    /// A pending block's free completed.
    pub fn note_pending_done(&mut self, small: bool, size: u64) {
        self.active.remove_pending(small, 1);
        self.active_bytes.remove_pending(small, size);
    }

    /// `torch.cuda.reset_peak_memory_stats`: every peak becomes the current value.
    pub fn reset_peaks(&mut self) {
        self.active.reset_peaks(&self.allocation);
        self.active_bytes.reset_peaks(&self.allocated_bytes);
        for pool in self.pool_stats_mut() {
            pool.reset_peaks();
        }
        for stat in [&mut self.oversize_allocations, &mut self.oversize_segments] {
            stat.peak = stat.current;
        }
    }

    /// `torch.cuda.reset_accumulated_memory_stats`: allocated/freed totals and event counters to 0.
    pub fn reset_accumulated(&mut self) {
        self.active.reset_accumulated(&self.allocation);
        self.active_bytes.reset_accumulated(&self.allocated_bytes);
        for pool in self.pool_stats_mut() {
            pool.reset_accumulated();
        }
        for stat in [&mut self.oversize_allocations, &mut self.oversize_segments] {
            stat.allocated = 0;
            stat.freed = 0;
        }
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.num_sync_all_streams = 0;
        self.num_oom_rejections = 0;
        self.num_create = 0;
        self.num_release_physical = 0;
        self.num_map = 0;
        self.num_unmap = 0;
        self.moved_bytes = 0;
    }

    /// The statistics as readers get them.
    pub fn read(&self) -> HeapStats {
        HeapStats {
            allocation: self.allocation.read(),
            segment: self.segment.read(),
            active: self.active.read(&self.allocation),
            inactive_split: self.inactive_split.read(),
            allocated_bytes: self.allocated_bytes.read(),
            reserved_bytes: self.reserved_bytes.read(),
            active_bytes: self.active_bytes.read(&self.allocated_bytes),
            inactive_split_bytes: self.inactive_split_bytes.read(),
            requested_bytes: self.requested_bytes.read(),
            oversize_allocations: self.oversize_allocations,
            oversize_segments: self.oversize_segments,
            num_alloc_retries: self.num_alloc_retries,
            num_ooms: self.num_ooms,
            num_device_alloc: self.num_device_alloc,
            num_device_free: self.num_device_free,
            num_sync_all_streams: self.num_sync_all_streams,
            num_oom_rejections: self.num_oom_rejections,
            num_mallocs: self.num_mallocs,
            num_frees: self.num_frees,
            num_cache_hits: self.num_cache_hits,
            num_device_synchronize: self.num_device_synchronize,
            virtual_reserved_bytes: self.virtual_reserved_bytes,
            num_create: self.num_create,
            num_release_physical: self.num_release_physical,
            num_map: self.num_map,
            num_unmap: self.num_unmap,
            moved_bytes: self.moved_bytes,
            released_bytes: self.released_bytes,
            device_alloc_latency_buckets: self.device_alloc_latency_buckets,
            device_alloc_latency_sum_ns: self.device_alloc_latency_sum_ns,
        }
    }
}

impl HeapStats {
    fn pool_stats(&self) -> [(&'static str, &PoolStat); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }
}

/// Figures of the last completed step (see `step`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StepFigures {
    pub steps: u64,
    pub phase: String,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    pub device_mallocs: u64,
    pub reserved_at_end: u64,
    /// 1 - peak allocated / peak reserved within the step.
    pub fragmentation: f64,
}

/// A copy of one device's statistics, as plain data.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DeviceStats {
    pub device: usize,
    pub heap: HeapStats,
    pub max_split_size: u64,
    pub device_total: u64,
    /// Bytes of free cached blocks (reserved - active).
    pub cached_free: u64,
    pub largest_free_block: u64,
    /// Steps completed per phase name.
    pub steps_by_phase: BTreeMap<String, u64>,
    pub last_step: StepFigures,
    pub driver_time: DriverTime,
    /// Bytes mapped in expandable segments.
    pub mapped_bytes: u64,
    /// Per-tag figures (`tags`), once a region was entered in the process; empty before.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<TagFigures>,
    /// Pinned host memory kept for backups of paused tags (`Allocator::pause`).
    #[serde(skip_serializing_if = "is_zero")]
    pub backup_host_bytes: u64,
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

impl DeviceStats {
    /// 1 - largest free block / cached free bytes; 0 when nothing is cached.
    pub fn external_fragmentation(&self) -> f64 {
        if self.cached_free == 0 {
            0.0
        } else {
            1.0 - self.largest_free_block as f64 / self.cached_free as f64
        }
    }

    /// 1 - requested bytes / allocated bytes; 0 when nothing is allocated.
    pub fn internal_fragmentation(&self) -> f64 {
        let allocated = self.heap.allocated_bytes.all.current;
        if allocated == 0 {
            0.0
        } else {
            1.0 - self.heap.requested_bytes.all.current as f64 / allocated as f64
        }
    }

    /// The flat map of `torch.cuda.memory_stats()` keys, plus stepalloc's under `stepalloc.`.
    pub fn to_map(&self) -> BTreeMap<String, serde_json::Value> {
        use serde_json::json;
        let h = &self.heap;
        let mut m = BTreeMap::new();
        for (name, pool) in h.pool_stats() {
            for (pool_name, stat) in pool.stats() {
                insert_stat(&mut m, &format!("{name}.{pool_name}"), stat);
            }
        }
        insert_stat(&mut m, "oversize_allocations", &h.oversize_allocations);
        insert_stat(&mut m, "oversize_segments", &h.oversize_segments);
        for (key, value) in [
            ("num_alloc_retries", h.num_alloc_retries),
            ("num_ooms", h.num_ooms),
            ("num_device_alloc", h.num_device_alloc),
            ("num_device_free", h.num_device_free),
            ("num_sync_all_streams", h.num_sync_all_streams),
            ("num_oom_rejections", h.num_oom_rejections),
        ] {
            m.insert(key.to_string(), json!(value));
        }
        // PyTorch's `DeviceStats::max_split_size` is an `int64_t`: -1 when unlimited.
        m.insert("max_split_size".into(), json!(crate::config::torch_int64(self.max_split_size)));
        let s = "stepalloc.";
        m.insert(format!("{s}device_total_bytes"), json!(self.device_total));
        m.insert(format!("{s}cached_free_bytes"), json!(self.cached_free));
        m.insert(format!("{s}largest_free_block_bytes"), json!(self.largest_free_block));
        m.insert(format!("{s}fragmentation.external"), json!(self.external_fragmentation()));
        m.insert(format!("{s}fragmentation.internal"), json!(self.internal_fragmentation()));
        m.insert(format!("{s}fragmentation.step"), json!(self.last_step.fragmentation));
        m.insert(format!("{s}num_mallocs"), json!(h.num_mallocs));
        m.insert(format!("{s}num_frees"), json!(h.num_frees));
        m.insert(format!("{s}num_cache_hits"), json!(h.num_cache_hits));
        m.insert(format!("{s}num_device_synchronize"), json!(h.num_device_synchronize));
        for reason in ReleaseReason::ALL {
            m.insert(format!("{s}released_bytes.{}", reason.label()), json!(h.released_bytes[reason as usize]));
        }
        m.insert(format!("{s}steps"), json!(self.last_step.steps));
        for (phase, steps) in &self.steps_by_phase {
            m.insert(format!("{s}steps.{phase}"), json!(steps));
        }
        m.insert(format!("{s}last_step.peak_allocated_bytes"), json!(self.last_step.peak_allocated));
        m.insert(format!("{s}last_step.peak_reserved_bytes"), json!(self.last_step.peak_reserved));
        m.insert(format!("{s}last_step.device_mallocs"), json!(self.last_step.device_mallocs));
        m.insert(format!("{s}driver_seconds.reserve"), json!(self.driver_time.reserve_ns as f64 * 1e-9));
        m.insert(format!("{s}driver_seconds.release"), json!(self.driver_time.release_ns as f64 * 1e-9));
        m.insert(format!("{s}driver_seconds.event"), json!(self.driver_time.event_ns as f64 * 1e-9));
        m.insert(format!("{s}driver_seconds.sync"), json!(self.driver_time.sync_ns as f64 * 1e-9));
        m.insert(format!("{s}driver_seconds.create"), json!(self.driver_time.create_ns as f64 * 1e-9));
        m.insert(format!("{s}driver_seconds.map"), json!(self.driver_time.map_ns as f64 * 1e-9));
        // Virtual memory: `reserved_bytes` counts mapped bytes, as PyTorch does.
        m.insert(format!("{s}mapped_bytes"), json!(self.mapped_bytes));
        m.insert(format!("{s}virtual_reserved_bytes"), json!(h.virtual_reserved_bytes));
        m.insert(format!("{s}moved_bytes"), json!(h.moved_bytes));
        m.insert(format!("{s}num_create"), json!(h.num_create));
        m.insert(format!("{s}num_release_physical"), json!(h.num_release_physical));
        m.insert(format!("{s}num_map"), json!(h.num_map));
        m.insert(format!("{s}num_unmap"), json!(h.num_unmap));
        m.insert(format!("{s}backup_host_bytes"), json!(self.backup_host_bytes));
        for f in &self.tags {
            let t = format!("{s}tag.{}", f.tag);
            m.insert(format!("{t}.live_bytes"), json!(f.live_bytes));
            m.insert(format!("{t}.paused_bytes"), json!(f.paused_bytes));
            m.insert(format!("{t}.backup_bytes"), json!(f.backup_bytes));
            m.insert(format!("{t}.pauses"), json!(f.pauses));
            m.insert(format!("{t}.resumes"), json!(f.resumes));
            m.insert(format!("{t}.pause_seconds"), json!(f.pause_seconds));
            m.insert(format!("{t}.resume_seconds"), json!(f.resume_seconds));
        }
        m
    }
}

fn insert_stat(m: &mut BTreeMap<String, serde_json::Value>, prefix: &str, stat: &Stat) {
    m.insert(format!("{prefix}.current"), stat.current.into());
    m.insert(format!("{prefix}.peak"), stat.peak.into());
    m.insert(format!("{prefix}.allocated"), stat.allocated.into());
    m.insert(format!("{prefix}.freed"), stat.freed.into());
}

/// The keys `torch.cuda.memory_stats()` returns (torch 2.x), for tests and for the Python shim.
pub fn torch_keys() -> Vec<String> {
    let mut keys = Vec::new();
    let suffixes = ["current", "peak", "allocated", "freed"];
    for name in [
        "allocation",
        "segment",
        "active",
        "inactive_split",
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "inactive_split_bytes",
        "requested_bytes",
    ] {
        for pool in ["all", "small_pool", "large_pool"] {
            for s in suffixes {
                keys.push(format!("{name}.{pool}.{s}"));
            }
        }
    }
    for name in ["oversize_allocations", "oversize_segments"] {
        for s in suffixes {
            keys.push(format!("{name}.{s}"));
        }
    }
    for k in [
        "num_alloc_retries",
        "num_ooms",
        "num_device_alloc",
        "num_device_free",
        "num_sync_all_streams",
        "num_oom_rejections",
        "max_split_size",
    ] {
        keys.push(k.to_string());
    }
    keys
}

/// One tag's figures on one device (`Heap::tag_figures`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TagFigures {
    pub tag: String,
    /// Bytes of the tag's allocated blocks that hold memory (not paused).
    pub live_bytes: u64,
    pub paused: bool,
    /// Bytes of the tag's allocated blocks while paused.
    pub paused_bytes: u64,
    /// Whether some of the tag's allocated memory was made in a region with a backup (a pause
    /// copies that memory to the host and discards the rest).
    pub backup: bool,
    /// Bytes of paused blocks held in a backup store (host memory or disk).
    pub backup_bytes: u64,
    /// Pinned host memory kept for the tag's backups.
    pub host_bytes: u64,
    /// Pageable host memory (`mmap` store) kept for the tag's backups: not pinned.
    pub mmap_bytes: u64,
    /// Bytes of paused blocks held in files of the backup directory (`Store::Disk`).
    pub disk_bytes: u64,
    pub pauses: u64,
    pub resumes: u64,
    pub pause_seconds: f64,
    pub resume_seconds: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.increase(10);
        s.increase(5);
        s.decrease(12);
        s.increase(1);
        assert_eq!(s, Stat { current: 4, peak: 15, allocated: 16, freed: 12 });
    }

    #[test]
    fn lifetime_totals_saturate() {
        let mut s = Stat { allocated: u64::MAX - 10, freed: u64::MAX - 10, ..Stat::default() };
        s.increase(100);
        s.decrease(100);
        assert_eq!(s, Stat { current: 0, peak: 100, allocated: u64::MAX, freed: u64::MAX });
    }

    #[test]
    fn map_has_every_torch_key() {
        let map = DeviceStats::default().to_map();
        for key in torch_keys() {
            assert!(map.contains_key(&key), "{key}");
        }
        let own = map.keys().filter(|k| !k.starts_with("stepalloc.")).count();
        assert_eq!(own, torch_keys().len(), "no key outside torch's set without the stepalloc. prefix");
    }

    #[test]
    fn max_split_size_is_torchs_int64() {
        // Once written as 2^64 - 1, which a reader of PyTorch's int64 rejects.
        let unlimited = DeviceStats { max_split_size: u64::MAX, ..Default::default() }.to_map();
        assert_eq!(unlimited["max_split_size"], serde_json::json!(-1));
        let set = DeviceStats { max_split_size: 128 << 20, ..Default::default() }.to_map();
        assert_eq!(set["max_split_size"], serde_json::json!(128i64 << 20));
    }

    #[test]
    fn fragmentation_figures() {
        let mut s = DeviceStats { cached_free: 100, largest_free_block: 25, ..Default::default() };
        s.heap.allocated_bytes.all.current = 1000;
        s.heap.requested_bytes.all.current = 900;
        assert!((s.external_fragmentation() - 0.75).abs() < 1e-12);
        assert!((s.internal_fragmentation() - 0.1).abs() < 1e-12);
        assert_eq!(DeviceStats::default().external_fragmentation(), 0.0);
        assert_eq!(DeviceStats::default().internal_fragmentation(), 0.0);
    }
}
