//! Sleep and wake: tagged memory (`crate::tags`) that `pause_tags` gives back to the device with
//! its addresses kept, and `resume_tags` maps again. Part of the heap: runs under the device lock,
//! `&mut self` throughout.
//!
//! Layout: a non-default tag's allocations live in segments of their own (the tag is in the
//! segment, the block class and the free-list key, like the stream and the lane), and those are
//! always virtual ranges with pages mapped on demand, as expandable segments are — even when
//! the configuration uses plain segments (vLLM's sleep mode reserves one virtual range per
//! allocation for the same reason); with `big_page_mb`, their large blocks take big pages from
//! the first allocation (a pause and a resume then cost few driver calls per byte). So pages
//! never hold blocks of two tags, and a pause unmaps exactly its tag's pages. The default tag
//! is untouched: its memory is laid out as before.
//!
//! A pause (`pause_tags`: one tag or several in one call), in order: wait for the pending
//! frees' events; synchronize the device, so that no work queued on any stream still uses the
//! pages (kernels on streams the heap never saw included: a side stream's kernel may write a
//! tensor of the tag without `record_stream`); queue every backed-up tag's live bytes' copies to its
//! store (pinned or pageable host buffers kept across pauses and grown when short, or a file
//! per block: `heap/backup.rs`) on the backend's copy stream, in
//! pieces, with an event every `COPY_BATCH` bytes; meanwhile unmap and release the whole pages
//! of the tags' free blocks, the live pages of the tags without backup and other tags' idle
//! cached pages (`empty_cache`, so the device shows the memory free when the call returns);
//! then unmap and release the backed-up tags' live pages in address order, each once the
//! copies that read it completed.
//! With `tags::keeps_cached` (torch_memory_saver's semantics, set per name by its room), the
//! pause also records the free pages it unmapped (`TagState::cached`; a block freed while paused
//! adds its pages) and keeps the tag's segments reserved, and the resume maps them again, no
//! copy, after the live pages: counted in its room check, all or none, then adopted as free
//! blocks of the tag (filed, in reserved bytes) that its mallocs reuse and `empty_cache` and the
//! cache limits release. Without it a pause releases them for good.
//! A resume (`resume_tags`) checks first that the device has room (free memory plus other
//! tags' idle cached pages; else the error names the tags and the shortfall and nothing
//! changed); then per `COPY_BATCH` of backed-up blocks it releases as many bytes of other tags'
//! idle cached pages as the batch maps, creates and maps the batch's pages and queues its
//! copies, so that the next batch's driver calls run under this one's copies; then it maps the
//! pages nothing is copied into and waits for the copies. All or none: on a failure it waits
//! for the queued copies and unmaps what it mapped, and the tags stay paused with their backups.
//!
//! Invariants while a tag is paused: its segments keep their blocks (allocated blocks stay
//! allocated, so `free` finds them) but none of their pages is mapped (`pages` holds `None`);
//! its free blocks hold no whole page (they are unmapped blocks); its allocated blocks count in
//! no statistic of the heap (not allocated, not reserved) but in the tag's paused bytes; a free
//! of one drops it and its backup; nothing maps, unmaps or hands out its pages: `malloc` with
//! the tag fails with `Error::Paused`, and `empty_cache`, the cache limit and page reuse take
//! whole pages of free blocks, which `whole_pages` never finds in a paused tag's segments.

use super::backup::DiskStore;
use super::expandable::Unmapped;
use super::Heap;
use crate::backend::{Event, PhysHandle};
use crate::error::{Error, OomReport, Result};
use crate::segment::{BlockId, BlockState, SegmentId, ANY_STREAM};
use crate::stats::ReleaseReason;
use crate::tags::{self, TagId};
use crate::trace::TraceAction;
use crate::units::{format_bytes, MIB};
use std::collections::BTreeMap;
use std::time::Instant;

/// One asynchronous copy at most: large enough for a copy engine's full speed.
const COPY_PIECE: u64 = 64 * MIB;
/// Bytes queued between two events of the copy stream: the unit in which unmaps follow copies.
const COPY_BATCH: u64 = 256 * MIB;
/// The least a tag's host buffers grow by (a pinned allocation costs far more than its bytes'
/// copy, so few and large).
const HOST_GROWTH: u64 = 64 * MIB;

/// Paused tags and what each tag keeps across pauses.
#[derive(Default)]
pub(crate) struct SleepState {
    /// Bit `t % 128` of word `t / 128` set while tag number `t` is paused on this device.
    pub(super) paused: [u128; 2],
    /// Per tag number (grown on demand).
    pub(super) tags: Vec<TagState>,
    /// The disk store's staging buffers and files (`heap/backup.rs`).
    pub(super) disk: DiskStore,
}

#[derive(Default)]
pub(super) struct TagState {
    /// Host buffers (address, bytes) of the tag number's store (`heap/backup.rs`: pinned, or
    /// pageable for `mmap`; none for disk), kept across pauses: a backup fills them from the
    /// start, in the order of the tag's blocks.
    pub(super) host: Vec<(u64, u64)>,
    /// While paused with a backup: each backed-up block's address -> (offset into the buffers,
    /// bytes). A block freed while paused leaves.
    pub(super) backup: BTreeMap<u64, (u64, u64)>,
    /// After a resume, the last backup's records while its buffers are kept
    /// (torch_memory_saver's `retain_cpu_backup`): its bytes stay readable through
    /// `backup_host_address` until the next pause, `release_backup`, or the block's free.
    pub(super) retained: BTreeMap<u64, (u64, u64)>,
    /// While paused by a pause that kept cached pages (`tags::keeps_cached`): the whole pages of
    /// the tag's free blocks it unmapped, and those of blocks freed since, as `[lo, hi)` ranges;
    /// the resume maps them again as free cached memory. The tag's segments stay reserved.
    pub(super) cached: Vec<(u64, u64)>,
    /// The last pause kept cached pages (`cached`) for the resume.
    pub(super) keep_cached: bool,
    pub(super) pauses: u64,
    pub(super) resumes: u64,
    pub(super) pause_ns: u64,
    pub(super) resume_ns: u64,
}

impl SleepState {
    #[inline]
    pub(crate) fn any_paused(&self) -> bool {
        self.paused != [0, 0]
    }

    #[inline]
    pub(crate) fn is_paused(&self, tag: TagId) -> bool {
        tag != 0 && self.paused[usize::from(tag >> 7)] & (1u128 << (tag & 127)) != 0
    }

    fn set_paused(&mut self, tag: TagId, paused: bool) {
        let (word, bit) = (usize::from(tag >> 7), 1u128 << (tag & 127));
        if paused {
            self.paused[word] |= bit;
        } else {
            self.paused[word] &= !bit;
        }
    }

    /// Whether `tag` is paused (or pausing) with its free cached pages kept for the resume: its
    /// segments must stay reserved even when nothing of them is mapped.
    pub(super) fn keeps_cached(&self, tag: TagId) -> bool {
        self.tags.get(usize::from(tag)).is_some_and(|t| t.keep_cached)
    }

    pub(super) fn tag(&mut self, tag: TagId) -> &mut TagState {
        let i = usize::from(tag);
        if self.tags.len() <= i {
            self.tags.resize_with(i + 1, TagState::default);
        }
        &mut self.tags[i]
    }

    /// Bytes of pinned host memory held for backups on this device (an `mmap` store's buffers
    /// are not pinned; the disk store's staging is).
    pub(crate) fn host_bytes(&self) -> u64 {
        let pinned = self.tags.iter().enumerate().filter(|&(i, _)| tags::Store::of(i as TagId) != tags::Store::Mmap);
        pinned.flat_map(|(_, t)| t.host.iter()).map(|&(_, bytes)| bytes).sum::<u64>() + self.disk.staging_bytes()
    }
}

/// What one pause or resume of one tag on one device did.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct SleepOutcome {
    /// The tag was paused already (pause) or not paused (resume): nothing was done.
    pub skipped: bool,
    /// Bytes of physical memory given back to the device (the tag's and other tags' idle pages).
    pub released_bytes: u64,
    /// Bytes of physical memory mapped again (resume).
    pub mapped_bytes: u64,
    /// Bytes copied to the host (pause) or back (resume).
    pub copied_bytes: u64,
    /// Bytes of live blocks whose contents were discarded (pause without backup).
    pub discarded_bytes: u64,
}

impl Heap {
    /// Gives back the physical memory of the pages of `tags` (tag number, backup), keeping
    /// every address: with a backup, the live blocks' bytes are copied to host memory (the
    /// number's store) first; without, they are discarded. A number is one of a name's
    /// `tags::numbers`; one paused already is skipped; refused during a CUDA-graph capture.
    /// One call, one outcome per tag: the pending
    /// frees and the tags' streams are waited for once; every backed-up tag's copies are queued
    /// first; while they run, the pages of the tags without backup, the backed-up tags' free
    /// pages and other tags' idle cached pages go; last the backed-up tags' live pages, batch
    /// by batch as each batch's copy completes. An error before any page went (no host memory
    /// for a backup, a failed copy) leaves every tag as it was.
    pub fn pause_tags(&mut self, tags: &[(TagId, bool)]) -> Result<Vec<SleepOutcome>> {
        self.pause_tags_discarding(tags, &[])
    }

    /// `pause_tags`, where the live blocks that start at an address of `discard` (sorted) are
    /// discarded even in a backed-up tag (vLLM's `discardable`: storage the caller rewrites
    /// after waking needs no copy).
    pub fn pause_tags_discarding(&mut self, tags: &[(TagId, bool)], discard: &[u64]) -> Result<Vec<SleepOutcome>> {
        for &(tag, _) in tags {
            self.check_sleep_call(tag, "pause")?;
        }
        let mut out = vec![SleepOutcome::default(); tags.len()];
        let mut todo: Vec<usize> = Vec::new();
        for (i, &(tag, _)) in tags.iter().enumerate() {
            if self.sleep.is_paused(tag) || tags[..i].iter().any(|t| t.0 == tag) {
                out[i].skipped = true;
            } else {
                todo.push(i);
            }
        }
        if todo.is_empty() {
            return Ok(out);
        }
        let started = Instant::now();
        if !self.pending.is_empty() {
            self.synchronize_pending()?;
        }
        let segments: Vec<Vec<SegmentId>> = todo.iter().map(|&i| self.tag_segments(tags[i].0)).collect();
        for &i in &todo {
            // The buffers are about to be written again: the retained records no longer hold.
            let state = self.sleep.tag(tags[i].0);
            state.retained.clear();
            state.cached.clear();
            state.keep_cached = false;
        }
        // Every stream's work, not only the streams the tags' blocks name: the first unmap must
        // not run under a kernel that still uses the pages.
        self.backend.synchronize()?;
        // The backed-up tags' copies, queued before any page goes: (position in `todo`, the
        // batches' events, the backup records).
        let mut gated: Vec<Gated> = Vec::new();
        for (k, &i) in todo.iter().enumerate() {
            let (tag, backup) = tags[i];
            let (live, dropped): (Vec<_>, Vec<_>) = self
                .tag_live_blocks(&segments[k])
                .into_iter()
                .partition(|&(addr, _, _)| backup && discard.binary_search(&addr).is_err());
            out[i].discarded_bytes = dropped.iter().map(|&(_, bytes, _)| bytes).sum();
            if !backup {
                continue;
            }
            match self.queue_backup(tag, &live) {
                Ok((batches, backups)) => {
                    out[i].copied_bytes = backups.values().map(|&(_, bytes)| bytes).sum();
                    gated.push((k, batches, backups));
                }
                Err(e) => {
                    // Nothing was unmapped yet: the copies queued for the tags before finish
                    // and every tag stays as it was.
                    self.drop_batches(gated.into_iter().flat_map(|g| g.1).collect());
                    return Err(e);
                }
            }
        }
        let result = self.pause_pages(tags, &todo, &segments, &mut gated, &mut out);
        // On an error, the batches not reached are waited for and dropped (their tags stay
        // resident).
        self.drop_batches(gated.into_iter().flat_map(|g| g.1).collect());
        result?;
        let share = (started.elapsed().as_nanos() as u64) / todo.len() as u64;
        for &i in &todo {
            let state = self.sleep.tag(tags[i].0);
            state.pauses += 1;
            state.pause_ns = state.pause_ns.saturating_add(share);
        }
        Ok(out)
    }

    /// The page work of `pause_tags` once the copies are queued: everything that waits for no
    /// copy first, then the backed-up tags' live pages as their batches complete. `gated`'s
    /// entries leave as they are used.
    fn pause_pages(
        &mut self,
        tags: &[(TagId, bool)],
        todo: &[usize],
        segments: &[Vec<SegmentId>],
        gated: &mut Vec<Gated>,
        out: &mut [SleepOutcome],
    ) -> Result<()> {
        // The streams' work on these pages completed: free neighbours of different streams may
        // merge, so that a page only free blocks share goes whole.
        self.settle_tag_free_streams(&segments.concat());
        // Free pages need no copy: they go while the copies run.
        // (A graph pool's free pages are the graph's: they go with the live pages, below, and a
        // resume maps them again; `heap/graphs.rs`.)
        for (k, &i) in todo.iter().enumerate() {
            let keep = tags::keeps_cached(tags[i].0);
            self.sleep.tag(tags[i].0).keep_cached = keep;
            for &seg in &segments[k] {
                if self.arena.segment(seg).pool != 0 {
                    continue;
                }
                let free: Vec<BlockId> =
                    self.arena.segment_blocks(seg).filter(|&id| self.arena.state(id) == BlockState::Free).collect();
                for id in free {
                    if keep {
                        self.note_cached(tags[i].0, id);
                    }
                    out[i].released_bytes += self.unmap_free_pages(id, ReleaseReason::Pause)?;
                }
            }
        }
        // The tags without backup: their live pages go now. From its mark on, a tag is paused:
        // its live blocks leave the heap's statistics.
        for (k, &i) in todo.iter().enumerate() {
            if tags[i].1 {
                continue;
            }
            self.mark_paused(tags[i].0, &segments[k]);
            out[i].released_bytes += self.release_live_pages(&segments[k], Vec::new())?;
        }
        // Idle pages of other tags are not needed now: the other side of the loop needs them.
        out[todo[0]].released_bytes += self.release_all_cached(ReleaseReason::Pause)?;
        // Last the backed-up tags' live pages, each once the copy that reads it completed.
        while !gated.is_empty() {
            let (k, batches, backups) = gated.remove(0);
            let i = todo[k];
            self.mark_paused(tags[i].0, &segments[k]);
            self.sleep.tag(tags[i].0).backup = backups;
            out[i].released_bytes += self.release_live_pages(&segments[k], batches)?;
        }
        Ok(())
    }

    /// From here on `tag` is paused: its live blocks leave the heap's statistics.
    fn mark_paused(&mut self, tag: TagId, segments: &[SegmentId]) {
        self.sleep.set_paused(tag, true);
        self.count_live_blocks(segments, false);
    }

    /// The live blocks of `segments`, in address order: (address, bytes to keep, block size).
    fn tag_live_blocks(&self, segments: &[SegmentId]) -> Vec<(u64, u64, u64)> {
        segments
            .iter()
            .flat_map(|&s| self.arena.segment_blocks(s))
            .filter(|&id| self.arena.state(id) == BlockState::Allocated)
            .map(|id| {
                let b = self.arena.block(id);
                (b.addr, b.requested, b.size)
            })
            .collect()
    }

    /// Waits for the copy batches' events and gives them back (after an error: errors of the
    /// waits themselves are the first error's consequences and are not reported again).
    fn drop_batches(&mut self, batches: Vec<(u64, Event)>) {
        for (_, event) in batches {
            let _ = self.backend.wait_event(event);
            self.backend.free_event(event);
        }
    }

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
        let mut out = vec![SleepOutcome::default(); tags.len()];
        let mut todo: Vec<usize> = Vec::new();
        for (i, &tag) in tags.iter().enumerate() {
            if !self.sleep.is_paused(tag) || tags[..i].contains(&tag) {
                out[i].skipped = true;
            } else {
                todo.push(i);
            }
        }
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
        let copied = self.backend.record_copy_event().and_then(|event| {
            let waited = self.backend.wait_event(event);
            self.backend.free_event(event);
            waited
        });
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

    /// Records the whole pages of the free block `id` of paused (or pausing) `tag` as cached
    /// pages its resume maps again.
    pub(super) fn note_cached(&mut self, tag: TagId, id: BlockId) {
        let b = self.arena.block(id);
        let (lo, hi) = self.arena.segment(b.segment).whole_pages(b.addr, b.size);
        if hi > lo {
            self.sleep.tag(tag).cached.push((lo, hi));
        }
    }

    /// The unmapped runs of `segments` (paused `tag`'s) inside the cached ranges its pause
    /// kept: (segment, start, end), page-aligned, each inside one unmapped block.
    fn cached_runs(&mut self, tag: TagId, segments: &[SegmentId]) -> Vec<CachedRun> {
        let mut ranges = std::mem::take(&mut self.sleep.tag(tag).cached);
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
        for (lo, hi) in ranges {
            match merged.last_mut() {
                Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
                _ => merged.push((lo, hi)),
            }
        }
        let mut runs = Vec::new();
        for &seg in segments {
            for id in self.arena.segment_blocks(seg) {
                if self.arena.state(id) != BlockState::Unmapped {
                    continue;
                }
                let (addr, end) = (self.arena.block(id).addr, self.arena.block(id).addr + self.arena.block(id).size);
                for &(lo, hi) in &merged {
                    let (start, stop) = (lo.max(addr), hi.min(end));
                    if start < stop {
                        runs.push((seg, start, stop));
                    }
                }
            }
        }
        // Kept until the resume succeeds: a failed one leaves the tag paused as it was.
        self.sleep.tag(tag).cached = merged;
        runs
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

    /// After a resume mapped the pages of `run` (reserved bytes counted then): the part of the
    /// unmapped block there becomes a free block, merged with free neighbours and filed, as
    /// `map_block` leaves pages it maps for a request. Its pages are the tag's cached memory:
    /// a malloc of the tag reuses them, `empty_cache` and the cache limits release them.
    fn adopt_cached(&mut self, (seg, start, end): CachedRun) {
        let Some(id) = self.arena.segment_blocks(seg).find(|&id| {
            let b = self.arena.block(id);
            self.arena.state(id) == BlockState::Unmapped && b.addr <= start && end <= b.addr + b.size
        }) else {
            debug_assert!(false, "a cached run lost its unmapped block");
            return;
        };
        let (addr, size) = (self.arena.block(id).addr, self.arena.block(id).size);
        self.arena.remove_unmapped(id);
        let mut middle = id;
        if start > addr {
            middle = self.split_block(id, start - addr);
            self.arena.add_unmapped(id);
        }
        if end < addr + size {
            let rest = self.split_block(middle, end - start);
            self.arena.add_unmapped(rest);
        }
        let clock = self.alloc_clock;
        self.arena.set_state(middle, BlockState::Free);
        let b = self.arena.block_mut(middle);
        // Fresh pages: no stream's work is queued on them.
        b.stream = ANY_STREAM;
        b.freed_at = clock;
        self.arena.segment_mut(seg).mapped += end - start;
        let (merged, absorbed, absorbed_bytes) = self.merge_neighbours(middle);
        self.enlist(merged);
        self.count_merged_free(merged, absorbed, absorbed_bytes);
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

    /// Frees the host buffers of every tag that holds no paused bytes in them, and the disk
    /// store's staging. Returns the bytes freed.
    pub fn release_backup(&mut self) -> Result<u64> {
        let mut freed = self.release_staging()?;
        for i in 0..self.sleep.tags.len() {
            if !self.sleep.tags[i].backup.is_empty() {
                continue;
            }
            self.sleep.tags[i].retained.clear();
            while let Some((addr, bytes)) = self.sleep.tags[i].host.pop() {
                self.host_buffer_free(i as TagId, addr, bytes)?;
                freed += bytes;
            }
        }
        Ok(freed)
    }

    /// Bytes of pinned host memory held for backups.
    pub fn backup_host_bytes(&self) -> u64 {
        self.sleep.host_bytes()
    }

    // ----- the steps ------------------------------------------------------------------------

    pub(crate) fn check_sleep_call(&self, tag: TagId, what: &str) -> Result<()> {
        if tag == 0 {
            return Err(Error::InvalidArgument(format!(
                "{what} of tag \"default\": memory allocated outside any region has no tag of its own and \
                 cannot be paused; allocate it in a region"
            )));
        }
        if self.captures_underway > 0 {
            return Err(Error::InvalidArgument(format!(
                "{what} of tag {:?} on device {} during a CUDA graph capture: unmapping or mapping memory \
                 would invalidate the capture; {what} after it ends",
                tags::name(tag),
                self.device
            )));
        }
        Ok(())
    }

    /// The allocated blocks of `segments` (a tag's) enter the heap's allocation statistics
    /// (`counted`, at resume) or leave them (at pause): a paused tag's blocks count in none.
    fn count_live_blocks(&mut self, segments: &[SegmentId], counted: bool) {
        for &seg in segments {
            for id in self.arena.segment_blocks(seg).filter(|&id| self.arena.state(id) == BlockState::Allocated) {
                let b = self.arena.block(id);
                let (small, size, requested) = (b.class.small(), b.size, b.requested);
                let s = &mut self.stats;
                if counted {
                    s.allocation.increase(small, 1);
                    s.allocated_bytes.increase(small, size);
                    s.requested_bytes.increase(small, requested);
                } else {
                    s.allocation.decrease(small, 1);
                    s.allocated_bytes.decrease(small, size);
                    s.requested_bytes.decrease(small, requested);
                }
            }
        }
    }

    /// Queues the copies of `live` blocks (address, bytes, size) into `tag`'s host buffers
    /// (grown when short). Returns the batches' events with the end address each covers, and
    /// the backup records.
    #[allow(clippy::type_complexity)]
    fn queue_backup(
        &mut self,
        tag: TagId,
        live: &[(u64, u64, u64)],
    ) -> Result<(Vec<(u64, Event)>, BTreeMap<u64, (u64, u64)>)> {
        if tags::Store::of(tag) == tags::Store::Disk {
            return Ok((Vec::new(), self.backup_to_disk(tag, live)?));
        }
        let need: u64 = live.iter().map(|&(_, bytes, _)| bytes).sum();
        self.grow_host(tag, need)?;
        let host = self.sleep.tag(tag).host.clone();
        let (mut batches, mut backups) = (Vec::new(), BTreeMap::new());
        let (mut offset, mut in_batch) = (0u64, 0u64);
        let mut queued = Ok(());
        for &(addr, bytes, size) in live {
            if bytes == 0 {
                continue;
            }
            queued = copy_pieces(&host, offset, bytes, addr, |dev, host, n| self.backend.copy_to_host(host, dev, n));
            if queued.is_err() {
                break;
            }
            backups.insert(addr, (offset, bytes));
            offset += bytes;
            in_batch += bytes;
            if in_batch >= COPY_BATCH {
                match self.backend.record_copy_event() {
                    Ok(event) => batches.push((addr + size, event)),
                    Err(e) => {
                        queued = Err(e);
                        break;
                    }
                }
                in_batch = 0;
            }
        }
        if queued.is_ok() && in_batch > 0 {
            match self.backend.record_copy_event() {
                Ok(event) => batches.push((u64::MAX, event)),
                Err(e) => queued = Err(e),
            }
        }
        if let Err(e) = queued {
            // Nothing was unmapped yet: wait for what was queued and leave the tag as it was.
            let drained = self.backend.record_copy_event().and_then(|event| {
                let waited = self.backend.wait_event(event);
                self.backend.free_event(event);
                waited
            });
            for (_, event) in batches {
                self.backend.free_event(event);
            }
            drained?;
            return Err(e);
        }
        Ok((batches, backups))
    }

    /// Grows `tag`'s host buffers (of its store) to hold `need` bytes.
    fn grow_host(&mut self, tag: TagId, need: u64) -> Result<()> {
        let have: u64 = self.sleep.tag(tag).host.iter().map(|&(_, bytes)| bytes).sum();
        if have >= need {
            return Ok(());
        }
        let mut bytes = (need - have).max(HOST_GROWTH).div_ceil(2 * MIB).saturating_mul(2 * MIB);
        // The growth is a floor for speed, not a need: short of host memory, ask for the need.
        let addr = match self.host_buffer_alloc(tag, bytes) {
            Ok(addr) => addr,
            Err(_) if bytes > need - have => {
                bytes = (need - have).div_ceil(2 * MIB).saturating_mul(2 * MIB);
                self.host_buffer_alloc(tag, bytes).map_err(|e| self.host_short(tag, bytes, e))?
            }
            Err(e) => return Err(self.host_short(tag, bytes, e)),
        };
        self.sleep.tag(tag).host.push((addr, bytes));
        Ok(())
    }

    /// The error of a pause that could not get `bytes` of host memory for `tag`'s backup:
    /// nothing was released yet, so the tag stays resident with its bytes.
    #[cold]
    fn host_short(&self, tag: TagId, bytes: u64, cause: Error) -> Error {
        let why = match cause {
            Error::OutOfMemory(_) => "out of memory".to_string(),
            other => other.to_string(),
        };
        Error::Unavailable(format!(
            "pause of tag {:?} on device {}: could not allocate {} of {} for its backup ({why}); \
             nothing was released: the tag stays on the device with its contents. Free host memory, or pause it \
             with backup=False (its contents are then discarded)",
            tags::name(tag),
            self.device,
            format_bytes(bytes),
            Self::host_kind(tag)
        ))
    }

    /// Unmaps and releases the remaining pages of paused `segments` in address order, each once
    /// the copy batch that reads it completed (`batches`: end address covered, event).
    fn release_live_pages(&mut self, segments: &[SegmentId], batches: Vec<(u64, Event)>) -> Result<u64> {
        let mut waiting = batches.into_iter().peekable();
        let mut covered = 0u64;
        let mut released = 0;
        let mut result = Ok(());
        'segments: for &seg in segments {
            let (seg_addr, page, small, stream) = {
                let s = self.arena.segment(seg);
                (s.addr, s.page, s.small, s.stream)
            };
            let count = self.pages.get(&seg).map_or(0, Vec::len);
            for index in 0..count {
                let Some(handle) = self.pages.get(&seg).and_then(|p| p[index]) else { continue };
                let addr = seg_addr + index as u64 * page;
                while covered < addr + page {
                    let Some((end, event)) = waiting.next() else { break };
                    let waited = self.backend.wait_event(event);
                    self.backend.free_event(event);
                    if let Err(e) = waited {
                        result = Err(e);
                        break 'segments;
                    }
                    covered = end;
                }
                if let Err(e) = self.backend.unmap(addr, page).and_then(|()| self.backend.release_physical(handle)) {
                    result = Err(e);
                    break 'segments;
                }
                self.sleep_page(seg, index).take();
                let s = &mut self.stats;
                s.num_unmap += 1;
                s.num_release_physical += 1;
                s.reserved_bytes.decrease(small, page);
                let reason = ReleaseReason::Pause as usize;
                s.released_bytes[reason] = s.released_bytes[reason].saturating_add(page);
                released += page;
                self.trace.record(TraceAction::SegmentUnmap, addr, page, 0, stream.0, 0);
            }
        }
        for (_, event) in waiting {
            if result.is_ok() {
                result = self.backend.wait_event(event);
            }
            self.backend.free_event(event);
        }
        if released > 0 {
            self.stats.num_device_free += 1;
        }
        result.map(|()| released)
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

/// A backed-up tag of a pause whose copies are queued: (its position in the call's tags to
/// pause, the copy batches' events with the end address each covers, the backup records).
type Gated = (usize, Vec<(u64, Event)>, BTreeMap<u64, (u64, u64)>);

/// A page a resume maps: (address, segment, page index).
type Want = (u64, SegmentId, usize);

/// Cached pages a resume maps again: (segment, start, end), inside one unmapped block.
type CachedRun = (SegmentId, u64, u64);

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

/// Runs `copy(device address, host address, bytes)` over `bytes` at `device`, backed at
/// `offset` of the concatenated host `buffers`, in pieces of at most `COPY_PIECE` that never
/// cross a buffer's end.
fn copy_pieces(
    buffers: &[(u64, u64)],
    offset: u64,
    bytes: u64,
    device: u64,
    mut copy: impl FnMut(u64, u64, u64) -> Result<()>,
) -> Result<()> {
    let (mut offset, mut done) = (offset, 0u64);
    let mut base = 0u64;
    for &(host, size) in buffers {
        while done < bytes && offset < base + size {
            let n = (bytes - done).min(base + size - offset).min(COPY_PIECE);
            copy(device + done, host + (offset - base), n)?;
            done += n;
            offset += n;
        }
        base += size;
        if done == bytes {
            return Ok(());
        }
    }
    Err(Error::InvalidArgument(format!("backup of {bytes} bytes does not fit the host buffers")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_cut_at_buffer_ends_and_piece_size() {
        let buffers = [(1000, 100 * MIB), (9_000_000_000, 200 * MIB)];
        let mut calls = Vec::new();
        copy_pieces(&buffers, 90 * MIB, 80 * MIB, 1 << 40, |d, h, n| {
            calls.push((d, h, n));
            Ok(())
        })
        .unwrap();
        assert_eq!(
            calls,
            vec![
                (1 << 40, 1000 + 90 * MIB, 10 * MIB),
                ((1 << 40) + 10 * MIB, 9_000_000_000, 64 * MIB),
                ((1 << 40) + 74 * MIB, 9_000_000_000 + 64 * MIB, 6 * MIB)
            ]
        );
        assert!(copy_pieces(&buffers, 250 * MIB, 100 * MIB, 0, |_, _, _| Ok(())).is_err());
    }
}
