//! The event stream every workload and trace parser produces and the runner consumes.
//!
//! Invariants of a `Program` built through `ProgramBuilder`: allocation ids are dense
//! (0..ids); an id is freed at most once after its allocation, and handed out again only after
//! that free (so ids stay below the most blocks ever live at once, however long the stream);
//! `StepBegin` phases index `phases`; devices are below `devices`. Parsers of foreign traces
//! keep these invariants by skipping (and counting) events that would break them.
//!
//! Bounds (every producer goes through `ProgramBuilder`, so none can exceed them): at most
//! `MAX_OPS` events, devices below `MAX_DEVICES`, at most `stepalloc::step::MAX_PHASES` phases,
//! and simulated time that never passes `MAX_TIME_NS` in total. The first bound an input
//! crosses is kept as the builder's `limit_error`; from then on the builder records nothing,
//! and the producer reports the error (with its own position) instead of a program.

use serde::Serialize;

/// Events in one program at most: 2^26 events take about 1.6 GB (24 bytes each).
pub const MAX_OPS: usize = 1 << 26;
/// Devices a program may use: the simulated device's limit (`sim_devices` 1..64).
pub const MAX_DEVICES: u16 = 64;
/// Simulated time a program may advance in total (2^62 ns, about 146 years): jumps beyond it
/// are cut so the device's clock, which adds its own delays on top, never overflows.
pub const MAX_TIME_NS: u64 = 1 << 62;

/// One event of a workload or trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Alloc {
        id: u32,
        size: u64,
        stream: u64,
        device: u16,
    },
    Free {
        id: u32,
    },
    RecordStream {
        id: u32,
        stream: u64,
    },
    StepBegin {
        phase: u16,
    },
    StepEnd,
    EmptyCache,
    /// Simulated time passes (kernel time; lets the simulated device complete events).
    Advance {
        ns: u64,
    },
}

/// What a trace parser noticed beside the events themselves.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SourceNotes {
    /// Trace format or workload name.
    pub format: String,
    /// Frees of addresses not live in the trace (allocated before recording began): skipped.
    pub unknown_frees: u64,
    /// Allocations at an address that was still live (a lost free): the old one is dropped.
    pub duplicate_allocs: u64,
    /// Events of kinds the replay does not use (segment events, OOM markers, ...).
    pub ignored_events: u64,
    /// Allocation failures recorded in the trace itself.
    pub recorded_failures: u64,
    /// The native allocator's own figures, when the trace holds them.
    pub native: Option<NativeFigures>,
    /// The recording allocator's configuration as `PYTORCH_CUDA_ALLOC_CONF` would spell it
    /// (from a snapshot's `allocator_settings`; empty: PyTorch's defaults), when recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocator_conf: Option<String>,
    /// Where each allocation was made, when the trace records it (not in reports).
    #[serde(skip)]
    pub sites: Sites,
}

/// Allocation sites: one per `Alloc`, in order, indexing `names` and `ops`. Kept beside the
/// events so the replay loop does not carry them. A PyTorch snapshot with frames gives each
/// allocation its top user frame; a recorded trace (JSON lines with `module` / `torch_op`) its
/// module path and operator.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sites {
    /// Empty when the trace recorded no sites.
    pub per_alloc: Vec<u32>,
    /// Interned name of each site, what attribution groups by: `file:line name` of the top user
    /// frame, or the module path. Entry 0 is the site of an allocation that has none
    /// (`SiteKind::none`); so is a recorded allocation outside every module.
    pub names: Vec<String>,
    /// The operator of each site (a recorded trace's `torch_op`), parallel to `names`; empty
    /// where not recorded.
    pub ops: Vec<String>,
    pub kind: SiteKind,
}

/// What a trace's sites are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SiteKind {
    /// The top user frame of a PyTorch snapshot's call stack.
    #[default]
    Frames,
    /// The module path and operator a recorder wrote (`module`, `torch_op`).
    Modules,
}

impl SiteKind {
    /// The name of site 0: an allocation with no site.
    pub fn none(self) -> &'static str {
        match self {
            SiteKind::Frames => "(no frame)",
            SiteKind::Modules => "(none)",
        }
    }

    /// How attribution groups by these sites, for reports.
    pub fn grouping(self) -> &'static str {
        match self {
            SiteKind::Frames => "by call site (top user frame)",
            SiteKind::Modules => "by module",
        }
    }
}

/// Distinct sites a program may have (module and operator pairs, or frames): a 7B model's
/// recorded step has a few thousand.
pub const MAX_SITES: usize = 1 << 16;

/// The recording allocator's reserved bytes, from a snapshot's segment events and segments.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct NativeFigures {
    /// Which allocator recorded them: PyTorch's native allocator, or stepalloc (its own
    /// snapshots).
    pub allocator: String,
    /// Peak reserved over the trace, from replaying segment_alloc / segment_free on top of
    /// the reserved bytes the trace started from (derived from `segments` when present).
    pub peak_reserved: Option<u64>,
    /// Reserved at snapshot time: the sum of `segments[].total_size`.
    pub current_reserved: Option<u64>,
    pub segment_allocs: u64,
    pub segment_frees: u64,
}

/// A whole event stream.
#[derive(Clone, Debug, Default)]
pub struct Program {
    pub ops: Vec<Op>,
    pub phases: Vec<String>,
    /// Number of allocation ids used (ids are 0..ids; an id is reused after its free).
    pub ids: u32,
    /// Number of devices the program touches.
    pub devices: u16,
    pub notes: SourceNotes,
}

impl Program {
    pub fn count_allocs(&self) -> usize {
        self.ops.iter().filter(|op| matches!(op, Op::Alloc { .. })).count()
    }

    /// Whether allocation sites (call stacks) were recorded (`SourceNotes::sites`).
    pub fn has_sites(&self) -> bool {
        !self.notes.sites.per_alloc.is_empty()
    }

    /// The site of the `n`-th allocation (0 when not recorded), and the name of a site.
    pub fn site_of(&self, n: usize) -> u32 {
        self.notes.sites.per_alloc.get(n).copied().unwrap_or(0)
    }

    pub fn site_name(&self, site: u32) -> &str {
        self.notes.sites.names.get(site as usize).map_or("", String::as_str)
    }

    /// The operator of a site ("" when not recorded).
    pub fn site_op(&self, site: u32) -> &str {
        self.notes.sites.ops.get(site as usize).map_or("", String::as_str)
    }
}

/// Builds a `Program`, handing out ids and interning phase names.
#[derive(Debug)]
pub struct ProgramBuilder {
    program: Program,
    /// Simulated time advanced so far (at most `MAX_TIME_NS`).
    time_ns: u64,
    /// The first bound crossed (see the module docs); nothing is recorded after it.
    limit_error: Option<String>,
    /// Events at most (`MAX_OPS` unless lowered), counted since the last `take_ops`.
    max_ops: usize,
    /// Ids freed and not handed out again (reused last freed first).
    free_ids: Vec<u32>,
    /// By id: whether it is allocated now (only such an id is recycled at its free, so a
    /// producer's double free never hands one id to two live blocks).
    live_ids: Vec<bool>,
    /// Allocations recorded so far.
    allocs: usize,
    /// Whether allocations carry sites (`enable_sites`), the site of the next allocation, and
    /// the index of each interned site by its key (`site_key`).
    track_sites: bool,
    next_site: u32,
    site_index: std::collections::HashMap<String, u32>,
    /// A reused buffer for `site_key`.
    key: String,
}

impl Default for ProgramBuilder {
    fn default() -> ProgramBuilder {
        ProgramBuilder::new("")
    }
}

impl ProgramBuilder {
    pub fn new(format: &str) -> ProgramBuilder {
        let mut program = Program::default();
        program.notes.format = format.to_string();
        program.devices = 1;
        ProgramBuilder {
            program,
            time_ns: 0,
            limit_error: None,
            max_ops: MAX_OPS,
            free_ids: Vec::new(),
            live_ids: Vec::new(),
            allocs: 0,
            track_sites: false,
            next_site: 0,
            site_index: std::collections::HashMap::new(),
            key: String::new(),
        }
    }

    /// Records a site for every allocation (`SourceNotes::sites`): the allocations made before
    /// this call get site 0 (none).
    pub fn enable_sites(&mut self, kind: SiteKind) {
        if !self.track_sites {
            self.track_sites = true;
            let sites = &mut self.program.notes.sites;
            sites.kind = kind;
            sites.names = vec![kind.none().to_string()];
            sites.ops = vec![String::new()];
            sites.per_alloc = vec![0; self.allocs];
        }
    }

    /// Sets the site of the next allocation (interned); ignored unless `enable_sites` was called.
    pub fn set_next_site(&mut self, name: &str) {
        self.set_next_site_with_op(name, "");
    }

    /// Sets the site of the next allocation to `name` and operator `op` (interned); ignored
    /// unless `enable_sites` was called. More than `MAX_SITES` distinct sites is a bound crossed.
    pub fn set_next_site_with_op(&mut self, name: &str, op: &str) {
        if !self.track_sites {
            return;
        }
        // The key: the name, a NUL, the operator (a name never holds a NUL where ops exist:
        // the JSON-lines reader refuses control characters).
        self.key.clear();
        self.key.push_str(name);
        self.key.push('\0');
        self.key.push_str(op);
        if let Some(&i) = self.site_index.get(self.key.as_str()) {
            self.next_site = i;
            return;
        }
        let sites = &mut self.program.notes.sites;
        if sites.names.len() >= MAX_SITES {
            return self.fail(format!(
                "more than {MAX_SITES} distinct allocation sites (module and operator pairs, or frames): over the \
                 limit of one trace"
            ));
        }
        // Below MAX_SITES: fits u32.
        let i = sites.names.len() as u32;
        sites.names.push(name.to_string());
        sites.ops.push(op.to_string());
        self.site_index.insert(self.key.clone(), i);
        self.next_site = i;
    }

    /// Lowers the bound on events below `MAX_OPS` (tests, callers with less memory).
    pub fn with_max_ops(mut self, max_ops: usize) -> ProgramBuilder {
        self.max_ops = max_ops.min(MAX_OPS);
        self
    }

    /// Records the first bound crossed; later ones add nothing.
    fn fail(&mut self, what: String) {
        self.limit_error.get_or_insert(what);
    }

    /// Whether one more event fits; records the error when it does not.
    fn room(&mut self) -> bool {
        if self.limit_error.is_some() {
            return false;
        }
        if self.program.ops.len() >= self.max_ops {
            self.fail(format!("more than {} events: over the limit of one program", self.max_ops));
            return false;
        }
        true
    }

    /// The first bound the program crossed, if any (see the module docs).
    pub fn limit_error(&self) -> Option<&str> {
        self.limit_error.as_deref()
    }

    /// Allocates a new id. Once a bound is crossed nothing is recorded and the id returned is
    /// a placeholder (the program is never finished then).
    pub fn alloc(&mut self, size: u64, stream: u64, device: u16) -> u32 {
        if device >= MAX_DEVICES {
            self.fail(format!("device {device} is out of range (devices 0..{} at most)", MAX_DEVICES - 1));
        }
        if !self.room() {
            return 0;
        }
        // New ids stay below the most blocks live at once.
        let id = match self.free_ids.pop() {
            Some(id) => id,
            None if self.program.ids == u32::MAX => {
                self.fail(format!("more than {} blocks live at once", u32::MAX));
                return 0;
            }
            None => {
                self.program.ids += 1;
                self.live_ids.push(false);
                self.program.ids - 1
            }
        };
        self.live_ids[id as usize] = true;
        self.program.devices = self.program.devices.max(device + 1);
        self.program.ops.push(Op::Alloc { id, size, stream, device });
        self.allocs += 1;
        if self.track_sites {
            self.program.notes.sites.per_alloc.push(std::mem::take(&mut self.next_site));
        }
        id
    }

    pub fn free(&mut self, id: u32) {
        if self.room() {
            self.program.ops.push(Op::Free { id });
            if let Some(live) = self.live_ids.get_mut(id as usize) {
                if *live {
                    *live = false;
                    self.free_ids.push(id);
                }
            }
        }
    }

    pub fn record_stream(&mut self, id: u32, stream: u64) {
        if self.room() {
            self.program.ops.push(Op::RecordStream { id, stream });
        }
    }

    pub fn step_begin(&mut self, phase: &str) {
        let index = match self.program.phases.iter().position(|p| p == phase) {
            Some(i) => i,
            None if self.program.phases.len() >= stepalloc::step::MAX_PHASES => {
                return self.fail(format!(
                    "phase `{phase}` is one more than the {} distinct phases allowed",
                    stepalloc::step::MAX_PHASES
                ));
            }
            None => {
                self.program.phases.push(phase.to_string());
                self.program.phases.len() - 1
            }
        };
        if self.room() {
            // Below MAX_PHASES, so it fits u16.
            self.program.ops.push(Op::StepBegin { phase: index as u16 });
        }
    }

    pub fn step_end(&mut self) {
        if self.room() {
            self.program.ops.push(Op::StepEnd);
        }
    }

    pub fn empty_cache(&mut self) {
        if self.room() {
            self.program.ops.push(Op::EmptyCache);
        }
    }

    /// Simulated time passes; the program's total is cut at `MAX_TIME_NS`.
    pub fn advance(&mut self, ns: u64) {
        let ns = ns.min(MAX_TIME_NS - self.time_ns);
        if ns > 0 && self.room() {
            self.time_ns += ns;
            self.program.ops.push(Op::Advance { ns });
        }
    }

    /// Takes the events recorded so far (a stream hands them out in chunks); the bound on
    /// events counts from here again. Ids, phases and devices carry on.
    pub fn take_ops(&mut self) -> Vec<Op> {
        std::mem::take(&mut self.program.ops)
    }

    /// The phases seen so far (`StepBegin` indexes them).
    pub fn phases(&self) -> &[String] {
        &self.program.phases
    }

    /// Ids handed out so far (every id is below it).
    pub fn ids(&self) -> u32 {
        self.program.ids
    }

    /// Simulated time advanced so far.
    pub fn time_ns(&self) -> u64 {
        self.time_ns
    }

    pub fn notes_mut(&mut self) -> &mut SourceNotes {
        &mut self.program.notes
    }

    pub fn len(&self) -> usize {
        self.program.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.program.ops.is_empty()
    }

    /// The program, or the first bound it crossed.
    pub fn finish(self) -> Result<Program, String> {
        match self.limit_error {
            Some(e) => Err(e),
            None => Ok(self.program),
        }
    }
}

/// Maps a trace's addresses to allocation ids, per device.
#[derive(Debug, Default)]
pub struct AddressMap {
    live: std::collections::HashMap<(u16, u64), u32>,
}

impl AddressMap {
    /// Records an allocation at `addr`; returns its id.
    pub fn alloc(&mut self, b: &mut ProgramBuilder, device: u16, addr: u64, size: u64, stream: u64) -> u32 {
        let id = b.alloc(size, stream, device);
        if let Some(old) = self.live.insert((device, addr), id) {
            // The trace lost the free of the old block: free it here so the replay stays sane.
            b.free(old);
            b.notes_mut().duplicate_allocs += 1;
        }
        id
    }

    /// Records a free of `addr`; unknown addresses are skipped and counted.
    pub fn free(&mut self, b: &mut ProgramBuilder, device: u16, addr: u64) {
        match self.live.remove(&(device, addr)) {
            Some(id) => b.free(id),
            None => b.notes_mut().unknown_frees += 1,
        }
    }

    pub fn lookup(&self, device: u16, addr: u64) -> Option<u32> {
        self.live.get(&(device, addr)).copied()
    }
}
