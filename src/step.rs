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
//!   under the limit, least recently used segments first.
//!
//! Only whole free segments are released; live blocks and blocks waiting on events are never
//! touched.

use crate::error::{Error, Result};
use crate::heap::Heap;
use crate::segment::SegmentId;
use crate::stats::{ReleaseReason, StepFigures};
use crate::trace::TraceAction;
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

impl Heap {
    /// Begins a step of `phase`. A step still open is ended first.
    pub fn step_begin(&mut self, phase: &str) -> Result<()> {
        validate_phase(phase)?;
        if self.step.in_step {
            self.step_end()?;
        }
        let index = self.step.phase_index(phase)?;
        let switching = self.step.phase.is_some_and(|p| p != index);
        self.step.phase = Some(index);
        if switching && self.config.phase_trim {
            self.trim_for_phase(index)?;
        }
        self.note_param_sizes();
        let reserved = self.stats.reserved_bytes.current();
        // A tick of its own, so that "freed before this step" is `freed_at < step_clock`.
        self.alloc_clock += 1;
        self.step_clock = self.alloc_clock;
        let s = &mut self.step;
        s.step += 1;
        s.in_step = true;
        s.peak_allocated = self.stats.allocated_bytes.current();
        s.peak_reserved = reserved;
        s.device_mallocs_at_begin = self.stats.num_device_alloc;
        s.reserved_at_begin = reserved;
        self.trace.record(TraceAction::StepBegin, 0, 0, 0, 0, index as u32);
        Ok(())
    }

    /// Ends the current step, runs the step-end policies and returns the step's figures.
    pub fn step_end(&mut self) -> Result<StepFigures> {
        if !self.step.in_step {
            return Err(Error::InvalidArgument("step_end without a step in progress".into()));
        }
        let index = self.step.phase.unwrap_or(0);
        let (peak_allocated, peak_reserved) = (self.step.peak_allocated, self.step.peak_reserved);
        let record = &mut self.step.phases[index];
        record.steps += 1;
        record.peak_allocated = record.peak_allocated.max(peak_allocated);
        record.peak_reserved = record.peak_reserved.max(peak_reserved);
        let phase = record.name.clone();
        self.step.in_step = false;
        if self.config.release_idle_steps > 0 {
            let now = self.step.step;
            let idle = self.config.release_idle_steps;
            let order: Vec<SegmentId> = self
                .releasable_segments()
                .into_iter()
                .filter(|&s| now.saturating_sub(self.arena.segment_use(s).last_used_step) >= idle)
                .collect();
            self.release_in_order(order, ReleaseReason::Step, |_| false)?;
        }
        if self.config.page_release {
            self.release_idle_pages_at_step_end()?;
        }
        self.enforce_cache_limit()?;
        let figures = StepFigures {
            steps: self.step.step,
            phase,
            peak_allocated,
            peak_reserved,
            device_mallocs: self.stats.num_device_alloc - self.step.device_mallocs_at_begin,
            reserved_at_end: self.stats.reserved_bytes.current(),
            fragmentation: if peak_reserved == 0 { 0.0 } else { 1.0 - peak_allocated as f64 / peak_reserved as f64 },
        };
        self.step.last = figures.clone();
        self.trace.record(TraceAction::StepEnd, 0, 0, 0, 0, index as u32);
        Ok(figures)
    }

    /// Reserved bytes when the current step began (after any phase trim).
    pub fn reserved_at_step_begin(&self) -> u64 {
        self.step.reserved_at_begin
    }

    /// Releases free segments, least recently used first, until the cache is under its limit.
    pub(crate) fn enforce_cache_limit(&mut self) -> Result<u64> {
        let limit = self.cache_limit();
        if limit == 0 || self.cached_free() <= limit {
            return Ok(0);
        }
        let mut order = self.releasable_segments();
        order.sort_by_key(|&s| self.arena.segment_use(s).last_used_step);
        let mut released = self.release_in_order(order, ReleaseReason::Limit, |h| h.cached_free() <= limit)?;
        if self.config.page_release {
            released += self.release_free_pages(ReleaseReason::Limit, |_| true, |h| h.cached_free() <= limit)?;
        }
        Ok(released)
    }

    /// Trims the cache to what phase `index` is predicted to need: its recorded peak of
    /// allocated bytes plus the margin. Segments the phase never allocated from go first.
    fn trim_for_phase(&mut self, index: usize) -> Result<u64> {
        let record = &self.step.phases[index];
        if record.steps == 0 {
            return Ok(0); // nothing known about this phase yet
        }
        let target = (record.peak_allocated as f64 * (1.0 + self.config.phase_trim_margin)) as u64;
        if self.stats.reserved_bytes.current() <= target {
            return Ok(0);
        }
        let bit = 1u64 << (index % 64);
        let mut order = self.releasable_segments();
        // Not used by the next phase first, then least recently used.
        order.sort_by_key(|&s| {
            let usage = self.arena.segment_use(s);
            (usage.phase_mask & bit != 0, usage.last_used_step)
        });
        self.release_in_order(order, ReleaseReason::PhaseSwitch, |h| h.stats.reserved_bytes.current() <= target)
    }
}
