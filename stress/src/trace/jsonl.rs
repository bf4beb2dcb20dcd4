//! stepalloc's own trace (what `Allocator::trace_jsonl` writes, and what `stepalloc.fit` records
//! without a GPU): one JSON object per line, `{"op":"alloc"|"free","device","addr","size",
//! "stream","t_us"}`, `{"op":"step_begin","phase"}` and `{"op":"step_end"}`. Blank lines are
//! allowed; a line is at most `MAX_LINE` bytes.
//!
//! An `alloc` line may name where it was made: `module` (the dotted path of the innermost
//! `nn.Module` running, "" outside every module) and `torch_op` (the ATen operator, or a source
//! such as "cublas_workspace"). Both are strings of at most `MAX_SITE_FIELD` bytes without control
//! characters, kept as the allocation's site (`ops::Sites`, `SiteKind::Modules`: attribution
//! groups by module); a trace with neither field has no sites, as before. At most
//! `ops::MAX_SITES` distinct (module, operator) pairs.
//!
//! Read line by line: memory is the program plus one line and the interned sites. Every error
//! names its line (and its column when the JSON parser knows it).

use super::{json_column, json_message, TraceError};
use crate::ops::{AddressMap, Program, ProgramBuilder, SiteKind};
use serde::Deserialize;
use std::io::{BufRead, Read};

/// The longest line accepted (stepalloc writes lines of about 100 bytes).
pub const MAX_LINE: usize = 1 << 20;
/// The longest `module` or `torch_op` accepted, in bytes (a 7B model's deepest module path,
/// with " (backward)", is under 100).
pub const MAX_SITE_FIELD: usize = 512;

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
        /// Kept as `Value` so that a wrong type is reported by the field's name
        /// (`site_field`).
        #[serde(default)]
        module: Option<serde_json::Value>,
        #[serde(default)]
        torch_op: Option<serde_json::Value>,
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
            Line::Alloc { device, addr, size, stream, t_us, module, torch_op } => {
                advance(&mut b, t_us);
                let module = site_field("module", module).map_err(|e| TraceError::at_line(line_no, e))?;
                let op = site_field("torch_op", torch_op).map_err(|e| TraceError::at_line(line_no, e))?;
                if module.is_some() || op.is_some() {
                    b.enable_sites(SiteKind::Modules);
                }
                let module = module.unwrap_or_default();
                let name = if module.is_empty() { SiteKind::Modules.none() } else { module.as_str() };
                b.set_next_site_with_op(name, op.as_deref().unwrap_or(""));
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

/// An alloc line's `module` or `torch_op`: absent or null is `None`; otherwise a string of at
/// most `MAX_SITE_FIELD` bytes with no control character, else an error naming the field.
fn site_field(name: &str, value: Option<serde_json::Value>) -> Result<Option<String>, String> {
    let text = match value {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(serde_json::Value::String(s)) => s,
        Some(other) => {
            let kind = match other {
                serde_json::Value::Bool(_) => "a boolean",
                serde_json::Value::Number(_) => "a number",
                serde_json::Value::Array(_) => "an array",
                _ => "an object",
            };
            return Err(format!(
                "`{name}` is {kind}; expected a string ({}) or null",
                if name == "module" { "the module's dotted path" } else { "the operator's name" }
            ));
        }
    };
    if text.len() > MAX_SITE_FIELD {
        return Err(format!(
            "`{name}` is {} bytes long; at most {MAX_SITE_FIELD} are accepted (shorten the name the recorder writes)",
            text.len()
        ));
    }
    if let Some(c) = text.chars().find(|c| c.is_control()) {
        return Err(format!("`{name}` holds the control character {:?}; a name is printable text", c));
    }
    Ok(Some(text))
}
