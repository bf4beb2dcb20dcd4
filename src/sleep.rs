//! Sleep and wake across devices: `Allocator::pause` and `Allocator::resume` by tag name, the
//! report they return, and the per-tag figures. Layer: beside `allocator` (it takes each
//! device's lock in turn); the work is the heap's (`heap/sleep.rs`), the names are `tags`'.
//!
//! Outcomes (the C ABI and Python document the same): pausing a name no region ever used is
//! `InvalidArgument` naming it, as is pausing or resuming "default" and either call during a
//! CUDA-graph capture; pausing a paused tag and resuming one that is not paused do nothing and
//! list it in `skipped`; a resume that cannot get the memory is `OutOfMemory` naming the tag and
//! the shortfall, with the tag still paused and its backup kept (a retry works); on several
//! devices a resume is all or none: devices it resumed before one failed pause again.

use crate::allocator::Allocator;
use crate::error::{Error, Result};
use crate::heap::{SleepOutcome, TagFigures};
use crate::tags::{self, TagId};
use std::time::Instant;

/// What one `pause` or `resume` did, over every tag and device it touched.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct SleepReport {
    /// "pause" or "resume".
    pub op: &'static str,
    /// Tags paused (or resumed) by this call.
    pub tags: Vec<String>,
    /// Tags named that were paused already (pause) or not paused (resume).
    pub skipped: Vec<String>,
    pub released_bytes: u64,
    pub mapped_bytes: u64,
    pub copied_bytes: u64,
    pub discarded_bytes: u64,
    pub seconds: f64,
    /// Copied bytes per second, in GiB/s (0 when nothing was copied).
    pub gib_per_s: f64,
}

impl SleepReport {
    fn add(&mut self, o: &SleepOutcome) {
        self.released_bytes += o.released_bytes;
        self.mapped_bytes += o.mapped_bytes;
        self.copied_bytes += o.copied_bytes;
        self.discarded_bytes += o.discarded_bytes;
    }

    fn finish(mut self, started: Instant) -> SleepReport {
        self.seconds = started.elapsed().as_secs_f64();
        if self.copied_bytes > 0 && self.seconds > 0.0 {
            self.gib_per_s = self.copied_bytes as f64 / (1u64 << 30) as f64 / self.seconds;
        }
        self
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The tag a caller named: a name some region used, never "default".
fn named(tag: &str, what: &str) -> Result<TagId> {
    tags::check_name(tag)?;
    match tags::lookup(tag) {
        Some(tags::DEFAULT) => Err(Error::InvalidArgument(format!(
            "{what} of tag \"default\": memory allocated outside any region has no tag of its own and cannot \
             be paused; allocate it in a region"
        ))),
        Some(id) => Ok(id),
        None => Err(Error::InvalidArgument(format!(
            "{what} of tag {tag:?}: no region of that tag was ever entered in this process"
        ))),
    }
}

impl Allocator {
    /// Pauses `tag` (None: every tag a region has used) on every device: its physical memory
    /// goes back to the device and its addresses stay reserved. `backup` None follows each
    /// allocation's region (memory made in a region with a backup is copied to the host, the
    /// rest discarded); Some overrides it for the whole tag.
    ///
    /// Per name, all or none: when one of its numbers on one device fails (no host memory for
    /// the backup, a driver error), what this call paused of that name resumes again, so the
    /// error leaves it resident with its bytes (the discarded part excepted, which is paused
    /// after the backed-up part, when nothing can fail for want of host memory any more).
    pub fn pause(&self, tag: Option<&str>, backup: Option<bool>) -> Result<SleepReport> {
        let started = Instant::now();
        let ids: Vec<TagId> = match tag {
            Some(name) => vec![named(name, "pause")?],
            None => tags::registered().into_iter().map(|(id, _)| id).collect(),
        };
        let mut report = SleepReport { op: "pause", ..Default::default() };
        for id in ids {
            let mut skipped = true;
            let mut paused: Vec<(usize, TagId)> = Vec::new();
            for number in tags::numbers(id) {
                let copy = backup.unwrap_or_else(|| tags::backup(number));
                for (device, heap) in self.devices.iter().enumerate() {
                    // The device's lock is let go before an undo takes locks again.
                    let result = heap.lock().pause_tag(number, copy);
                    let outcome = match result {
                        Ok(outcome) => outcome,
                        Err(e) => {
                            for &(d, n) in paused.iter().rev() {
                                let _ = self.devices[d].lock().resume_tag(n);
                            }
                            return Err(e);
                        }
                    };
                    if !outcome.skipped {
                        paused.push((device, number));
                    }
                    skipped &= outcome.skipped;
                    report.add(&outcome);
                }
            }
            if skipped { &mut report.skipped } else { &mut report.tags }.push(tags::name(id));
        }
        Ok(report.finish(started))
    }

    /// Resumes `tag` (None: every paused tag) on every device: memory is mapped again at the
    /// same addresses and backed-up bytes restored.
    pub fn resume(&self, tag: Option<&str>) -> Result<SleepReport> {
        let started = Instant::now();
        let paused_anywhere =
            |id: TagId| tags::numbers(id).iter().any(|&n| self.devices.iter().any(|h| h.lock().tag_paused(n)));
        let ids: Vec<TagId> = match tag {
            Some(name) => vec![named(name, "resume")?],
            None => tags::registered().into_iter().map(|(id, _)| id).filter(|&id| paused_anywhere(id)).collect(),
        };
        let mut report = SleepReport { op: "resume", ..Default::default() };
        for id in ids {
            let mut skipped = true;
            let mut resumed: Vec<(usize, TagId)> = Vec::new();
            for number in tags::numbers(id) {
                for (device, heap) in self.devices.iter().enumerate() {
                    let result = heap.lock().resume_tag(number);
                    let outcome = match result {
                        Ok(outcome) => outcome,
                        Err(e) => {
                            // All or none: what this call resumed pauses again (with a backup,
                            // so no byte is lost), and the tag is paused everywhere.
                            for &(d, n) in &resumed {
                                let _ = self.devices[d].lock().pause_tag(n, true);
                            }
                            return Err(e);
                        }
                    };
                    if !outcome.skipped {
                        resumed.push((device, number));
                    }
                    skipped &= outcome.skipped;
                    report.add(&outcome);
                }
            }
            if skipped { &mut report.skipped } else { &mut report.tags }.push(tags::name(id));
        }
        Ok(report.finish(started))
    }

    /// Frees the pinned host buffers that hold no paused bytes, on every device. Returns bytes.
    pub fn release_backup(&self) -> Result<u64> {
        let mut freed = 0;
        for heap in &self.devices {
            freed += heap.lock().release_backup()?;
        }
        Ok(freed)
    }

    /// Where the backup of `[ptr, ptr + bytes)` of a paused tag lies in host memory, on the
    /// device that holds it (`Heap::backup_host_address`).
    pub fn backup_host_address(&self, ptr: u64, bytes: u64) -> Option<u64> {
        self.devices.iter().find_map(|heap| heap.lock().backup_host_address(ptr, bytes))
    }

    /// Per-tag figures summed over devices, by tag name.
    pub fn tag_figures(&self) -> Vec<TagFigures> {
        let mut all: Vec<TagFigures> = Vec::new();
        for heap in &self.devices {
            for f in heap.lock().tag_figures() {
                match all.iter_mut().find(|a| a.tag == f.tag) {
                    Some(a) => {
                        a.live_bytes += f.live_bytes;
                        a.paused |= f.paused;
                        a.backup |= f.backup;
                        a.paused_bytes += f.paused_bytes;
                        a.backup_bytes += f.backup_bytes;
                        a.host_bytes += f.host_bytes;
                        a.pauses = a.pauses.max(f.pauses);
                        a.resumes = a.resumes.max(f.resumes);
                        a.pause_seconds += f.pause_seconds;
                        a.resume_seconds += f.resume_seconds;
                    }
                    None => all.push(f),
                }
            }
        }
        all
    }

    /// `tag_figures` as the JSON object of `stepalloc_tags_json`: tag name -> figures.
    pub fn tags_json(&self) -> String {
        let map: serde_json::Map<String, serde_json::Value> = self
            .tag_figures()
            .into_iter()
            .map(|f| {
                let value = serde_json::json!({
                    "live_bytes": f.live_bytes,
                    "paused": f.paused,
                    "paused_bytes": f.paused_bytes,
                    "backup": f.backup,
                    "backup_bytes": f.backup_bytes,
                    "host_bytes": f.host_bytes,
                    "pauses": f.pauses,
                    "resumes": f.resumes,
                    "pause_seconds": f.pause_seconds,
                    "resume_seconds": f.resume_seconds,
                });
                (f.tag, value)
            })
            .collect();
        serde_json::Value::Object(map).to_string()
    }
}
