//! Memory snapshots in the layout of `torch.cuda.memory._snapshot()`, so PyTorch's memory
//! viewer (pytorch.org/memory_viz) and tools written for it read stepalloc's state.
//! Step markers appear as `external_annotations` (START/END), as torch's own annotations do.

use crate::heap::Heap;
use crate::segment::BlockState;
use crate::trace::TraceAction;
use serde::Serialize;
use serde_json::{json, Value};

/// No stack frames are recorded; torch's layout has the field, always a list.
type Frames = [u8; 0];

/// One block of a snapshot segment (torch's layout).
#[derive(Clone, Debug, Serialize)]
pub struct SnapshotBlock {
    pub address: u64,
    pub size: u64,
    pub requested_size: u64,
    pub state: &'static str,
    pub frames: Frames,
}

/// One segment of `torch.cuda.memory._snapshot()["segments"]`.
#[derive(Clone, Debug, Serialize)]
pub struct SnapshotSegment {
    pub device: usize,
    pub address: u64,
    pub total_size: u64,
    pub stream: u64,
    pub segment_type: &'static str,
    pub segment_pool_id: (u64, u64),
    pub allocated_size: u64,
    pub active_size: u64,
    pub requested_size: u64,
    pub is_expandable: bool,
    pub frames: Frames,
    pub blocks: Vec<SnapshotBlock>,
    /// stepalloc's: the tag of a tagged segment (`crate::tags`); absent for "default".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// stepalloc's: the run belongs to a paused tag: its addresses are reserved and its blocks
    /// kept, but no memory is behind them (`Allocator::pause`). Absent when false; the memory
    /// viewer ignores the key and shows the run as a segment.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
}

/// One event of `device_traces[device]`.
#[derive(Clone, Debug, Serialize)]
pub struct SnapshotTraceEvent {
    pub action: &'static str,
    pub addr: u64,
    pub size: u64,
    pub requested_size: u64,
    pub stream: u64,
    pub time_us: u64,
    pub frames: Frames,
    /// `oom` events only: the device's free bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_free: Option<u64>,
}

/// A step marker, as torch's `external_annotations`.
#[derive(Clone, Debug, Serialize)]
pub struct SnapshotAnnotation {
    pub device: usize,
    pub name: String,
    pub stage: &'static str,
    pub time_us: u64,
    /// Where in `device_traces[device]` the marker happened (replays place it between events
    /// recorded in the same microsecond).
    pub trace_index: usize,
}

impl Heap {
    /// [`Heap::snapshot_segment_records`] as JSON values.
    pub fn snapshot_segments(&self) -> Vec<Value> {
        self.snapshot_segment_records().iter().map(|s| json!(s)).collect()
    }

    /// This device's segments, each with its blocks, in torch's snapshot layout. An expandable
    /// segment appears as PyTorch shows it: one segment per run of mapped pages
    /// (`is_expandable: true`), unmapped address space left out.
    pub fn snapshot_segment_records(&self) -> Vec<SnapshotSegment> {
        let mut segments: Vec<SnapshotSegment> = Vec::new();
        for seg_id in self.arena.live_segment_ids() {
            let seg = self.arena.segment(seg_id);
            let tag = (seg.tag != 0).then(|| crate::tags::name(seg.tag));
            let paused = self.tag_paused(seg.tag);
            let mut run: Vec<SnapshotBlock> = Vec::new();
            let (mut start, mut total, mut allocated, mut active, mut requested) = (0u64, 0u64, 0u64, 0u64, 0u64);
            let mut close = |run: &mut Vec<SnapshotBlock>, start: u64, total: u64, figures: (u64, u64, u64)| {
                if run.is_empty() {
                    return;
                }
                segments.push(SnapshotSegment {
                    device: self.device,
                    address: start,
                    total_size: total,
                    stream: seg.stream.0,
                    segment_type: if seg.small { "small" } else { "large" },
                    segment_pool_id: (0, u64::from(seg.pool)),
                    allocated_size: figures.0,
                    active_size: figures.1,
                    requested_size: figures.2,
                    is_expandable: seg.expandable(),
                    frames: [],
                    blocks: std::mem::take(run),
                    tag: tag.clone(),
                    paused,
                });
            };
            for id in self.arena.segment_blocks(seg_id) {
                let b = self.arena.block(id);
                let state = match self.arena.state(id) {
                    BlockState::Unmapped => {
                        close(&mut run, start, total, (allocated, active, requested));
                        (total, allocated, active, requested) = (0, 0, 0, 0);
                        continue;
                    }
                    BlockState::Allocated => {
                        allocated += b.size;
                        active += b.size;
                        requested += b.requested;
                        "active_allocated"
                    }
                    BlockState::Pending => {
                        active += b.size;
                        "active_pending_free"
                    }
                    _ => "inactive",
                };
                if run.is_empty() {
                    start = b.addr;
                }
                total += b.size;
                run.push(SnapshotBlock {
                    address: b.addr,
                    size: b.size,
                    requested_size: b.requested,
                    state,
                    frames: [],
                });
            }
            close(&mut run, start, total, (allocated, active, requested));
        }
        segments.sort_by_key(|s| s.address);
        segments
    }

    /// This device's trace (`device_traces[device]`) and its step annotations.
    pub fn snapshot_trace(&self) -> (Vec<SnapshotTraceEvent>, Vec<SnapshotAnnotation>) {
        let mut trace = Vec::new();
        let mut annotations = Vec::new();
        for e in self.trace.entries() {
            match e.action {
                TraceAction::StepBegin | TraceAction::StepEnd => annotations.push(SnapshotAnnotation {
                    device: self.device,
                    name: self.step.phase_name(e.phase).to_string(),
                    stage: if e.action == TraceAction::StepBegin { "START" } else { "END" },
                    time_us: e.time_us,
                    trace_index: trace.len(),
                }),
                action => {
                    // Like torch: block events carry the requested size, segment events their size.
                    let block_event =
                        matches!(action, TraceAction::Alloc | TraceAction::FreeRequested | TraceAction::FreeCompleted);
                    trace.push(SnapshotTraceEvent {
                        action: action.torch_name(),
                        addr: e.addr,
                        size: if block_event { e.requested } else { e.size },
                        requested_size: e.requested,
                        stream: e.stream,
                        time_us: e.time_us,
                        frames: [],
                        device_free: (action == TraceAction::Oom).then_some(e.addr),
                    });
                }
            }
        }
        (trace, annotations)
    }

    /// This device's trace as stepalloc's JSON-lines trace format (one event per line).
    pub fn trace_jsonl(&self, out: &mut String) {
        for e in self.trace.entries() {
            let line = match e.action {
                TraceAction::Alloc => {
                    json!({"op": "alloc", "device": self.device, "addr": e.addr, "size": e.requested, "stream": e.stream, "t_us": e.time_us})
                }
                TraceAction::FreeRequested => {
                    json!({"op": "free", "device": self.device, "addr": e.addr, "size": e.requested, "stream": e.stream, "t_us": e.time_us})
                }
                TraceAction::StepBegin => {
                    json!({"op": "step_begin", "phase": self.step.phase_name(e.phase), "t_us": e.time_us})
                }
                TraceAction::StepEnd => json!({"op": "step_end", "t_us": e.time_us}),
                _ => continue,
            };
            out.push_str(&line.to_string());
            out.push('\n');
        }
    }
}
