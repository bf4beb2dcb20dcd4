//! stepalloc's own trace (what `Allocator::trace_jsonl` writes): one JSON object per line,
//! `{"op":"alloc"|"free","device","addr","size","stream","t_us"}`, `{"op":"step_begin","phase"}`
//! and `{"op":"step_end"}`. Blank lines are allowed.

use super::TraceError;
use crate::ops::{AddressMap, Program, ProgramBuilder};
use serde::Deserialize;

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
    let text = std::str::from_utf8(data).map_err(|e| {
        let line = data[..e.valid_up_to()].iter().filter(|&&c| c == b'\n').count() as u64 + 1;
        TraceError::at_line(line, "not UTF-8 text")
    })?;
    let mut b = ProgramBuilder::new("stepalloc trace (JSON lines)");
    let mut map = AddressMap::default();
    let mut last_t = None;
    let mut in_step = false;
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
    for (i, raw) in text.lines().enumerate() {
        let line_no = i as u64 + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(raw).map_err(|e| {
            TraceError::at_line(line_no, format!("column {}: bad stepalloc trace line: {e}", e.column()))
        })?;
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
    }
    Ok(b.finish())
}
