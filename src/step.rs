//! Steps and phases of a training or agent loop, and the release policies that run at their
//! boundaries.
//!
//! The loop says where a step begins (with its phase: `rollout`, `train`, ...) and where it ends.
//! Per phase the heap remembers the peak bytes its steps needed; per segment it remembers the
//! last step and the phases that allocated from it. At the boundaries:
//! - `release_idle_steps:N` — at step end, free segments untouched for N steps go back;
//! - `phase_trim:True` — when a step of another phase begins, the cache is trimmed to that
//!   phase's recorded peak (plus `phase_trim_margin`), releasing first the segments the phase
//!   never used (a rollout's KV-cache blocks when training starts), then the least recently used;
//! - `cache_limit_mb` / `cache_limit_fraction` — at step end, cached free bytes are brought
//!   under the limit, least recently used segments first (with `page_release`, the whole free
//!   pages too: `heap/limit.rs`).
//!
//! Only whole free segments are released; live blocks and blocks waiting on events are never
//! touched.
//!
//! This module is the step bookkeeping as plain data (`StepState`: the current step and phase,
//! each phase's recorded peaks, the step's own peaks) and the phase-label rule; it knows nothing
//! of the heap. The heap holds a `StepState` and runs the policies above at the boundaries
//! (`heap/steps.rs`), asking it what to release towards.

use crate::error::{Error, Result};
use crate::stats::StepFigures;
use std::collections::BTreeMap;

/// Phases are a small, bounded label set (they become metric labels).
pub const MAX_PHASES: usize = 32;
/// Longest phase name accepted.
pub const MAX_PHASE_NAME: usize = 64;

#[derive(Clone, Debug, Default)]
struct PhaseRecord {
    name: String,
    steps: u64,
    peak_allocated: u64,
    peak_reserved: u64,
}

#[derive(Debug, Default)]
pub struct StepState {
    /// Steps begun so far; the number of the current (or last) step.
    pub step: u64,
    pub in_step: bool,
    phase: Option<usize>,
    phases: Vec<PhaseRecord>,
    peak_allocated: u64,
    peak_reserved: u64,
    device_mallocs_at_begin: u64,
    reserved_at_begin: u64,
    pub last: StepFigures,
}

impl StepState {
    /// The bit segments record for the current phase (0 outside steps).
    #[inline]
    pub fn phase_bit(&self) -> u64 {
        match self.phase {
            Some(i) if self.in_step => 1 << (i % 64),
            _ => 0,
        }
    }

    #[inline]
    pub fn note_allocated(&mut self, allocated: u64) {
        self.peak_allocated = self.peak_allocated.max(allocated);
    }

    #[inline]
    pub fn note_reserved(&mut self, reserved: u64) {
        self.peak_reserved = self.peak_reserved.max(reserved);
    }

    pub fn steps_by_phase(&self) -> BTreeMap<String, u64> {
        self.phases.iter().map(|p| (p.name.clone(), p.steps)).collect()
    }

    pub fn phase_name(&self, index: u32) -> &str {
        self.phases.get(index as usize).map_or("", |p| p.name.as_str())
    }

    /// Enters phase `name` for the step about to begin: its index (recorded on first use) and
    /// whether it differs from the phase of the previous step.
    pub fn enter_phase(&mut self, name: &str) -> Result<(usize, bool)> {
        let index = self.phase_index(name)?;
        let switching = self.phase.is_some_and(|p| p != index);
        self.phase = Some(index);
        Ok((index, switching))
    }

    /// Opens a step with the heap's figures at its start (after any phase trim).
    pub fn begin(&mut self, allocated: u64, reserved: u64, device_mallocs: u64) {
        self.step += 1;
        self.in_step = true;
        self.peak_allocated = allocated;
        self.peak_reserved = reserved;
        self.device_mallocs_at_begin = device_mallocs;
        self.reserved_at_begin = reserved;
    }

    /// Closes the step in progress and adds its peaks to its phase's record. Returns the phase's
    /// index and name and the step's peak allocated and reserved bytes.
    pub fn end(&mut self) -> (usize, String, u64, u64) {
        let index = self.phase.unwrap_or(0);
        let (peak_allocated, peak_reserved) = (self.peak_allocated, self.peak_reserved);
        let record = &mut self.phases[index];
        record.steps += 1;
        record.peak_allocated = record.peak_allocated.max(peak_allocated);
        record.peak_reserved = record.peak_reserved.max(peak_reserved);
        let phase = record.name.clone();
        self.in_step = false;
        (index, phase, peak_allocated, peak_reserved)
    }

    /// Device mallocs when the current (or last) step began.
    pub fn device_mallocs_at_begin(&self) -> u64 {
        self.device_mallocs_at_begin
    }

    /// Reserved bytes when the current (or last) step began (after any phase trim).
    pub fn reserved_at_begin(&self) -> u64 {
        self.reserved_at_begin
    }

    /// What a trim for phase `index` brings the reserved bytes down to: the phase's recorded
    /// peak of allocated bytes plus `margin` (a fraction of it); `None` while nothing is known
    /// of the phase (none of its steps has ended).
    pub fn trim_target(&self, index: usize, margin: f64) -> Option<u64> {
        let record = &self.phases[index];
        if record.steps == 0 {
            return None;
        }
        Some((record.peak_allocated as f64 * (1.0 + margin)) as u64)
    }

    fn phase_index(&mut self, name: &str) -> Result<usize> {
        if let Some(i) = self.phases.iter().position(|p| p.name == name) {
            return Ok(i);
        }
        if self.phases.len() >= MAX_PHASES {
            return Err(Error::InvalidArgument(format!(
                "too many phases (at most {MAX_PHASES}); `{name}` is one more"
            )));
        }
        self.phases.push(PhaseRecord { name: name.to_string(), ..Default::default() });
        Ok(self.phases.len() - 1)
    }
}

/// Checks a phase label: 1..=64 characters of letters, digits, `_`, `-`, `.`.
pub fn validate_phase(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_PHASE_NAME
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        // Escaped and cut short: the name may hold a NUL or be very long, and the message
        // crosses the C ABI as a C string.
        let shown: String = name.chars().take(MAX_PHASE_NAME + 1).flat_map(char::escape_debug).collect();
        Err(Error::InvalidArgument(format!(
            "phase `{shown}`: use 1 to {MAX_PHASE_NAME} letters, digits, '_', '-' or '.'"
        )))
    }
}
