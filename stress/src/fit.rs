//! `stepalloc-stress fit TRACE`: will this training step fit on a device of a given size, under
//! PyTorch's allocator with its usual settings, with the user's own `PYTORCH_CUDA_ALLOC_CONF`,
//! and under stepalloc? Layer: a report over the replay runner, beside `advise`.
//!
//! The device: `--capacity-gb` of memory, of which `--outside-mb` is not PyTorch's (the CUDA
//! context, NCCL, ...; `DEFAULT_OUTSIDE_MB` unless given); each column replays the whole trace
//! on a simulated device of the usable rest, in parallel (`advise::run_all`), continuing past an
//! out-of-memory (the allocation is skipped, as a caller catching the error would) so that the
//! peaks are still reported. PyTorch's columns run the core with `exact_fit:True`, which
//! reproduces PyTorch's reserved bytes and its out-of-memory path (free oversize cached blocks
//! and retry; free every unsplit cached segment and retry; raise): `scripts/torch_replay.py`
//! checks both against PyTorch's own allocator.
//!
//! Reported per column (`Column`): fits or not; peaks of reserved, allocated and requested
//! bytes; headroom; retries; the first out-of-memory with its site and the cache's state when
//! the allocator gave up (`FirstOom`, the moment PyTorch's error message describes); and the live
//! bytes at the column's peak by module (`advise::attribute` over the trace's sites). The JSON
//! keys are the contract with `python -m stepalloc.fit` (docs: `docs/fit.md`).

use crate::advise::{self, Capacity};
use crate::compare::{self, Base};
use crate::ops::{Op, Program};
use crate::replay::RunConfig;
use crate::report::{gib, RunReport};
use crate::torch_conf;
use comfy_table::{presets::UTF8_FULL_CONDENSED, CellAlignment, Table};
use serde::Serialize;
use std::fmt::Write as _;

/// Memory on the device that is not PyTorch's, unless `--outside-mb` says otherwise: a CUDA 12
/// context with PyTorch's kernels loaded lazily (the default since CUDA 11.7) takes about
/// 300–600 MiB on Ampere and Hopper GPUs; NCCL's buffers come on top under several ranks.
pub const DEFAULT_OUTSIDE_MB: u64 = 512;
/// The columns without `--compare`.
pub const DEFAULT_COLUMNS: &[&str] = &["pytorch", "pytorch_expandable", "split128", "stepalloc"];
/// The name of the column of `--pytorch-conf`.
pub const YOURS: &str = "yours";
/// Modules named at a peak; the rest are summed as "(other)".
pub const TOP_MODULES: usize = 8;

/// What `fit` needs besides the trace.
pub struct FitOptions {
    pub trace_name: String,
    pub capacity: Capacity,
    pub outside_mb: u64,
    /// `--pytorch-conf`: the user's `PYTORCH_CUDA_ALLOC_CONF`.
    pub pytorch_conf: Option<String>,
    /// `--compare`: replaces `DEFAULT_COLUMNS` when not empty.
    pub compare: Vec<String>,
    pub threads: usize,
}

/// The trace as `fit` saw it.
#[derive(Clone, Debug, Serialize)]
pub struct TraceSummary {
    pub path: String,
    pub format: String,
    pub allocations: u64,
    pub frees: u64,
    pub steps: u64,
    /// Peak live requested bytes (of the busiest device): what any allocator must hold.
    pub floor_bytes: u64,
    /// What the sites are: "modules" (a recorded trace), "frames" (a snapshot's call stacks)
    /// or "none".
    pub sites: String,
}

/// The device the trace is fitted to.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceSummary {
    pub capacity_bytes: u64,
    pub outside_bytes: u64,
    /// Whether `outside_bytes` is `DEFAULT_OUTSIDE_MB` (not given).
    pub outside_default: bool,
    pub usable_bytes: u64,
}

/// Live bytes at a peak from one module (or "(other)", "(none)").
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModuleBytes {
    pub module: String,
    pub bytes: u64,
}

/// The first allocation that ran out of memory, where it was made, and the cache then.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FirstOom {
    /// 1-based index of the allocation among the trace's allocations.
    pub allocation: u64,
    pub size: u64,
    pub stream: u64,
    /// 1-based step (of any phase) in progress, and its phase; null between steps.
    pub step: Option<u64>,
    pub phase: Option<String>,
    /// The module path ("(none)": outside every module; "": the trace records no modules) and
    /// the operator ("" when not recorded).
    pub module: String,
    pub torch_op: String,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    /// Usable memory less reserved.
    pub free_device_bytes: u64,
    /// Reserved less allocated: the cache's free bytes the request could not use.
    pub cached_free_bytes: u64,
    pub largest_free_block_bytes: u64,
    /// 1 - largest free block / cached free bytes (0 when nothing is cached).
    pub external_fragmentation: f64,
}

/// One configuration's result.
#[derive(Clone, Debug, Serialize)]
pub struct Column {
    pub name: String,
    /// "pytorch" (PyTorch's allocator) or "stepalloc".
    pub allocator: String,
    /// The setting as the user writes it in `env`'s variable ("" for the defaults).
    pub conf: String,
    /// `PYTORCH_CUDA_ALLOC_CONF=...` or `STEPALLOC_CONF=...`.
    pub env: String,
    pub fits: bool,
    pub peak_reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub peak_requested_bytes: u64,
    /// Usable memory less peak reserved when it fits; 0 when it does not.
    pub headroom_bytes: u64,
    pub alloc_retries: u64,
    pub ooms: u64,
    /// Calls refused for another reason than out of memory (0 unless the trace is broken).
    pub errors: u64,
    pub first_oom: Option<FirstOom>,
    /// The allocation that took reserved bytes to their peak (1-based, as `FirstOom::allocation`),
    /// and the step in progress then (1-based).
    pub peak_allocation: Option<u64>,
    pub peak_step: Option<u64>,
    pub peak_phase: Option<String>,
    pub peak_top_modules: Vec<ModuleBytes>,
    /// The same live bytes with numbered path parts summed (`layers.*.mlp`: every layer's
    /// MLP together): what a deep model's peak is made of.
    pub peak_top_module_patterns: Vec<ModuleBytes>,
}

/// What `fit` prints as JSON.
#[derive(Clone, Debug, Serialize)]
pub struct FitReport {
    pub trace: TraceSummary,
    pub device: DeviceSummary,
    pub configs: Vec<Column>,
    /// Settings of `--pytorch-conf` left out of the model, and why.
    pub notes: Vec<String>,
}

/// The report and the runs behind it (their timelines draw the picture).
pub struct Fit {
    pub report: FitReport,
    pub runs: Vec<RunReport>,
}

/// The usable MiB of the device, or an error naming the flags.
pub fn usable_mb(capacity: &Capacity, outside_mb: u64) -> Result<u64, String> {
    match capacity.mb.checked_sub(outside_mb) {
        Some(usable) if usable >= 2 => Ok(usable),
        _ => Err(format!(
            "--outside-mb {outside_mb}: the memory outside PyTorch leaves {} of the device's {} MiB ({}) for PyTorch; \
             the replay needs at least 2 MiB: lower --outside-mb or raise --capacity-gb",
            if capacity.mb > outside_mb { format!("{} MiB", capacity.mb - outside_mb) } else { "nothing".into() },
            capacity.mb,
            capacity.source
        )),
    }
}

/// Replays `program` under every column and gathers the report.
pub fn fit(program: &Program, opts: &FitOptions) -> Result<Fit, String> {
    let usable = usable_mb(&opts.capacity, opts.outside_mb)?;
    let base = Base { cuda: false, capacity_mb: usable, devices: program.devices };
    base.validate().map_err(|e| format!("{e} (the usable memory: --capacity-gb less --outside-mb)"))?;
    let mut notes = Vec::new();
    let names: Vec<String> = if opts.compare.is_empty() {
        DEFAULT_COLUMNS.iter().map(|s| s.to_string()).collect()
    } else {
        opts.compare.clone()
    };
    let mut configs = Vec::new();
    let mut settings = Vec::new();
    for name in &names {
        let rc = compare::resolve_one(name, &base)?;
        settings.push(setting_of(&rc, &base)?);
        configs.push(rc);
    }
    if let Some(text) = &opts.pytorch_conf {
        let t = torch_conf::translate(text, opts.capacity.mb, usable)?;
        let mut rc = compare::resolve_one(&t.conf, &base).map_err(|e| format!("--pytorch-conf `{text}`: {e}"))?;
        rc.name = YOURS.to_string();
        settings.push(("pytorch", t.setting.clone()));
        configs.push(rc);
        notes.extend(t.notes);
    }
    for rc in &mut configs {
        rc.track_peak = true;
    }
    let runs = advise::run_all(program, &configs, opts.threads, None)?;
    let usable_bytes = usable * MIB;
    let columns = runs
        .iter()
        .zip(&settings)
        .map(|(r, (family, setting))| column(program, r, family, setting, usable_bytes))
        .collect();
    let report = FitReport {
        trace: summary(program, &opts.trace_name),
        device: DeviceSummary {
            capacity_bytes: opts.capacity.mb * MIB,
            outside_bytes: opts.outside_mb * MIB,
            outside_default: opts.outside_mb == DEFAULT_OUTSIDE_MB,
            usable_bytes,
        },
        configs: columns,
        notes,
    };
    Ok(Fit { report, runs })
}

const MIB: u64 = 1 << 20;

/// Which allocator a resolved column is, and its setting as the user writes it: PyTorch's
/// presets are the core's `exact_fit:True` plus PyTorch's keys; anything else is a
/// `STEPALLOC_CONF`.
fn setting_of(rc: &RunConfig, base: &Base) -> Result<(&'static str, String), String> {
    // The base keys come first in every resolved configuration (`compare::resolve_one`).
    let own = compare::without_base(&rc.conf, base);
    Ok(match own.strip_prefix("exact_fit:True") {
        Some(rest) => ("pytorch", rest.trim_start_matches(',').to_string()),
        None => ("stepalloc", own.to_string()),
    })
}

fn summary(program: &Program, path: &str) -> TraceSummary {
    let (mut allocations, mut frees, mut steps) = (0u64, 0u64, 0u64);
    let mut live = vec![0u64; program.ids as usize];
    let mut per_device = vec![0u64; usize::from(program.devices.max(1))];
    let mut floor = 0u64;
    let mut device_of = vec![0u16; program.ids as usize];
    for op in &program.ops {
        match *op {
            Op::Alloc { id, size, device, .. } => {
                allocations += 1;
                let (i, d) = (id as usize, usize::from(device));
                if let (Some(slot), Some(total)) = (live.get_mut(i), per_device.get_mut(d)) {
                    *slot = size;
                    device_of[i] = device;
                    *total = total.saturating_add(size);
                    floor = floor.max(*total);
                }
            }
            Op::Free { id } => {
                frees += 1;
                if let Some(slot) = live.get_mut(id as usize) {
                    let d = usize::from(device_of[id as usize]);
                    per_device[d] = per_device[d].saturating_sub(std::mem::take(slot));
                }
            }
            Op::StepBegin { .. } => steps += 1,
            _ => {}
        }
    }
    let sites = match (program.has_sites(), program.notes.sites.kind) {
        (false, _) => "none",
        (true, crate::ops::SiteKind::Modules) => "modules",
        (true, crate::ops::SiteKind::Frames) => "frames",
    };
    TraceSummary {
        path: path.to_string(),
        format: program.notes.format.clone(),
        allocations,
        frees,
        steps,
        floor_bytes: floor,
        sites: sites.to_string(),
    }
}

fn column(program: &Program, r: &RunReport, family: &str, setting: &str, usable: u64) -> Column {
    let fits = r.ooms == 0 && r.errors == 0;
    let variable = if family == "pytorch" { "PYTORCH_CUDA_ALLOC_CONF" } else { "STEPALLOC_CONF" };
    let first_oom = r.first_oom.as_ref().map(|m| {
        let site = program.site_of(usize::try_from(m.alloc).unwrap_or(usize::MAX));
        let cached_free = m.reserved.saturating_sub(m.allocated);
        FirstOom {
            allocation: m.alloc + 1,
            size: m.size,
            stream: m.stream,
            step: m.step,
            phase: m.phase.clone(),
            module: if program.has_sites() { program.site_name(site).to_string() } else { String::new() },
            torch_op: program.site_op(site).to_string(),
            allocated_bytes: m.allocated,
            reserved_bytes: m.reserved,
            free_device_bytes: usable.saturating_sub(m.reserved),
            cached_free_bytes: cached_free,
            largest_free_block_bytes: m.largest_free_block,
            external_fragmentation: if cached_free == 0 {
                0.0
            } else {
                1.0 - m.largest_free_block.min(cached_free) as f64 / cached_free as f64
            },
        }
    });
    let (peak_top_modules, peak_top_module_patterns) = match &r.peak_moment {
        Some(p) => top_modules(program, p.op, p.device, &r.failed_allocs),
        None => (Vec::new(), Vec::new()),
    };
    Column {
        name: r.name.clone(),
        allocator: family.to_string(),
        conf: setting.to_string(),
        env: format!("{variable}={setting}"),
        fits,
        peak_reserved_bytes: r.worst.peak_reserved,
        peak_allocated_bytes: r.worst.peak_allocated,
        peak_requested_bytes: r.worst.floor,
        headroom_bytes: if fits { usable.saturating_sub(r.worst.peak_reserved) } else { 0 },
        alloc_retries: r.alloc_retries,
        ooms: r.ooms,
        errors: r.errors,
        first_oom,
        peak_allocation: r.peak_moment.as_ref().map(|p| allocations_through(program, p.op)),
        peak_step: r.peak_moment.as_ref().and_then(|p| p.step.map(|s| s + 1)),
        peak_phase: r.peak_moment.as_ref().and_then(|p| p.phase.clone()),
        peak_top_modules,
        peak_top_module_patterns,
    }
}

/// Allocations among the events up to `op` (inclusive).
fn allocations_through(program: &Program, op: u64) -> u64 {
    let end = usize::try_from(op).unwrap_or(usize::MAX).saturating_add(1).min(program.ops.len());
    program.ops[..end].iter().filter(|o| matches!(o, Op::Alloc { .. })).count() as u64
}

/// Live bytes just after event `op` on `device` by module, and by module pattern
/// (`module_pattern`): the `TOP_MODULES` largest groups each, the rest as "(other)"; a trace
/// without sites is one "(none)".
fn top_modules(program: &Program, op: u64, device: usize, failed: &[u64]) -> (Vec<ModuleBytes>, Vec<ModuleBytes>) {
    let a = advise::attribute(program, op, device, usize::MAX, failed);
    if !a.frames_recorded {
        let all = vec![ModuleBytes { module: "(none)".to_string(), bytes: a.live_bytes }];
        return (all.clone(), all);
    }
    let by_module: Vec<(String, u64)> = a.groups.iter().map(|g| (g.site.clone(), g.bytes)).collect();
    let mut patterns: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    for (module, bytes) in &by_module {
        let e = patterns.entry(module_pattern(module)).or_default();
        *e = e.saturating_add(*bytes);
    }
    let mut by_pattern: Vec<(String, u64)> = patterns.into_iter().collect();
    by_pattern.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    (top(by_module), top(by_pattern))
}

/// The `TOP_MODULES` first of groups sorted largest first, and "(other)" for the rest.
fn top(groups: Vec<(String, u64)>) -> Vec<ModuleBytes> {
    let rest: u64 = groups.iter().skip(TOP_MODULES).fold(0u64, |s, g| s.saturating_add(g.1));
    let more = groups.len() > TOP_MODULES;
    let mut out: Vec<ModuleBytes> =
        groups.into_iter().take(TOP_MODULES).map(|(module, bytes)| ModuleBytes { module, bytes }).collect();
    if more {
        out.push(ModuleBytes { module: "(other)".to_string(), bytes: rest });
    }
    out
}

/// A module path with every numbered part as `*`: `model.layers.17.mlp (backward)` is
/// `model.layers.*.mlp (backward)`.
pub fn module_pattern(module: &str) -> String {
    module
        .split('.')
        .map(|part| if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) { "*" } else { part })
        .collect::<Vec<_>>()
        .join(".")
}

/// Bytes as GiB from 1 GiB up, else MiB.
pub fn size(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{} GiB", gib(bytes))
    } else {
        format!("{:.2} MiB", bytes as f64 / MIB as f64)
    }
}

/// `n` with thousands separators.
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Where an allocation was made, for a sentence, after a comma: ", aten::mm in
/// layers.17.mlp (backward)"; nothing when the trace does not say.
pub fn site_text(module: &str, op: &str) -> String {
    match (module, op) {
        ("", "") => String::new(),
        ("(none)", "") => ", outside every module".to_string(),
        ("(none)" | "", op) => format!(", {op} outside every module"),
        (m, "") => format!(", in {m}"),
        (m, op) => format!(", {op} in {m}"),
    }
}

/// The first out-of-memory of a column as one line.
pub fn oom_line(c: &Column) -> Option<String> {
    let o = c.first_oom.as_ref()?;
    let when = match (&o.phase, o.step) {
        (Some(phase), Some(step)) => format!(", {phase} step {step}"),
        _ => String::new(),
    };
    Some(format!(
        "{}: out of memory at allocation {} ({}{}{when}): {} cached free, largest free block {}, {:.0}% fragmented; \
         {} of the device free",
        c.name,
        count(o.allocation),
        size(o.size),
        site_text(&o.module, &o.torch_op),
        size(o.cached_free_bytes),
        size(o.largest_free_block_bytes),
        o.external_fragmentation * 100.0,
        size(o.free_device_bytes),
    ))
}

/// The groups to show of a column's peak, and how they are made: by module pattern when it
/// sums numbered layers, else by module.
pub fn shown_modules(c: &Column) -> (&[ModuleBytes], &'static str) {
    if c.peak_top_module_patterns != c.peak_top_modules {
        (&c.peak_top_module_patterns, "by module, numbered layers summed (*)")
    } else {
        (&c.peak_top_modules, "by module")
    }
}

/// The terminal report.
pub fn text(f: &FitReport) -> String {
    let mut out = String::new();
    let t = &f.trace;
    let _ = writeln!(
        out,
        "fit: {} ({}: {} allocations, {} steps; sites: {})",
        t.path,
        t.format,
        count(t.allocations),
        count(t.steps),
        t.sites
    );
    let d = &f.device;
    let _ = writeln!(
        out,
        "device: {} GiB, of which {} outside PyTorch ({}) and {} GiB usable",
        gib(d.capacity_bytes),
        size(d.outside_bytes),
        if d.outside_default {
            "the default for a CUDA context; --outside-mb sets it".to_string()
        } else {
            "--outside-mb".to_string()
        },
        gib(d.usable_bytes)
    );
    let _ = writeln!(out, "live tensors at their peak (what any allocator must hold): {}", size(t.floor_bytes));
    let mut table = Table::new();
    table.load_preset(UTF8_FULL_CONDENSED);
    table.set_header(vec!["", "fits", "peak reserved GiB", "peak allocated GiB", "headroom GiB", "alloc retries"]);
    for c in &f.configs {
        let fits = match &c.first_oom {
            None if c.fits => "yes".to_string(),
            None => format!("no: {} refused calls", c.errors),
            Some(o) => format!("no: OOM at allocation {} ({} OOMs)", count(o.allocation), count(c.ooms)),
        };
        table.add_row(vec![
            c.name.clone(),
            fits,
            gib(c.peak_reserved_bytes),
            gib(c.peak_allocated_bytes),
            if c.fits { gib(c.headroom_bytes) } else { "-".into() },
            c.alloc_retries.to_string(),
        ]);
    }
    for (i, column) in table.column_iter_mut().enumerate() {
        if i > 1 {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    out.push_str(&table.to_string());
    out.push('\n');
    for c in &f.configs {
        let shown = if c.conf.is_empty() { format!("{} unset", c.env.trim_end_matches('=')) } else { c.env.clone() };
        let _ = writeln!(out, "  {} = {shown}", c.name);
    }
    for c in &f.configs {
        if let Some(line) = oom_line(c) {
            let _ = writeln!(out, "{line}");
        }
    }
    // The top modules, once per distinct peak moment (columns often share one); numbered
    // layers summed when the trace has them.
    let mut shown: Vec<Option<u64>> = Vec::new();
    for c in &f.configs {
        if c.peak_top_modules.is_empty() || shown.contains(&c.peak_allocation) {
            continue;
        }
        let (groups, how) = shown_modules(c);
        shown.push(c.peak_allocation);
        let same: Vec<&str> =
            f.configs.iter().filter(|o| o.peak_allocation == c.peak_allocation).map(|o| o.name.as_str()).collect();
        let when = match (&c.peak_phase, c.peak_step) {
            (Some(phase), Some(step)) => format!("{phase} step {step}, "),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "live at the peak of {} ({when}allocation {}), {how}:",
            same.join(", "),
            count(c.peak_allocation.unwrap_or(0))
        );
        for m in groups {
            let _ = writeln!(out, "  {:>12}  {}", size(m.bytes), m.module);
        }
    }
    for n in &f.notes {
        let _ = writeln!(out, "note: --pytorch-conf: {n}");
    }
    out
}
