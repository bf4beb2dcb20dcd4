//! The event ring: the last N allocator events of a device, kept when `trace_entries` > 0.
//! It feeds the snapshot's `device_traces` and stepalloc's own JSON-lines trace format, which
//! the stress tool replays.
//!
//! The ring's memory grows with use, up to `trace_entries`, by fallible reservations: nothing is
//! taken at start, and a refused reservation leaves a smaller ring, never an abort.

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
    /// Kept entries. Grows on demand up to `limit` (nothing is reserved at start: a large
    /// `trace_entries` on many devices must not take memory it never uses); once full, the
    /// oldest entry is at `next` and each new entry overwrites it.
    entries: Vec<TraceEntry>,
    /// `trace_entries`: the most entries kept; 0 = off.
    limit: usize,
    /// The ring stopped growing: it reached `limit`, or memory for more entries was refused (the
    /// ring then keeps what it holds and wraps there; a refusal never aborts the process).
    full: bool,
    /// When full, the slot of the oldest entry (the next one overwritten).
    next: usize,
    /// Entries ever recorded; the oldest kept one is `total - len`.
    total: u64,
    start: Instant,
}

/// The ring grows by at least this many entries at a time (then doubling).
const MIN_GROWTH: usize = 64;

impl TraceRing {
    pub fn new(limit: usize) -> TraceRing {
        TraceRing { entries: Vec::new(), limit, full: false, next: 0, total: 0, start: Instant::now() }
    }

    pub fn enabled(&self) -> bool {
        self.limit > 0
    }

    /// Starts over with a new limit (`torch.cuda.memory._record_memory_history`): the kept
    /// entries are dropped and their memory given back; 0 stops recording.
    pub fn restart(&mut self, limit: usize) {
        self.entries = Vec::new();
        self.limit = limit;
        self.full = false;
        self.next = 0;
        self.total = 0;
    }

    /// The most entries kept (`trace_entries`, or the last `restart`); 0 = off.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Entries the ring has memory for now (at most `trace_entries`).
    pub fn allocated(&self) -> usize {
        self.entries.capacity()
    }

    /// Records an entry when tracing is on. The check is inlined into the hot path; the
    /// recording is not (with tracing off, as by default, a malloc or free pays one compare).
    #[inline(always)]
    pub fn record(&mut self, action: TraceAction, addr: u64, size: u64, requested: u64, stream: u64, phase: u32) {
        if self.limit != 0 {
            self.push(action, addr, size, requested, stream, phase);
        }
    }

    #[inline(never)]
    fn push(&mut self, action: TraceAction, addr: u64, size: u64, requested: u64, stream: u64, phase: u32) {
        let time_us = u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX);
        let entry = TraceEntry { action, addr, size, requested, stream, time_us, phase };
        self.total = self.total.saturating_add(1);
        if !self.full {
            if self.entries.len() == self.entries.capacity() && !self.grow() {
                self.full = true;
            } else {
                self.entries.push(entry);
                self.full = self.entries.len() >= self.limit;
                return;
            }
        }
        if let Some(slot) = self.entries.get_mut(self.next) {
            *slot = entry;
            self.next = (self.next + 1) % self.entries.len();
        }
    }

    /// Makes room for more entries (doubling, up to `limit`); false when memory is refused.
    #[cold]
    fn grow(&mut self) -> bool {
        let len = self.entries.len();
        let more = len.max(MIN_GROWTH).min(self.limit - len);
        self.entries.try_reserve_exact(more).is_ok()
    }

    /// Kept entries, oldest first.
    pub fn entries(&self) -> Vec<TraceEntry> {
        if !self.full {
            return self.entries.clone();
        }
        let mut out = self.entries[self.next..].to_vec();
        out.extend_from_slice(&self.entries[..self.next]);
        out
    }

    /// Entries lost because the ring wrapped (or had no memory for them).
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

    #[test]
    fn restart_drops_the_history_and_sets_the_new_limit() {
        let mut ring = TraceRing::new(0);
        ring.record(TraceAction::Alloc, 1, 512, 1, 0, 0);
        assert!(ring.entries().is_empty(), "off: nothing kept");
        ring.restart(2);
        for i in 0..3 {
            ring.record(TraceAction::Alloc, i, 512, 1, 0, 0);
        }
        let addrs: Vec<u64> = ring.entries().iter().map(|e| e.addr).collect();
        assert_eq!(addrs, [1, 2]);
        ring.restart(0);
        ring.record(TraceAction::Alloc, 9, 512, 1, 0, 0);
        assert!(ring.entries().is_empty() && ring.allocated() == 0 && !ring.enabled());
    }

    #[test]
    fn ring_memory_grows_with_use_not_with_the_limit() {
        // `trace_entries:67108864` on 64 devices must not reserve 64 x 3.5 GiB at start.
        let mut ring = TraceRing::new(1 << 26);
        assert_eq!(ring.allocated(), 0, "nothing is reserved before the first entry");
        for i in 0..1000 {
            ring.record(TraceAction::Alloc, i, 512, 1, 0, 0);
        }
        assert!(ring.allocated() < 4096, "{}", ring.allocated());
        assert_eq!(ring.entries().len(), 1000);
        assert_eq!(ring.dropped(), 0);
        // Wrapping past a limit that is not a multiple of the growth step keeps the order.
        let mut ring = TraceRing::new(100);
        for i in 0..250 {
            ring.record(TraceAction::Alloc, i, 512, 1, 0, 0);
        }
        let addrs: Vec<u64> = ring.entries().iter().map(|e| e.addr).collect();
        assert_eq!(addrs, (150..250).collect::<Vec<u64>>());
        assert_eq!((ring.dropped(), ring.allocated()), (150, 100));
    }
}
