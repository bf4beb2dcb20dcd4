//! The heap at step boundaries: `step_begin` (a phase trim when the phase changes) and
//! `step_end` (idle segments, idle pages, the cache limit), the policies `step` describes. The
//! step's bookkeeping is `step::StepState`'s; this part of the heap decides what to release and
//! releases it. Part of the heap: runs under the device lock, `&mut self` throughout.

use super::Heap;
use crate::error::{Error, Result};
use crate::segment::SegmentId;
use crate::stats::{ReleaseReason, StepFigures};
use crate::step::validate_phase;
use crate::trace::TraceAction;

impl Heap {
    /// Begins a step of `phase`. A step still open is ended first.
    pub fn step_begin(&mut self, phase: &str) -> Result<()> {
        validate_phase(phase)?;
        if self.step.in_step {
            self.step_end()?;
        }
        let (index, switching) = self.step.enter_phase(phase)?;
        if switching && self.config.phase_trim {
            self.trim_for_phase(index)?;
        }
        self.note_param_sizes();
        let reserved = self.stats.reserved_bytes.current();
        // A tick of its own, so that "freed before this step" is `freed_at < step_clock`.
        self.alloc_clock += 1;
        self.step_clock = self.alloc_clock;
        self.step.begin(self.stats.allocated_bytes.current(), reserved, self.stats.num_device_alloc);
        self.trace.record(TraceAction::StepBegin, 0, 0, 0, 0, index as u32);
        Ok(())
    }

    /// Ends the current step, runs the step-end policies and returns the step's figures.
    pub fn step_end(&mut self) -> Result<StepFigures> {
        if !self.step.in_step {
            return Err(Error::InvalidArgument("step_end without a step in progress".into()));
        }
        let (index, phase, peak_allocated, peak_reserved) = self.step.end();
        // Frees whose streams finished are free: the releases below count them (no event is
        // queried while a capture is underway).
        if !self.pending.is_empty() && self.captures_underway == 0 {
            self.process_events()?;
        }
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
            device_mallocs: self.stats.num_device_alloc - self.step.device_mallocs_at_begin(),
            reserved_at_end: self.stats.reserved_bytes.current(),
            fragmentation: if peak_reserved == 0 { 0.0 } else { 1.0 - peak_allocated as f64 / peak_reserved as f64 },
        };
        self.step.last = figures.clone();
        self.trace.record(TraceAction::StepEnd, 0, 0, 0, 0, index as u32);
        Ok(figures)
    }

    /// Reserved bytes when the current step began (after any phase trim).
    pub fn reserved_at_step_begin(&self) -> u64 {
        self.step.reserved_at_begin()
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
        released += self.release_pages_over_limit(ReleaseReason::Limit)?;
        Ok(released)
    }

    /// Trims the cache to what phase `index` is predicted to need: its recorded peak of
    /// allocated bytes plus the margin. Segments the phase never allocated from go first.
    fn trim_for_phase(&mut self, index: usize) -> Result<u64> {
        let Some(target) = self.step.trim_target(index, self.config.phase_trim_margin) else {
            return Ok(0); // nothing known about this phase yet
        };
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
