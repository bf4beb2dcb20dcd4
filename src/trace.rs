//! The event ring: the last N allocator events of a device, kept when `trace_entries` > 0.
//! It feeds the snapshot's `device_traces` and stepalloc's own JSON-lines trace format, which
//! the stress tool replays.
//!
//! Recording writes into a buffer allocated once at start; the hot path never allocates here.

use serde::Serialize;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceAction {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    /// Pages mapped into an expandable segment (PyTorch's `segment_map`).
    SegmentMap,
    SegmentUnmap,
    Oom,
    StepBegin,
    StepEnd,
}

impl TraceAction {
    /// The action's name in PyTorch's snapshot `device_traces` (step markers are stepalloc's).
    pub fn torch_name(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
            TraceAction::SegmentMap => "segment_map",
            TraceAction::SegmentUnmap => "segment_unmap",
            TraceAction::Oom => "oom",
            TraceAction::StepBegin => "step_begin",
            TraceAction::StepEnd => "step_end",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TraceEntry {
    pub action: TraceAction,
    pub addr: u64,
    /// Block or segment bytes (for `alloc`, the rounded size).
    pub size: u64,
    /// Bytes the caller asked for (`alloc`, `free_requested`).
    pub requested: u64,
    pub stream: u64,
    /// Microseconds since the ring was created.
    pub time_us: u64,
    /// Phase index for step markers (see `Heap::phase_name`).
    pub phase: u32,
}

pub struct TraceRing {
    entries: Vec<TraceEntry>,
    capacity: usize,
    /// Entries ever recorded; the oldest kept one is `total - len`.
    total: u64,
    start: Instant,
}

impl TraceRing {
    pub fn new(capacity: usize) -> TraceRing {
        TraceRing { entries: Vec::with_capacity(capacity), capacity, total: 0, start: Instant::now() }
    }

    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    #[inline]
    pub fn record(&mut self, action: TraceAction, addr: u64, size: u64, requested: u64, stream: u64, phase: u32) {
        if self.capacity == 0 {
            return;
        }
        let entry = TraceEntry {
            action,
            addr,
            size,
            requested,
            stream,
            time_us: self.start.elapsed().as_micros() as u64,
            phase,
        };
        if self.entries.len() < self.capacity {
            self.entries.push(entry);
        } else {
            self.entries[(self.total % self.capacity as u64) as usize] = entry;
        }
        self.total += 1;
    }

    /// Kept entries, oldest first.
    pub fn entries(&self) -> Vec<TraceEntry> {
        if self.entries.len() < self.capacity || self.capacity == 0 {
            return self.entries.clone();
        }
        let split = (self.total % self.capacity as u64) as usize;
        let mut out = self.entries[split..].to_vec();
        out.extend_from_slice(&self.entries[..split]);
        out
    }

    /// Entries lost because the ring wrapped.
    pub fn dropped(&self) -> u64 {
        self.total - self.entries.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_newest_entries_in_order() {
        let mut ring = TraceRing::new(3);
        for i in 0..5 {
            ring.record(TraceAction::Alloc, i, 512, 1, 0, 0);
        }
        let addrs: Vec<u64> = ring.entries().iter().map(|e| e.addr).collect();
        assert_eq!(addrs, [2, 3, 4]);
        assert_eq!(ring.dropped(), 2);
        let mut off = TraceRing::new(0);
        off.record(TraceAction::Alloc, 1, 512, 1, 0, 0);
        assert!(off.entries().is_empty() && !off.enabled());
    }
}
