//! Trace readers: each turns a file into a `Program` (see `ops`). Formats are detected from
//! the first bytes: a pickle (0x80 protocol marker) or a JSON document with `segments` /
//! `device_traces` is a PyTorch memory snapshot; a first line starting with `Thread` is RMM's
//! logging CSV; JSON objects one per line with `op` are stepalloc's own trace.
//!
//! A UTF-8 byte-order mark before a text format is skipped. Text formats are streamed; the
//! bounds of `ops` (events, devices, phases, time) hold for every reader.
//!
//! Every error carries a position (byte offset or line number); no input makes a reader panic.

pub mod jsonl;
mod pickle_depth;
mod pickle_vm;
pub mod rmm;
pub mod torch;

use crate::ops::Program;
use std::fmt;
use std::io::{BufReader, Read};
use std::path::Path;

/// A trace that could not be read, and where.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceError {
    /// `byte N` or `line N` (or `file` when the whole file is at fault).
    pub position: String,
    pub message: String,
}

impl TraceError {
    pub fn at_line(line: u64, message: impl Into<String>) -> TraceError {
        TraceError { position: format!("line {line}"), message: message.into() }
    }

    pub fn at_byte(byte: u64, message: impl Into<String>) -> TraceError {
        TraceError { position: format!("byte {byte}"), message: message.into() }
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "at {}: {}", self.position, self.message)
    }
}

impl std::error::Error for TraceError {}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    TorchPickle,
    TorchJson,
    RmmCsv,
    StepallocJsonl,
}

/// Bytes read ahead to detect the format; the rest of the file is read as the parser goes.
pub const DETECT_BYTES: usize = 64 * 1024;

/// The UTF-8 byte-order mark some editors put at the start of text files.
pub const UTF8_BOM: &[u8] = b"\xef\xbb\xbf";

/// Keys of a PyTorch snapshot's top-level dict (any one of them decides).
const SNAPSHOT_KEYS: &[&str] = &["segments", "device_traces", "external_annotations", "allocator_settings"];

/// Guesses the format from the first bytes (at most `DETECT_BYTES` are looked at).
pub fn detect(data: &[u8]) -> Result<Format, TraceError> {
    if data.first() == Some(&0x80) {
        return Ok(Format::TorchPickle);
    }
    let head = &data[..data.len().min(DETECT_BYTES)];
    let bom = if head.starts_with(UTF8_BOM) { UTF8_BOM.len() } else { 0 };
    let start = bom + head[bom..].iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(head.len() - bom);
    let rest = &head[start..];
    if rest.is_empty() {
        return Err(TraceError::at_byte(0, "empty file: no trace to replay"));
    }
    if rest.starts_with(b"Thread") {
        return Ok(Format::RmmCsv);
    }
    if rest[0] == b'{' {
        // stepalloc's trace has an "op" key in its first object; a snapshot has its own keys.
        // Only the first object's top-level keys are read (values are skipped, not kept), so a
        // long first line costs nothing; undecided (no key known before the bytes looked at
        // end) means a snapshot, whose first value may be megabytes long.
        return Ok(match first_object_kind(rest) {
            Some(f) => f,
            None => Format::TorchJson,
        });
    }
    Err(TraceError::at_byte(
        start as u64,
        "unknown trace format: expected a PyTorch snapshot (pickle or JSON), RMM CSV or stepalloc JSON lines",
    ))
}

/// The format the top-level keys of the JSON object at the start of `text` point to.
fn first_object_kind(text: &[u8]) -> Option<Format> {
    use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
    struct Keys<'a>(&'a mut Option<Format>);
    impl<'de> Visitor<'de> for Keys<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if key == "op" {
                    *self.0 = Some(Format::StepallocJsonl);
                } else if SNAPSHOT_KEYS.contains(&&*key) {
                    *self.0 = Some(Format::TorchJson);
                }
                if self.0.is_some() {
                    // Decided: stop reading (the error is dropped).
                    return Err(serde::de::Error::custom("decided"));
                }
                map.next_value::<IgnoredAny>()?;
            }
            Ok(())
        }
    }
    impl<'de> DeserializeSeed<'de> for Keys<'_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_map(self)
        }
    }
    let mut found = None;
    let _ = Keys(&mut found).deserialize(&mut serde_json::Deserializer::from_slice(text));
    found
}

/// Parses a trace held in memory, detecting its format.
pub fn parse(data: &[u8]) -> Result<Program, TraceError> {
    read(data)
}

/// Parses a trace from a reader, detecting its format from the first `DETECT_BYTES` bytes.
/// Text formats are read as they are parsed (nothing but the program is kept); a pickle is
/// read whole (the pickle machine needs it), up to `torch::MAX_PICKLE_BYTES`.
pub fn read<R: Read>(mut reader: R) -> Result<Program, TraceError> {
    let mut head = Vec::with_capacity(DETECT_BYTES);
    (&mut reader)
        .take(DETECT_BYTES as u64)
        .read_to_end(&mut head)
        .map_err(|e| TraceError { position: "file".into(), message: format!("cannot read: {e}") })?;
    let format = detect(&head)?;
    if format != Format::TorchPickle && head.starts_with(UTF8_BOM) {
        head.drain(..UTF8_BOM.len());
    }
    let whole = BufReader::new(std::io::Cursor::new(head).chain(reader));
    match format {
        Format::TorchPickle => torch::read_pickle(whole),
        Format::TorchJson => torch::read_json(whole),
        Format::RmmCsv => rmm::read(whole),
        Format::StepallocJsonl => jsonl::read(whole),
    }
}

/// Reads and parses a trace file.
pub fn load(path: &Path) -> Result<Program, TraceError> {
    let file = std::fs::File::open(path)
        .map_err(|e| TraceError { position: "file".into(), message: format!("{}: {e}", path.display()) })?;
    read(file)
}

/// A serde_json error's message without the " at line L column C" serde_json appends (the
/// position is reported on its own).
pub(crate) fn json_message(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.rsplit_once(" at line ") {
        Some((message, _)) if e.line() > 0 => message.to_string(),
        _ => text,
    }
}

/// "column C: " when serde_json knows the column (type errors of buffered values do not).
pub(crate) fn json_column(e: &serde_json::Error) -> String {
    if e.column() > 0 {
        format!("column {}: ", e.column())
    } else {
        String::new()
    }
}
