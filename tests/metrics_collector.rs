//! The Prometheus collector against the allocator's own statistics: after a scripted two-phase
//! workload on two simulated devices, every sample of `metrics::render` equals the figure
//! `Allocator::stats` reports, and the free-block ranges match an oracle computed from the
//! segments and live blocks. Also checks the Grafana dashboard only plots metrics that exist.

mod common;

use common::{sample, Samples};
use stepalloc::heap::{FREE_BLOCK_RANGES, FREE_BLOCK_RANGE_BOUNDS};
use stepalloc::metrics::{self, Kind, FREE_BLOCK_RANGE_LABELS, METRICS};
use stepalloc::stats::{ReleaseReason, DEVICE_ALLOC_BUCKETS_S};
use stepalloc::{Allocator, Config, DeviceStats, Stream};

const MIB: u64 = 1 << 20;

fn get(samples: &Samples, name: &str, labels: &[(&str, &str)]) -> f64 {
    sample(samples, name, labels).unwrap_or_else(|| panic!("no sample {name}{labels:?}"))
}

/// Two phases on device 0 (rollout: KV-cache-shaped blocks; train: activations), an
/// `empty_cache`, an out-of-memory, and split blocks left cached; a little on device 1.
fn scripted_workload(a: &Allocator) -> Vec<(usize, u64)> {
    let s = Stream::DEFAULT;
    let mut live = Vec::new();
    let alloc = |d: usize, size: u64, live: &mut Vec<(usize, u64)>| {
        let p = a.malloc(d, size, s).expect("malloc");
        live.push((d, p));
        p
    };
    for round in 0..2 {
        a.step_begin("rollout").expect("step");
        let kv: Vec<u64> = (0..8).map(|_| a.malloc(0, 24 * MIB + 4096, s).expect("kv")).collect();
        let small: Vec<u64> = (0..50).map(|i| a.malloc(0, 3000 + i * 512, s).expect("small")).collect();
        for &p in &kv[round..] {
            a.free(0, p, 0).expect("free");
        }
        for &p in small.iter().step_by(2) {
            a.free(0, p, 0).expect("free");
        }
        live.extend(kv[..round].iter().map(|&p| (0, p)));
        live.extend(small.iter().skip(1).step_by(2).map(|&p| (0, p)));
        a.step_end().expect("step");

        a.step_begin("train").expect("step");
        let act: Vec<u64> = (0..3).map(|_| a.malloc(0, 100 * MIB, s).expect("act")).collect();
        let mid: Vec<u64> = (0..10).map(|_| a.malloc(0, 5 * MIB + 100, s).expect("mid")).collect();
        for &p in act.iter().chain(mid.iter().step_by(2)) {
            a.free(0, p, 0).expect("free");
        }
        live.extend(mid.iter().skip(1).step_by(2).map(|&p| (0, p)));
        a.step_end().expect("step");
    }
    assert!(a.empty_cache().expect("empty_cache") > 0);
    // A cached 64 MiB segment, then a request that cannot fit: the OOM path releases it.
    let cached = a.malloc(0, 64 * MIB, s).expect("malloc");
    a.free(0, cached, 0).expect("free");
    alloc(0, 300 * MIB, &mut live);
    assert!(a.malloc(0, 700 * MIB, s).expect_err("must not fit").is_out_of_memory());
    // Split blocks left free inside a 20 MiB segment.
    let split: Vec<u64> = (0..3).map(|_| a.malloc(0, 3 * MIB, s).expect("split")).collect();
    a.free(0, split[1], 0).expect("free");
    live.extend([(0, split[0]), (0, split[2])]);
    alloc(1, MIB + 2048, &mut live);
    alloc(1, 700, &mut live);
    live
}

fn allocator() -> Allocator {
    let config = Config::parse(
        "backend:sim,sim_devices:2,sim_capacity_mb:1024,sim_cost_model:True,release_idle_steps:3,phase_trim:True",
    )
    .expect("config");
    Allocator::new(config).expect("allocator")
}

/// Free blocks computed from segments and live blocks alone: with one stream, free blocks are
/// exactly the maximal gaps between live blocks inside each segment.
fn oracle_free_ranges(a: &Allocator, device: usize) -> [(u64, u64); FREE_BLOCK_RANGES] {
    let (segments, mut blocks) = a.with_heap(device, |h| (h.segments(), h.live_blocks())).expect("heap");
    blocks.sort();
    let mut ranges = [(0u64, 0u64); FREE_BLOCK_RANGES];
    let mut add = |size: u64| {
        let i = FREE_BLOCK_RANGE_BOUNDS.iter().position(|&b| size < b).unwrap_or(FREE_BLOCK_RANGES - 1);
        ranges[i].0 += 1;
        ranges[i].1 += size;
    };
    for (base, size, _) in segments {
        let mut cursor = base;
        for &(addr, bsize, _, _) in blocks.iter().filter(|b| b.0 >= base && b.0 < base + size) {
            if addr > cursor {
                add(addr - cursor);
            }
            cursor = addr + bsize;
        }
        if cursor < base + size {
            add(base + size - cursor);
        }
    }
    ranges
}

fn check_device(samples: &Samples, s: &DeviceStats, free_ranges: &[(u64, u64); FREE_BLOCK_RANGES]) {
    let d = s.device.to_string();
    let d = d.as_str();
    let h = &s.heap;
    let dev = [("device", d)];
    for (pool, small) in [("small", true), ("large", false)] {
        let labels = [("device", d), ("pool", pool)];
        let pick = |p: &stepalloc::stats::PoolStat| if small { p.small_pool } else { p.large_pool };
        let cur = |n: &str, p: &stepalloc::stats::PoolStat| {
            assert_eq!(get(samples, n, &labels), pick(p).current as f64, "{n}{labels:?}")
        };
        cur("stepalloc_reserved_bytes", &h.reserved_bytes);
        cur("stepalloc_allocated_bytes", &h.allocated_bytes);
        cur("stepalloc_requested_bytes", &h.requested_bytes);
        cur("stepalloc_active_bytes", &h.active_bytes);
        cur("stepalloc_inactive_split_bytes", &h.inactive_split_bytes);
        cur("stepalloc_segments", &h.segment);
        cur("stepalloc_live_allocations", &h.allocation);
        let peak = |n: &str, p: &stepalloc::stats::PoolStat| {
            assert_eq!(get(samples, n, &labels), pick(p).peak as f64, "{n}{labels:?}")
        };
        peak("stepalloc_peak_reserved_bytes", &h.reserved_bytes);
        peak("stepalloc_peak_allocated_bytes", &h.allocated_bytes);
        peak("stepalloc_peak_requested_bytes", &h.requested_bytes);
        let cached = pick(&h.reserved_bytes).current - pick(&h.active_bytes).current;
        assert_eq!(get(samples, "stepalloc_cached_free_bytes", &labels), cached as f64);
    }
    let cached_sum = get(samples, "stepalloc_cached_free_bytes", &[("device", d), ("pool", "small")])
        + get(samples, "stepalloc_cached_free_bytes", &[("device", d), ("pool", "large")]);
    assert_eq!(cached_sum, s.cached_free as f64);

    let gauges = [
        ("stepalloc_device_total_bytes", s.device_total as f64),
        ("stepalloc_largest_free_block_bytes", s.largest_free_block as f64),
        ("stepalloc_external_fragmentation_ratio", s.external_fragmentation()),
        ("stepalloc_internal_fragmentation_ratio", s.internal_fragmentation()),
        ("stepalloc_last_step_fragmentation_ratio", s.last_step.fragmentation),
        ("stepalloc_last_step_peak_allocated_bytes", s.last_step.peak_allocated as f64),
        ("stepalloc_last_step_peak_reserved_bytes", s.last_step.peak_reserved as f64),
        ("stepalloc_last_step_reserved_at_end_bytes", s.last_step.reserved_at_end as f64),
        ("stepalloc_last_step_device_allocs", s.last_step.device_mallocs as f64),
        ("stepalloc_allocations_total", h.num_mallocs as f64),
        ("stepalloc_frees_total", h.num_frees as f64),
        ("stepalloc_cache_hits_total", h.num_cache_hits as f64),
        ("stepalloc_device_allocs_total", h.num_device_alloc as f64),
        ("stepalloc_device_frees_total", h.num_device_free as f64),
        ("stepalloc_alloc_retries_total", h.num_alloc_retries as f64),
        ("stepalloc_ooms_total", h.num_ooms as f64),
        ("stepalloc_sync_all_streams_total", h.num_sync_all_streams as f64),
        ("stepalloc_device_synchronizations_total", h.num_device_synchronize as f64),
    ];
    for (name, expected) in gauges {
        assert_eq!(get(samples, name, &dev), expected, "{name} on device {d}");
    }
    for ratio in ["external", "internal", "last_step"] {
        let v = get(samples, &format!("stepalloc_{ratio}_fragmentation_ratio"), &dev);
        assert!((0.0..=1.0).contains(&v), "{ratio} ratio {v}");
    }
    for (phase, &steps) in &s.steps_by_phase {
        assert_eq!(get(samples, "stepalloc_steps_total", &[("device", d), ("phase", phase)]), steps as f64);
    }
    let phases = samples.keys().filter(|(n, l)| n == "stepalloc_steps_total" && l["device"] == d).count();
    assert_eq!(phases, s.steps_by_phase.len());
    for reason in ReleaseReason::ALL {
        let v = get(samples, "stepalloc_released_bytes_total", &[("device", d), ("reason", reason.label())]);
        assert_eq!(v, h.released_bytes[reason as usize] as f64, "{}", reason.label());
    }
    let t = &s.driver_time;
    for (call, ns) in [("reserve", t.reserve_ns), ("release", t.release_ns), ("event", t.event_ns), ("sync", t.sync_ns)]
    {
        assert_eq!(get(samples, "stepalloc_driver_seconds_total", &[("device", d), ("call", call)]), ns as f64 * 1e-9);
    }

    // The histogram: cumulative buckets over the same bounds, +Inf = count = device mallocs.
    let mut cumulative = 0;
    for (i, &le) in DEVICE_ALLOC_BUCKETS_S.iter().enumerate() {
        cumulative += h.device_alloc_latency_buckets[i];
        let le = le.to_string();
        let v = get(samples, "stepalloc_device_alloc_duration_seconds_bucket", &[("device", d), ("le", &le)]);
        assert_eq!(v, cumulative as f64, "bucket le={le}");
    }
    let count = get(samples, "stepalloc_device_alloc_duration_seconds_count", &dev);
    assert_eq!(get(samples, "stepalloc_device_alloc_duration_seconds_bucket", &[("device", d), ("le", "+Inf")]), count);
    assert_eq!(count, h.num_device_alloc as f64, "every device malloc is timed once");
    let sum = get(samples, "stepalloc_device_alloc_duration_seconds_sum", &dev);
    assert_eq!(sum, h.device_alloc_latency_sum_ns as f64 * 1e-9);

    assert_eq!(get(samples, "stepalloc_mapped_bytes", &dev), s.mapped_bytes as f64);
    assert_eq!(get(samples, "stepalloc_virtual_reserved_bytes", &dev), h.virtual_reserved_bytes as f64);
    assert_eq!(get(samples, "stepalloc_moved_bytes_total", &dev), h.moved_bytes as f64);
    for (op, count) in
        [("create", h.num_create), ("release", h.num_release_physical), ("map", h.num_map), ("unmap", h.num_unmap)]
    {
        assert_eq!(get(samples, "stepalloc_vm_operations_total", &[("device", d), ("op", op)]), count as f64, "{op}");
    }
    let t = &s.driver_time;
    for (call, ns) in [("create", t.create_ns), ("map", t.map_ns)] {
        assert_eq!(get(samples, "stepalloc_driver_seconds_total", &[("device", d), ("call", call)]), ns as f64 * 1e-9);
    }

    let mut free_bytes = 0;
    for (label, &(count, bytes)) in FREE_BLOCK_RANGE_LABELS.iter().zip(free_ranges.iter()) {
        assert_eq!(get(samples, "stepalloc_free_blocks", &[("device", d), ("range", label)]), count as f64, "{label}");
        assert_eq!(get(samples, "stepalloc_free_block_bytes", &[("device", d), ("range", label)]), bytes as f64);
        free_bytes += bytes;
    }
    assert_eq!(free_bytes, s.cached_free, "no pending blocks: free blocks hold every cached free byte");
}

#[test]
fn collector_values_equal_the_allocator_stats() {
    let a = allocator();
    let live = scripted_workload(&a);
    let text = metrics::render(&a);
    if std::env::var_os("STEPALLOC_PRINT_METRICS").is_some() {
        println!("{text}");
    }
    let samples = common::samples(&text);

    for device in 0..a.device_count() {
        let stats = a.stats(device).expect("stats");
        let oracle = oracle_free_ranges(&a, device);
        assert_eq!(a.with_heap(device, |h| h.free_block_ranges()).expect("heap"), oracle, "device {device}");
        check_device(&samples, &stats, &oracle);
    }

    // The workload reached what it was meant to.
    let s0 = a.stats(0).expect("stats");
    assert_eq!(s0.steps_by_phase.get("rollout"), Some(&2));
    assert_eq!(s0.steps_by_phase.get("train"), Some(&2));
    assert!(s0.heap.num_ooms >= 1 && s0.heap.num_alloc_retries >= 1);
    assert!(s0.heap.released_bytes[ReleaseReason::Oom as usize] >= 64 * MIB);
    assert!(s0.heap.released_bytes[ReleaseReason::EmptyCache as usize] > 0);
    assert!(s0.heap.inactive_split_bytes.large_pool.current > 0 && s0.heap.inactive_split_bytes.small_pool.current > 0);
    assert!(s0.external_fragmentation() > 0.0 && s0.internal_fragmentation() > 0.0);
    assert!(s0.driver_time.reserve_ns > 0, "cost model on: device mallocs take modelled time");

    // Every specified family appears, with HELP and TYPE lines.
    for spec in METRICS {
        let kind = match spec.kind {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
            Kind::Histogram => "histogram",
        };
        assert!(text.contains(&format!("# HELP {} {}\n", spec.name, spec.help)), "{}", spec.name);
        assert!(text.contains(&format!("# TYPE {} {kind}\n", spec.name)), "{}", spec.name);
    }
    // No device label outside the devices, no family outside the specification.
    for (name, labels) in samples.keys() {
        assert!(labels["device"] == "0" || labels["device"] == "1", "{name}{labels:?}");
        let base = name.trim_end_matches("_bucket").trim_end_matches("_sum").trim_end_matches("_count");
        assert!(METRICS.iter().any(|m| m.name == name || (m.kind == Kind::Histogram && m.name == base)), "{name}");
    }

    // The values follow the allocator: free everything and scrape again.
    for (d, p) in live {
        a.free(d, p, 0).expect("free");
    }
    a.empty_cache().expect("empty_cache");
    let after = common::samples(&metrics::render(&a));
    for d in ["0", "1"] {
        for pool in ["small", "large"] {
            assert_eq!(get(&after, "stepalloc_reserved_bytes", &[("device", d), ("pool", pool)]), 0.0);
            assert_eq!(get(&after, "stepalloc_allocated_bytes", &[("device", d), ("pool", pool)]), 0.0);
        }
    }
    let s0 = a.stats(0).expect("stats");
    check_device(&after, &s0, &oracle_free_ranges(&a, 0));
}

#[test]
fn virtual_memory_metrics_follow_the_allocator() {
    let config = Config::parse(
        "backend:sim,sim_devices:2,sim_capacity_mb:1024,sim_cost_model:True,expandable_segments:True,large_segment_size_mb:2,page_reuse:True",
    )
    .expect("config");
    let a = Allocator::new(config).expect("allocator");
    let p = a.malloc(0, 10 * MIB, stepalloc::Stream(0)).expect("malloc");
    let q = a.malloc(0, 10 * MIB, stepalloc::Stream(0)).expect("malloc");
    a.free(0, p, 0).expect("free");
    let r = a.malloc(0, 12 * MIB, stepalloc::Stream(0)).expect("malloc: moves p's pages");
    let samples = common::samples(&metrics::render(&a));
    let s = a.stats(0).expect("stats");
    assert!(s.heap.moved_bytes > 0 && s.mapped_bytes == 22 * MIB);
    assert!(s.driver_time.create_ns > 0 && s.driver_time.map_ns > 0, "modelled virtual-memory time");
    check_device(&samples, &s, &a.with_heap(0, |h| h.free_block_ranges()).expect("heap"));
    for ptr in [q, r] {
        a.free(0, ptr, 0).expect("free");
    }
}

#[test]
fn dashboard_plots_only_exported_metrics() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/dashboards/stepalloc.json");
    let text = std::fs::read_to_string(path).expect("dashboards/stepalloc.json");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard is JSON");
    assert!(dashboard["title"].as_str().is_some_and(|t| !t.is_empty()));
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut exprs = Vec::new();
    for panel in panels {
        assert!(panel["title"].as_str().is_some(), "every panel has a title");
        for target in panel["targets"].as_array().map(|t| t.as_slice()).unwrap_or_default() {
            exprs.push(target["expr"].as_str().expect("target expr").to_string());
        }
    }
    let mut used = std::collections::BTreeSet::new();
    for expr in &exprs {
        let mut rest = expr.as_str();
        while let Some(i) = rest.find("stepalloc_") {
            let name: String = rest[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            rest = &rest[i + name.len()..];
            let base = name.trim_end_matches("_bucket").trim_end_matches("_sum").trim_end_matches("_count");
            assert!(
                METRICS.iter().any(|m| m.name == name || (m.kind == Kind::Histogram && m.name == base)),
                "dashboard uses `{name}`, which stepalloc does not export"
            );
            used.insert(name);
        }
    }
    for needed in [
        "stepalloc_reserved_bytes",
        "stepalloc_allocated_bytes",
        "stepalloc_requested_bytes",
        "stepalloc_external_fragmentation_ratio",
        "stepalloc_internal_fragmentation_ratio",
        "stepalloc_last_step_fragmentation_ratio",
        "stepalloc_device_allocs_total",
        "stepalloc_device_alloc_duration_seconds_bucket",
        "stepalloc_released_bytes_total",
        "stepalloc_steps_total",
    ] {
        assert!(used.contains(needed), "the dashboard plots {needed}");
    }
    assert!(exprs.iter().any(|e| e.contains("histogram_quantile(")), "a latency quantile panel");
}
