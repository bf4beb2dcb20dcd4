//! `stepalloc-stress advise TRACE`: which allocator settings to use, from the user's own trace.
//!
//! The trace is parsed once; the runs share it (`&Program`) and go in parallel, one thread per
//! core, pulling configurations from a shared counter. The search has two passes: a coarse one
//! over each PyTorch key alone (`max_split_size_mb`, `roundup_power2_divisions`,
//! `garbage_collection_threshold`, `expandable_segments`) plus stepalloc's configurations, then
//! the best native setting combined with the other keys' values. PyTorch's rules are replayed
//! with `exact_fit:True`, as the `pytorch` preset does (see `compare`).
//!
//! "Best" is the lowest peak reserved that does not run out of memory at the capacity, ties
//! broken by fewer device calls (`num_device_alloc + num_device_free`). Each winner is explained
//! from its own replay: the moment device memory first reached its peak (`PeakMoment`: the pool
//! holding the most reserved bytes over requested, the step and phase in progress), what gave
//! memory back, and which allocations were live then (`attribute`: by call site when the trace
//! recorded frames, else by size class).

use crate::compare::{self, Base};
use crate::ops::{Op, Program};
use crate::replay::{self, RunConfig};
use crate::report::{
    best, device_calls, fits, gib, size, Attribution, AttributionGroup, DeviceReport, PeakMoment, Report, RunReport,
};
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use indicatif::ProgressBar;
use serde::Serialize;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// The largest capacity the simulated device takes (`sim_capacity_mb` at most 2^24 MiB).
pub const MAX_CAPACITY_GB: f64 = 16384.0;
/// Groups of live allocations reported per configuration.
pub const TOP_GROUPS: usize = 8;

/// PyTorch's keys searched, each value alone in the first pass.
const NATIVE_COARSE: &[&str] = &[
    "",
    "expandable_segments:True",
    "max_split_size_mb:64",
    "max_split_size_mb:128",
    "max_split_size_mb:256",
    "max_split_size_mb:512",
    "roundup_power2_divisions:2",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:8",
    "garbage_collection_threshold:0.6",
    "garbage_collection_threshold:0.8",
];

/// stepalloc's configurations searched (`STEPALLOC_CONF`).
const STEPALLOC_CANDIDATES: &[&str] = &[
    compare::STEPALLOC_BEST,
    "expandable_segments:True,large_segment_size_mb:2,page_reuse:True,page_release:True",
    "expandable_segments:True,page_reuse:True",
    "expandable_segments:True,page_reuse:True,page_release:True",
    "expandable_segments:True,large_segment_size_mb:2",
    "",
    "phase_trim:True",
    "release_idle_steps:1",
];

/// Which allocator a configuration is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// PyTorch's native allocator (`PYTORCH_CUDA_ALLOC_CONF`).
    Native,
    /// stepalloc (`STEPALLOC_CONF`).
    Stepalloc,
}

impl Family {
    pub fn variable(self) -> &'static str {
        match self {
            Family::Native => "PYTORCH_CUDA_ALLOC_CONF",
            Family::Stepalloc => "STEPALLOC_CONF",
        }
    }
}

/// The device the search is for, and where its size came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Capacity {
    pub mb: u64,
    pub source: String,
}

/// `--capacity-gb`, checked: a finite number of GiB in (0, `MAX_CAPACITY_GB`], at least 1 MiB.
/// Errors quote the flag as it was typed (cut short), not the number it parsed to: `1e300`
/// would print 301 digits.
pub fn capacity_from_gb(text: &str) -> Result<Capacity, String> {
    let shown = || -> String {
        let cut: String = text.chars().take(32).flat_map(char::escape_debug).collect();
        if text.chars().count() > 32 {
            format!("{cut}...")
        } else {
            cut
        }
    };
    let range = format!("expected GiB of device memory in (0, {MAX_CAPACITY_GB}] (the simulated device's limit)");
    let gb: f64 = text.trim().parse().map_err(|_| format!("--capacity-gb `{}`: not a number; {range}", shown()))?;
    if !(gb.is_finite() && gb > 0.0 && gb <= MAX_CAPACITY_GB) {
        return Err(format!("--capacity-gb `{}`: out of range; {range}", shown()));
    }
    let mb = (gb * 1024.0).round() as u64;
    if mb == 0 {
        return Err(format!("--capacity-gb `{}`: below 1 MiB; {range}", shown()));
    }
    Ok(Capacity { mb, source: "--capacity-gb".into() })
}

/// One configuration's result, as `advise` reports it.
#[derive(Clone, Debug, Serialize)]
pub struct Choice {
    pub family: Family,
    /// The setting as the user would write it in `variable` (empty: the defaults).
    pub setting: String,
    /// `VARIABLE=setting`, ready for a shell.
    pub env: String,
    pub peak_reserved: u64,
    /// Device bytes still free at the peak: capacity - peak reserved (0 when it does not fit).
    pub headroom_bytes: u64,
    /// No out-of-memory at the capacity.
    pub fits: bool,
    pub device_calls: u64,
    pub device_mallocs: u64,
    pub device_frees: u64,
    pub driver_unmaps: Option<u64>,
    pub ooms: u64,
    pub peak_allocated: u64,
    /// Peak live requested bytes (the same for every configuration).
    pub floor: u64,
    pub reserved_at_step_end_mean: f64,
    pub peak: Option<PeakMoment>,
    pub attribution: Option<Attribution>,
    /// The device the figures above are of: the worst (highest peak reserved) of a trace with
    /// several devices, each of which replays on its own simulated device of the capacity.
    pub worst_device: usize,
    /// Every device's own figures (one entry for a one-device trace).
    pub devices: Vec<DeviceReport>,
}

/// What `advise` found.
#[derive(Clone, Debug, Serialize)]
pub struct Advice {
    pub trace: String,
    pub format: String,
    pub events: u64,
    pub frames_recorded: bool,
    pub capacity_bytes: u64,
    pub capacity_source: String,
    /// The recording allocator's own peak reserved, when the snapshot holds segment events.
    pub recorded_peak_reserved: Option<u64>,
    /// The user's setting as recorded (`allocator_settings`), `None` when not recorded.
    pub recorded_setting: Option<String>,
    /// How the current setting is labelled ("PyTorch default (not recorded)", ...).
    pub current_label: String,
    pub current: Choice,
    pub pytorch_default: Choice,
    pub best_native: Choice,
    pub best_stepalloc: Choice,
    pub explanation_native: String,
    pub explanation_stepalloc: String,
    /// Configurations replayed, and the search's wall time.
    pub candidates: u64,
    pub search_s: f64,
    /// Every configuration replayed: (family, setting, peak reserved, device calls, OOMs).
    pub all: Vec<Summary>,
    /// Why the recorded setting was not replayed, if it was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub family: Family,
    pub setting: String,
    pub peak_reserved: u64,
    pub device_calls: u64,
    pub ooms: u64,
}

/// A configuration to replay.
struct Candidate {
    family: Family,
    setting: String,
}

impl Candidate {
    /// The full run configuration (PyTorch's rules take exact fits, as the `pytorch` preset).
    fn run_config(&self, base: &Base) -> Result<RunConfig, String> {
        let conf = match (self.family, self.setting.is_empty()) {
            (Family::Native, true) => "exact_fit:True".to_string(),
            (Family::Native, false) => format!("exact_fit:True,{}", self.setting),
            (Family::Stepalloc, _) => self.setting.clone(),
        };
        // A raw configuration (no `=`, never a preset name), named after the user's variable.
        let mut rc = compare::resolve_one(&conf, base)?;
        rc.name = format!("{}={}", self.family.variable(), self.setting);
        rc.track_peak = true;
        Ok(rc)
    }
}

/// The recorded `PYTORCH_CUDA_ALLOC_CONF` as the replay takes it: without `backend` (the
/// replay's device is always the simulated one; `backend:native` is PyTorch's own allocator).
/// Another backend (`cudaMallocAsync`, CUDA's allocator) is not modelled: an error saying so.
fn replayable(recorded: &str) -> Result<String, String> {
    let mut keys = Vec::new();
    for kv in recorded.split(',').map(str::trim).filter(|kv| !kv.is_empty()) {
        match kv.split_once(':') {
            Some((k, v)) if k.trim() == "backend" => {
                if v.trim() != "native" {
                    return Err(format!(
                        "the recorded PYTORCH_CUDA_ALLOC_CONF `{recorded}` uses backend `{}`, which the replay does \
                         not model (only PyTorch's native caching allocator); PyTorch's default stands in for it",
                        v.trim()
                    ));
                }
            }
            _ => keys.push(kv),
        }
    }
    Ok(keys.join(","))
}

/// Replays every configuration on `threads` threads (results in the order given).
pub fn run_all(
    program: &Program,
    configs: &[RunConfig],
    threads: usize,
    progress: Option<&ProgressBar>,
) -> Result<Vec<RunReport>, String> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<RunReport, String>>>> = Mutex::new(vec![None; configs.len()]);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, configs.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(rc) = configs.get(i) else { break };
                let run = replay::run(program, rc, None, None);
                if let Ok(mut r) = results.lock() {
                    r[i] = Some(run);
                }
                if let Some(pb) = progress {
                    pb.set_message(rc.name.clone());
                    pb.inc(1);
                }
            });
        }
    });
    let results = results.into_inner().map_err(|_| "a replay thread failed".to_string())?;
    results
        .into_iter()
        .zip(configs)
        .map(|(r, rc)| r.unwrap_or_else(|| Err(format!("`{}` was not replayed", rc.name))))
        .collect()
}

/// Splits `key:value,...` into its keys.
fn keys_of(setting: &str) -> Vec<&str> {
    setting.split(',').filter(|kv| !kv.is_empty()).filter_map(|kv| kv.split(':').next()).collect()
}

/// The second pass: the first pass's best native setting with each other key's values.
fn refinements(winner: &str) -> Vec<String> {
    if winner.is_empty() {
        return Vec::new();
    }
    let taken = keys_of(winner);
    NATIVE_COARSE
        .iter()
        .filter(|c| !c.is_empty() && keys_of(c).iter().all(|k| !taken.contains(k)))
        .map(|c| format!("{winner},{c}"))
        .collect()
}

/// Inputs of `advise` besides the trace.
pub struct AdviseOptions {
    pub trace_name: String,
    pub capacity: Capacity,
    /// Threads replaying at once (the cores).
    pub threads: usize,
}

/// Runs the search. `progress` counts finished configurations.
pub fn advise(
    program: &Program,
    opts: &AdviseOptions,
    progress: Option<&ProgressBar>,
) -> Result<(Advice, Vec<RunReport>), String> {
    let base = Base { cuda: false, capacity_mb: opts.capacity.mb, devices: program.devices };
    base.validate().map_err(|e| format!("{e} (from {})", opts.capacity.source))?;
    let started = Instant::now();
    let mut candidates: Vec<Candidate> = NATIVE_COARSE
        .iter()
        .map(|s| Candidate { family: Family::Native, setting: s.to_string() })
        .chain(STEPALLOC_CANDIDATES.iter().map(|s| Candidate { family: Family::Stepalloc, setting: s.to_string() }))
        .collect();
    // The user's recorded setting, replayed when it is one stepalloc reads.
    let mut note = None;
    let recorded = program.notes.allocator_conf.clone();
    let mut current_index = 0; // the default, unless the recorded setting differs
    if let Some(recorded) = &recorded {
        match replayable(recorded) {
            Ok(setting) if setting.is_empty() => {}
            Ok(setting) => {
                let c = Candidate { family: Family::Native, setting };
                match c.run_config(&base) {
                    Ok(_) => {
                        current_index = candidates
                            .iter()
                            .position(|x| x.family == Family::Native && x.setting == c.setting)
                            .unwrap_or_else(|| {
                                candidates.push(c);
                                candidates.len() - 1
                            });
                    }
                    Err(e) => {
                        // The core's message names the key and the accepted form.
                        let why = e.split_once(": ").map_or(e.as_str(), |(_, why)| why);
                        note = Some(format!(
                            "the recorded PYTORCH_CUDA_ALLOC_CONF `{recorded}` cannot be replayed ({why}); PyTorch's \
                             default stands in for it"
                        ))
                    }
                }
            }
            Err(why) => note = Some(why),
        }
    }
    let configs: Vec<RunConfig> = candidates.iter().map(|c| c.run_config(&base)).collect::<Result<_, _>>()?;
    if let Some(pb) = progress {
        pb.set_length((configs.len() + NATIVE_COARSE.len()) as u64);
    }
    let mut runs = run_all(program, &configs, opts.threads, progress)?;
    // Second pass: refine around the best native setting of the first.
    let native: Vec<(usize, &RunReport)> =
        runs.iter().enumerate().filter(|(i, _)| candidates[*i].family == Family::Native).collect();
    let first = best(&native).ok_or("no native configuration was replayed")?;
    let extra: Vec<Candidate> = refinements(&candidates[first].setting)
        .into_iter()
        .filter(|s| !candidates.iter().any(|c| c.family == Family::Native && c.setting == *s))
        .map(|setting| Candidate { family: Family::Native, setting })
        .collect();
    let extra_configs: Vec<RunConfig> = extra.iter().map(|c| c.run_config(&base)).collect::<Result<_, _>>()?;
    if let Some(pb) = progress {
        pb.set_length((configs.len() + extra_configs.len()) as u64);
    }
    runs.extend(run_all(program, &extra_configs, opts.threads, progress)?);
    candidates.extend(extra);
    let search_s = started.elapsed().as_secs_f64();

    let of = |family: Family| -> Vec<(usize, &RunReport)> {
        runs.iter().enumerate().filter(|(i, _)| candidates[*i].family == family).collect()
    };
    let best_native = best(&of(Family::Native)).ok_or("no native configuration was replayed")?;
    let best_stepalloc = best(&of(Family::Stepalloc)).ok_or("no stepalloc configuration was replayed")?;
    let capacity_bytes = opts.capacity.mb.saturating_mul(1 << 20);
    let choice = |i: usize| -> Choice {
        let r = &runs[i];
        let c = &candidates[i];
        let peak = r.peak_moment.clone();
        let attribution = peak.as_ref().map(|p| attribute(program, p.op, p.device, TOP_GROUPS, &r.failed_allocs));
        Choice {
            family: c.family,
            setting: c.setting.clone(),
            env: format!("{}={}", c.family.variable(), c.setting),
            peak_reserved: r.worst.peak_reserved,
            headroom_bytes: if fits(r) { capacity_bytes.saturating_sub(r.worst.peak_reserved) } else { 0 },
            fits: fits(r),
            device_calls: device_calls(r),
            device_mallocs: r.worst.device_mallocs,
            device_frees: r.worst.device_frees,
            driver_unmaps: r.worst.driver_unmaps,
            ooms: r.ooms,
            peak_allocated: r.worst.peak_allocated,
            floor: r.worst.floor,
            reserved_at_step_end_mean: r.reserved_at_step_end_mean,
            peak,
            attribution,
            worst_device: r.worst_device,
            devices: r.devices.clone(),
        }
    };
    let default = choice(0);
    let current = choice(current_index);
    let best_native = choice(best_native);
    let best_stepalloc = choice(best_stepalloc);
    let current_label = match &recorded {
        None => "PyTorch default (not recorded)".to_string(),
        Some(s) if s.is_empty() => "PyTorch default (recorded)".to_string(),
        Some(s) if note.is_some() => format!("recorded `{s}` (not replayable: PyTorch default shown)"),
        Some(s) => format!("recorded `{s}`"),
    };
    let explanation_native = explain(&best_native, &default, program);
    let explanation_stepalloc = explain(&best_stepalloc, &default, program);
    let all = candidates
        .iter()
        .zip(&runs)
        .map(|(c, r)| Summary {
            family: c.family,
            setting: c.setting.clone(),
            peak_reserved: r.worst.peak_reserved,
            device_calls: device_calls(r),
            ooms: r.ooms,
        })
        .collect();
    let advice = Advice {
        trace: opts.trace_name.clone(),
        format: program.notes.format.clone(),
        events: program.ops.len() as u64,
        frames_recorded: program.has_sites(),
        capacity_bytes,
        capacity_source: opts.capacity.source.clone(),
        recorded_peak_reserved: program.notes.native.as_ref().and_then(|n| n.peak_reserved),
        recorded_setting: recorded,
        current_label,
        current,
        pytorch_default: default,
        best_native,
        best_stepalloc,
        explanation_native,
        explanation_stepalloc,
        candidates: candidates.len() as u64,
        search_s,
        all,
        note,
    };
    // The runs worth plotting: the current setting and the two winners.
    let mut plotted = Vec::new();
    for (label, choice) in
        [("current", &advice.current), ("best native", &advice.best_native), ("best stepalloc", &advice.best_stepalloc)]
    {
        if let Some(i) = candidates.iter().position(|c| c.family == choice.family && c.setting == choice.setting) {
            let mut r = runs[i].clone();
            r.name = format!("{label}: {}", choice.env);
            r.peak_attribution = choice.attribution.clone();
            plotted.push(r);
        }
    }
    Ok((advice, plotted))
}

/// Two sentences on why `c` wins, from its own replay and the default's: its peak against the
/// default's (and the default's excess at its own peak), then where the excess sat at its
/// peak, when the peak came and what gave memory back.
fn explain(c: &Choice, default: &Choice, program: &Program) -> String {
    let mut out = String::new();
    let setting = if c.setting.is_empty() { "the defaults".to_string() } else { format!("`{}`", c.setting) };
    let versus = match c.peak_reserved.cmp(&default.peak_reserved) {
        std::cmp::Ordering::Less => format!("{} below", size(default.peak_reserved - c.peak_reserved)),
        std::cmp::Ordering::Equal => "the same as".to_string(),
        std::cmp::Ordering::Greater => format!("{} above", size(c.peak_reserved - default.peak_reserved)),
    };
    let default_excess = match &default.peak {
        Some(d) if c.setting != default.setting || c.family != default.family => format!(
            ", whose large pool held {} and small pool {} over requested at its peak",
            size(d.large.excess()),
            size(d.small.excess())
        ),
        _ => String::new(),
    };
    let _ = write!(
        out,
        "With {setting} the replay peaks at {} reserved, {versus} PyTorch's default ({}){default_excess}.",
        size(c.peak_reserved),
        size(default.peak_reserved)
    );
    match &c.peak {
        Some(p) => {
            let when = match (&p.phase, p.step) {
                (Some(phase), Some(step)) => format!("in step {step}, phase `{phase}`"),
                _ if program.phases.is_empty() => "the trace has no step markers".to_string(),
                _ => "between steps".to_string(),
            };
            let (pool, held, other, other_held) = if p.large.excess() >= p.small.excess() {
                ("large", &p.large, "small", &p.small)
            } else {
                ("small", &p.small, "large", &p.large)
            };
            if held.excess() < 1 << 20 {
                let _ = write!(
                    out,
                    " At its peak (event {}, {when}) reserved matched the live requests: {} reserved for {} requested, \
                     under 1 MiB over in either pool",
                    p.op,
                    size(p.large.reserved + p.small.reserved),
                    size(p.large.requested + p.small.requested)
                );
            } else {
                let _ = write!(
                    out,
                    " At its peak (event {}, {when}) the {pool} pool held the excess: {} reserved for {} requested \
                     ({} over; the {other} pool {} over)",
                    p.op,
                    size(held.reserved),
                    size(held.requested),
                    size(held.excess()),
                    size(other_held.excess())
                );
            }
        }
        None => out.push_str(" Its peak was not located"),
    }
    if c.device_frees > 0 {
        let _ = write!(
            out,
            "; memory went back to the device {} times{}{}.",
            c.device_frees,
            c.driver_unmaps.map_or(String::new(), |u| format!(" ({u} unmaps)")),
            if program.phases.is_empty() {
                String::new()
            } else {
                format!(", leaving {} reserved at step ends on average", size(c.reserved_at_step_end_mean as u64))
            }
        );
    } else {
        out.push_str("; nothing went back to the device: the cache only grew.");
    }
    out
}

/// A size class label: the power-of-two range holding `size`.
fn size_class(size: u64) -> String {
    if size == 0 {
        return "0 B".into();
    }
    let k = 63 - size.leading_zeros();
    let unit = |b: u128| -> String {
        match b {
            b if b >= 1 << 30 => format!("{} GiB", b >> 30),
            b if b >= 1 << 20 => format!("{} MiB", b >> 20),
            b if b >= 1 << 10 => format!("{} KiB", b >> 10),
            b => format!("{b} B"),
        }
    };
    format!("[{}, {})", unit(1u128 << k), unit(1u128 << (k + 1)))
}

/// The allocations on `device` live just after event `op` (the peak is one device's), grouped
/// by site (size class when the trace has no sites); the `top` largest groups by bytes.
/// Liveness is the trace's own, less `failed`: the ordinals (0-based, in trace order, sorted)
/// of the allocations that ran out of memory in the replay, which it skipped.
pub fn attribute(program: &Program, op: u64, device: usize, top: usize, failed: &[u64]) -> Attribution {
    let mut live: Vec<Option<(u64, u32)>> = vec![None; program.ids as usize];
    let mut allocs = 0usize;
    let end = usize::try_from(op).unwrap_or(usize::MAX).saturating_add(1).min(program.ops.len());
    for o in &program.ops[..end] {
        match *o {
            Op::Alloc { id, size, device: d, .. } => {
                let site = program.site_of(allocs);
                let skipped = failed.binary_search(&(allocs as u64)).is_ok();
                allocs += 1;
                if usize::from(d) != device || skipped {
                    continue;
                }
                if let Some(slot) = live.get_mut(id as usize) {
                    *slot = Some((size, site));
                }
            }
            Op::Free { id } => {
                if let Some(slot) = live.get_mut(id as usize) {
                    *slot = None;
                }
            }
            _ => {}
        }
    }
    let frames = program.has_sites();
    let mut groups: HashMap<String, (u64, u64)> = HashMap::new();
    let (mut bytes, mut count) = (0u64, 0u64);
    for &(size, site) in live.iter().flatten() {
        bytes = bytes.saturating_add(size);
        count += 1;
        let key = if frames { program.site_name(site).to_string() } else { size_class(size) };
        let g = groups.entry(key).or_default();
        g.0 = g.0.saturating_add(size);
        g.1 += 1;
    }
    let mut groups: Vec<AttributionGroup> =
        groups.into_iter().map(|(site, (bytes, count))| AttributionGroup { site, bytes, count }).collect();
    groups.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.site.cmp(&b.site)));
    groups.truncate(top);
    let grouping = if frames { program.notes.sites.kind.grouping() } else { "by size class" };
    Attribution {
        frames_recorded: frames,
        grouping: grouping.to_string(),
        live_bytes: bytes,
        live_count: count,
        groups,
    }
}

/// The text report.
pub fn text(a: &Advice) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "advise: {} ({}, {} events)", a.trace, a.format, a.events);
    let _ = writeln!(out, "device capacity: {} GiB ({})", gib(a.capacity_bytes), a.capacity_source);
    if let Some(p) = a.recorded_peak_reserved {
        let _ = writeln!(out, "recorded peak reserved: {} GiB", gib(p));
    }
    let _ = writeln!(out, "searched {} configurations in {:.2} s", a.candidates, a.search_s);
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec!["", "setting", "peak reserved GiB", "headroom GiB", "device calls", "OOMs"]);
    for (label, c) in [
        (format!("current: {}", a.current_label), &a.current),
        ("best for PyTorch's allocator".to_string(), &a.best_native),
        ("best for stepalloc".to_string(), &a.best_stepalloc),
    ] {
        t.add_row(vec![
            label,
            shown(c),
            gib(c.peak_reserved),
            if c.fits { gib(c.headroom_bytes) } else { "does not fit".into() },
            c.device_calls.to_string(),
            c.ooms.to_string(),
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    if a.current.devices.len() > 1 {
        let _ = writeln!(
            out,
            "{} devices, each on its own device of the capacity: every figure above is its worst device's; by device:",
            a.current.devices.len()
        );
        for (label, c) in
            [("current", &a.current), ("best native", &a.best_native), ("best stepalloc", &a.best_stepalloc)]
        {
            for d in &c.devices {
                let worst = if d.device == c.worst_device { " (worst)" } else { "" };
                let _ = writeln!(
                    out,
                    "  {label}: device {}{worst}: peak reserved {} GiB for {} GiB requested ({:.3}x), {} device calls, {} OOMs",
                    d.device,
                    gib(d.figures.peak_reserved),
                    gib(d.figures.floor),
                    d.figures.reserved_over_floor,
                    d.figures.device_mallocs.saturating_add(d.figures.device_frees),
                    d.ooms
                );
            }
        }
    }
    if let Some(n) = &a.note {
        let _ = writeln!(out, "note: {n}");
    }
    let _ = writeln!(out, "\nwhy {}: {}", shown(&a.best_native), a.explanation_native);
    let _ = writeln!(out, "why {}: {}", shown(&a.best_stepalloc), a.explanation_stepalloc);
    out.push('\n');
    for (label, c) in [("current", &a.current), ("best native", &a.best_native), ("best stepalloc", &a.best_stepalloc)]
    {
        if let Some(attr) = &c.attribution {
            out.push_str(&attr.describe(&format!("{label} ({})", shown(c))));
        }
    }
    out
}

/// The setting as a shell assignment, or that the variable stays unset.
fn shown(c: &Choice) -> String {
    if c.setting.is_empty() {
        format!("{} unset (defaults)", c.family.variable())
    } else {
        c.env.clone()
    }
}

/// The runs of the current setting and the two winners, as a report for `--plot`.
pub fn plot_report(a: &Advice, runs: Vec<RunReport>) -> Report {
    Report { workload: format!("advise {}", a.trace), runs, ..Default::default() }
}
