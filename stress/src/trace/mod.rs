//! Trace readers: each turns a file into a `Program` (see `ops`). Formats are detected from
//! the first bytes: a pickle (0x80 protocol marker) or a JSON document with `segments` /
//! `device_traces` is a PyTorch memory snapshot; a first line starting with `Thread` is RMM's
//! logging CSV; JSON objects one per line with `op` are stepalloc's own trace.
//!
//! Every error carries a position (byte offset or line number); no input makes a reader panic.

pub mod jsonl;
pub mod rmm;
pub mod torch;

use crate::ops::Program;
use std::fmt;
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

/// A first line longer than this is not a line of stepalloc's trace.
const MAX_JSONL_LINE: usize = 4096;

/// Guesses the format from the first bytes.
pub fn detect(data: &[u8]) -> Result<Format, TraceError> {
    if data.first() == Some(&0x80) {
        return Ok(Format::TorchPickle);
    }
    let start = data.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(data.len());
    let rest = &data[start..];
    if rest.is_empty() {
        return Err(TraceError::at_byte(0, "empty file: no trace to replay"));
    }
    if rest.starts_with(b"Thread") {
        return Ok(Format::RmmCsv);
    }
    if rest[0] == b'{' {
        // One object per line with an "op" key is stepalloc's trace; otherwise a snapshot
        // (often a single line of megabytes: only a short first line is worth parsing).
        let line_end = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
        if line_end <= MAX_JSONL_LINE {
            if let Ok(serde_json::Value::Object(m)) = serde_json::from_slice::<serde_json::Value>(&rest[..line_end]) {
                if m.contains_key("op") {
                    return Ok(Format::StepallocJsonl);
                }
            }
        }
        return Ok(Format::TorchJson);
    }
    Err(TraceError::at_byte(
        start as u64,
        "unknown trace format: expected a PyTorch snapshot (pickle or JSON), RMM CSV or stepalloc JSON lines",
    ))
}

/// Parses a trace held in memory, detecting its format.
pub fn parse(data: &[u8]) -> Result<Program, TraceError> {
    match detect(data)? {
        Format::TorchPickle => torch::parse_pickle(data),
        Format::TorchJson => torch::parse_json(data),
        Format::RmmCsv => rmm::parse(data),
        Format::StepallocJsonl => jsonl::parse(data),
    }
}

/// Reads and parses a trace file.
pub fn load(path: &Path) -> Result<Program, TraceError> {
    let data = std::fs::read(path)
        .map_err(|e| TraceError { position: "file".into(), message: format!("{}: {e}", path.display()) })?;
    parse(&data)
}
