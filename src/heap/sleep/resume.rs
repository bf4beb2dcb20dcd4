//! Resume: the pages of paused tags mapped again at the same addresses and their bytes copied
//! back. Part of the heap's sleep and wake (`heap/sleep.rs`: the layout, and the invariants
//! while a tag is paused); runs under the device lock, `&mut self` throughout.
//!
//! A resume (`resume_tags`) checks first that the device has room (free memory plus other
//! tags' idle cached pages; else the error names the tags and the shortfall and nothing
//! changed); then per `COPY_BATCH` of backed-up blocks it releases as many bytes of other tags'
//! idle cached pages as the batch maps, creates and maps the batch's pages and queues its
//! copies, so that the next batch's driver calls run under this one's copies; then it maps the
//! pages nothing is copied into and waits for the copies. All or none: on a failure it waits
//! for the queued copies and unmaps what it mapped, and the tags stay paused with their backups.
//! The cached pages a pause kept (`cached.rs`) are mapped last, counted in the same room check.

use super::cached::CachedRun;
use super::host::copy_pieces;
use super::{SleepOutcome, COPY_BATCH};
use crate::backend::PhysHandle;
use crate::error::{Error, OomReport, Result};
use crate::heap::expandable::Unmapped;
use crate::heap::Heap;
use crate::segment::{BlockId, BlockState, SegmentId};
use crate::stats::ReleaseReason;
use crate::tags::{self, TagId};
use crate::trace::TraceAction;
use crate::units::format_bytes;
use std::time::Instant;

impl Heap {
    /// Maps physical memory again at every address of the live blocks of `tags` and restores
    /// the backed-up bytes, in one call, one outcome each, all or none: when the device cannot
    /// give the memory, the tags stay paused with their backups and the error names them and
    /// the shortfall. The room is
    /// checked first (free device memory plus other tags' idle cached pages); then, per
    /// `COPY_BATCH` of backed-up blocks, idle cached pages of other tags are released for the
    /// batch's pages (as many bytes as it maps, while any are left: the resumed memory takes
    /// their place), its pages created and mapped and its copies queued, so that one batch's
    /// driver calls run while the batch before copies; then the pages without a backup are
    /// mapped while the last copies run; then the copies are waited for. On a failure what
    /// was mapped is unmapped and released: every tag stays paused with its backup.
    pub fn resume_tags(&mut self, tags: &[TagId]) -> Result<Vec<SleepOutcome>> {
        for &tag in tags {
            self.check_sleep_call(tag, "resume")?;
        }
        let (mut out, mut todo) = self.sleep.plan(tags, false);
        if todo.is_empty() {
            return Ok(out);
        }
        let started = Instant::now();
        // Backed-up tags first: their copies start first.
        todo.sort_by_key(|&i| self.sleep.tags.get(usize::from(tags[i])).is_none_or(|t| t.backup.is_empty()));
        let resumed: Vec<TagId> = todo.iter().map(|&i| tags[i]).collect();
        let segments: Vec<Vec<SegmentId>> = resumed.iter().map(|&t| self.tag_segments(t)).collect();
        let wanted: Vec<Vec<Want>> = segments.iter().map(|s| self.wanted_pages(s)).collect();
        // The free cached pages a pause kept (`tags::keeps_cached`), mapped after the live ones.
        let runs: Vec<Vec<CachedRun>> = resumed.iter().zip(&segments).map(|(&t, s)| self.cached_runs(t, s)).collect();
        let cached: Vec<Vec<Want>> = runs.iter().map(|r| self.run_pages(r)).collect();
        let need: u64 = wanted.iter().chain(&cached).flatten().map(|w| self.arena.segment(w.1).page).sum();
        self.check_resume_room(&resumed, need)?;
        let mut result = self.resume_pages(&resumed, &wanted, &mut out, &todo);
        for (k, w) in cached.iter().enumerate() {
            if result.is_err() {
                break;
            }
            result = self.map_wanted(w).map(|released| out[todo[k]].released_bytes += released);
        }
        let copied = self.wait_for_copies();
        result = result.and(copied);
        if let Err(e) = result {
            // Nothing is lost: back to paused, every page given back, the backups kept.
            for w in wanted.iter().chain(&cached).flatten() {
                self.unmap_resumed(w)?;
            }
            if e.is_out_of_memory() {
                return Err(self.resume_out_of_memory(&resumed, need));
            }
            return Err(e);
        }
        let share = (started.elapsed().as_nanos() as u64) / todo.len() as u64;
        for (k, &tag) in resumed.iter().enumerate() {
            let i = todo[k];
            out[i].mapped_bytes = wanted[k].iter().chain(&cached[k]).map(|w| self.arena.segment(w.1).page).sum();
            self.sleep.set_paused(tag, false);
            self.drop_disk_files(tag);
            self.count_live_blocks(&segments[k], true);
            for &run in &runs[k] {
                self.adopt_cached(run);
            }
            let state = self.sleep.tag(tag);
            state.cached.clear();
            state.keep_cached = false;
            state.retained = std::mem::take(&mut state.backup);
            state.resumes += 1;
            state.resume_ns = state.resume_ns.saturating_add(share);
        }
        self.step.note_reserved(self.stats.reserved_bytes.current());
        Ok(out)
    }

    /// The mapping and copying of `resume_tags`, batch by batch (`resumed[k]` is `tags[todo[k]]`,
    /// `wanted[k]` its pages). Pages it mapped are in `pages`: on an error the caller waits for
    /// the queued copies and unmaps them.
    fn resume_pages(
        &mut self,
        resumed: &[TagId],
        wanted: &[Vec<Want>],
        out: &mut [SleepOutcome],
        todo: &[usize],
    ) -> Result<()> {
        // Per tag, the next of its pages to map.
        let mut next = vec![0usize; resumed.len()];
        for (k, &tag) in resumed.iter().enumerate() {
            let backups: Vec<(u64, (u64, u64))> = self.sleep.tag(tag).backup.iter().map(|(&a, &v)| (a, v)).collect();
            let host = self.sleep.tag(tag).host.clone();
            let mut start = 0;
            while start < backups.len() {
                // A batch: blocks up to `COPY_BATCH` bytes (at least one), and the pages under them.
                let (mut end, mut bytes) = (start, 0u64);
                while end < backups.len() && (end == start || bytes < COPY_BATCH) {
                    bytes += backups[end].1 .1;
                    end += 1;
                }
                let (last_addr, (_, last_bytes)) = backups[end - 1];
                let pages = wanted[k][next[k]..].iter().take_while(|w| w.0 < last_addr + last_bytes).count();
                out[todo[k]].released_bytes += self.map_wanted(&wanted[k][next[k]..next[k] + pages])?;
                next[k] += pages;
                for &(addr, (offset, bytes)) in &backups[start..end] {
                    if tags::Store::of(tag) == tags::Store::Disk {
                        self.restore_from_disk(tag, addr, bytes)?;
                    } else {
                        copy_pieces(&host, offset, bytes, addr, |dev, host, n| {
                            self.backend.copy_to_device(dev, host, n)
                        })?;
                    }
                    out[todo[k]].copied_bytes += bytes;
                }
                start = end;
            }
        }
        // The pages nothing is copied into, while the last copies run.
        for (k, w) in wanted.iter().enumerate() {
            out[todo[k]].released_bytes += self.map_wanted(&w[next[k]..])?;
        }
        Ok(())
    }

    /// Every unmapped page of `segments` (a paused tag's) under a block that is not an unmapped
    /// one, in address order.
    fn wanted_pages(&self, segments: &[SegmentId]) -> Vec<Want> {
        let mut wanted: Vec<Want> = Vec::new();
        for &seg in segments {
            let (seg_addr, page) = (self.arena.segment(seg).addr, self.arena.segment(seg).page);
            for id in self.arena.segment_blocks(seg) {
                if self.arena.state(id) == BlockState::Unmapped {
                    continue;
                }
                let b = self.arena.block(id);
                let first = ((b.addr - seg_addr) / page) as usize;
                let last = ((b.addr + b.size - seg_addr).div_ceil(page)) as usize;
                for index in first..last {
                    let mapped = self.pages.get(&seg).is_some_and(|p| p[index].is_some());
                    if !mapped && wanted.last().is_none_or(|w| (w.1, w.2) != (seg, index)) {
                        wanted.push((seg_addr + index as u64 * page, seg, index));
                    }
                }
            }
        }
        wanted
    }

    /// The pages of `runs`, in order.
    fn run_pages(&self, runs: &[CachedRun]) -> Vec<Want> {
        let mut pages = Vec::new();
        for &(seg, start, end) in runs {
            let (seg_addr, page) = (self.arena.segment(seg).addr, self.arena.segment(seg).page);
            for addr in (start..end).step_by(page as usize) {
                pages.push((addr, seg, ((addr - seg_addr) / page) as usize));
            }
        }
        pages
    }

    /// Bytes of idle cached memory that other tags could give back now: whole pages of free
    /// blocks (a paused tag's and a graph's are not counted) and free plain segments.
    fn idle_cached_bytes(&self) -> u64 {
        let pages: u64 = self.free_pages.iter().filter_map(|id| self.whole_pages(id)).map(|(lo, hi)| hi - lo).sum();
        let segments: u64 = self.releasable_segments().iter().map(|&s| self.arena.segment(s).size).sum();
        pages + segments
    }

    /// A resume of `tags` needing `need` bytes fails up front, before any page is created, when
    /// neither the device's free memory nor the memory fraction leaves room for them once
    /// other tags' idle cached pages are released.
    fn check_resume_room(&mut self, tags: &[TagId], need: u64) -> Result<()> {
        let idle = self.idle_cached_bytes();
        let device_free = self.backend.mem_info().map_or(u64::MAX, |(free, _)| free);
        let over_fraction = self.fraction_set
            && self.stats.reserved_bytes.current().saturating_sub(idle).saturating_add(need) > self.allowed;
        if need > device_free.saturating_add(idle) || over_fraction {
            return Err(self.resume_out_of_memory(tags, need));
        }
        Ok(())
    }

    /// Creates and maps a page for each of `wanted`, after releasing as many bytes of other
    /// tags' idle cached pages (while any are left). A create refused for memory releases
    /// every idle cached page and tries once more. Returns the bytes released.
    fn map_wanted(&mut self, wanted: &[Want]) -> Result<u64> {
        let bytes: u64 = wanted.iter().map(|w| self.arena.segment(w.1).page).sum();
        let mut released = 0;
        if bytes > 0 {
            released += self.release_cached_for_resume(bytes)?;
        }
        for w in wanted {
            let page = self.arena.segment(w.1).page;
            let mut retried = false;
            let handle = loop {
                let over_limit =
                    self.fraction_set && self.stats.reserved_bytes.current().saturating_add(page) > self.allowed;
                let created = if over_limit {
                    Err(Error::OutOfMemory(Box::default()))
                } else {
                    self.backend.create_physical(page)
                };
                match created {
                    Ok(handle) => break handle,
                    Err(e) if e.is_out_of_memory() && !retried => {
                        retried = true;
                        self.stats.num_alloc_retries += 1;
                        released += self.release_all_cached(ReleaseReason::Oom)?;
                    }
                    Err(e) => return Err(e),
                }
            };
            self.stats.num_create += 1;
            if let Err(e) = self.map_resumed(w, handle) {
                self.backend.release_physical(handle)?;
                self.stats.num_release_physical += 1;
                return Err(e);
            }
        }
        Ok(released)
    }

    /// Releases at least `bytes` of other tags' idle cached memory, or all there is: whole
    /// pages of free blocks in block order (a block's first pages first), then free plain
    /// segments.
    fn release_cached_for_resume(&mut self, bytes: u64) -> Result<u64> {
        let mut candidates: Vec<BlockId> = self.free_pages.iter().collect();
        candidates.sort_unstable();
        let (mut released, mut synced) = (0u64, Vec::new());
        for id in candidates {
            if released >= bytes {
                break;
            }
            let Some((lo, hi)) = self.whole_pages(id) else { continue };
            let page = self.arena.segment(self.arena.block(id).segment).page;
            let end = hi.min(lo.saturating_add((bytes - released).div_ceil(page).saturating_mul(page)));
            self.unmap_range(id, lo, end, Unmapped::Release(ReleaseReason::Pause), &mut synced)?;
            released += end - lo;
        }
        self.free_unmapped_segments()?;
        for seg in self.releasable_segments() {
            if released >= bytes {
                break;
            }
            released += self.release_segment(seg, ReleaseReason::Pause)?;
        }
        Ok(released)
    }

    /// The out-of-memory error of a resume that could not get `need` bytes for `tags`.
    fn resume_out_of_memory(&mut self, tags: &[TagId], need: u64) -> Error {
        self.stats.num_ooms += 1;
        let (device_free, device_total) = self.backend.mem_info().unwrap_or((0, self.device_total));
        // Other tags' idle cached pages would have made room: they count as free here.
        let mut short = need.saturating_sub(device_free.saturating_add(self.idle_cached_bytes()));
        if self.fraction_set {
            short = short.max(self.stats.reserved_bytes.current().saturating_add(need).saturating_sub(self.allowed));
        }
        Error::OutOfMemory(Box::new(OomReport {
            device: self.device,
            requested: need,
            rounded: need,
            segment_size: need,
            device_total,
            device_free,
            reserved: self.stats.reserved_bytes.current(),
            allocated: self.stats.allocated_bytes.current(),
            allowed: self.fraction_set.then_some(self.allowed),
            largest_free_block: self.largest_free_block(),
            address_space: None,
            hint: format!(
                "Resuming {} needs {} of device memory: {}. {} paused with {} backup; free memory (or pause \
                 another tag) and resume again.",
                resumed_names(tags),
                format_bytes(need),
                if short > 0 {
                    format!("{} more than the device has free or the memory fraction allows", format_bytes(short))
                } else {
                    format!("the device refused it with {} free", format_bytes(device_free))
                },
                if names_count(tags) == 1 { "The tag stays" } else { "The tags stay" },
                if names_count(tags) == 1 { "its" } else { "their" },
            ),
            unmapped: None,
        }))
    }

    /// Maps one page of a resuming tag (`wanted` entry) with `handle`.
    fn map_resumed(&mut self, w: &(u64, SegmentId, usize), handle: PhysHandle) -> Result<()> {
        let (addr, seg, index) = *w;
        let (page, small, stream) = {
            let s = self.arena.segment(seg);
            (s.page, s.small, s.stream)
        };
        self.backend.map(addr, page, handle)?;
        self.sleep_page(seg, index).replace(handle);
        let s = &mut self.stats;
        s.num_map += 1;
        s.num_device_alloc += 1;
        s.reserved_bytes.increase(small, page);
        self.trace.record(TraceAction::SegmentMap, addr, page, 0, stream.0, 0);
        Ok(())
    }

    /// Undoes `map_resumed` after a failed resume: the page is unmapped and released.
    fn unmap_resumed(&mut self, w: &(u64, SegmentId, usize)) -> Result<()> {
        let (addr, seg, index) = *w;
        let (page, small) = (self.arena.segment(seg).page, self.arena.segment(seg).small);
        if let Some(handle) = self.sleep_page(seg, index).take() {
            self.backend.unmap(addr, page)?;
            self.backend.release_physical(handle)?;
            self.stats.reserved_bytes.decrease(small, page);
            self.stats.num_unmap += 1;
            self.stats.num_release_physical += 1;
        }
        Ok(())
    }
}

/// A page a resume maps: (address, segment, page index).
type Want = (u64, SegmentId, usize);

/// The names of tag numbers, each once: `tag "a"` or `tags "a", "b"`.
fn resumed_names(tags: &[TagId]) -> String {
    let mut names: Vec<String> = Vec::new();
    for &t in tags {
        let name = format!("{:?}", tags::name(t));
        if !names.contains(&name) {
            names.push(name);
        }
    }
    format!("{} {}", if names.len() == 1 { "tag" } else { "tags" }, names.join(", "))
}

/// How many names `tags` (numbers) are.
fn names_count(tags: &[TagId]) -> usize {
    let mut bases: Vec<TagId> = tags.iter().map(|&t| tags::base(t)).collect();
    bases.sort_unstable();
    bases.dedup();
    bases.len()
}
