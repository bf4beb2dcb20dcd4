//! PyTorch memory snapshots: `torch.cuda.memory._dump_snapshot` pickles and the same structure
//! as JSON. Only the fields the replay needs are read: the events, each allocation's top user
//! frame (kept as an interned site per allocation, `SourceNotes::sites`, for peak attribution) and
//! `allocator_settings` (as a configuration string, `SourceNotes::allocator_conf`); everything
//! else (blocks, the other frames) is skipped.
//!
//! Replay rule: `alloc` allocates; `free_completed` frees (the moment the native allocator could
//! reuse the block, after the events of `record_stream` completed). When the trace holds no
//! `free_completed` at all, `free_requested` frees instead. Events of several devices are merged
//! by `time_us`. `segment_alloc` / `segment_free` (and `segment_map` / `segment_unmap`) give the
//! native allocator's reserved bytes over time; `segments` gives reserved at snapshot time.
//!
//! stepalloc's own snapshots (`Allocator::snapshot`, recognised by the `requested_size` of their
//! trace entries) have the same layout: their segment figures are stepalloc's, and their step
//! markers (`external_annotations`, START/END) become steps of the replay, placed by their
//! `trace_index` (the position in the device's trace where they happened) or else by time.
//!
//! Bounds: a pickle is read whole up to `MAX_PICKLE_BYTES`; torch's own pickles are decoded by
//! `pickle_vm` (iterative, shared objects kept shared); any other is read by serde_pickle after
//! its nesting and its size with shared values copied are measured (`pickle_depth`: at most
//! `MAX_PICKLE_DEPTH` levels, at most `max_expanded_values` values); at most
//! `ops::MAX_DEVICES` device traces.

use super::pickle_vm::{self, V};
use super::{json_column, json_message, pickle_depth, TraceError};
use crate::ops::{AddressMap, NativeFigures, Program, ProgramBuilder, SiteKind, MAX_DEVICES};
use serde::Deserialize;
use std::collections::HashMap;
use std::io::Read;
use std::rc::Rc;

/// The largest pickle read (the decoded values take several times more memory).
pub const MAX_PICKLE_BYTES: u64 = 2 << 30;
/// How deeply a pickle's values may nest. A snapshot nests 6 levels (dict, device_traces,
/// a device's list, an entry, its frames, a frame).
pub const MAX_PICKLE_DEPTH: u32 = 64;

/// The most values serde_pickle may build for a pickle of `len` bytes: every shared value is
/// copied where it is used, so DUP and memo references can make a few bytes stand for billions
/// of values. A pickle that shares nothing builds at most one value per opcode byte; torch's
/// own snapshots, which share their frames, are read by `pickle_vm`, which keeps them shared.
pub fn max_expanded_values(len: usize) -> u64 {
    (1u64 << 16).saturating_add((len as u64).saturating_mul(2))
}

/// A snapshot; `F` is how each entry's frames are read (`TopFrame`, or `NoFrames` where
/// serde_pickle reads the pickle: it cannot read the frames torch shares between entries).
#[derive(Deserialize, Default)]
struct Snapshot<F = TopFrame> {
    #[serde(default)]
    segments: Vec<Segment>,
    #[serde(default)]
    device_traces: Vec<Vec<TraceEntry<F>>>,
    #[serde(default)]
    external_annotations: Vec<Annotation>,
    /// The recording allocator's settings (read leniently: only what `allocator_conf` knows).
    #[serde(default)]
    allocator_settings: Option<serde_json::Value>,
}

/// A step marker of a stepalloc snapshot (torch writes the same shape for its annotations).
#[derive(Deserialize)]
struct Annotation {
    #[serde(default)]
    device: u64,
    #[serde(default)]
    name: String,
    #[serde(default)]
    stage: String,
    #[serde(default)]
    time_us: u64,
    /// stepalloc: the position in `device_traces[device]` where the marker happened.
    #[serde(default)]
    trace_index: Option<u64>,
}

#[derive(Deserialize, Default)]
struct Segment {
    #[serde(default)]
    total_size: u64,
}

#[derive(Deserialize)]
struct TraceEntry<F = TopFrame> {
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
    /// The allocation's top user frame (`_record_memory_history(stacks="python")`), if any.
    #[serde(default)]
    frames: F,
}

/// Where an entry's allocation was made, if known.
trait Site {
    fn site(&self) -> Option<&str>;
}

/// Frames skipped.
#[derive(Default)]
struct NoFrames;

impl<'de> Deserialize<'de> for NoFrames {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<NoFrames, D::Error> {
        serde::de::IgnoredAny::deserialize(d).map(|_| NoFrames)
    }
}

impl Site for NoFrames {
    fn site(&self) -> Option<&str> {
        None
    }
}

impl Site for TopFrame {
    fn site(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

/// The first frame of a traceback (innermost first) that is the user's code rather than
/// torch's own modules or C++, as `file:line name`; the first frame when none is. Only this
/// label is kept, not the frames.
#[derive(Default)]
struct TopFrame(Option<Rc<str>>);

#[derive(Deserialize)]
struct Frame {
    #[serde(default)]
    filename: String,
    #[serde(default)]
    line: i64,
    #[serde(default)]
    name: String,
}

impl Frame {
    fn is_user(&self) -> bool {
        let f = &self.filename;
        let native = [".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh", ".c"].iter().any(|ext| f.ends_with(ext));
        !(f.is_empty() || f.starts_with("??") || native || f.contains("/torch/") || f.contains("\\torch\\"))
    }

    fn label(&self) -> String {
        format!("{}:{} {}", self.filename, self.line, self.name)
    }
}

impl<'de> Deserialize<'de> for TopFrame {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<TopFrame, D::Error> {
        struct Frames;
        impl<'de> serde::de::Visitor<'de> for Frames {
            type Value = TopFrame;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of frames")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<TopFrame, A::Error> {
                let (mut first, mut user) = (None, None);
                while let Some(frame) = seq.next_element::<Frame>()? {
                    if user.is_none() && frame.is_user() {
                        user = Some(frame.label());
                    } else if first.is_none() {
                        first = Some(frame.label());
                    }
                }
                Ok(TopFrame(user.or(first).map(Rc::from)))
            }
            fn visit_none<E: serde::de::Error>(self) -> Result<TopFrame, E> {
                Ok(TopFrame(None))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<TopFrame, E> {
                Ok(TopFrame(None))
            }
        }
        d.deserialize_any(Frames)
    }
}

/// The recorded settings as a `PYTORCH_CUDA_ALLOC_CONF` string: the variable itself when it
/// was set, else the non-default figures of `allocator_settings` (empty: PyTorch's defaults).
fn allocator_conf(settings: &serde_json::Value) -> String {
    if let Some(conf) = settings.get("PYTORCH_CUDA_ALLOC_CONF").and_then(|v| v.as_str()) {
        if !conf.trim().is_empty() {
            return conf.trim().to_string();
        }
    }
    let mut keys = Vec::new();
    // -1 (and stepalloc's 2^64-1) mean unlimited.
    if let Some(n) = settings.get("max_split_size").and_then(|v| v.as_i64()) {
        if n > 0 && n < i64::MAX {
            keys.push(format!("max_split_size_mb:{}", n >> 20));
        }
    }
    if let Some(t) = settings.get("garbage_collection_threshold").and_then(|v| v.as_f64()) {
        if t > 0.0 && t < 1.0 {
            keys.push(format!("garbage_collection_threshold:{t}"));
        }
    }
    if settings.get("expandable_segments").and_then(|v| v.as_bool()) == Some(true) {
        keys.push("expandable_segments:True".to_string());
    }
    // A list (one value per power of two) or, in newer torch, a dict by interval start.
    let divisions = settings.get("roundup_power2_divisions").and_then(|v| match v {
        serde_json::Value::Array(list) => Some(list.iter().collect::<Vec<_>>()),
        serde_json::Value::Object(map) => Some(map.values().collect()),
        _ => None,
    });
    if let Some(list) = divisions {
        let values: Vec<u64> = list.iter().filter_map(|v| v.as_u64()).collect();
        // One value for every size (0 and 1: no rounding); per-range lists are not rebuilt.
        if let Some(&v) = values.first() {
            if v > 1 && values.iter().all(|&x| x == v) {
                keys.push(format!("roundup_power2_divisions:{v}"));
            }
        }
    }
    keys.join(",")
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
    // The fast path: torch's own pickles (shared frames and all). It neither recurses nor
    // drops recursively, so it needs no depth check; anything it does not take (or a pickle
    // without trace entries) is read, or refused with a position, by serde_pickle below.
    if let Some(snapshot) = pickle_vm::decode(data).ok().as_ref().and_then(|d| from_vm(&d.0)) {
        if check_has_trace(&snapshot).is_ok() {
            return replay(snapshot, "torch snapshot (pickle)");
        }
    }
    let shape = pickle_depth::shape(data, MAX_PICKLE_DEPTH);
    if shape.depth > MAX_PICKLE_DEPTH {
        return Err(TraceError {
            position: "file".into(),
            message: format!(
                "the pickle nests deeper than {MAX_PICKLE_DEPTH} levels (a PyTorch snapshot nests 6): not a memory snapshot"
            ),
        });
    }
    let most = max_expanded_values(data.len());
    if shape.expanded > most {
        return Err(TraceError {
            position: "file".into(),
            message: format!(
                "the pickle's shared values stand for {} values once copied, more than the {most} read for a \
                 file of {} bytes: not a memory snapshot",
                shape.expanded,
                data.len()
            ),
        });
    }
    let options = || serde_pickle::DeOptions::new().replace_unresolved_globals().replace_recursive_structures();
    let mut reader = Counting { data, pos: 0 };
    let snapshot: Snapshot<NoFrames> = match serde_pickle::from_reader(&mut reader, options()) {
        Ok(s) => s,
        // serde_pickle refuses integers beyond i64 even in fields the snapshot skips (stepalloc
        // writes max_split_size 2^64-1): read such a pickle through values (slower, but
        // integers up to u64 are kept).
        Err(serde_pickle::Error::Syntax(serde_pickle::ErrorCode::InvalidValue(m))) if m == "integer too large" => {
            let value = serde_pickle::value_from_slice(data, options())
                .map_err(|e| TraceError::at_byte(0, format!("not a PyTorch memory snapshot ({e})")))?;
            match pickle_to_json(value) {
                serde_json::Value::Object(m) => {
                    serde_json::from_value(serde_json::Value::Object(m)).map_err(|e| TraceError {
                        position: "file".into(),
                        message: format!("not a PyTorch memory snapshot ({})", json_message(&e)),
                    })?
                }
                _ => Snapshot::default(),
            }
        }
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
    replay(snapshot, "torch snapshot (pickle)")
}

/// A decoded pickle as a JSON value: integers beyond u64 and non-finite floats become null,
/// bytes become text (lossy), sets and tuples arrays, dict keys text. Recursive, but only
/// after `pickle_depth` bounded the nesting.
fn pickle_to_json(v: serde_pickle::Value) -> serde_json::Value {
    use serde_json::Value as J;
    use serde_pickle::{HashableValue as H, Value as P};
    fn number(n: impl Into<serde_json::Number>) -> J {
        J::Number(n.into())
    }
    fn hashable(h: H) -> J {
        match h {
            H::None => J::Null,
            H::Bool(b) => J::Bool(b),
            H::I64(i) => number(i),
            H::Int(b) => u64::try_from(&b).map_or(J::Null, number),
            H::F64(f) => serde_json::Number::from_f64(f).map_or(J::Null, J::Number),
            H::Bytes(b) => J::String(String::from_utf8_lossy(&b).into_owned()),
            H::String(s) => J::String(s),
            H::Tuple(items) => J::Array(items.into_iter().map(hashable).collect()),
            H::FrozenSet(items) => J::Array(items.into_iter().map(hashable).collect()),
        }
    }
    match v {
        P::None => J::Null,
        P::Bool(b) => J::Bool(b),
        P::I64(i) => number(i),
        P::Int(b) => u64::try_from(&b).map_or(J::Null, number),
        P::F64(f) => serde_json::Number::from_f64(f).map_or(J::Null, J::Number),
        P::Bytes(b) => J::String(String::from_utf8_lossy(&b).into_owned()),
        P::String(s) => J::String(s),
        P::List(items) | P::Tuple(items) => J::Array(items.into_iter().map(pickle_to_json).collect()),
        P::Set(items) | P::FrozenSet(items) => J::Array(items.into_iter().map(hashable).collect()),
        P::Dict(map) => J::Object(
            map.into_iter()
                .map(|(k, v)| {
                    let key = match hashable(k) {
                        J::String(s) => s,
                        other => other.to_string(),
                    };
                    (key, pickle_to_json(v))
                })
                .collect(),
        ),
    }
}

/// Reads a pickle (whole, up to `MAX_PICKLE_BYTES`) and parses it.
pub fn read_pickle<R: Read>(reader: R) -> Result<Program, TraceError> {
    let mut data = Vec::new();
    reader
        .take(MAX_PICKLE_BYTES + 1)
        .read_to_end(&mut data)
        .map_err(|e| TraceError::at_byte(data.len() as u64, format!("cannot read: {e}")))?;
    if data.len() as u64 > MAX_PICKLE_BYTES {
        return Err(TraceError::at_byte(
            MAX_PICKLE_BYTES,
            format!("the pickle is larger than {} GiB, the most this reader takes", MAX_PICKLE_BYTES >> 30),
        ));
    }
    parse_pickle(&data)
}

pub fn parse_json(data: &[u8]) -> Result<Program, TraceError> {
    read_json(data)
}

/// Parses a JSON snapshot as it is read (serde_json limits nesting to 128 levels).
pub fn read_json<R: Read>(reader: R) -> Result<Program, TraceError> {
    let snapshot: Snapshot = serde_json::from_reader(reader).map_err(|e| {
        TraceError::at_line(
            e.line() as u64,
            format!("{}bad PyTorch snapshot JSON: {}", json_column(&e), json_message(&e)),
        )
    })?;
    check_has_trace(&snapshot)?;
    replay(snapshot, "torch snapshot (JSON)")
}

/// Values read from a decoded pickle's small parts (annotations, settings) at most.
const SMALL_PART_VALUES: u64 = 1 << 20;

/// The snapshot in a decoded pickle; `None` where a field is not what torch writes (the
/// caller then reads the pickle with serde_pickle, which names what is wrong).
fn from_vm(v: &V) -> Option<Snapshot<TopFrame>> {
    let V::Dict(_) = v else { return None };
    let mut snapshot = Snapshot::<TopFrame>::default();
    if let Some(segments) = v.get("segments") {
        for seg in segments.items()? {
            let total_size = match seg.get("total_size") {
                Some(t) => t.as_u64()?,
                None => 0,
            };
            snapshot.segments.push(Segment { total_size });
        }
    }
    // Each traceback list's label, by the list's identity (torch shares them).
    let mut labels: HashMap<*const (), Option<Rc<str>>> = HashMap::new();
    if let Some(traces) = v.get("device_traces") {
        for device in traces.items()? {
            let V::List(entries) = device else { return None };
            let entries = entries.borrow();
            let mut out = Vec::with_capacity(entries.len());
            for e in entries.iter() {
                out.push(entry_from_vm(e, &mut labels)?);
            }
            snapshot.device_traces.push(out);
        }
    }
    let mut budget = SMALL_PART_VALUES;
    if let Some(a) = v.get("external_annotations") {
        snapshot.external_annotations = serde_json::from_value(a.to_json(8, &mut budget)?).ok()?;
    }
    if let Some(s) = v.get("allocator_settings") {
        snapshot.allocator_settings = Some(s.to_json(8, &mut budget)?);
    }
    Some(snapshot)
}

fn entry_from_vm(e: &V, labels: &mut HashMap<*const (), Option<Rc<str>>>) -> Option<TraceEntry<TopFrame>> {
    let V::Dict(d) = e else { return None };
    let mut entry = TraceEntry {
        action: String::new(),
        addr: 0,
        size: 0,
        requested_size: None,
        stream: 0,
        time_us: 0,
        frames: TopFrame(None),
    };
    let mut action = false;
    for (k, v) in d.borrow().iter() {
        match k.as_str()? {
            "action" => {
                entry.action = v.as_str()?.to_string();
                action = true;
            }
            "addr" => entry.addr = v.as_u64()?,
            "size" => entry.size = v.as_u64()?,
            "requested_size" => entry.requested_size = if let V::None = v { None } else { Some(v.as_u64()?) },
            "stream" => entry.stream = v.as_u64()?,
            "time_us" => entry.time_us = v.as_u64()?,
            "frames" => entry.frames = TopFrame(frames_label(v, labels)),
            _ => {}
        }
    }
    action.then_some(entry)
}

/// The top user frame of a traceback list (see `TopFrame`), once per shared list.
fn frames_label(v: &V, labels: &mut HashMap<*const (), Option<Rc<str>>>) -> Option<Rc<str>> {
    let V::List(list) = v else { return None };
    let key = Rc::as_ptr(list) as *const ();
    if let Some(label) = labels.get(&key) {
        return label.clone();
    }
    let (mut first, mut user) = (None, None);
    for f in list.borrow().iter() {
        let frame = Frame {
            filename: f.get("filename").and_then(|x| x.as_str().map(str::to_string)).unwrap_or_default(),
            line: match f.get("line") {
                Some(V::Int(i)) => i64::try_from(i).unwrap_or(0),
                _ => 0,
            },
            name: f.get("name").and_then(|x| x.as_str().map(str::to_string)).unwrap_or_default(),
        };
        if frame.is_user() {
            user = Some(frame.label());
            break;
        }
        if first.is_none() {
            first = Some(frame.label());
        }
    }
    let label: Option<Rc<str>> = user.or(first).map(Rc::from);
    labels.insert(key, label.clone());
    label
}

/// A snapshot without `device_traces` entries has nothing to replay (history was not recorded).
fn check_has_trace<F>(snapshot: &Snapshot<F>) -> Result<(), TraceError> {
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

/// Where an event of the merged stream comes from.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Source {
    /// A step marker (index into `external_annotations`): before the entry at the same place.
    Marker(usize),
    /// A trace entry (index into its device's trace).
    Entry(usize),
}

fn replay<F: Site>(snapshot: Snapshot<F>, format: &str) -> Result<Program, TraceError> {
    if snapshot.device_traces.len() > MAX_DEVICES as usize {
        return Err(TraceError {
            position: "file".into(),
            message: format!(
                "device_traces has {} devices; at most {MAX_DEVICES} are replayed",
                snapshot.device_traces.len()
            ),
        });
    }
    let stepalloc = snapshot.device_traces.iter().flatten().any(|e| e.requested_size.is_some());
    let format = if stepalloc { format.replace("torch snapshot", "stepalloc snapshot") } else { format.to_string() };
    let mut b = ProgramBuilder::new(&format);
    let frames = snapshot.device_traces.iter().flatten().any(|e| e.action == "alloc" && e.frames.site().is_some());
    if frames {
        b.enable_sites(SiteKind::Frames);
    }
    b.notes_mut().allocator_conf = snapshot.allocator_settings.as_ref().map(allocator_conf);
    let mut map = AddressMap::default();
    let use_completed = snapshot.device_traces.iter().flatten().any(|e| e.action == "free_completed");
    let free_action = if use_completed { "free_completed" } else { "free_requested" };
    // Merge devices by time (stable: same-time events keep their order within a device); one
    // device keeps its order. Device numbers are below MAX_DEVICES (checked above): u16.
    let by_time = snapshot.device_traces.len() > 1;
    let key = |t: u64| if by_time { t } else { 0 };
    let mut order: Vec<(u64, u16, usize, Source)> = Vec::new();
    for (device, trace) in snapshot.device_traces.iter().enumerate() {
        order.extend(trace.iter().enumerate().map(|(i, e)| (key(e.time_us), device as u16, i, Source::Entry(i))));
    }
    if stepalloc {
        // stepalloc marks every step on every device: one device's markers are the steps.
        let marked = snapshot.external_annotations.iter().map(|a| a.device).min();
        for (k, a) in snapshot.external_annotations.iter().enumerate() {
            if Some(a.device) != marked || a.device >= snapshot.device_traces.len() as u64 {
                continue;
            }
            let device = a.device as usize;
            let trace = &snapshot.device_traces[device];
            // Before the entry it preceded (its trace_index), else before the first entry later
            // than it (START) or after every entry of its time (END).
            let at = match a.trace_index {
                Some(i) => (i as usize).min(trace.len()),
                None if a.stage == "START" => trace.partition_point(|e| e.time_us < a.time_us),
                None => trace.partition_point(|e| e.time_us <= a.time_us),
            };
            let time = match trace.get(at) {
                Some(e) => e.time_us,
                None => trace.last().map_or(a.time_us, |e| e.time_us.max(a.time_us)),
            };
            order.push((key(time), device as u16, at, Source::Marker(k)));
        }
    }
    order.sort();
    let (mut seg_now, mut seg_min, mut seg_max) = (0i128, 0i128, 0i128);
    let mut native = NativeFigures {
        allocator: if stepalloc { "stepalloc (the recorded run)" } else { "PyTorch's native allocator" }.to_string(),
        ..NativeFigures::default()
    };
    let mut last_time = None;
    let mut in_step = false;
    for (_, device, _, source) in order {
        let i = match source {
            Source::Marker(k) => {
                let a = &snapshot.external_annotations[k];
                match a.stage.as_str() {
                    "START" => {
                        stepalloc::step::validate_phase(&a.name).map_err(|e| TraceError {
                            position: "file".into(),
                            message: format!("external_annotations[{k}]: bad step name: {e}"),
                        })?;
                        b.step_begin(&a.name);
                        in_step = true;
                    }
                    "END" if in_step => {
                        b.step_end();
                        in_step = false;
                    }
                    _ => b.notes_mut().ignored_events += 1,
                }
                if let Some(e) = b.limit_error() {
                    return Err(TraceError {
                        position: "file".into(),
                        message: format!("external_annotations[{k}]: {e}"),
                    });
                }
                continue;
            }
            Source::Entry(i) => i,
        };
        let e = &snapshot.device_traces[device as usize][i];
        let time = e.time_us;
        if let Some(t) = last_time {
            if time > t {
                b.advance((time - t).saturating_mul(1000));
            }
        }
        last_time = Some(time);
        match e.action.as_str() {
            "alloc" => {
                if let Some(site) = e.frames.site() {
                    b.set_next_site(site);
                }
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
        if let Some(err) = b.limit_error() {
            return Err(TraceError {
                position: "file".into(),
                message: format!("device_traces[{device}][{i}]: {err}"),
            });
        }
    }
    let has_segments = !snapshot.segments.is_empty();
    if has_segments {
        // Saturating: sizes come from the file.
        native.current_reserved = Some(snapshot.segments.iter().fold(0u64, |s, seg| s.saturating_add(seg.total_size)));
    }
    if native.segment_allocs + native.segment_frees > 0 || has_segments {
        // Reserved when recording began: what the snapshot holds minus the net change over the
        // trace; never below what the trace itself needs (its deepest dip).
        let start = match native.current_reserved {
            Some(current) => (current as i128 - seg_now).max(-seg_min),
            None => -seg_min,
        };
        native.peak_reserved = Some(u64::try_from((start + seg_max).max(0)).unwrap_or(u64::MAX));
        b.notes_mut().native = Some(native);
    }
    b.finish().map_err(|message| TraceError { position: "file".into(), message })
}
