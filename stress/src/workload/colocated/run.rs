//! The colocated loop under four ways of sharing one device, side by side:
//! 1. `both_resident`: PyTorch's default rules, nothing released between phases;
//! 2. `pytorch_empty_cache`: PyTorch's default rules; between phases the engine frees its KV
//!    cache (and allocates it again at the next rollout), weights stay, and the loop calls
//!    `empty_cache` at both switches;
//! 3. `vllm_sleep`: the trainer under `expandable_segments:True`; the engine in vLLM's pools
//!    (one for weights, one for the cache, PyTorch's default rules inside each, as vLLM turns
//!    expandable segments off in them), asleep in vLLM's manner during training: every
//!    allocation of its pools unmapped, weights backed up with one synchronous copy per
//!    allocation, the cache discarded; the loop calls `empty_cache` before the engine wakes
//!    (what RL frameworks do so the trainer's cache does not sit under the engine);
//! 4. `stepalloc`: stepalloc's recommended configuration, the engine's allocations in regions
//!    of tags `engine_weights` (backed up) and `kv_cache` (discarded), both paused after the
//!    rollout by one `Allocator::pause_tags` and resumed before the next by one `resume_tags`,
//!    with no `empty_cache` (the resume releases the trainer's idle cached pages it takes the
//!    place of). Its switch time is the simulated device's host clock over those two calls:
//!    each driver call moves it by its modelled cost, each wait for a copy to the copy's end,
//!    and the copy engine moves the bytes at the link's rate as the library queues them.
//!
//! Peak device use is the most bytes the device holds for the process at once over the run:
//! reserved bytes (mapped pages under expandable segments), with paused memory not counted;
//! column 3 adds its three pools', counting a sleeping pool as nothing. Runs use a simulated
//! device far larger than the capacity, so every column completes and "fits" compares its peak
//! with `--capacity-gb`. Every iteration is one full cycle: rollout, switch to training,
//! training step, switch back.

use super::cost::CostModel;
use super::{generate, ColocatedSpec, Ev, Loop, Owner};
use crate::report::gib;
use comfy_table::{presets::UTF8_FULL_CONDENSED, CellAlignment, Table};
use serde::Serialize;
use stepalloc::{Allocator, Config, DeviceStats, Stream};

/// The simulated device every column runs on: 1 TiB, so nothing is refused and each column's
/// own peak is measured.
const SIM_MB: u64 = 1 << 20;
const WEIGHTS_TAG: &str = "engine_weights";
const KV_TAG: &str = "kv_cache";
const GIB: u64 = 1 << 30;
/// How the stepalloc column switches, as the table's header says.
const STEPALLOC_SWITCH: &str = "one pause and one resume of both engine tags, no empty_cache; the library's calls \
     timed on the simulated device's clock (copy engine at the link's rate)";

/// One way of sharing the device, measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Column {
    pub name: String,
    /// Most bytes held on the device at once (reserved / mapped).
    pub peak_bytes: u64,
    /// `peak_bytes` over the larger phase's own peak, minus 1.
    pub over_larger_phase: f64,
    /// Bytes copied over the host link per iteration (out and back).
    pub copied_per_iteration: u64,
    /// Modelled seconds of the two switches of an iteration.
    pub switch_s_per_iteration: f64,
    /// `copied_per_iteration` at link speed: the least those copies can cost.
    pub link_floor_s_per_iteration: f64,
    pub fits: bool,
}

/// The whole comparison.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ColocatedReport {
    pub spec: ColocatedSpec,
    pub cost: CostModel,
    pub capacity_bytes: u64,
    /// The rollout phase's own peak (engine, cache, the trainer's kept state).
    pub rollout_phase_peak: u64,
    /// The training phase's own peak (the trainer alone).
    pub train_phase_peak: u64,
    pub larger_phase_peak: u64,
    pub engine_weight_bytes: u64,
    pub engine_weight_tensors: u64,
    pub columns: Vec<Column>,
}

/// `--capacity-gb` when no capacity flag is given: an 80 GB GPU.
pub const DEFAULT_CAPACITY_GB: u64 = 80;
/// The largest device `--capacity-gb` (and `--capacity-mb`, in MiB) accepts.
pub const MAX_CAPACITY_GB: u64 = 16_384;

/// Runs the four columns on `spec`'s loop. `capacity_mb` is the device to fit (MiB).
pub fn run(spec: &ColocatedSpec, capacity_mb: u64, cost: CostModel) -> Result<ColocatedReport, String> {
    if !(1..=MAX_CAPACITY_GB * 1024).contains(&capacity_mb) {
        return Err(format!(
            "a device of {capacity_mb} MiB: must be in 1..={} MiB (--capacity-mb) or 1..={MAX_CAPACITY_GB} GiB \
             (--capacity-gb)",
            MAX_CAPACITY_GB * 1024
        ));
    }
    let lp = generate(spec)?;
    let capacity_bytes = capacity_mb << 20;
    let larger = lp.rollout_peak.max(lp.train_peak);
    let mut columns = Vec::new();
    for (name, m) in [
        ("both_resident", Mode::Resident),
        ("pytorch_empty_cache", Mode::EmptyCache),
        ("vllm_sleep", Mode::VllmSleep),
        ("stepalloc", Mode::Stepalloc),
    ] {
        let t = play(&lp, m, &cost).map_err(|e| format!("{name}: {e}"))?;
        let n = spec.iterations as f64;
        let copied = t.copied / spec.iterations;
        columns.push(Column {
            name: name.to_string(),
            peak_bytes: t.peak,
            over_larger_phase: t.peak as f64 / larger.max(1) as f64 - 1.0,
            copied_per_iteration: copied,
            switch_s_per_iteration: t.switch_s / n,
            link_floor_s_per_iteration: cost.link_s(copied),
            fits: t.peak <= capacity_bytes,
        });
    }
    Ok(ColocatedReport {
        spec: spec.clone(),
        cost,
        capacity_bytes,
        rollout_phase_peak: lp.rollout_peak,
        train_phase_peak: lp.train_peak,
        larger_phase_peak: larger,
        engine_weight_bytes: lp.weight_bytes,
        engine_weight_tensors: lp.weight_tensors,
        columns,
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Resident,
    EmptyCache,
    VllmSleep,
    Stepalloc,
}

/// What one column's run adds up to.
#[derive(Default)]
struct Tally {
    peak: u64,
    copied: u64,
    switch_s: f64,
}

/// The allocators of a column: one, or (vLLM) the trainer's and the engine's two pools.
struct Device {
    mode: Mode,
    trainer: Allocator,
    /// vLLM's weights and cache pools (`None` in the other columns: the trainer's serves all).
    pools: Option<[Allocator; 2]>,
    /// vLLM's pools are asleep (they hold nothing on the device).
    asleep: std::cell::Cell<bool>,
}

/// An allocator on the simulated device with its cost model, its copy engine at the link's rate.
fn allocator(conf: &str, cost: &CostModel) -> Result<Allocator, String> {
    let link = cost.sim_copy_mb_s();
    let full = format!("backend:sim,sim_capacity_mb:{SIM_MB},sim_cost_model:True,sim_copy_mb_s:{link},{conf}");
    let config = Config::parse(&full).map_err(|e| e.to_string())?;
    Allocator::new(config).map_err(|e| e.to_string())
}

fn stats(a: &Allocator) -> Result<DeviceStats, String> {
    a.stats(0).map_err(|e| e.to_string())
}

/// Seconds the driver's calls took, without the waits for copies (`sync_ns`) unless `waits`.
fn driver_s(s: &DeviceStats, waits: bool) -> f64 {
    let d = &s.driver_time;
    let sync = if waits { d.sync_ns } else { 0 };
    (d.reserve_ns + d.release_ns + d.event_ns + sync + d.create_ns + d.map_ns) as f64 * 1e-9
}

impl Device {
    fn new(mode: Mode, cost: &CostModel) -> Result<Device, String> {
        let allocator = |conf: &str| allocator(conf, cost);
        let pytorch = "exact_fit:True";
        Ok(match mode {
            Mode::Resident | Mode::EmptyCache => {
                Device { mode, trainer: allocator(pytorch)?, pools: None, asleep: Default::default() }
            }
            Mode::VllmSleep => Device {
                mode,
                trainer: allocator("exact_fit:True,expandable_segments:True")?,
                pools: Some([allocator(pytorch)?, allocator(pytorch)?]),
                asleep: Default::default(),
            },
            Mode::Stepalloc => Device {
                mode,
                trainer: allocator(stepalloc::config::RECOMMENDED)?,
                pools: None,
                asleep: Default::default(),
            },
        })
    }

    fn of(&self, owner: Owner) -> &Allocator {
        match (&self.pools, owner) {
            (Some(p), Owner::EngineWeights) => &p[0],
            (Some(p), Owner::KvCache) => &p[1],
            _ => &self.trainer,
        }
    }

    fn malloc(&self, bytes: u64, owner: Owner) -> Result<u64, String> {
        let a = self.of(owner);
        let tag = match (self.mode, owner) {
            (Mode::Stepalloc, Owner::EngineWeights) => Some((WEIGHTS_TAG, true)),
            (Mode::Stepalloc, Owner::KvCache) => Some((KV_TAG, false)),
            _ => None,
        };
        if let Some((name, backup)) = tag {
            stepalloc::tags::enter(name, backup).map_err(|e| e.to_string())?;
        }
        let ptr = a.malloc(0, bytes, Stream::DEFAULT);
        if tag.is_some() {
            stepalloc::tags::exit().map_err(|e| e.to_string())?;
        }
        ptr.map_err(|e| e.to_string())
    }

    /// Bytes the device holds now, and at most since the last `reset`.
    fn held(&self) -> Result<(u64, u64), String> {
        let mut now = 0;
        let mut peak = 0;
        for (i, a) in self.all().iter().enumerate() {
            if self.asleep.get() && i > 0 {
                continue;
            }
            let r = stats(a)?.heap.reserved_bytes.all;
            now += r.current;
            peak += r.peak;
        }
        Ok((now, peak))
    }

    fn reset(&self) -> Result<(), String> {
        for a in self.all() {
            a.reset_peak_stats(0).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn asleep_set(&self, on: bool) {
        self.asleep.set(on);
    }

    fn all(&self) -> Vec<&Allocator> {
        let mut v = vec![&self.trainer];
        if let Some(p) = &self.pools {
            v.extend(p.iter());
        }
        v
    }

    /// `empty_cache` on the trainer's allocator: its driver time.
    fn empty_cache(&self) -> Result<f64, String> {
        let before = driver_s(&stats(&self.trainer)?, true);
        self.trainer.empty_cache().map_err(|e| e.to_string())?;
        Ok(driver_s(&stats(&self.trainer)?, true) - before)
    }
}

/// Plays the loop under `mode`.
fn play(lp: &Loop, mode: Mode, cost: &CostModel) -> Result<Tally, String> {
    let d = Device::new(mode, cost)?;
    let mut t = Tally::default();
    let mut live: Vec<Option<(u64, u64, Owner)>> = Vec::new();
    // Column 2: the cache blocks freed at the switch, allocated again at the next rollout.
    let mut dropped_cache: Vec<(u32, u64)> = Vec::new();
    let mut started = false;
    let alloc = |live: &mut Vec<Option<(u64, u64, Owner)>>, id: u32, bytes: u64, owner: Owner| {
        let ptr = d.malloc(bytes, owner)?;
        let i = id as usize;
        if live.len() <= i {
            live.resize(i + 1, None);
        }
        live[i] = Some((ptr, bytes, owner));
        Ok::<(), String>(())
    };
    for &ev in &lp.events {
        match ev {
            Ev::Alloc { id, bytes, owner } => alloc(&mut live, id, bytes, owner)?,
            Ev::Free { id } => {
                if let Some((ptr, bytes, owner)) = live.get_mut(id as usize).and_then(Option::take) {
                    d.of(owner).free(0, ptr, bytes).map_err(|e| e.to_string())?;
                }
            }
            Ev::Train => {
                note_phase_end(&d, &mut t)?;
                match mode {
                    Mode::Resident => {}
                    Mode::EmptyCache => {
                        for (i, slot) in live.iter_mut().enumerate() {
                            if let Some((ptr, bytes, Owner::KvCache)) = *slot {
                                d.trainer.free(0, ptr, bytes).map_err(|e| e.to_string())?;
                                dropped_cache.push((i as u32, bytes));
                                *slot = None;
                            }
                        }
                        t.switch_s += d.empty_cache()?;
                    }
                    Mode::VllmSleep => {
                        // Sleep: every allocation (segment) of both pools unmapped and released,
                        // the weights' copied first, one synchronous copy each.
                        let (w, kv) = pool_segments(&d)?;
                        t.copied += w.1;
                        t.switch_s += cost.vllm_s(w.0, w.1, w.0 + kv.0, false);
                        d.asleep_set(true);
                    }
                    Mode::Stepalloc => switch_engine(&d, &mut t, true)?,
                }
                note_switch(&d, &mut t)?;
            }
            Ev::Rollout if !started => started = true,
            Ev::Rollout => {
                note_phase_end(&d, &mut t)?;
                match mode {
                    Mode::Resident => {}
                    Mode::EmptyCache => {
                        t.switch_s += d.empty_cache()?;
                        for (id, bytes) in dropped_cache.drain(..) {
                            alloc(&mut live, id, bytes, Owner::KvCache)?;
                        }
                    }
                    Mode::VllmSleep => {
                        t.switch_s += d.empty_cache()?;
                        let (w, kv) = pool_segments(&d)?;
                        t.copied += w.1;
                        t.switch_s += cost.vllm_s(w.0, w.1, w.0 + kv.0, true);
                        d.asleep_set(false);
                    }
                    Mode::Stepalloc => switch_engine(&d, &mut t, false)?,
                }
                note_switch(&d, &mut t)?;
            }
        }
    }
    note_phase_end(&d, &mut t)?;
    d.trainer.check_invariants()?;
    Ok(t)
}

/// stepalloc's pause (or resume) of the engine: both its tags in one call, its invariants
/// checked after. Returns what it copied and the seconds it took on the simulated device's host
/// clock (its driver calls, and its waits for the copies it queued, as the library makes them).
fn switch_engine(d: &Device, t: &mut Tally, pause: bool) -> Result<(), String> {
    let before = stats(&d.trainer)?;
    let engine = [WEIGHTS_TAG, KV_TAG];
    let r = if pause { d.trainer.pause_tags(&engine, None) } else { d.trainer.resume_tags(&engine) };
    let r = r.map_err(|e| e.to_string())?;
    let after = stats(&d.trainer)?;
    d.trainer.check_invariants().map_err(|e| format!("after the engine's {}: {e}", r.op))?;
    t.copied += r.copied_bytes;
    t.switch_s += driver_s(&after, true) - driver_s(&before, true);
    Ok(())
}

/// A pool's segments (vLLM's allocations) and their reserved bytes.
type PoolFigures = (u64, u64);

/// The figures of vLLM's weights pool and of its cache pool.
fn pool_segments(d: &Device) -> Result<(PoolFigures, PoolFigures), String> {
    let Some([w, kv]) = &d.pools else { return Ok(((0, 0), (0, 0))) };
    let f = |a: &Allocator| -> Result<PoolFigures, String> {
        let s = stats(a)?;
        Ok((s.heap.segment.all.current, s.heap.reserved_bytes.all.current))
    };
    Ok((f(w)?, f(kv)?))
}

/// A phase ends: the most its allocators held together since it began.
fn note_phase_end(d: &Device, t: &mut Tally) -> Result<(), String> {
    t.peak = t.peak.max(d.held()?.1);
    Ok(())
}

/// After a switch: what the device holds now; the next phase's peak starts here.
fn note_switch(d: &Device, t: &mut Tally) -> Result<(), String> {
    t.peak = t.peak.max(d.held()?.0);
    d.reset()
}

/// The report as a table, with the two phases' own peaks and the claims it lets one check.
pub fn table(r: &ColocatedReport) -> String {
    let s = &r.spec;
    let mut out = format!(
        "colocated loop: decoder {} x {} layers ({} GiB of engine weights in {} tensors), rollout batch {} x {}..{} \
         response tokens, {} micro-batches of {}..{} tokens, {} iterations, seed {}\n\
         host link {:.0} GB/s (PCIe 4 x16 about {:.0}, PCIe 5 x16 about {:.0}), device {}\n\
         stepalloc's switch: {}\n\
         phases' own peaks: rollout {} GiB, training {} GiB; larger {} GiB\n",
        s.hidden,
        s.layers,
        gib(r.engine_weight_bytes),
        r.engine_weight_tensors,
        s.rollout_batch,
        s.prompt_tokens + s.response_min,
        s.prompt_tokens + s.response_max,
        s.micro_batches,
        s.micro_tokens_min,
        s.micro_tokens_max,
        s.iterations,
        s.seed,
        r.cost.link_gbps,
        super::PCIE4_X16_GBPS,
        super::PCIE5_X16_GBPS,
        device_size(r.capacity_bytes),
        STEPALLOC_SWITCH,
        gib(r.rollout_phase_peak),
        gib(r.train_phase_peak),
        gib(r.larger_phase_peak),
    );
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    let mut header = vec![String::new()];
    header.extend(r.columns.iter().map(|c| c.name.clone()));
    t.set_header(header);
    type Row = (&'static str, fn(&Column) -> String);
    let rows: &[Row] = &[
        ("peak device use, GiB", |c| gib(c.peak_bytes)),
        ("over the larger phase's peak", |c| format!("{:+.1}%", c.over_larger_phase * 100.0)),
        ("copied per iteration, GiB", |c| gib(c.copied_per_iteration)),
        ("switch time per iteration, ms", |c| format!("{:.1}", c.switch_s_per_iteration * 1e3)),
        ("copied / link bandwidth, ms", |c| format!("{:.1}", c.link_floor_s_per_iteration * 1e3)),
        ("fits the device", |c| if c.fits { "yes" } else { "no" }.to_string()),
    ];
    for (label, f) in rows {
        let mut row = vec![label.to_string()];
        row.extend(r.columns.iter().map(f));
        t.add_row(row);
    }
    for i in 1..=r.columns.len() {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    out.push_str(&t.to_string());
    out.push('\n');
    out
}

/// A device's size as the flags give it: whole GiB, else MiB.
fn device_size(bytes: u64) -> String {
    if bytes % GIB == 0 {
        format!("{} GiB", bytes / GIB)
    } else {
        format!("{} MiB ({} GiB)", bytes >> 20, gib(bytes))
    }
}
