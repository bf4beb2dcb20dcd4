//! The event stream every workload and trace parser produces and the runner consumes.
//!
//! Invariants of a `Program` built through `ProgramBuilder`: allocation ids are dense
//! (0..ids), each id is allocated at most once and freed at most once after its allocation;
//! `StepBegin` phases index `phases`; devices are below `devices`. Parsers of foreign traces
//! keep these invariants by skipping (and counting) events that would break them.

use serde::Serialize;

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
}

/// PyTorch's native allocator's reserved bytes, from a snapshot's segment events and segments.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct NativeFigures {
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
    /// Number of allocation ids used (ids are 0..ids).
    pub ids: u32,
    /// Number of devices the program touches.
    pub devices: u16,
    pub notes: SourceNotes,
}

impl Program {
    pub fn count_allocs(&self) -> usize {
        self.ops.iter().filter(|op| matches!(op, Op::Alloc { .. })).count()
    }
}

/// Builds a `Program`, handing out ids and interning phase names.
#[derive(Debug, Default)]
pub struct ProgramBuilder {
    program: Program,
}

impl ProgramBuilder {
    pub fn new(format: &str) -> ProgramBuilder {
        let mut b = ProgramBuilder::default();
        b.program.notes.format = format.to_string();
        b.program.devices = 1;
        b
    }

    pub fn alloc(&mut self, size: u64, stream: u64, device: u16) -> u32 {
        let id = self.program.ids;
        self.program.ids += 1;
        self.program.devices = self.program.devices.max(device + 1);
        self.program.ops.push(Op::Alloc { id, size, stream, device });
        id
    }

    pub fn free(&mut self, id: u32) {
        self.program.ops.push(Op::Free { id });
    }

    pub fn record_stream(&mut self, id: u32, stream: u64) {
        self.program.ops.push(Op::RecordStream { id, stream });
    }

    pub fn step_begin(&mut self, phase: &str) {
        let index = match self.program.phases.iter().position(|p| p == phase) {
            Some(i) => i,
            None => {
                self.program.phases.push(phase.to_string());
                self.program.phases.len() - 1
            }
        };
        self.program.ops.push(Op::StepBegin { phase: index as u16 });
    }

    pub fn step_end(&mut self) {
        self.program.ops.push(Op::StepEnd);
    }

    pub fn empty_cache(&mut self) {
        self.program.ops.push(Op::EmptyCache);
    }

    pub fn advance(&mut self, ns: u64) {
        if ns > 0 {
            self.program.ops.push(Op::Advance { ns });
        }
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

    pub fn finish(self) -> Program {
        self.program
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
