//! Sleep and wake across devices: `Allocator::pause` and `Allocator::resume` by tag name, the
//! report they return, and the per-tag figures. Layer: beside `allocator` (it takes each
//! device's lock in turn); the work is the heap's (`heap/sleep.rs`), the names are `tags`'.
//!
//! Outcomes (the C ABI and Python document the same): pausing a name no region ever used is
//! `InvalidArgument` naming it, as is pausing or resuming "default" and either call during a
//! CUDA-graph capture; pausing a paused tag and resuming one that is not paused do nothing and
//! list it in `skipped`; a resume that cannot get the memory is `OutOfMemory` naming the tag and
//! the shortfall, with the tag still paused and its backup kept (a retry works); on several
//! devices a resume is all or none: devices it resumed before one failed pause again, each part
//! as it was paused (what came back from a backup is backed up again, the rest discarded), and a
//! rollback that fails says so in the error.
//!
//! A call holds every device's lock while it acts on one name (in device order, the only place
//! that takes more than one): another thread, a metrics scrape or `tags()` sees a name either
//! untouched or paused with both its numbers on every device, never half, and a capture on any
//! device refuses the call before any device changes.

use crate::allocator::Allocator;
use crate::error::{Error, Result};
use crate::heap::{Heap, SleepOutcome, TagFigures};
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

/// A capture underway on any device refuses a pause or resume of `id` before any device
/// changes (an unmap or a synchronization on one device would invalidate a global-mode capture
/// on another).
fn refuse_during_capture(heaps: &[crate::allocator::HeapGuard<'_, Heap>], id: TagId, what: &str) -> Result<()> {
    heaps.iter().try_for_each(|h| h.check_sleep_call(id, what))
}

/// A tag some of whose live blocks another process may still hold through CUDA IPC is not
/// paused: the receiver keeps the pages it mapped, so after a pause and resume the two
/// processes would see different memory behind one tensor.
fn refuse_while_shared(heaps: &[crate::allocator::HeapGuard<'_, Heap>], id: TagId) -> Result<()> {
    let held = heaps.iter().flat_map(|h| tags::numbers(id).map(|t| h.shared_of_tag(t)));
    let (tensors, bytes) = held.fold((0, 0), |(n, b), (n2, b2)| (n + n2, b + b2));
    if tensors == 0 {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "pause of tag {:?}: {tensors} of its tensors ({bytes} bytes) were sent to other processes (CUDA IPC) \
         and may still be held there; a receiver keeps the memory it mapped, so it cannot leave the device. \
         Pause once every receiver dropped them (torch.cuda.ipc_collect() lets go of those that did)",
        tags::name(id)
    )))
}

/// The error of a call whose rollback (`undone`, one result per device and number) did what
/// it says, or the error with what the rollback could not do: then the name is not whole.
fn with_rollback(e: Error, undone: Vec<Result<()>>, did: &str) -> Error {
    let failed: Vec<String> = undone.into_iter().filter_map(|r| r.err()).map(|f| f.to_string()).collect();
    if failed.is_empty() {
        return e;
    }
    Error::Unavailable(format!(
        "{e}; and undoing the parts this call had done failed, so the tag is not whole on every device \
         (what could not be {did}: {}); retry the call once the cause is fixed",
        failed.join("; ")
    ))
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
            let mut heaps: Vec<_> = self.devices.iter().map(|h| h.lock()).collect();
            refuse_during_capture(&heaps, id, "pause")?;
            refuse_while_shared(&heaps, id)?;
            let mut skipped = true;
            let mut paused: Vec<(usize, TagId)> = Vec::new();
            for number in tags::numbers(id) {
                let copy = backup.unwrap_or_else(|| tags::backup(number));
                for device in 0..heaps.len() {
                    let outcome = match heaps[device].pause_tag(number, copy) {
                        Ok(outcome) => outcome,
                        Err(e) => {
                            let undone = paused.iter().rev().map(|&(d, n)| heaps[d].resume_tag(n).map(|_| ()));
                            return Err(with_rollback(e, undone.collect(), "resumed"));
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
            let mut heaps: Vec<_> = self.devices.iter().map(|h| h.lock()).collect();
            refuse_during_capture(&heaps, id, "resume")?;
            let mut skipped = true;
            // What this call resumed, and whether it restored bytes from a backup.
            let mut resumed: Vec<(usize, TagId, bool)> = Vec::new();
            for number in tags::numbers(id) {
                for device in 0..heaps.len() {
                    let outcome = match heaps[device].resume_tag(number) {
                        Ok(outcome) => outcome,
                        Err(e) => {
                            // All or none: what this call resumed pauses again as it was paused
                            // (restored bytes backed up again, discarded ones discarded again).
                            let undone = resumed.iter().map(|&(d, n, restored)| {
                                heaps[d].pause_tag(n, restored || tags::backup(n)).map(|_| ())
                            });
                            return Err(with_rollback(e, undone.collect(), "paused again"));
                        }
                    };
                    if !outcome.skipped {
                        resumed.push((device, number, outcome.copied_bytes > 0));
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
