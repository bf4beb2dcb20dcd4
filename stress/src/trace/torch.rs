//! PyTorch memory snapshots: `torch.cuda.memory._dump_snapshot` pickles and the same structure
//! as JSON. Only the fields the replay needs are read; everything else (frames, blocks, settings)
//! is skipped.
//!
//! Replay rule: `alloc` allocates; `free_completed` frees (the moment the native allocator could
//! reuse the block, after the events of `record_stream` completed). When the trace holds no
//! `free_completed` at all, `free_requested` frees instead. Events of several devices are merged
//! by `time_us`. `segment_alloc` / `segment_free` (and `segment_map` / `segment_unmap`) give the
//! native allocator's reserved bytes over time; `segments` gives reserved at snapshot time.

use super::TraceError;
use crate::ops::{AddressMap, NativeFigures, Program, ProgramBuilder};
use serde::Deserialize;
use std::io::Read;

#[derive(Deserialize, Default)]
struct Snapshot {
    #[serde(default)]
    segments: Vec<Segment>,
    #[serde(default)]
    device_traces: Vec<Vec<TraceEntry>>,
}

#[derive(Deserialize, Default)]
struct Segment {
    #[serde(default)]
    total_size: u64,
}

#[derive(Deserialize)]
struct TraceEntry {
    action: String,
    #[serde(default)]
    addr: u64,
    #[serde(default)]
    size: u64,
    /// Not in PyTorch's trace entries (their `size` is the requested size); stepalloc's
    /// snapshots write the block size in `size` and the request here.
    #[serde(default)]
    requested_size: Option<u64>,
    #[serde(default)]
    stream: u64,
    #[serde(default)]
    time_us: u64,
}

/// A reader that counts the bytes it has given out, for error positions.
struct Counting<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Read for Counting<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.data.len() - self.pos);
        buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

pub fn parse_pickle(data: &[u8]) -> Result<Program, TraceError> {
    let mut reader = Counting { data, pos: 0 };
    let options = serde_pickle::DeOptions::new().replace_unresolved_globals().replace_recursive_structures();
    let snapshot: Snapshot = match serde_pickle::from_reader(&mut reader, options) {
        Ok(s) => s,
        Err(serde_pickle::Error::Eval(code, pos)) => {
            return Err(TraceError::at_byte(pos as u64, format!("bad pickle: {code}")))
        }
        Err(serde_pickle::Error::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(TraceError::at_byte(reader.pos as u64, "truncated pickle: the file ends inside the snapshot"))
        }
        Err(e) => {
            return Err(TraceError::at_byte(
                reader.pos as u64,
                format!("not a PyTorch memory snapshot ({e}); read up to here"),
            ))
        }
    };
    check_has_trace(&snapshot)?;
    Ok(replay(snapshot, "torch snapshot (pickle)"))
}

pub fn parse_json(data: &[u8]) -> Result<Program, TraceError> {
    let snapshot: Snapshot = serde_json::from_slice(data).map_err(|e| {
        TraceError::at_line(e.line() as u64, format!("column {}: bad PyTorch snapshot JSON: {e}", e.column()))
    })?;
    check_has_trace(&snapshot)?;
    Ok(replay(snapshot, "torch snapshot (JSON)"))
}

/// A snapshot without `device_traces` entries has nothing to replay (history was not recorded).
fn check_has_trace(snapshot: &Snapshot) -> Result<(), TraceError> {
    if snapshot.device_traces.iter().all(Vec::is_empty) {
        return Err(TraceError {
            position: "file".into(),
            message: format!(
                "the snapshot has no device_traces entries ({} segments): record allocations with \
                 torch.cuda.memory._record_memory_history() before _dump_snapshot",
                snapshot.segments.len()
            ),
        });
    }
    Ok(())
}

fn replay(snapshot: Snapshot, format: &str) -> Program {
    let mut b = ProgramBuilder::new(format);
    let mut map = AddressMap::default();
    let use_completed = snapshot.device_traces.iter().flatten().any(|e| e.action == "free_completed");
    let free_action = if use_completed { "free_completed" } else { "free_requested" };
    // Merge devices by time (stable: same-time events keep their order within a device).
    let mut order: Vec<(u64, u16, usize)> = Vec::new();
    for (device, trace) in snapshot.device_traces.iter().enumerate() {
        order.extend(trace.iter().enumerate().map(|(i, e)| (e.time_us, device as u16, i)));
    }
    if snapshot.device_traces.len() > 1 {
        order.sort();
    }
    let (mut seg_now, mut seg_min, mut seg_max) = (0i128, 0i128, 0i128);
    let mut native = NativeFigures::default();
    let mut last_time = None;
    for (time, device, i) in order {
        let e = &snapshot.device_traces[device as usize][i];
        if let Some(t) = last_time {
            if time > t {
                b.advance((time - t).saturating_mul(1000));
            }
        }
        last_time = Some(time);
        match e.action.as_str() {
            "alloc" => {
                map.alloc(&mut b, device, e.addr, e.requested_size.unwrap_or(e.size), e.stream);
            }
            a if a == free_action => map.free(&mut b, device, e.addr),
            "segment_alloc" | "segment_map" => {
                native.segment_allocs += 1;
                seg_now += e.size as i128;
                seg_max = seg_max.max(seg_now);
            }
            "segment_free" | "segment_unmap" => {
                native.segment_frees += 1;
                seg_now -= e.size as i128;
                seg_min = seg_min.min(seg_now);
            }
            "oom" => b.notes_mut().recorded_failures += 1,
            _ => b.notes_mut().ignored_events += 1,
        }
    }
    let has_segments = !snapshot.segments.is_empty();
    if has_segments {
        native.current_reserved = Some(snapshot.segments.iter().map(|s| s.total_size).sum());
    }
    if native.segment_allocs + native.segment_frees > 0 || has_segments {
        // Reserved when recording began: what the snapshot holds minus the net change over the
        // trace; never below what the trace itself needs (its deepest dip).
        let start = match native.current_reserved {
            Some(current) => (current as i128 - seg_now).max(-seg_min),
            None => -seg_min,
        };
        native.peak_reserved = Some((start + seg_max).max(0) as u64);
        b.notes_mut().native = Some(native);
    }
    b.finish()
}
