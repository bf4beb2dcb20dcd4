//! Reports: plain data gathered by the runner, printed as a table, as JSON, or drawn as SVG.
//!
//! Wall-clock fields (`wall_s`, `ops_per_s`, `parse_s`) are the only ones that differ between
//! two runs of the same seed; `without_wall_clock` removes them for comparisons.

use crate::ops::SourceNotes;
use comfy_table::{presets::UTF8_FULL_CONDENSED, CellAlignment, Table};
use serde::Serialize;
use std::fmt::Write as _;

#[derive(Clone, Debug, Default, Serialize)]
pub struct Sample {
    pub op: u64,
    pub requested: u64,
    pub allocated: u64,
    pub reserved: u64,
    /// The highest device memory in use since the previous sample (`RunConfig::track_peak`;
    /// else `reserved`), so a drawn line reaches the peaks between samples.
    #[serde(skip)]
    pub reserved_max: u64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct StepReport {
    pub step: u64,
    pub phase: String,
    /// Index of the step's `StepBegin` in the event stream.
    pub first_op: u64,
    /// The device these figures are of: the step's worst (highest peak reserved) where the run
    /// has several; OOMs and driver figures are the whole step's, over every device.
    pub device: usize,
    /// Peak live requested bytes within the step (the step's floor).
    pub peak_requested: u64,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    /// Reserved when the step began, after phase trims.
    pub reserved_at_begin: u64,
    /// Reserved after the step-end policies (and the emulated empty_cache, if any).
    pub reserved_at_end: u64,
    pub device_mallocs: u64,
    /// 1 - peak allocated / peak reserved within the step.
    pub fragmentation: f64,
    pub ooms: u64,
    /// Driver time (modelled or measured) from the step's begin to the end of its step-end
    /// policies, and the map / unmap / create calls in it (`None` where not counted).
    pub driver_time_s: f64,
    pub driver_maps: Option<u64>,
    pub driver_unmaps: Option<u64>,
    pub driver_creates: Option<u64>,
    /// The step's modelled GPU compute time (generated workloads only; see
    /// `workload::agent::time`).
    pub modelled_compute_s: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct RunReport {
    pub name: String,
    pub conf: String,
    pub ops: u64,
    /// The worst device's memory and driver figures (`worst_device`; the only device of a
    /// one-device run), under the same keys as a `DeviceReport`'s.
    #[serde(flatten)]
    pub worst: DeviceFigures,
    pub steps_count: u64,
    pub reserved_at_step_begin_mean: f64,
    pub reserved_at_step_end_mean: f64,
    /// Mean over timeline samples (every device summed) of reserved minus allocated bytes:
    /// what the cache holds through the run, not only at step boundaries.
    pub cached_free_mean: f64,
    /// Mean over step ends of the share of the free mapped bytes that the largest request the
    /// cache could serve without new device memory leaves unused (`fragmentation`): 1 - largest
    /// free block / free bytes, with `page_reuse` the whole pages of other free blocks counted
    /// toward that request.
    pub external_fragmentation_mean: f64,
    /// Mean over step ends of those unused bytes (every device's summed).
    pub stranded_free_at_step_end_mean: f64,
    /// Mean over timeline samples of 1 - requested / allocated.
    pub internal_fragmentation_mean: f64,
    /// Mean over steps of 1 - peak allocated / peak reserved.
    pub step_fragmentation_mean: f64,
    /// `worst.driver_time_s` per step (the whole run when it has no steps).
    pub driver_time_per_step_s: f64,
    /// Modelled GPU compute time of the steps run, summed (generated workloads only).
    pub modelled_step_time_s: Option<f64>,
    /// `driver_time_s` over `modelled_step_time_s` (the target: at most 1%). The driver
    /// time of the whole run (the weights' before the first step too) over the compute of its
    /// steps, the driver's own time not added to them: an upper bound of its share.
    pub driver_share_of_step: Option<f64>,
    pub alloc_retries: u64,
    pub ooms: u64,
    /// Frees skipped because their allocation had failed (OOM) or was never made.
    pub skipped_frees: u64,
    /// Calls the allocator refused for another reason than out of memory (should be 0).
    pub errors: u64,
    pub first_error: Option<String>,
    pub wall_s: f64,
    pub ops_per_s: f64,
    pub steps: Vec<StepReport>,
    pub timeline: Vec<Sample>,
    /// The moment device memory in use first reached its peak (`RunConfig::track_peak`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_moment: Option<PeakMoment>,
    /// What was live at that moment, grouped by call site or size class (trace replays).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_attribution: Option<Attribution>,
    /// The first allocation that ran out of memory, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_oom: Option<OomMoment>,
    /// Ordinals (0-based, ascending) of the allocations that ran out of memory: the replay
    /// skipped them, so they are not live in its attribution.
    #[serde(skip)]
    pub failed_allocs: Vec<u64>,
    /// With `--explain`: what held the reserved bytes at (within 1% of) their peak.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_explanation: Option<PeakExplanation>,
    /// Each device the run used, in device order. On several devices `worst` is the worst
    /// device's figures, not sums: a sum of per-device peaks is the peak of nothing. Counts of the run as a whole (ops,
    /// OOMs, alloc retries, skipped frees, errors, steps) and the means over steps and samples
    /// cover every device.
    pub devices: Vec<DeviceReport>,
    /// The device the headline figures are from: the highest peak reserved (then the highest
    /// floor, then the lowest number).
    pub worst_device: usize,
}

/// Which of several devices' figures stand for the run (or a step): the highest peak reserved,
/// then the highest peak requested, then the lowest device number. Items are
/// `(device, peak reserved, peak requested)`.
pub fn worst_device(devices: impl IntoIterator<Item = (usize, u64, u64)>) -> Option<usize> {
    devices.into_iter().max_by_key(|&(d, reserved, requested)| (reserved, requested, std::cmp::Reverse(d))).map(|w| w.0)
}

/// One device's figures over a run: its own peaks, tracked on that device as the run goes.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DeviceReport {
    pub device: usize,
    #[serde(flatten)]
    pub figures: DeviceFigures,
    pub alloc_retries: u64,
    /// Allocations on this device that ran out of memory.
    pub ooms: u64,
}

/// What one device's memory and driver work came to: its peaks, their ratios to its floor,
/// and its device and driver calls with their times. A `DeviceReport` holds its device's; a
/// `RunReport` its worst device's (the counts of a run as a whole, OOMs and retries, are the
/// run's own).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DeviceFigures {
    /// Peak live requested bytes (the physical floor), counted by the runner.
    pub floor: u64,
    /// The allocator's own peak of requested bytes (equals `floor` when the runner and the
    /// allocator see the same device).
    pub stats_peak_requested: u64,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    pub reserved_over_floor: f64,
    pub allocated_over_floor: f64,
    pub final_reserved: u64,
    pub device_mallocs: u64,
    pub device_frees: u64,
    /// Modelled (sim cost model) or measured time in device malloc / free.
    pub device_malloc_time_s: f64,
    pub device_free_time_s: f64,
    /// Driver virtual-memory calls (map / unmap / physical create), where the statistics have
    /// them (`None`: this build of the core does not count them).
    pub driver_maps: Option<u64>,
    pub driver_unmaps: Option<u64>,
    pub driver_creates: Option<u64>,
    /// Bytes of physical pages moved (remapped) instead of created, where counted.
    pub moved_bytes: Option<u64>,
    /// Modelled (sim cost model) or measured time in every timed driver call.
    pub driver_time_s: f64,
}

/// Where the reserved bytes sat at the peak: live blocks, free space inside segments that hold
/// live blocks, and whole free (cached, releasable) segments by size.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PeakExplanation {
    pub device: usize,
    pub reserved: u64,
    pub allocated: u64,
    /// Live requested bytes on all devices at that moment.
    pub requested: u64,
    pub segments: u64,
    /// Free bytes inside segments that also hold live blocks (not releasable without moving data).
    pub free_in_used_segments: u64,
    pub whole_free_segments: u64,
    pub whole_free_bytes: u64,
    /// The most common sizes of whole free segments: (size in bytes, count), largest total first.
    pub whole_free_by_size: Vec<(u64, u64)>,
}

impl RunReport {
    /// Sets the modelled compute time of the steps run from `per_step` (one entry per step
    /// generated, in order; extra entries of steps not run are ignored) and the driver's share
    /// of it. Nothing when the workload has no time model.
    pub fn set_step_compute(&mut self, per_step: &[f64]) {
        if per_step.is_empty() {
            return;
        }
        for (step, &t) in self.steps.iter_mut().zip(per_step) {
            step.modelled_compute_s = Some(t);
        }
        let total: f64 = per_step.iter().take(self.steps.len()).sum();
        self.modelled_step_time_s = Some(total);
        self.driver_share_of_step = (total > 0.0).then(|| self.worst.driver_time_s / total);
    }
}

impl PeakExplanation {
    /// Builds the description from the heap's segments (address, size, small) and live blocks
    /// (address, block size, requested, stream).
    pub fn of(
        device: usize,
        stats: &stepalloc::DeviceStats,
        requested: u64,
        mut segments: Vec<(u64, u64, bool)>,
        live: &[(u64, u64, u64, stepalloc::Stream)],
    ) -> PeakExplanation {
        segments.sort_unstable();
        let mut used = vec![0u64; segments.len()];
        for &(addr, size, _, _) in live {
            // The segment holding the block: the last one starting at or below its address.
            let i = segments.partition_point(|s| s.0 <= addr);
            if i > 0 {
                used[i - 1] += size;
            }
        }
        let mut e = PeakExplanation {
            device,
            reserved: stats.heap.reserved_bytes.all.current,
            allocated: stats.heap.allocated_bytes.all.current,
            requested,
            segments: segments.len() as u64,
            ..Default::default()
        };
        let mut by_size = std::collections::BTreeMap::<u64, u64>::new();
        for (seg, &u) in segments.iter().zip(&used) {
            if u == 0 {
                e.whole_free_segments += 1;
                e.whole_free_bytes += seg.1;
                *by_size.entry(seg.1).or_default() += 1;
            } else {
                e.free_in_used_segments += seg.1.saturating_sub(u);
            }
        }
        let mut sizes: Vec<(u64, u64)> = by_size.into_iter().collect();
        sizes.sort_by_key(|&(size, n)| std::cmp::Reverse(size * n));
        sizes.truncate(6);
        e.whole_free_by_size = sizes;
        e
    }

    pub fn describe(&self, name: &str) -> String {
        let sizes: Vec<String> =
            self.whole_free_by_size.iter().map(|(size, n)| format!("{n} x {} MiB", size >> 20)).collect();
        format!(
            "{name}: at peak reserved {} GiB on device {}: allocated {} GiB (requested {} GiB); {} GiB free inside \
             segments holding live blocks; {} whole free segments = {} GiB ({})",
            gib(self.reserved),
            self.device,
            gib(self.allocated),
            gib(self.requested),
            gib(self.free_in_used_segments),
            self.whole_free_segments,
            gib(self.whole_free_bytes),
            if sizes.is_empty() { "none".to_string() } else { sizes.join(", ") }
        )
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub workload: String,
    pub source: SourceNotes,
    /// Seconds spent generating or parsing the event stream.
    pub parse_s: f64,
    pub runs: Vec<RunReport>,
}

impl Report {
    /// The report as JSON; `timeline` and per-step figures only when asked for.
    pub fn to_json(&self, per_step: bool, timeline: bool) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        if let Some(runs) = v.get_mut("runs").and_then(|r| r.as_array_mut()) {
            for run in runs {
                if let Some(obj) = run.as_object_mut() {
                    if !per_step {
                        obj.remove("steps");
                    }
                    if !timeline {
                        obj.remove("timeline");
                    }
                }
            }
        }
        v
    }
}

/// Removes the wall-clock fields from a JSON report (for comparing two runs).
pub fn without_wall_clock(mut v: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = v.as_object_mut() {
        obj.remove("parse_s");
    }
    if let Some(runs) = v.get_mut("runs").and_then(|r| r.as_array_mut()) {
        for run in runs {
            if let Some(obj) = run.as_object_mut() {
                obj.remove("wall_s");
                obj.remove("ops_per_s");
            }
        }
    }
    v
}

pub fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 30) as f64)
}

/// A size for a sentence: GiB with two decimals from 1 GiB, else MiB with one.
pub fn size(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{} GiB", gib(bytes))
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// Device calls a run made: device mallocs and frees (maps and unmaps with expandable segments).
pub fn device_calls(r: &RunReport) -> u64 {
    r.worst.device_mallocs.saturating_add(r.worst.device_frees)
}

/// Whether a run went through: no out-of-memory and no refused call.
pub fn fits(r: &RunReport) -> bool {
    r.ooms == 0 && r.errors == 0
}

/// The best of `runs` (each with its index), by index: the lowest peak reserved that fits, ties
/// broken by fewer device calls; when none fits, the fewest out-of-memory events, then the
/// lowest peak.
pub fn best(runs: &[(usize, &RunReport)]) -> Option<usize> {
    runs.iter().min_by_key(|(_, r)| (!fits(r), r.ooms, r.worst.peak_reserved, device_calls(r))).map(|&(i, _)| i)
}

/// A count the statistics may not have: `-` when absent.
fn opt(v: Option<u64>) -> String {
    v.map_or("-".into(), |v| v.to_string())
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// The line under the table that says what its external fragmentation row measures.
pub const EXTERNAL_FRAGMENTATION_NOTE: &str =
    "external fragmentation: of the free mapped bytes at step ends, the share \
     the largest request the cache could serve without new device memory leaves unused (1 - largest free block / \
     free bytes; under page_reuse the whole free pages of other blocks count toward that request, as they are mapped \
     where it needs them; unmapped address space is not counted)";

/// The side-by-side table of every run.
pub fn table(report: &Report) -> String {
    table_with(report, None)
}

/// The side-by-side table of every run, with `verdict` (`verdict::verdict`) as the line under it.
pub fn table_with(report: &Report, verdict: Option<&str>) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    let mut header = vec!["".to_string()];
    header.extend(report.runs.iter().map(|r| r.name.clone()));
    t.set_header(header);
    type Row = (&'static str, fn(&RunReport) -> String);
    let rows: &[Row] = &[
        ("peak requested (floor), GiB", |r| gib(r.worst.floor)),
        ("peak allocated, GiB", |r| gib(r.worst.peak_allocated)),
        ("peak reserved, GiB", |r| gib(r.worst.peak_reserved)),
        ("reserved / floor", |r| format!("{:.3}x", r.worst.reserved_over_floor)),
        ("reserved at step begin (mean), GiB", |r| gib(r.reserved_at_step_begin_mean as u64)),
        ("reserved at step end (mean), GiB", |r| gib(r.reserved_at_step_end_mean as u64)),
        ("cached free (mean over the run), GiB", |r| gib(r.cached_free_mean as u64)),
        ("external fragmentation (step ends)", |r| pct(r.external_fragmentation_mean)),
        ("internal fragmentation", |r| pct(r.internal_fragmentation_mean)),
        ("step fragmentation", |r| pct(r.step_fragmentation_mean)),
        ("device mallocs / frees", |r| format!("{} / {}", r.worst.device_mallocs, r.worst.device_frees)),
        ("device malloc / free time, ms", |r| {
            format!("{:.1} / {:.1}", r.worst.device_malloc_time_s * 1e3, r.worst.device_free_time_s * 1e3)
        }),
        ("driver maps / unmaps / creates", |r| {
            format!("{} / {} / {}", opt(r.worst.driver_maps), opt(r.worst.driver_unmaps), opt(r.worst.driver_creates))
        }),
        ("moved bytes, GiB", |r| r.worst.moved_bytes.map_or("-".into(), gib)),
        ("driver time per step, ms", |r| format!("{:.2}", r.driver_time_per_step_s * 1e3)),
        ("driver % of step (modelled compute)", |r| {
            r.driver_share_of_step.map_or("-".into(), |x| format!("{:.2}%", x * 100.0))
        }),
        ("alloc retries (OOM path ran)", |r| r.alloc_retries.to_string()),
        ("OOMs", |r| r.ooms.to_string()),
        ("steps", |r| r.steps_count.to_string()),
        ("ops", |r| r.ops.to_string()),
        ("throughput, Mops/s", |r| format!("{:.2}", r.ops_per_s / 1e6)),
    ];
    for (label, f) in rows {
        let mut row = vec![label.to_string()];
        row.extend(report.runs.iter().map(f));
        t.add_row(row);
    }
    for (i, column) in t.column_iter_mut().enumerate() {
        if i > 0 {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    let mut out = format!("workload: {}\n", report.workload);
    let n = &report.source;
    if n.unknown_frees + n.duplicate_allocs + n.ignored_events + n.recorded_failures > 0 {
        let _ = writeln!(
            out,
            "trace: {} frees of unknown addresses skipped, {} duplicate allocations, {} other events ignored, {} failures recorded",
            n.unknown_frees, n.duplicate_allocs, n.ignored_events, n.recorded_failures
        );
    }
    if let Some(native) = &n.native {
        let _ = writeln!(
            out,
            "{} in this snapshot: peak reserved {} GiB, reserved at snapshot {} GiB ({} segment allocs, {} segment frees)",
            native.allocator,
            native.peak_reserved.map_or("?".into(), gib),
            native.current_reserved.map_or("?".into(), gib),
            native.segment_allocs,
            native.segment_frees
        );
    }
    let devices = report.runs.iter().map(|r| r.devices.len()).max().unwrap_or(0);
    if devices > 1 {
        let _ = writeln!(
            out,
            "{devices} devices: each column is its worst device (the highest peak reserved); every device below"
        );
    }
    out.push_str(&t.to_string());
    out.push('\n');
    if let Some(verdict) = verdict {
        let _ = writeln!(out, "{verdict}");
    }
    out.push_str(EXTERNAL_FRAGMENTATION_NOTE);
    out.push('\n');
    for r in &report.runs {
        let _ = writeln!(out, "  {} = `{}`", r.name, r.conf);
    }
    for r in report.runs.iter().filter(|r| r.devices.len() > 1) {
        out.push_str(&device_table(r));
    }
    for r in &report.runs {
        if let Some(e) = &r.peak_explanation {
            let _ = writeln!(out, "{}", e.describe(&r.name));
        }
    }
    for r in &report.runs {
        if let Some(a) = &r.peak_attribution {
            out.push_str(&a.describe(&r.name));
        }
    }
    for r in &report.runs {
        if let Some(e) = &r.first_error {
            let _ = writeln!(out, "{}: {} refused calls; first: {e}", r.name, r.errors);
        }
    }
    out
}

/// Per-device table of one run (its worst device marked).
pub fn device_table(run: &RunReport) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "device",
        "floor GiB",
        "peak alloc GiB",
        "peak resv GiB",
        "resv / floor",
        "dev mallocs / frees",
        "maps/unmaps/creates",
        "driver ms / step",
        "OOMs",
    ]);
    for d in &run.devices {
        let device = if d.device == run.worst_device { format!("{} (worst)", d.device) } else { d.device.to_string() };
        t.add_row(vec![
            device,
            gib(d.figures.floor),
            gib(d.figures.peak_allocated),
            gib(d.figures.peak_reserved),
            format!("{:.3}x", d.figures.reserved_over_floor),
            format!("{} / {}", d.figures.device_mallocs, d.figures.device_frees),
            format!(
                "{}/{}/{}",
                opt(d.figures.driver_maps),
                opt(d.figures.driver_unmaps),
                opt(d.figures.driver_creates)
            ),
            format!("{:.2}", d.figures.driver_time_s / run.steps_count.max(1) as f64 * 1e3),
            d.ooms.to_string(),
        ]);
    }
    for (i, column) in t.column_iter_mut().enumerate() {
        if i > 0 {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    format!("per device: {}\n{t}\n", run.name)
}

/// Per-step table of one run.
pub fn step_table(run: &RunReport) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "step",
        "phase",
        "floor GiB",
        "peak alloc GiB",
        "peak resv GiB",
        "resv begin GiB",
        "resv end GiB",
        "dev mallocs",
        "frag",
        "OOMs",
        "maps/unmaps/creates",
        "driver ms",
    ]);
    for s in &run.steps {
        t.add_row(vec![
            s.step.to_string(),
            s.phase.clone(),
            gib(s.peak_requested),
            gib(s.peak_allocated),
            gib(s.peak_reserved),
            gib(s.reserved_at_begin),
            gib(s.reserved_at_end),
            s.device_mallocs.to_string(),
            pct(s.fragmentation),
            s.ooms.to_string(),
            format!("{}/{}/{}", opt(s.driver_maps), opt(s.driver_unmaps), opt(s.driver_creates)),
            format!("{:.2}", s.driver_time_s * 1e3),
        ]);
    }
    format!("per step: {}\n{t}\n", run.name)
}

/// Reserved / allocated / requested over time, one panel per configuration, same scales.
pub fn svg(report: &Report) -> String {
    const W: f64 = 900.0;
    const PANEL_H: f64 = 180.0;
    const LEFT: f64 = 70.0;
    const RIGHT: f64 = 20.0;
    const TOP: f64 = 40.0;
    const GAP: f64 = 50.0;
    let runs = &report.runs;
    let max_y =
        runs.iter().flat_map(|r| r.timeline.iter()).map(|s| s.reserved.max(s.allocated)).max().unwrap_or(1).max(1)
            as f64;
    let max_x = runs.iter().flat_map(|r| r.timeline.iter()).map(|s| s.op).max().unwrap_or(1).max(1) as f64;
    let height = TOP + runs.len() as f64 * (PANEL_H + GAP) + 10.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="20" font-size="14">{}: reserved (blue), allocated (orange), requested (black) over events, GiB</text>"#,
        xml_escape(&report.workload)
    );
    for (i, run) in runs.iter().enumerate() {
        let y0 = TOP + i as f64 * (PANEL_H + GAP);
        let sx = |op: u64| LEFT + op as f64 / max_x * (W - LEFT - RIGHT);
        let sy = |b: u64| y0 + PANEL_H - b as f64 / max_y * PANEL_H;
        let _ = writeln!(
            out,
            r#"<text x="{LEFT}" y="{:.1}" font-weight="bold">{} — peak reserved {} GiB, {:.3}x floor</text>"#,
            y0 - 6.0,
            xml_escape(&run.name),
            gib(run.worst.peak_reserved),
            run.worst.reserved_over_floor
        );
        let _ = writeln!(
            out,
            r##"<rect x="{LEFT}" y="{y0}" width="{:.1}" height="{PANEL_H}" fill="none" stroke="#999"/>"##,
            W - LEFT - RIGHT
        );
        for k in 0..=4 {
            let b = (max_y * k as f64 / 4.0) as u64;
            let _ = writeln!(
                out,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
                LEFT - 6.0,
                sy(b) + 4.0,
                gib(b)
            );
        }
        let series: [Series; 3] =
            [("#1f77b4", |s| s.reserved), ("#ff7f0e", |s| s.allocated), ("#000000", |s| s.requested)];
        for (color, f) in series {
            let mut points = String::new();
            for s in &run.timeline {
                let _ = write!(points, "{:.1},{:.1} ", sx(s.op), sy(f(s)));
            }
            let _ = writeln!(
                out,
                r#"<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{}"/>"#,
                points.trim_end()
            );
        }
        if let Some(peak) = &run.peak_moment {
            // The peak, marked with what held most of it.
            let x = sx(peak.op);
            let top = run.peak_attribution.as_ref().and_then(|a| a.groups.first());
            let label = match top {
                Some(g) => format!("peak: {} GiB; top: {} ({} MiB)", gib(peak.device_used), g.site, g.bytes >> 20),
                None => format!("peak: {} GiB", gib(peak.device_used)),
            };
            let anchor = if x > W / 2.0 { "end" } else { "start" };
            let _ = writeln!(
                out,
                r##"<line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{:.1}" stroke="#d62728" stroke-dasharray="4 3"/>"##,
                y0 + PANEL_H
            );
            let _ = writeln!(
                out,
                r##"<text class="peak" x="{:.1}" y="{:.1}" text-anchor="{anchor}" fill="#d62728">{}</text>"##,
                if anchor == "end" { x - 4.0 } else { x + 4.0 },
                y0 + 14.0,
                xml_escape(&label)
            );
        }
    }
    out.push_str("</svg>\n");
    out
}

/// A timeline line: its colour and the figure it draws.
type Series = (&'static str, fn(&Sample) -> u64);

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// When a device's memory in use first reached the run's peak, and how its pools stood.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PeakMoment {
    /// Index of the allocation event (in the event stream) that reached the peak.
    pub op: u64,
    /// Memory in use then on the device that reached it (reserved bytes, as the simulated
    /// device counts them): the highest any one device reached in the run.
    pub device_used: u64,
    /// That device.
    pub device: usize,
    /// The step in progress (0-based, counting steps of every phase) and its phase, if any.
    pub step: Option<u64>,
    pub phase: Option<String>,
    /// That device's pools at that moment.
    pub small: PoolFigures,
    pub large: PoolFigures,
}

/// The first allocation that ran out of memory in a run, and the device's state when the
/// allocator gave up: after its out-of-memory path (free cached blocks, retry), the moment
/// PyTorch's own error message describes.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct OomMoment {
    /// Index of the event in the stream, and the allocation's ordinal among allocations
    /// (0-based, failed ones counted).
    pub op: u64,
    pub alloc: u64,
    pub size: u64,
    pub stream: u64,
    pub device: usize,
    /// The step in progress (1-based, counting steps of every phase) and its phase, if any.
    pub step: Option<u64>,
    pub phase: Option<String>,
    pub allocated: u64,
    pub reserved: u64,
    /// The device's free memory as the allocator read it.
    pub device_free: u64,
    pub largest_free_block: u64,
}

/// Current reserved / allocated / requested bytes of one pool.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PoolFigures {
    pub reserved: u64,
    pub allocated: u64,
    pub requested: u64,
}

impl PoolFigures {
    /// Reserved bytes beyond what the live requests asked for.
    pub fn excess(&self) -> u64 {
        self.reserved.saturating_sub(self.requested)
    }
}

/// Live allocations at the peak, grouped by where they were made: the top user frame when the
/// trace recorded call stacks, the module when it recorded modules, else the size class (a
/// power-of-two range).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Attribution {
    /// Whether the trace recorded sites, call stacks or modules (false: groups are size
    /// classes).
    pub frames_recorded: bool,
    /// How the groups are made: "by call site (top user frame)", "by module" or "by size class".
    pub grouping: String,
    pub live_bytes: u64,
    pub live_count: u64,
    /// The largest groups by bytes, largest first.
    pub groups: Vec<AttributionGroup>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct AttributionGroup {
    /// `file:line name` of the top user frame, or the size class (`[1 MiB, 2 MiB)`).
    pub site: String,
    pub bytes: u64,
    pub count: u64,
}

impl Attribution {
    /// One line per group, `  bytes in count allocations: site`.
    pub fn describe(&self, name: &str) -> String {
        let what = if self.frames_recorded {
            self.grouping.as_str()
        } else {
            "by size class (frames were not recorded in the trace)"
        };
        let mut out = format!(
            "{name}: live at the peak: {} GiB in {} allocations, {what}:\n",
            gib(self.live_bytes),
            self.live_count
        );
        for g in &self.groups {
            let _ = writeln!(out, "  {:>10} MiB  {:>7} allocs  {}", format!("{:.1}", mib(g.bytes)), g.count, g.site);
        }
        out
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}
