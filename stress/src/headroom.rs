//! Headroom: for each configuration, the largest scale of an `agent` workload that runs without
//! out-of-memory on a simulated device of a given capacity.
//!
//! The scale is a factor on the preset's batch dimensions (`rollout_batch`, `sft_batch`), its
//! sequence dimensions (`prompt_median`, `prompt_max`, `observation_median`, `response_min`,
//! `response_max`) or both (`Dimension`); scaled values are rounded and never below 1. The
//! search brackets the answer by doubling (or halving) from scale 1 within
//! [`MIN_SCALE`, `max_scale`], then bisects a fixed number of times (`probes`), so every
//! configuration costs the same bounded number of runs. Each run stops at its first
//! out-of-memory. Invariant of the result: the workload at `scale` ran without out-of-memory,
//! and the one at `fails_at` (when present) did not.

use crate::compare::Base;
use crate::replay::{self, RunConfig};
use crate::workload::agent::{self, AgentSpec};
use comfy_table::{presets::UTF8_FULL_CONDENSED, CellAlignment, Table};
use serde::Serialize;
use std::fmt::Write as _;

/// The smallest scale tried: below it the headroom is reported as 0.
pub const MIN_SCALE: f64 = 1.0 / 64.0;

/// The largest `--max-scale` (scaled dimensions must still pass `AgentSpec::validate`).
pub const MAX_SCALE: f64 = 1024.0;
/// The most bisection steps (each halves the uncertainty: 52 exhaust an f64).
pub const MAX_PROBES: u32 = 52;

/// Which dimensions the scale multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Dimension {
    /// Episodes per rollout and sequences per SFT micro-batch.
    Batch,
    /// Prompt, observation and response lengths.
    Sequence,
    /// Both (memory grows faster than the scale).
    Both,
}

/// `headroom`'s own flags (the workload flags are `AgentArgs`).
#[derive(Clone, Debug, clap::Args)]
pub struct HeadroomArgs {
    /// Which dimensions the scale multiplies.
    #[arg(long, value_enum, default_value = "batch")]
    pub dimension: Dimension,
    /// The largest scale tried.
    #[arg(long, default_value_t = 16.0)]
    pub max_scale: f64,
    /// Bisection steps after the bracket is found (each halves the uncertainty).
    #[arg(long, default_value_t = 6)]
    pub probes: u32,
}

impl Default for HeadroomArgs {
    fn default() -> HeadroomArgs {
        HeadroomArgs { dimension: Dimension::Batch, max_scale: 16.0, probes: 6 }
    }
}

/// `spec` with its `dimension` multiplied by `scale` (rounded, at least 1).
pub fn scaled(spec: &AgentSpec, scale: f64, dimension: Dimension) -> AgentSpec {
    let f = |v: u64| ((v as f64 * scale).round() as u64).max(1);
    let mut s = spec.clone();
    if matches!(dimension, Dimension::Batch | Dimension::Both) {
        s.rollout_batch = f(s.rollout_batch);
        s.sft_batch = f(s.sft_batch);
    }
    if matches!(dimension, Dimension::Sequence | Dimension::Both) {
        s.prompt_median = f(s.prompt_median);
        s.prompt_max = f(s.prompt_max);
        s.observation_median = f(s.observation_median);
        s.response_min = f(s.response_min);
        s.response_max = f(s.response_max);
    }
    s
}

/// One run of the search.
#[derive(Clone, Debug, Serialize)]
pub struct Probe {
    pub scale: f64,
    pub fits: bool,
    /// Peak reserved bytes (up to the first out-of-memory when it did not fit).
    pub peak_reserved: u64,
    /// Peak live requested bytes (idem).
    pub floor: u64,
}

/// The headroom of one configuration.
#[derive(Clone, Debug, Serialize)]
pub struct HeadroomRow {
    pub name: String,
    pub conf: String,
    /// The largest scale that ran without out-of-memory (0 when even `MIN_SCALE` did not).
    pub scale: f64,
    /// The smallest scale seen to run out of memory; `None` when `max_scale` fit.
    pub fails_at: Option<f64>,
    /// The dimensions at `scale`, for reproducing it with `agent`.
    pub rollout_batch: u64,
    pub sft_batch: u64,
    pub prompt_median: u64,
    /// Figures of the run at `scale`.
    pub peak_reserved: u64,
    pub floor: u64,
    /// Calls refused for another reason than out of memory, over every probe (should be 0).
    pub errors: u64,
    pub probes: Vec<Probe>,
}

#[derive(Clone, Debug, Serialize)]
pub struct HeadroomReport {
    pub workload: String,
    pub capacity_mb: u64,
    pub dimension: Dimension,
    pub max_scale: f64,
    pub rows: Vec<HeadroomRow>,
}

/// Runs the search for every configuration.
pub fn run(
    spec: &AgentSpec,
    args: &HeadroomArgs,
    base: &Base,
    configs: &[RunConfig],
) -> Result<HeadroomReport, String> {
    if base.cuda {
        return Err("headroom runs on the simulated device only (--backend sim)".into());
    }
    if !(1.0..=MAX_SCALE).contains(&args.max_scale) {
        return Err(format!("--max-scale {} is out of range: accepted 1..={MAX_SCALE}", args.max_scale));
    }
    if args.probes > MAX_PROBES {
        return Err(format!("--probes {} is out of range: accepted 0..={MAX_PROBES}", args.probes));
    }
    let mut rows = Vec::new();
    for rc in configs {
        rows.push(search(spec, args, rc)?);
    }
    Ok(HeadroomReport {
        workload: format!("agent {} (seed {}, {} iterations)", spec.preset, spec.seed, spec.iterations),
        capacity_mb: base.capacity_mb,
        dimension: args.dimension,
        max_scale: args.max_scale,
        rows,
    })
}

fn probe(spec: &AgentSpec, args: &HeadroomArgs, rc: &RunConfig, scale: f64) -> Result<(Probe, u64), String> {
    let program =
        agent::generate(&scaled(spec, scale, args.dimension)).map_err(|e| format!("at scale {scale}: {e}"))?;
    let rc = RunConfig { stop_at_first_oom: true, explain: false, ..rc.clone() };
    let run = replay::run(&program, &rc, None, None)?;
    Ok((
        Probe { scale, fits: run.ooms == 0, peak_reserved: run.worst.peak_reserved, floor: run.worst.floor },
        run.errors,
    ))
}

fn search(spec: &AgentSpec, args: &HeadroomArgs, rc: &RunConfig) -> Result<HeadroomRow, String> {
    let mut probes = Vec::new();
    let mut errors = 0;
    let mut try_scale = |scale: f64, probes: &mut Vec<Probe>| -> Result<bool, String> {
        let (p, e) = probe(spec, args, rc, scale)?;
        errors += e;
        let fits = p.fits;
        probes.push(p);
        Ok(fits)
    };
    // Bracket: `good` fits, `bad` does not.
    let (mut good, mut bad): (Option<f64>, Option<f64>) = (None, None);
    let mut s = 1.0f64;
    if try_scale(s, &mut probes)? {
        good = Some(s);
        while s < args.max_scale {
            s = (s * 2.0).min(args.max_scale);
            if try_scale(s, &mut probes)? {
                good = Some(s);
            } else {
                bad = Some(s);
                break;
            }
        }
    } else {
        bad = Some(s);
        while s > MIN_SCALE {
            s = (s / 2.0).max(MIN_SCALE);
            if try_scale(s, &mut probes)? {
                good = Some(s);
                break;
            }
            bad = Some(s);
        }
    }
    if let (Some(mut lo), Some(mut hi)) = (good, bad) {
        for _ in 0..args.probes {
            let mid = (lo + hi) / 2.0;
            if try_scale(mid, &mut probes)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        good = Some(lo);
        bad = Some(hi);
    }
    let scale = good.unwrap_or(0.0);
    let at = scaled(spec, scale.max(MIN_SCALE), args.dimension);
    let best = probes.iter().find(|p| p.fits && p.scale == scale);
    Ok(HeadroomRow {
        name: rc.name.clone(),
        conf: rc.conf.clone(),
        scale,
        fails_at: bad,
        rollout_batch: if good.is_some() { at.rollout_batch } else { 0 },
        sft_batch: if good.is_some() { at.sft_batch } else { 0 },
        prompt_median: if good.is_some() { at.prompt_median } else { 0 },
        peak_reserved: best.map_or(0, |p| p.peak_reserved),
        floor: best.map_or(0, |p| p.floor),
        errors,
        probes,
    })
}

/// The headroom table: one row per configuration.
pub fn table(report: &HeadroomReport) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "configuration",
        "headroom (scale)",
        "vs first",
        "fails at",
        "rollout batch",
        "SFT batch",
        "prompt median",
        "peak reserved GiB",
        "floor GiB",
        "runs",
    ]);
    let first = report.rows.first().map_or(0.0, |r| r.scale);
    for r in &report.rows {
        let capped = if r.fails_at.is_none() { "≥ " } else { "" };
        t.add_row(vec![
            r.name.clone(),
            format!("{capped}{:.3}", r.scale),
            if first > 0.0 { format!("{:.2}x", r.scale / first) } else { "-".into() },
            r.fails_at.map_or("-".into(), |f| format!("{f:.3}")),
            r.rollout_batch.to_string(),
            r.sft_batch.to_string(),
            r.prompt_median.to_string(),
            crate::report::gib(r.peak_reserved),
            crate::report::gib(r.floor),
            r.probes.len().to_string(),
        ]);
    }
    for (i, column) in t.column_iter_mut().enumerate() {
        if i > 0 {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    let mut out = format!(
        "headroom: {} on a simulated {} MiB device, scaling {:?} dimensions (at most {}x)\n",
        report.workload, report.capacity_mb, report.dimension, report.max_scale
    );
    out.push_str(&t.to_string());
    out.push('\n');
    for r in &report.rows {
        let _ = writeln!(out, "  {} = `{}`", r.name, r.conf);
        if r.errors > 0 {
            let _ = writeln!(out, "  {}: {} refused calls (not out of memory) during the search", r.name, r.errors);
        }
    }
    out
}
