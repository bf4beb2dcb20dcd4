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
//! A call holds every device's lock while it acts (in device order, the only place that takes
//! more than one): another thread, a metrics scrape or `tags()` sees the names either untouched
//! or paused with all their numbers on every device, never half, and a capture on any device
//! (or a name unknown, "default" or shared over IPC) refuses the call before any device
//! changes. Every name of a call, and every number of each, go to one heap call per device
//! (`Heap::pause_tags` / `resume_tags`), so that one tag's driver calls run under another's
//! copies; a call of several names is all or none across them.

use crate::allocator::{Allocator, HeapGuard};
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

    fn merge(&mut self, other: SleepReport) {
        self.tags.extend(other.tags);
        self.skipped.extend(other.skipped);
        self.released_bytes += other.released_bytes;
        self.mapped_bytes += other.mapped_bytes;
        self.copied_bytes += other.copied_bytes;
        self.discarded_bytes += other.discarded_bytes;
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
fn refuse_during_capture(heaps: &[HeapGuard<'_>], id: TagId, what: &str) -> Result<()> {
    heaps.iter().try_for_each(|h| h.check_sleep_call(id, what))
}

/// A tag some of whose live blocks another process may still hold through CUDA IPC is not
/// paused: the receiver keeps the pages it mapped, so after a pause and resume the two
/// processes would see different memory behind one tensor.
fn refuse_while_shared(heaps: &[HeapGuard<'_>], id: TagId) -> Result<()> {
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

/// Keeps the first of each repeated tag, in order.
fn dedup_in_order<T>(ids: &mut Vec<T>, id_of: impl Fn(&T) -> TagId) {
    let mut seen = 0u128;
    ids.retain(|item| {
        let id = id_of(item);
        let new = seen & (1u128 << (id & 127)) == 0;
        seen |= 1u128 << (id & 127);
        new
    });
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
    /// All or none: when one number on one device fails (no host memory for the backup, a
    /// driver error), what this call paused resumes again, so the error leaves every tag
    /// resident with its bytes.
    pub fn pause(&self, tag: Option<&str>, backup: Option<bool>) -> Result<SleepReport> {
        match tag {
            Some(name) => self.pause_tags(&[name], backup),
            None => self.pause_ids(tags::registered().into_iter().map(|(id, _)| (id, backup)).collect(), &[]),
        }
    }

    /// `pause` of several tags in one call: each device pauses them all at once
    /// (`Heap::pause_tags`: the backed-up tags' copies queued first, the other pages released
    /// while they run). Every name is checked (known, not "default", no capture, no IPC share)
    /// before any device changes.
    pub fn pause_tags(&self, names: &[&str], backup: Option<bool>) -> Result<SleepReport> {
        let each: Vec<(&str, Option<bool>)> = names.iter().map(|&name| (name, backup)).collect();
        self.pause_tags_each(&each)
    }

    /// `pause_tags` with a backup choice per name (torch_memory_saver's and vLLM's sleep: the
    /// tags to offload named at the call).
    pub fn pause_tags_each(&self, names: &[(&str, Option<bool>)]) -> Result<SleepReport> {
        self.pause_tags_discarding(names, &[])
    }

    /// `pause_tags_each`, where the live blocks starting at an address of `discard` are
    /// discarded, not copied, whatever their tag's backup (vLLM's `sleep(discardable=...)`: the
    /// storage the caller rewrites after waking; `Heap::pause_tags_discarding`).
    pub fn pause_tags_discarding(&self, names: &[(&str, Option<bool>)], discard: &[u64]) -> Result<SleepReport> {
        let ids =
            names.iter().map(|&(name, backup)| Ok((named(name, "pause")?, backup))).collect::<Result<Vec<_>>>()?;
        let mut discard = discard.to_vec();
        discard.sort_unstable();
        self.pause_ids(ids, &discard)
    }

    /// Every name in one call per device; when that fails with several names and nothing of it
    /// is left, the names are paused one after the other, each all or none, as a call of one
    /// name would (names before a failing one stay paused, the error is that name's).
    fn pause_ids(&self, mut ids: Vec<(TagId, Option<bool>)>, discard: &[u64]) -> Result<SleepReport> {
        let started = Instant::now();
        dedup_in_order(&mut ids, |&(id, _)| id);
        match self.pause_together(&ids, discard) {
            Ok(report) => Ok(report.finish(started)),
            Err((e, restored)) if !restored || ids.len() < 2 => Err(e),
            Err(_) => {
                let mut report = SleepReport { op: "pause", ..Default::default() };
                for &one in &ids {
                    report.merge(self.pause_together(&[one], discard).map_err(|(e, _)| e)?);
                }
                Ok(report.finish(started))
            }
        }
    }

    /// One call per device for every name of `ids` (`discard`: sorted block addresses discarded
    /// whatever their tag's backup). An error comes with whether every part of the call was
    /// undone.
    fn pause_together(
        &self,
        ids: &[(TagId, Option<bool>)],
        discard: &[u64],
    ) -> std::result::Result<SleepReport, (Error, bool)> {
        let mut report = SleepReport { op: "pause", ..Default::default() };
        let mut heaps: Vec<_> = self.lock_all().map_err(|e| (e, true))?;
        for &(id, _) in ids {
            refuse_during_capture(&heaps, id, "pause").map_err(|e| (e, true))?;
            refuse_while_shared(&heaps, id).map_err(|e| (e, true))?;
        }
        let numbers: Vec<(TagId, bool)> = ids
            .iter()
            .flat_map(|&(id, backup)| tags::numbers(id).map(|n| (n, backup.unwrap_or_else(|| tags::backup(n)))))
            .collect();
        let mut skipped = vec![true; ids.len()];
        // Per device, the numbers this call paused there.
        let mut paused: Vec<Vec<TagId>> = Vec::new();
        for device in 0..heaps.len() {
            let before: Vec<bool> = numbers.iter().map(|&(n, _)| heaps[device].tag_paused(n)).collect();
            match heaps[device].pause_tags_discarding(&numbers, discard) {
                Ok(outcomes) => {
                    let mut here = Vec::new();
                    for (j, o) in outcomes.iter().enumerate() {
                        if !o.skipped {
                            here.push(numbers[j].0);
                            skipped[j / tags::NUMBERS] = false;
                        }
                        report.add(o);
                    }
                    paused.push(here);
                }
                Err(e) => {
                    // What this device paused before the error, then every device before it.
                    let partial: Vec<TagId> = numbers
                        .iter()
                        .zip(&before)
                        .filter(|&(&(n, _), &was)| !was && heaps[device].tag_paused(n))
                        .map(|(&(n, _), _)| n)
                        .collect();
                    paused.push(partial);
                    let undone: Vec<Result<()>> = paused
                        .iter()
                        .enumerate()
                        .rev()
                        .filter(|(_, ns)| !ns.is_empty())
                        .map(|(d, ns)| heaps[d].resume_tags(ns).map(|_| ()))
                        .collect();
                    let restored = undone.iter().all(Result::is_ok);
                    return Err((with_rollback(e, undone, "resumed"), restored));
                }
            }
        }
        for (k, &(id, _)) in ids.iter().enumerate() {
            if skipped[k] { &mut report.skipped } else { &mut report.tags }.push(tags::name(id));
        }
        Ok(report)
    }

    /// Resumes `tag` (None: every paused tag) on every device: memory is mapped again at the
    /// same addresses and backed-up bytes restored.
    pub fn resume(&self, tag: Option<&str>) -> Result<SleepReport> {
        match tag {
            Some(name) => self.resume_tags(&[name]),
            None => {
                let paused_anywhere =
                    |id: TagId| tags::numbers(id).iter().any(|&n| self.devices.iter().any(|h| h.lock().tag_paused(n)));
                let ids = tags::registered().into_iter().map(|(id, _)| id).filter(|&id| paused_anywhere(id));
                self.resume_ids(ids.collect())
            }
        }
    }

    /// `resume` of several tags in one call: each device resumes them all at once
    /// (`Heap::resume_tags`: room checked first, each batch's pages mapped while the batch
    /// before copies). All or none: a device that fails leaves them paused there, and the
    /// devices resumed before it pause again, each part as it was paused.
    pub fn resume_tags(&self, names: &[&str]) -> Result<SleepReport> {
        let ids = names.iter().map(|name| named(name, "resume")).collect::<Result<Vec<TagId>>>()?;
        self.resume_ids(ids)
    }

    /// As `pause_ids`: every name in one call per device, else (several names, a failure
    /// undone) one name after the other, each all or none.
    fn resume_ids(&self, mut ids: Vec<TagId>) -> Result<SleepReport> {
        let started = Instant::now();
        dedup_in_order(&mut ids, |&id| id);
        match self.resume_together(&ids) {
            Ok(report) => Ok(report.finish(started)),
            Err((e, restored)) if !restored || ids.len() < 2 => Err(e),
            Err(_) => {
                let mut report = SleepReport { op: "resume", ..Default::default() };
                for &id in &ids {
                    report.merge(self.resume_together(&[id]).map_err(|(e, _)| e)?);
                }
                Ok(report.finish(started))
            }
        }
    }

    fn resume_together(&self, ids: &[TagId]) -> std::result::Result<SleepReport, (Error, bool)> {
        let mut report = SleepReport { op: "resume", ..Default::default() };
        let mut heaps: Vec<_> = self.lock_all().map_err(|e| (e, true))?;
        for &id in ids {
            refuse_during_capture(&heaps, id, "resume").map_err(|e| (e, true))?;
        }
        let numbers: Vec<TagId> = ids.iter().flat_map(|&id| tags::numbers(id)).collect();
        let mut skipped = vec![true; ids.len()];
        // Per device, what this call resumed there, and whether it restored bytes from a backup.
        let mut resumed: Vec<Vec<(TagId, bool)>> = Vec::new();
        for device in 0..heaps.len() {
            match heaps[device].resume_tags(&numbers) {
                Ok(outcomes) => {
                    let mut here = Vec::new();
                    for (j, o) in outcomes.iter().enumerate() {
                        if !o.skipped {
                            here.push((numbers[j], o.copied_bytes > 0));
                            skipped[j / tags::NUMBERS] = false;
                        }
                        report.add(o);
                    }
                    resumed.push(here);
                }
                Err(e) => {
                    // All or none: what this call resumed pauses again as it was paused
                    // (restored bytes backed up again, discarded ones discarded again).
                    let undone: Vec<Result<()>> = resumed
                        .iter()
                        .enumerate()
                        .filter(|(_, ns)| !ns.is_empty())
                        .map(|(d, ns)| {
                            let again: Vec<(TagId, bool)> =
                                ns.iter().map(|&(n, restored)| (n, restored || tags::backup(n))).collect();
                            heaps[d].pause_tags(&again).map(|_| ())
                        })
                        .collect();
                    let restored = undone.iter().all(Result::is_ok);
                    return Err((with_rollback(e, undone, "paused again"), restored));
                }
            }
        }
        for (k, &id) in ids.iter().enumerate() {
            if skipped[k] { &mut report.skipped } else { &mut report.tags }.push(tags::name(id));
        }
        Ok(report)
    }

    /// Frees the pinned host buffers that hold no paused bytes, on every device. Returns bytes.
    pub fn release_backup(&self) -> Result<u64> {
        let mut freed = 0;
        for (device, heap) in self.devices.iter().enumerate() {
            freed += heap.lock_usable(device)?.release_backup()?;
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
                        a.mmap_bytes += f.mmap_bytes;
                        a.disk_bytes += f.disk_bytes;
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
                    "mmap_bytes": f.mmap_bytes,
                    "disk_bytes": f.disk_bytes,
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
