//! The Prometheus collector: turns each device's `DeviceStats` into metric families when the
//! registry is gathered (at scrape time). Layer: above `allocator`, beside the HTTP endpoint.
//!
//! Invariants: malloc and free never touch anything here — the collector takes each device's
//! lock once per scrape, copies the statistics (`Heap::stats`) and the free-block summary
//! (`Heap::free_block_ranges`) out, and builds the families after releasing the lock. Every
//! family emitted is listed in [`METRICS`] with its type, labels and HELP text, and registered
//! with the `prometheus` crate through one `Desc` each. Label sets are small and bounded:
//! `device` (≤ 64), `pool` (2), `reason` (6), `phase` (≤ `step::MAX_PHASES`), `call` (4),
//! `range` (5), `tag` (≤ `tags::MAX_TAGS` + 1), plus a constant `rank` under torchrun.

use crate::allocator::Allocator;
use crate::heap::FREE_BLOCK_RANGES;
use crate::stats::{DeviceStats, PoolStat, ReleaseReason, DEVICE_ALLOC_BUCKETS_S};
use prometheus::core::{Collector, Desc};
use prometheus::proto::{Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType};
use std::collections::HashMap;
use std::sync::Arc;

/// The kind of a metric family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
    Histogram,
}

/// One metric family stepalloc exports: its name, type, label names and HELP text.
#[derive(Debug)]
pub struct MetricSpec {
    pub name: &'static str,
    pub kind: Kind,
    pub labels: &'static [&'static str],
    pub help: &'static str,
}

const D: &[&str] = &["device"];
const DP: &[&str] = &["device", "pool"];
const DT: &[&str] = &["device", "tag"];

/// Every metric family stepalloc exports, in the order they are built.
pub const METRICS: &[MetricSpec] = &[
    // Memory, by pool (small: requests up to 1 MiB in 2 MiB segments; large: the rest).
    MetricSpec {
        name: "stepalloc_reserved_bytes",
        kind: Kind::Gauge,
        labels: DP,
        help: "Device memory held in segments reserved from the driver, in bytes (torch reserved_bytes current).",
    },
    MetricSpec {
        name: "stepalloc_allocated_bytes",
        kind: Kind::Gauge,
        labels: DP,
        help: "Bytes in blocks handed out to the caller, after size rounding (torch allocated_bytes current).",
    },
    MetricSpec {
        name: "stepalloc_requested_bytes",
        kind: Kind::Gauge,
        labels: DP,
        help: "Bytes the caller asked for in live allocations, before size rounding (torch requested_bytes current).",
    },
    MetricSpec {
        name: "stepalloc_active_bytes",
        kind: Kind::Gauge,
        labels: DP,
        help: "Bytes in blocks allocated or freed but still waiting for stream events (torch active_bytes current).",
    },
    MetricSpec {
        name: "stepalloc_inactive_split_bytes",
        kind: Kind::Gauge,
        labels: DP,
        help: "Bytes in free blocks of segments that are split into several blocks (torch inactive_split_bytes current).",
    },
    MetricSpec {
        name: "stepalloc_cached_free_bytes",
        kind: Kind::Gauge,
        labels: DP,
        help: "Reserved bytes not in active blocks: cached memory reusable without a device malloc (reserved minus active).",
    },
    MetricSpec {
        name: "stepalloc_peak_reserved_bytes",
        kind: Kind::Gauge,
        labels: DP,
        help: "Highest reserved bytes since start or the last peak reset (torch reserved_bytes peak).",
    },
    MetricSpec {
        name: "stepalloc_peak_allocated_bytes",
        kind: Kind::Gauge,
        labels: DP,
        help: "Highest allocated bytes since start or the last peak reset (torch allocated_bytes peak).",
    },
    MetricSpec {
        name: "stepalloc_peak_requested_bytes",
        kind: Kind::Gauge,
        labels: DP,
        help: "Highest requested bytes since start or the last peak reset (torch requested_bytes peak).",
    },
    MetricSpec {
        name: "stepalloc_segments",
        kind: Kind::Gauge,
        labels: DP,
        help: "Segments currently reserved from the driver (torch segment current).",
    },
    MetricSpec {
        name: "stepalloc_live_allocations",
        kind: Kind::Gauge,
        labels: DP,
        help: "Blocks currently handed out to the caller (torch allocation current).",
    },
    // Per device.
    MetricSpec {
        name: "stepalloc_device_total_bytes",
        kind: Kind::Gauge,
        labels: D,
        help: "Total memory of the device, in bytes.",
    },
    MetricSpec {
        name: "stepalloc_largest_free_block_bytes",
        kind: Kind::Gauge,
        labels: D,
        help: "Size of the largest free cached block, in bytes: the largest request served without a device malloc.",
    },
    MetricSpec {
        name: "stepalloc_external_fragmentation_ratio",
        kind: Kind::Gauge,
        labels: D,
        help: "1 - largest free block / cached free bytes (0 when nothing is cached): how scattered the cache is.",
    },
    MetricSpec {
        name: "stepalloc_internal_fragmentation_ratio",
        kind: Kind::Gauge,
        labels: D,
        help: "1 - requested bytes / allocated bytes (0 when nothing is allocated): share lost to size rounding.",
    },
    MetricSpec {
        name: "stepalloc_last_step_fragmentation_ratio",
        kind: Kind::Gauge,
        labels: D,
        help: "1 - peak allocated / peak reserved bytes within the last completed step (0 before the first step).",
    },
    MetricSpec {
        name: "stepalloc_last_step_peak_allocated_bytes",
        kind: Kind::Gauge,
        labels: D,
        help: "Peak allocated bytes within the last completed step.",
    },
    MetricSpec {
        name: "stepalloc_last_step_peak_reserved_bytes",
        kind: Kind::Gauge,
        labels: D,
        help: "Peak reserved bytes within the last completed step.",
    },
    MetricSpec {
        name: "stepalloc_last_step_reserved_at_end_bytes",
        kind: Kind::Gauge,
        labels: D,
        help: "Reserved bytes at the end of the last completed step, after the step-end release policies ran.",
    },
    MetricSpec {
        name: "stepalloc_last_step_device_allocs",
        kind: Kind::Gauge,
        labels: D,
        help: "Device mallocs (segment reserves) inside the last completed step; 0 in steady state.",
    },
    MetricSpec {
        name: "stepalloc_free_blocks",
        kind: Kind::Gauge,
        labels: &["device", "range"],
        help: "Free cached blocks whose size is in the range (<1MiB, 1MiB-10MiB, 10MiB-100MiB, 100MiB-1GiB, >=1GiB).",
    },
    MetricSpec {
        name: "stepalloc_free_block_bytes",
        kind: Kind::Gauge,
        labels: &["device", "range"],
        help: "Bytes in free cached blocks whose size is in the range (<1MiB, 1MiB-10MiB, 10MiB-100MiB, 100MiB-1GiB, >=1GiB).",
    },
    // Counters.
    MetricSpec {
        name: "stepalloc_allocations_total",
        kind: Kind::Counter,
        labels: D,
        help: "Allocations served (malloc calls that returned memory), since start or the last accumulated-stats reset.",
    },
    MetricSpec {
        name: "stepalloc_frees_total",
        kind: Kind::Counter,
        labels: D,
        help: "Frees of live allocations, since start or the last accumulated-stats reset.",
    },
    MetricSpec {
        name: "stepalloc_cache_hits_total",
        kind: Kind::Counter,
        labels: D,
        help: "Allocations served from a cached free block, without a device malloc.",
    },
    MetricSpec {
        name: "stepalloc_device_allocs_total",
        kind: Kind::Counter,
        labels: D,
        help: "Segments reserved from the driver (device mallocs, torch num_device_alloc).",
    },
    MetricSpec {
        name: "stepalloc_device_frees_total",
        kind: Kind::Counter,
        labels: D,
        help: "Segments returned to the driver (device frees, torch num_device_free).",
    },
    MetricSpec {
        name: "stepalloc_alloc_retries_total",
        kind: Kind::Counter,
        labels: D,
        help: "Device mallocs retried after releasing the whole cache on out-of-memory (torch num_alloc_retries).",
    },
    MetricSpec {
        name: "stepalloc_ooms_total",
        kind: Kind::Counter,
        labels: D,
        help: "Allocations that failed with out-of-memory after the whole recovery path ran (torch num_ooms).",
    },
    MetricSpec {
        name: "stepalloc_sync_all_streams_total",
        kind: Kind::Counter,
        labels: D,
        help: "Times the allocator waited for all pending stream events (torch num_sync_all_streams).",
    },
    MetricSpec {
        name: "stepalloc_device_synchronizations_total",
        kind: Kind::Counter,
        labels: D,
        help: "Device-wide synchronizations made to merge free blocks of different streams before releasing them.",
    },
    MetricSpec {
        name: "stepalloc_mapped_bytes",
        kind: Kind::Gauge,
        labels: D,
        help: "Bytes mapped in expandable segments (virtual memory); counted in reserved bytes too.",
    },
    MetricSpec {
        name: "stepalloc_virtual_reserved_bytes",
        kind: Kind::Gauge,
        labels: D,
        help: "Address space reserved for expandable segments (no memory behind it until mapped).",
    },
    MetricSpec {
        name: "stepalloc_moved_bytes_total",
        kind: Kind::Counter,
        labels: D,
        help: "Bytes of idle pages unmapped and mapped where a request needed them, instead of creating memory (page_reuse).",
    },
    MetricSpec {
        name: "stepalloc_vm_operations_total",
        kind: Kind::Counter,
        labels: &["device", "op"],
        help: "Virtual-memory driver operations on pages, by op (create, release, map, unmap).",
    },
    MetricSpec {
        name: "stepalloc_steps_total",
        kind: Kind::Counter,
        labels: &["device", "phase"],
        help: "Completed steps (step_begin .. step_end), by the phase named at step_begin.",
    },
    MetricSpec {
        name: "stepalloc_released_bytes_total",
        kind: Kind::Counter,
        labels: &["device", "reason"],
        help: "Bytes of cached segments returned to the driver, by reason (step, phase_switch, limit, empty_cache, oom, pause).",
    },
    MetricSpec {
        name: "stepalloc_driver_seconds_total",
        kind: Kind::Counter,
        labels: &["device", "call"],
        help: "Time spent in driver calls, by call (reserve, release, event, sync, create, map); modelled on the simulated device.",
    },
    // Sleep and wake (`pause` / `resume`), by tag: "default" and the names regions used.
    MetricSpec {
        name: "stepalloc_tag_live_bytes",
        kind: Kind::Gauge,
        labels: DT,
        help: "Bytes of the tag's allocated blocks that hold device memory (not paused).",
    },
    MetricSpec {
        name: "stepalloc_tag_paused_bytes",
        kind: Kind::Gauge,
        labels: DT,
        help: "Bytes of the tag's allocated blocks while it is paused (addresses kept, no memory behind them).",
    },
    MetricSpec {
        name: "stepalloc_tag_backup_bytes",
        kind: Kind::Gauge,
        labels: DT,
        help: "Bytes of the paused tag's blocks held in its backup stores (host memory or disk files).",
    },
    MetricSpec {
        name: "stepalloc_tag_backup_host_bytes",
        kind: Kind::Gauge,
        labels: &["device", "tag", "kind"],
        help: "Host memory kept for the tag's backups, by kind: pinned, or mmap (pageable, not pinned) (kept across pauses; freed by release_backup).",
    },
    MetricSpec {
        name: "stepalloc_tag_backup_disk_bytes",
        kind: Kind::Gauge,
        labels: DT,
        help: "Bytes of the paused tag's blocks held in files in the backup directory (removed at resume).",
    },
    MetricSpec {
        name: "stepalloc_tag_paused",
        kind: Kind::Gauge,
        labels: DT,
        help: "1 while the tag is paused, else 0.",
    },
    MetricSpec {
        name: "stepalloc_tag_pauses_total",
        kind: Kind::Counter,
        labels: DT,
        help: "Pauses of the tag.",
    },
    MetricSpec {
        name: "stepalloc_tag_resumes_total",
        kind: Kind::Counter,
        labels: DT,
        help: "Resumes of the tag.",
    },
    MetricSpec {
        name: "stepalloc_tag_sleep_seconds_total",
        kind: Kind::Counter,
        labels: &["device", "tag", "op"],
        help: "Time spent pausing and resuming the tag, by op (pause, resume).",
    },
    MetricSpec {
        name: "stepalloc_backup_host_bytes",
        kind: Kind::Gauge,
        labels: D,
        help: "Pinned host memory kept for backups of paused tags (freed by release_backup).",
    },
    MetricSpec {
        name: "stepalloc_device_alloc_duration_seconds",
        kind: Kind::Histogram,
        labels: D,
        help: "Duration of successful device mallocs (segment reserves), in seconds.",
    },
];

/// Label values of the free-block size ranges, in the order of `Heap::free_block_ranges`.
pub const FREE_BLOCK_RANGE_LABELS: [&str; FREE_BLOCK_RANGES] =
    ["<1MiB", "1MiB-10MiB", "10MiB-100MiB", "100MiB-1GiB", ">=1GiB"];

/// What one scrape reads from one device, copied out under its lock.
#[derive(Clone, Debug)]
pub struct DeviceReading {
    pub stats: DeviceStats,
    pub free_ranges: [(u64, u64); FREE_BLOCK_RANGES],
}

/// Reads every device: one lock acquisition per device, for a consistent copy of each.
pub fn read_devices(allocator: &Allocator) -> Vec<DeviceReading> {
    (0..allocator.device_count())
        .filter_map(|d| {
            allocator
                .with_heap(d, |heap| DeviceReading { stats: heap.stats(), free_ranges: heap.free_block_ranges() })
                .ok()
        })
        .collect()
}

/// Where a collector gets its readings: a live allocator (read at each gather) or readings
/// taken already (for `render`, which reads at call time).
enum Source {
    Live(Arc<Allocator>),
    Taken(Vec<DeviceReading>),
}

/// The collector registered in stepalloc's own registry.
pub struct StepallocCollector {
    descs: Vec<Desc>,
    source: Source,
}

impl StepallocCollector {
    /// A collector that reads `allocator` each time the registry is gathered.
    pub fn live(allocator: Arc<Allocator>) -> prometheus::Result<StepallocCollector> {
        Ok(StepallocCollector { descs: descs()?, source: Source::Live(allocator) })
    }

    /// A collector over readings already taken.
    pub fn taken(readings: Vec<DeviceReading>) -> prometheus::Result<StepallocCollector> {
        Ok(StepallocCollector { descs: descs()?, source: Source::Taken(readings) })
    }
}

fn descs() -> prometheus::Result<Vec<Desc>> {
    METRICS
        .iter()
        .map(|m| {
            Desc::new(
                m.name.to_string(),
                m.help.to_string(),
                m.labels.iter().map(|l| l.to_string()).collect(),
                HashMap::new(),
            )
        })
        .collect()
}

impl Collector for StepallocCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        match &self.source {
            Source::Live(allocator) => families(&read_devices(allocator)),
            Source::Taken(readings) => families(readings),
        }
    }
}

/// A registry of stepalloc's own (never the crate's global one) holding `collector`, with
/// the constant label `rank` when given.
pub fn registry(collector: StepallocCollector, rank: Option<&str>) -> prometheus::Result<prometheus::Registry> {
    let labels = rank.map(|r| HashMap::from([("rank".to_string(), r.to_string())]));
    let registry = prometheus::Registry::new_custom(None, labels)?;
    registry.register(Box::new(collector))?;
    Ok(registry)
}

/// Gathers `registry` into the text exposition format (version 0.0.4).
pub fn encode(registry: &prometheus::Registry) -> prometheus::Result<String> {
    prometheus::TextEncoder::new().encode_to_string(&registry.gather())
}

// ----- building the families ---------------------------------------------------------------

/// The families of every device, in the order of [`METRICS`].
pub fn families(readings: &[DeviceReading]) -> Vec<MetricFamily> {
    let mut out: Vec<MetricFamily> = METRICS.iter().map(family).collect();
    for r in readings {
        add_device(&mut out, r);
    }
    out
}

fn family(spec: &MetricSpec) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(spec.name.to_string());
    f.set_help(spec.help.to_string());
    f.set_field_type(match spec.kind {
        Kind::Gauge => MetricType::GAUGE,
        Kind::Counter => MetricType::COUNTER,
        Kind::Histogram => MetricType::HISTOGRAM,
    });
    f
}

/// Appends one device's samples to the families (indexed as in [`METRICS`]).
fn add_device(out: &mut [MetricFamily], r: &DeviceReading) {
    let s = &r.stats;
    let h = &s.heap;
    let device = s.device.to_string();
    let mut w = Writer { out, device: &device };

    let current = |p: &PoolStat| [p.small_pool.current, p.large_pool.current];
    let peak = |p: &PoolStat| [p.small_pool.peak, p.large_pool.peak];
    let cached = [
        h.reserved_bytes.small_pool.current.saturating_sub(h.active_bytes.small_pool.current),
        h.reserved_bytes.large_pool.current.saturating_sub(h.active_bytes.large_pool.current),
    ];
    w.pools("stepalloc_reserved_bytes", current(&h.reserved_bytes));
    w.pools("stepalloc_allocated_bytes", current(&h.allocated_bytes));
    w.pools("stepalloc_requested_bytes", current(&h.requested_bytes));
    w.pools("stepalloc_active_bytes", current(&h.active_bytes));
    w.pools("stepalloc_inactive_split_bytes", current(&h.inactive_split_bytes));
    w.pools("stepalloc_cached_free_bytes", cached);
    w.pools("stepalloc_peak_reserved_bytes", peak(&h.reserved_bytes));
    w.pools("stepalloc_peak_allocated_bytes", peak(&h.allocated_bytes));
    w.pools("stepalloc_peak_requested_bytes", peak(&h.requested_bytes));
    w.pools("stepalloc_segments", current(&h.segment));
    w.pools("stepalloc_live_allocations", current(&h.allocation));

    w.gauge("stepalloc_device_total_bytes", &[], s.device_total as f64);
    w.gauge("stepalloc_largest_free_block_bytes", &[], s.largest_free_block as f64);
    w.gauge("stepalloc_external_fragmentation_ratio", &[], s.external_fragmentation());
    w.gauge("stepalloc_internal_fragmentation_ratio", &[], s.internal_fragmentation());
    w.gauge("stepalloc_last_step_fragmentation_ratio", &[], s.last_step.fragmentation);
    w.gauge("stepalloc_last_step_peak_allocated_bytes", &[], s.last_step.peak_allocated as f64);
    w.gauge("stepalloc_last_step_peak_reserved_bytes", &[], s.last_step.peak_reserved as f64);
    w.gauge("stepalloc_last_step_reserved_at_end_bytes", &[], s.last_step.reserved_at_end as f64);
    w.gauge("stepalloc_last_step_device_allocs", &[], s.last_step.device_mallocs as f64);
    for (label, &(count, bytes)) in FREE_BLOCK_RANGE_LABELS.iter().zip(r.free_ranges.iter()) {
        w.gauge("stepalloc_free_blocks", &[("range", label)], count as f64);
        w.gauge("stepalloc_free_block_bytes", &[("range", label)], bytes as f64);
    }

    w.counter("stepalloc_allocations_total", &[], h.num_mallocs as f64);
    w.counter("stepalloc_frees_total", &[], h.num_frees as f64);
    w.counter("stepalloc_cache_hits_total", &[], h.num_cache_hits as f64);
    w.counter("stepalloc_device_allocs_total", &[], h.num_device_alloc as f64);
    w.counter("stepalloc_device_frees_total", &[], h.num_device_free as f64);
    w.counter("stepalloc_alloc_retries_total", &[], h.num_alloc_retries as f64);
    w.counter("stepalloc_ooms_total", &[], h.num_ooms as f64);
    w.counter("stepalloc_sync_all_streams_total", &[], h.num_sync_all_streams as f64);
    w.counter("stepalloc_device_synchronizations_total", &[], h.num_device_synchronize as f64);
    for (phase, &steps) in &s.steps_by_phase {
        w.counter("stepalloc_steps_total", &[("phase", phase)], steps as f64);
    }
    for reason in ReleaseReason::ALL {
        w.counter(
            "stepalloc_released_bytes_total",
            &[("reason", reason.label())],
            h.released_bytes[reason as usize] as f64,
        );
    }
    let t = &s.driver_time;
    for (call, ns) in [
        ("reserve", t.reserve_ns),
        ("release", t.release_ns),
        ("event", t.event_ns),
        ("sync", t.sync_ns),
        ("create", t.create_ns),
        ("map", t.map_ns),
    ] {
        w.counter("stepalloc_driver_seconds_total", &[("call", call)], ns as f64 * 1e-9);
    }
    w.gauge("stepalloc_mapped_bytes", &[], s.mapped_bytes as f64);
    w.gauge("stepalloc_virtual_reserved_bytes", &[], h.virtual_reserved_bytes as f64);
    w.counter("stepalloc_moved_bytes_total", &[], h.moved_bytes as f64);
    for (op, count) in
        [("create", h.num_create), ("release", h.num_release_physical), ("map", h.num_map), ("unmap", h.num_unmap)]
    {
        w.counter("stepalloc_vm_operations_total", &[("op", op)], count as f64);
    }
    // Before any region, everything is "default"'s (the families exist from the first scrape).
    let default_only = [crate::heap::TagFigures {
        tag: crate::tags::DEFAULT_NAME.into(),
        live_bytes: h.allocated_bytes.all.current,
        ..Default::default()
    }];
    let tag_figures = if s.tags.is_empty() { &default_only[..] } else { &s.tags[..] };
    for f in tag_figures {
        let tag = [("tag", f.tag.as_str())];
        w.gauge("stepalloc_tag_live_bytes", &tag, f.live_bytes as f64);
        w.gauge("stepalloc_tag_paused_bytes", &tag, f.paused_bytes as f64);
        w.gauge("stepalloc_tag_backup_bytes", &tag, f.backup_bytes as f64);
        for (kind, bytes) in [("pinned", f.host_bytes), ("mmap", f.mmap_bytes)] {
            w.gauge("stepalloc_tag_backup_host_bytes", &[("tag", f.tag.as_str()), ("kind", kind)], bytes as f64);
        }
        w.gauge("stepalloc_tag_backup_disk_bytes", &tag, f.disk_bytes as f64);
        w.gauge("stepalloc_tag_paused", &tag, f64::from(u8::from(f.paused)));
        w.counter("stepalloc_tag_pauses_total", &tag, f.pauses as f64);
        w.counter("stepalloc_tag_resumes_total", &tag, f.resumes as f64);
        for (op, seconds) in [("pause", f.pause_seconds), ("resume", f.resume_seconds)] {
            w.counter("stepalloc_tag_sleep_seconds_total", &[("tag", f.tag.as_str()), ("op", op)], seconds);
        }
    }
    w.gauge("stepalloc_backup_host_bytes", &[], s.backup_host_bytes as f64);

    // Buckets hold counts per bucket (the last one above every bound); Prometheus wants
    // cumulative counts per upper bound, +Inf being the total (the encoder writes it).
    let mut cumulative = 0u64;
    let mut buckets = Vec::with_capacity(DEVICE_ALLOC_BUCKETS_S.len());
    for (&upper, &count) in DEVICE_ALLOC_BUCKETS_S.iter().zip(h.device_alloc_latency_buckets.iter()) {
        cumulative += count;
        let mut b = Bucket::default();
        b.set_upper_bound(upper);
        b.set_cumulative_count(cumulative);
        buckets.push(b);
    }
    let mut histogram = Histogram::default();
    histogram.set_bucket(buckets);
    histogram.set_sample_count(h.device_alloc_latency_buckets.iter().sum());
    histogram.set_sample_sum(h.device_alloc_latency_sum_ns as f64 * 1e-9);
    let mut m = Metric::from_label(w.labels(&[]));
    m.set_histogram(histogram);
    w.push("stepalloc_device_alloc_duration_seconds", m);
}

/// Adds samples of one device to the families.
struct Writer<'a> {
    out: &'a mut [MetricFamily],
    device: &'a str,
}

impl Writer<'_> {
    fn labels(&self, extra: &[(&str, &str)]) -> Vec<LabelPair> {
        std::iter::once(("device", self.device))
            .chain(extra.iter().copied())
            .map(|(name, value)| {
                let mut pair = LabelPair::default();
                pair.set_name(name.to_string());
                pair.set_value(value.to_string());
                pair
            })
            .collect()
    }

    fn push(&mut self, name: &str, metric: Metric) {
        // Every name used in `add_device` is in METRICS (checked by a test); a name that were
        // not would be dropped rather than panic in a scrape.
        if let Some(i) = METRICS.iter().position(|m| m.name == name) {
            self.out[i].mut_metric().push(metric);
        }
    }

    fn gauge(&mut self, name: &str, extra: &[(&str, &str)], value: f64) {
        let mut g = Gauge::default();
        g.set_value(value);
        let mut m = Metric::from_label(self.labels(extra));
        m.set_gauge(g);
        self.push(name, m);
    }

    fn counter(&mut self, name: &str, extra: &[(&str, &str)], value: f64) {
        let mut c = Counter::default();
        c.set_value(value);
        let mut m = Metric::from_label(self.labels(extra));
        m.set_counter(c);
        self.push(name, m);
    }

    fn pools(&mut self, name: &str, [small, large]: [u64; 2]) {
        self.gauge(name, &[("pool", "small")], small as f64);
        self.gauge(name, &[("pool", "large")], large as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_reading() -> DeviceReading {
        let mut stats = DeviceStats::default();
        stats.steps_by_phase.insert("train".into(), 2);
        stats.heap.device_alloc_latency_buckets[0] = 2;
        stats.heap.device_alloc_latency_buckets[3] = 1;
        stats.heap.device_alloc_latency_buckets[11] = 1;
        stats.heap.device_alloc_latency_sum_ns = 1_000_000_000;
        DeviceReading { stats, free_ranges: [(0, 0); FREE_BLOCK_RANGES] }
    }

    #[test]
    fn every_family_is_specified_and_labelled_as_specified() {
        let families = families(&[sample_reading()]);
        assert_eq!(families.len(), METRICS.len());
        for (f, spec) in families.iter().zip(METRICS) {
            assert_eq!(f.name(), spec.name);
            assert!(!f.get_metric().is_empty(), "{} has no sample", spec.name);
            for m in f.get_metric() {
                let names: Vec<&str> = m.get_label().iter().map(|l| l.name()).collect();
                assert_eq!(names, spec.labels, "{}", spec.name);
            }
        }
    }

    #[test]
    fn names_follow_the_conventions() {
        for spec in METRICS {
            assert!(spec.name.starts_with("stepalloc_"), "{}", spec.name);
            assert_eq!(spec.kind == Kind::Counter, spec.name.ends_with("_total"), "{}", spec.name);
            assert!(!spec.help.is_empty());
            assert_eq!(spec.labels.first(), Some(&"device"), "{}", spec.name);
        }
        assert!(descs().is_ok());
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let families = families(&[sample_reading()]);
        let f = families.iter().find(|f| f.name() == "stepalloc_device_alloc_duration_seconds").expect("histogram");
        let h = f.get_metric()[0].get_histogram();
        let counts: Vec<u64> = h.get_bucket().iter().map(|b| b.cumulative_count()).collect();
        assert_eq!(counts, [2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]);
        assert_eq!(h.get_sample_count(), 4);
        assert_eq!(h.get_sample_sum(), 1.0);
    }

    #[test]
    fn rank_is_a_constant_label() {
        let registry =
            registry(StepallocCollector::taken(vec![sample_reading()]).expect("descs"), Some("3")).expect("registry");
        let text = encode(&registry).expect("encode");
        assert!(text.contains("stepalloc_steps_total{device=\"0\",phase=\"train\",rank=\"3\"} 2\n"), "{text}");
    }
}
