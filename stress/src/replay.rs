//! The runner: plays one `Program` against one `Allocator` and measures what happened.
//!
//! Invariants: the runner never frees an id it did not allocate (an allocation that ran out of
//! memory is counted and its later free and record_stream are skipped); the physical floor is
//! the peak of live requested bytes as the runner itself counts them, independent of the
//! allocator; peaks of allocated and reserved bytes come from the allocator's statistics.
//! Every peak is tracked per device (each device of a multi-device trace runs on its own
//! device, so its figures are those of that device replayed alone); the run's headline is the
//! worst device (`RunReport::devices`), never a sum of peaks. Timeline samples add the devices'
//! current values at one moment; each step's figures are its worst device's (`StepReport::device`).

use crate::fragmentation;
use crate::ops::{Op, Program};
use crate::report::{
    worst_device, DeviceFigures, DeviceReport, OomMoment, PeakExplanation, RunReport, Sample, StepReport,
};
use indicatif::ProgressBar;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use stepalloc::{Allocator, Config, Error, Stream};

/// Points of the reserved/allocated/requested timeline kept per run (for `--plot`).
pub const TIMELINE_POINTS: usize = 1500;

/// One configuration to run: a display name, the allocator configuration and the runner's
/// own emulation of user behaviour.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunConfig {
    pub name: String,
    /// The full configuration string given to the allocator (base keys included).
    pub conf: String,
    /// Emulate a user calling `torch.cuda.empty_cache()` after every step.
    pub empty_cache_every_step: bool,
    /// Describe the heap at its peak of reserved bytes (`PeakExplanation`); costs a statistics
    /// read per allocation.
    pub explain: bool,
    /// Stop at the first allocation that runs out of memory (`headroom` only needs to know
    /// whether one does).
    pub stop_at_first_oom: bool,
    /// Find the moment of peak device memory (`RunReport::peak_moment`): reads the simulated
    /// device's memory in use after every allocation (no effect on `backend:cuda`); the
    /// timeline's samples then carry the highest value between them (`Sample::reserved_max`).
    #[serde(skip)]
    pub track_peak: bool,
}

/// A chunk of events and the phases known so far (`StepBegin` indexes them).
pub type Chunk<'a> = (&'a [Op], &'a [String]);

/// Events handed to the runner in chunks: a whole `Program` is one chunk, a generated workload
/// one chunk per iteration (`workload::agent::AgentStream`), so it is never held whole.
pub trait OpSource {
    /// The next chunk of events and the phases known so far, or `None` at the end.
    fn next_chunk(&mut self) -> Result<Option<Chunk<'_>>, String>;
    /// Events in total, or an estimate (for the timeline's sampling and progress).
    fn len_hint(&self) -> u64;
    /// Devices the events use.
    fn devices(&self) -> u16;
    /// Modelled compute time of each step generated so far, in order (empty: not modelled,
    /// as for traces).
    fn step_compute_s(&self) -> &[f64] {
        &[]
    }
}

/// A whole program as one chunk.
struct Whole<'a> {
    program: &'a Program,
    done: bool,
}

impl OpSource for Whole<'_> {
    fn next_chunk(&mut self) -> Result<Option<Chunk<'_>>, String> {
        if std::mem::replace(&mut self.done, true) {
            return Ok(None);
        }
        Ok(Some((&self.program.ops, &self.program.phases)))
    }

    fn len_hint(&self) -> u64 {
        self.program.ops.len() as u64
    }

    fn devices(&self) -> u16 {
        self.program.devices
    }
}

/// Runs `program` under `rc`. `metrics_addr`: serve live metrics while it runs.
pub fn run(
    program: &Program,
    rc: &RunConfig,
    progress: Option<&ProgressBar>,
    metrics_addr: Option<&str>,
) -> Result<RunReport, String> {
    run_source(&mut Whole { program, done: false }, rc, progress, metrics_addr)
}

/// Runs the events of `source` under `rc`, chunk by chunk. `metrics_addr`: serve live metrics
/// while it runs.
pub fn run_source(
    source: &mut dyn OpSource,
    rc: &RunConfig,
    progress: Option<&ProgressBar>,
    metrics_addr: Option<&str>,
) -> Result<RunReport, String> {
    let config = Config::parse(&rc.conf).map_err(|e| format!("configuration `{}`: {e}", rc.conf))?;
    let devices = config.sim.devices.max(1);
    if config.backend == stepalloc::BackendKind::Sim && devices < source.devices() as usize {
        return Err(format!("the program uses {} devices but the configuration has {devices}", source.devices()));
    }
    let allocator = Arc::new(Allocator::new(config).map_err(|e| format!("cannot create the allocator: {e}"))?);
    // The endpoint serves this run only: it is shut down (its port closed) when the run ends,
    // however it ends, so the next configuration can serve on the same address.
    let _server = match metrics_addr {
        Some(addr) => {
            let server = stepalloc::metrics::serve(allocator.clone(), addr)
                .map_err(|e| format!("--metrics-addr `{addr}` for `{}`: {e}", rc.name))?;
            crate::note!("serving live metrics of `{}` on http://{}/metrics", rc.name, server.addr);
            Some(ServerGuard(Some(server)))
        }
        None => None,
    };
    let mut runner = Runner::new(&allocator, source.devices());
    runner.explain = rc.explain;
    runner.track_peak = rc.track_peak && allocator.config().backend == stepalloc::BackendKind::Sim;
    let started = Instant::now();
    let stride = usize::try_from(source.len_hint() / TIMELINE_POINTS as u64).unwrap_or(usize::MAX).max(1);
    // Index of the next event over all chunks.
    let mut i = 0usize;
    'chunks: while let Some((ops, phases)) = source.next_chunk()? {
        for &op in ops {
            runner.apply(op, i, phases, rc.empty_cache_every_step)?;
            if rc.stop_at_first_oom && runner.ooms > 0 {
                i += 1;
                break 'chunks;
            }
            if i % stride == 0 {
                runner.sample(i as u64);
            }
            if i % 8192 == 0 {
                if let Some(pb) = progress {
                    pb.set_position(i as u64);
                }
            }
            i += 1;
        }
    }
    let ops = i as u64;
    let wall = started.elapsed().as_secs_f64();
    runner.sample(ops);
    if let Err(e) = allocator.check_invariants() {
        return Err(format!("allocator invariants broken after `{}`: {e}", rc.name));
    }
    let live: Vec<(u16, u64)> = runner.live.iter().flatten().map(|l| (l.device, l.ptr)).collect();
    let mut report = runner.finish(rc, ops, wall);
    report.set_step_compute(source.step_compute_s());
    // Give the memory back before the next configuration runs: on a GPU every run of the
    // comparison shares the one device (the allocator itself never releases at drop).
    for (device, addr) in live {
        let _ = allocator.free(device as usize, addr, 0);
    }
    let _ = allocator.empty_cache();
    Ok(report)
}

/// Shuts the metrics endpoint down when dropped.
struct ServerGuard(Option<stepalloc::metrics::MetricsServer>);

impl Drop for ServerGuard {
    fn drop(&mut self) {
        if let Some(server) = self.0.take() {
            server.shutdown();
        }
    }
}

/// Running totals of the driver's work (see `Runner::driver_totals`).
#[derive(Default)]
struct DriverTotals {
    time_s: f64,
    maps: Option<u64>,
    unmaps: Option<u64>,
    creates: Option<u64>,
}

struct Live {
    device: u16,
    ptr: u64,
    size: u64,
}

struct Runner<'a> {
    allocator: &'a Allocator,
    /// Allocation events seen so far (the next one's 0-based ordinal), failed ones included.
    allocs: u64,
    /// Ordinals of the allocations that ran out of memory (ascending), and the first's moment.
    failed_allocs: Vec<u64>,
    first_oom: Option<OomMoment>,
    /// With `track_peak`: the highest device memory in use since the last sample.
    window_max: u64,
    devices: usize,
    /// Devices the events use (reported one by one): at most `devices`.
    used: usize,
    /// By id: the live allocation, if any.
    live: Vec<Option<Live>>,
    requested: u64,
    /// By device (`devices` entries): live requested bytes, their peak, and OOMs.
    device_requested: Vec<u64>,
    device_floor: Vec<u64>,
    device_ooms: Vec<u64>,
    ooms: u64,
    skipped_frees: u64,
    errors: u64,
    first_error: Option<String>,
    steps: Vec<StepReport>,
    step_floor: u64,
    /// By device: live requested bytes' peak within the step, and reserved bytes at its begin.
    device_step_floor: Vec<u64>,
    device_step_reserved_begin: Vec<u64>,
    step_ooms: u64,
    step_index_op: usize,
    step_driver_begin: DriverTotals,
    ext_frag_at_step_end: Vec<f64>,
    /// Bytes each step end's external fragmentation leaves unused (`fragmentation::stranded`).
    stranded_at_step_end: Vec<f64>,
    int_frag_samples: Vec<f64>,
    timeline: Vec<Sample>,
    explain: bool,
    explained_at: u64,
    explanation: Option<PeakExplanation>,
    /// `RunConfig::track_peak`: the phase in progress and the peak of device memory in use so far.
    track_peak: bool,
    phase: Option<u16>,
    peak: Option<crate::report::PeakMoment>,
}

impl<'a> Runner<'a> {
    fn new(allocator: &'a Allocator, used: u16) -> Runner<'a> {
        let devices = allocator.device_count();
        Runner {
            allocator,
            allocs: 0,
            failed_allocs: Vec::new(),
            first_oom: None,
            window_max: 0,
            devices,
            used: usize::from(used).clamp(1, devices.max(1)),
            live: Vec::new(),
            requested: 0,
            device_requested: vec![0; devices],
            device_floor: vec![0; devices],
            device_ooms: vec![0; devices],
            ooms: 0,
            skipped_frees: 0,
            errors: 0,
            first_error: None,
            steps: Vec::new(),
            step_floor: 0,
            device_step_floor: vec![0; devices],
            device_step_reserved_begin: vec![0; devices],
            step_ooms: 0,
            step_index_op: 0,
            step_driver_begin: DriverTotals::default(),
            ext_frag_at_step_end: Vec::new(),
            stranded_at_step_end: Vec::new(),
            int_frag_samples: Vec::new(),
            timeline: Vec::with_capacity(TIMELINE_POINTS + 8),
            explain: false,
            explained_at: 0,
            explanation: None,
            track_peak: false,
            phase: None,
            peak: None,
        }
    }

    fn note_error(&mut self, what: String) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(what);
        }
    }

    fn apply(&mut self, op: Op, index: usize, phases: &[String], empty_cache_every_step: bool) -> Result<(), String> {
        match op {
            Op::Alloc { id, size, stream, device } => {
                let ordinal = self.allocs;
                self.allocs += 1;
                match self.allocator.malloc(device as usize, size, Stream(stream)) {
                    Ok(ptr) => {
                        // Ids are dense: the table grows as new ones appear.
                        if id as usize >= self.live.len() {
                            self.live.resize_with(id as usize + 1, || None);
                        }
                        self.live[id as usize] = Some(Live { device, ptr, size });
                        self.requested += size;
                        // The allocator accepted the device: it is below `devices`.
                        let d = device as usize;
                        self.device_requested[d] += size;
                        self.device_floor[d] = self.device_floor[d].max(self.device_requested[d]);
                        self.device_step_floor[d] = self.device_step_floor[d].max(self.device_requested[d]);
                        self.step_floor = self.step_floor.max(self.requested);
                        if self.explain {
                            self.maybe_explain(device as usize);
                        }
                        if self.track_peak {
                            self.note_peak(device as usize, index, phases);
                        }
                    }
                    Err(Error::OutOfMemory(report)) => {
                        if self.first_oom.is_none() {
                            self.first_oom = Some(OomMoment {
                                op: index as u64,
                                alloc: ordinal,
                                size,
                                stream,
                                device: device as usize,
                                step: self.phase.map(|_| self.steps.len() as u64 + 1),
                                phase: self.phase_name(phases),
                                allocated: report.allocated,
                                reserved: report.reserved,
                                device_free: report.device_free,
                                largest_free_block: report.largest_free_block,
                            });
                        }
                        self.failed_allocs.push(ordinal);
                        self.ooms += 1;
                        self.step_ooms += 1;
                        if let Some(n) = self.device_ooms.get_mut(device as usize) {
                            *n += 1;
                        }
                    }
                    Err(e) => self.note_error(format!("op {index}: malloc of {size} bytes: {e}")),
                }
            }
            Op::Free { id } => match self.live.get_mut(id as usize).and_then(Option::take) {
                Some(l) => {
                    self.requested -= l.size;
                    self.device_requested[l.device as usize] -= l.size;
                    if let Err(e) = self.allocator.free(l.device as usize, l.ptr, l.size) {
                        self.note_error(format!("op {index}: free of {:#x}: {e}", l.ptr));
                    }
                }
                None => self.skipped_frees += 1,
            },
            Op::RecordStream { id, stream } => {
                if let Some(Some(l)) = self.live.get(id as usize) {
                    if let Err(e) = self.allocator.record_stream(l.device as usize, l.ptr, Stream(stream)) {
                        self.note_error(format!("op {index}: record_stream: {e}"));
                    }
                }
            }
            Op::StepBegin { phase } => {
                let name = phases.get(phase as usize).map_or("step", String::as_str);
                self.allocator.step_begin(name).map_err(|e| format!("op {index}: step_begin: {e}"))?;
                self.phase = Some(phase);
                self.step_floor = self.requested;
                self.device_step_floor.copy_from_slice(&self.device_requested);
                self.step_ooms = 0;
                self.step_index_op = index;
                for d in 0..self.devices {
                    self.device_step_reserved_begin[d] =
                        self.allocator.with_heap(d, |h| h.reserved_at_step_begin()).unwrap_or(0);
                }
                self.step_driver_begin = self.driver_totals();
            }
            Op::StepEnd => {
                // External fragmentation as the step leaves the cache, before the step-end
                // policies: free mapped bytes the largest servable request leaves unused
                // (`fragmentation`), over the free mapped bytes, every device's summed.
                let (free, stranded) = fragmentation::of_allocator(self.allocator);
                self.ext_frag_at_step_end.push(fragmentation::share(free, stranded));
                self.stranded_at_step_end.push(stranded as f64);
                let figures = self.allocator.step_end().map_err(|e| format!("op {index}: step_end: {e}"))?;
                self.phase = None;
                if empty_cache_every_step {
                    self.allocator.empty_cache().map_err(|e| format!("op {index}: empty_cache: {e}"))?;
                }
                // The step's figures are its worst device's, as the run's headline is: a sum of
                // several devices' peaks is the peak of nothing.
                let worst = worst_device(
                    figures
                        .iter()
                        .zip(&self.device_step_floor)
                        .enumerate()
                        .map(|(d, (f, &floor))| (d, f.peak_reserved, floor)),
                )
                .unwrap_or(0);
                let mut step = StepReport {
                    step: figures.first().map_or(0, |f| f.steps),
                    phase: figures.first().map(|f| f.phase.clone()).unwrap_or_default(),
                    first_op: self.step_index_op as u64,
                    device: worst,
                    peak_requested: self.device_step_floor.get(worst).copied().unwrap_or(self.step_floor),
                    reserved_at_begin: self.device_step_reserved_begin.get(worst).copied().unwrap_or(0),
                    ooms: self.step_ooms,
                    ..Default::default()
                };
                if let Some(f) = figures.get(worst) {
                    step.peak_allocated = f.peak_allocated;
                    step.peak_reserved = f.peak_reserved;
                    step.device_mallocs = f.device_mallocs;
                }
                step.reserved_at_end =
                    self.allocator.stats(worst).map(|s| s.heap.reserved_bytes.all.current).unwrap_or(0);
                let (begin, end) = (&self.step_driver_begin, self.driver_totals());
                step.driver_time_s = end.time_s - begin.time_s;
                step.driver_maps = end.maps.map(|e| e.saturating_sub(begin.maps.unwrap_or(0)));
                step.driver_unmaps = end.unmaps.map(|e| e.saturating_sub(begin.unmaps.unwrap_or(0)));
                step.driver_creates = end.creates.map(|e| e.saturating_sub(begin.creates.unwrap_or(0)));
                step.fragmentation = if step.peak_reserved == 0 {
                    0.0
                } else {
                    1.0 - step.peak_allocated as f64 / step.peak_reserved as f64
                };
                self.steps.push(step);
            }
            Op::EmptyCache => {
                self.allocator.empty_cache().map_err(|e| format!("op {index}: empty_cache: {e}"))?;
            }
            Op::Advance { ns } => self.allocator.advance_time(ns),
        }
        Ok(())
    }

    /// Records what holds the reserved bytes when they pass the last recorded peak by more than
    /// 1% (so the description is of a moment within 1% of the true peak).
    fn maybe_explain(&mut self, device: usize) {
        let Ok(stats) = self.allocator.stats(device) else { return };
        let reserved = stats.heap.reserved_bytes.all.current;
        if reserved <= self.explained_at + self.explained_at / 100 {
            return;
        }
        self.explained_at = reserved;
        let Ok((segments, live)) = self.allocator.with_heap(device, |h| (h.segments(), h.live_blocks())) else {
            return;
        };
        self.explanation = Some(PeakExplanation::of(device, &stats, self.requested, segments, &live));
    }

    /// The name of the phase in progress, if any.
    fn phase_name(&self, phases: &[String]) -> Option<String> {
        self.phase.map(|p| phases.get(p as usize).map_or("step", String::as_str).to_string())
    }

    /// Records the moment one device's memory in use passes the highest any device reached so far:
    /// the event, the step and phase in progress, and the pools of the device that grew (read
    /// at each new peak only: device memory grows in whole segments or pages).
    fn note_peak(&mut self, device: usize, index: usize, phases: &[String]) {
        // Only this device's memory grew; the peak is the highest any one device reached (a
        // device's capacity is what a configuration must fit in).
        let Ok(Ok((free, total))) = self.allocator.with_heap(device, |h| h.device_mem_info()) else { return };
        let used = total.saturating_sub(free);
        self.window_max = self.window_max.max(used);
        let peak_so_far = self.peak.as_ref().map_or(0, |p| p.device_used);
        if used <= peak_so_far {
            return;
        }
        let mut moment = self.peak.take().unwrap_or_default();
        moment.op = index as u64;
        moment.device_used = used;
        moment.device = device;
        moment.step = self.phase.map(|_| self.steps.len() as u64);
        moment.phase = self.phase_name(phases);
        if let Ok(s) = self.allocator.stats(device) {
            let h = &s.heap;
            let pool = |p: &stepalloc::stats::PoolStat, small: bool| -> u64 {
                if small {
                    p.small_pool.current
                } else {
                    p.large_pool.current
                }
            };
            for (small, figures) in [(true, &mut moment.small), (false, &mut moment.large)] {
                *figures = crate::report::PoolFigures {
                    reserved: pool(&h.reserved_bytes, small),
                    allocated: pool(&h.allocated_bytes, small),
                    requested: pool(&h.requested_bytes, small),
                };
            }
        }
        self.peak = Some(moment);
    }

    /// Driver time and virtual-memory calls so far, summed over devices.
    fn driver_totals(&self) -> DriverTotals {
        let mut t = DriverTotals::default();
        for d in 0..self.devices {
            let Ok(s) = self.allocator.stats(d) else { continue };
            let map = s.to_map();
            t.time_s += driver_seconds(&map);
            add_opt(&mut t.maps, stat_u64(&map, NUM_MAP_KEYS));
            add_opt(&mut t.unmaps, stat_u64(&map, NUM_UNMAP_KEYS));
            add_opt(&mut t.creates, stat_u64(&map, NUM_CREATE_KEYS));
        }
        t
    }

    fn sample(&mut self, op: u64) {
        let (mut allocated, mut reserved, mut requested) = (0, 0, 0);
        for d in 0..self.devices {
            if let Ok(s) = self.allocator.stats(d) {
                allocated += s.heap.allocated_bytes.all.current;
                reserved += s.heap.reserved_bytes.all.current;
                requested += s.heap.requested_bytes.all.current;
            }
        }
        if allocated > 0 {
            self.int_frag_samples.push(1.0 - requested as f64 / allocated as f64);
        }
        let reserved_max = std::mem::take(&mut self.window_max).max(reserved);
        self.timeline.push(Sample { op, requested: self.requested, allocated, reserved, reserved_max });
    }

    /// One device's figures from its statistics and the runner's own counts.
    fn device_report(&self, d: usize) -> DeviceReport {
        let mut f = DeviceFigures { floor: self.device_floor[d], ..Default::default() };
        let mut alloc_retries = 0;
        if let Ok(s) = self.allocator.stats(d) {
            let h = &s.heap;
            f.peak_allocated = h.allocated_bytes.all.peak;
            f.peak_reserved = h.reserved_bytes.all.peak;
            f.stats_peak_requested = h.requested_bytes.all.peak;
            f.device_mallocs = h.num_device_alloc;
            f.device_frees = h.num_device_free;
            f.device_malloc_time_s = s.driver_time.reserve_ns as f64 * 1e-9;
            f.device_free_time_s = s.driver_time.release_ns as f64 * 1e-9;
            alloc_retries = h.num_alloc_retries;
            f.final_reserved = h.reserved_bytes.all.current;
            let map = s.to_map();
            f.driver_maps = stat_u64(&map, NUM_MAP_KEYS);
            f.driver_unmaps = stat_u64(&map, NUM_UNMAP_KEYS);
            f.driver_creates = stat_u64(&map, NUM_CREATE_KEYS);
            f.moved_bytes = stat_u64(&map, MOVED_BYTES_KEYS);
            f.driver_time_s = driver_seconds(&map);
        }
        f.reserved_over_floor = ratio(f.peak_reserved, f.floor);
        f.allocated_over_floor = ratio(f.peak_allocated, f.floor);
        DeviceReport { device: d, figures: f, alloc_retries, ooms: self.device_ooms[d] }
    }

    fn finish(self, rc: &RunConfig, ops: u64, wall: f64) -> RunReport {
        let devices: Vec<DeviceReport> = (0..self.used).map(|d| self.device_report(d)).collect();
        let worst = worst_device(devices.iter().map(|d| (d.device, d.figures.peak_reserved, d.figures.floor)))
            .and_then(|w| devices.get(w))
            .cloned()
            .unwrap_or_default();
        let mut r = RunReport {
            name: rc.name.clone(),
            conf: rc.conf.clone(),
            worst: worst.figures,
            alloc_retries: devices.iter().map(|d| d.alloc_retries).sum(),
            worst_device: worst.device,
            ..Default::default()
        };
        r.devices = devices;
        r.ops = ops;
        r.ooms = self.ooms;
        r.skipped_frees = self.skipped_frees;
        r.errors = self.errors;
        r.first_error = self.first_error;
        r.steps_count = self.steps.len() as u64;
        r.driver_time_per_step_s = r.worst.driver_time_s / r.steps_count.max(1) as f64;
        r.reserved_at_step_begin_mean = mean(self.steps.iter().map(|s| s.reserved_at_begin as f64));
        r.reserved_at_step_end_mean = mean(self.steps.iter().map(|s| s.reserved_at_end as f64));
        r.step_fragmentation_mean = mean(self.steps.iter().map(|s| s.fragmentation));
        r.external_fragmentation_mean = mean(self.ext_frag_at_step_end.iter().copied());
        r.stranded_free_at_step_end_mean = mean(self.stranded_at_step_end.iter().copied());
        r.internal_fragmentation_mean = mean(self.int_frag_samples.iter().copied());
        r.cached_free_mean = mean(self.timeline.iter().map(|s| s.reserved.saturating_sub(s.allocated) as f64));
        r.wall_s = wall;
        r.ops_per_s = if wall > 0.0 { r.ops as f64 / wall } else { 0.0 };
        r.steps = self.steps;
        r.timeline = self.timeline;
        r.peak_explanation = self.explanation;
        r.peak_moment = self.peak;
        r.first_oom = self.first_oom;
        r.failed_allocs = self.failed_allocs;
        r
    }
}

/// Keys of the core's virtual-memory statistics (under `stepalloc.`), each with the spellings
/// accepted, first match wins; a build without virtual memory has none of them.
const NUM_MAP_KEYS: &[&str] = &["stepalloc.num_map"];
const NUM_UNMAP_KEYS: &[&str] = &["stepalloc.num_unmap"];
const NUM_CREATE_KEYS: &[&str] = &["stepalloc.num_create"];
const MOVED_BYTES_KEYS: &[&str] = &["stepalloc.moved_bytes"];

/// The first of `keys` present in the statistics map as an unsigned number.
pub fn stat_u64(map: &BTreeMap<String, serde_json::Value>, keys: &[&str]) -> Option<u64> {
    keys.iter().find_map(|k| map.get(*k).and_then(serde_json::Value::as_u64))
}

/// Modelled (or measured) seconds in every driver call the statistics time:
/// the sum of `stepalloc.driver_seconds.*`.
pub fn driver_seconds(map: &BTreeMap<String, serde_json::Value>) -> f64 {
    map.range("stepalloc.driver_seconds.".to_string()..)
        .take_while(|(k, _)| k.starts_with("stepalloc.driver_seconds."))
        .filter_map(|(_, v)| v.as_f64())
        .sum()
}

fn add_opt(total: &mut Option<u64>, value: Option<u64>) {
    if let Some(v) = value {
        *total = Some(total.unwrap_or(0) + v);
    }
}

pub fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (mut sum, mut n) = (0.0, 0usize);
    for v in values {
        sum += v;
        n += 1;
    }
    if n == 0 {
        0.0
    } else {
        sum / n as f64
    }
}
