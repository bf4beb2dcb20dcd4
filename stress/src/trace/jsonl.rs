//! stepalloc's own trace (what `Allocator::trace_jsonl` writes): one JSON object per line,
//! `{"op":"alloc"|"free","device","addr","size","stream","t_us"}`, `{"op":"step_begin","phase"}`
//! and `{"op":"step_end"}`. Blank lines are allowed; a line is at most `MAX_LINE` bytes.
//!
//! Read line by line: memory is the program plus one line. Every error names its line (and its
//! column when the JSON parser knows it).

use super::{json_column, json_message, TraceError};
use crate::ops::{AddressMap, Program, ProgramBuilder};
use serde::Deserialize;
use std::io::{BufRead, Read};

/// The longest line accepted (stepalloc writes lines of about 100 bytes).
pub const MAX_LINE: usize = 1 << 20;

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Line {
    Alloc {
        #[serde(default)]
        device: u16,
        addr: u64,
        size: u64,
        #[serde(default)]
        stream: u64,
        #[serde(default)]
        t_us: Option<u64>,
    },
    Free {
        #[serde(default)]
        device: u16,
        addr: u64,
        #[serde(default)]
        t_us: Option<u64>,
    },
    StepBegin {
        phase: String,
    },
    StepEnd {},
}

pub fn parse(data: &[u8]) -> Result<Program, TraceError> {
    read(data)
}

/// Reads the trace line by line from `reader`.
pub fn read<R: BufRead>(mut reader: R) -> Result<Program, TraceError> {
    let mut b = ProgramBuilder::new("stepalloc trace (JSON lines)");
    let mut map = AddressMap::default();
    let mut last_t: Option<u64> = None;
    let mut in_step = false;
    let mut raw = Vec::new();
    let mut line_no = 0u64;
    loop {
        line_no += 1;
        raw.clear();
        let n = (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut raw)
            .map_err(|e| TraceError::at_line(line_no, format!("cannot read: {e}")))?;
        if n == 0 {
            break;
        }
        // The newline does not count: a line of MAX_LINE bytes and its newline is accepted.
        if raw.len() > MAX_LINE && raw.last() != Some(&b'\n') {
            return Err(TraceError::at_line(line_no, format!("line longer than {MAX_LINE} bytes")));
        }
        let text = std::str::from_utf8(&raw).map_err(|_| TraceError::at_line(line_no, "not UTF-8 text"))?;
        if text.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(text).map_err(|e| {
            TraceError::at_line(line_no, format!("{}bad stepalloc trace line: {}", json_column(&e), json_message(&e)))
        })?;
        // Time: only forward jumps advance the simulated clock (the builder bounds the total).
        let mut advance = |b: &mut ProgramBuilder, t: Option<u64>| {
            if let Some(t) = t {
                if let Some(prev) = last_t {
                    if t > prev {
                        b.advance((t - prev).saturating_mul(1000));
                    }
                }
                last_t = Some(t);
            }
        };
        match line {
            Line::Alloc { device, addr, size, stream, t_us } => {
                advance(&mut b, t_us);
                map.alloc(&mut b, device, addr, size, stream);
            }
            Line::Free { device, addr, t_us } => {
                advance(&mut b, t_us);
                map.free(&mut b, device, addr);
            }
            Line::StepBegin { phase } => {
                stepalloc::step::validate_phase(&phase)
                    .map_err(|e| TraceError::at_line(line_no, format!("bad phase: {e}")))?;
                b.step_begin(&phase);
                in_step = true;
            }
            // A trace recorded from the middle of a step starts with its end: skip that one.
            Line::StepEnd {} if !in_step => b.notes_mut().ignored_events += 1,
            Line::StepEnd {} => {
                b.step_end();
                in_step = false;
            }
        }
        if let Some(e) = b.limit_error() {
            return Err(TraceError::at_line(line_no, e.to_string()));
        }
    }
    b.finish().map_err(|e| TraceError::at_line(line_no, e))
}
