//! Pause: the pages of tags given back to the device, every address kept. Part of the heap's
//! sleep and wake (`heap/sleep.rs`: the layout, and the invariants while a tag is paused); runs
//! under the device lock, `&mut self` throughout.
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
//! The free pages of a tag that keeps its cached memory are recorded first (`cached.rs`); the
//! blocks of `pause_tags_discarding`'s list are dropped as a tag's without backup are.

use super::SleepOutcome;
use crate::backend::Event;
use crate::error::Result;
use crate::heap::Heap;
use crate::segment::{BlockId, BlockState, SegmentId};
use crate::stats::ReleaseReason;
use crate::tags::{self, TagId};
use crate::trace::TraceAction;
use std::collections::BTreeMap;
use std::time::Instant;

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
        let numbers: Vec<TagId> = tags.iter().map(|&(tag, _)| tag).collect();
        let (mut out, todo) = self.sleep.plan(&numbers, true);
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
}

/// A backed-up tag of a pause whose copies are queued: (its position in the call's tags to
/// pause, the copy batches' events with the end address each covers, the backup records).
type Gated = (usize, Vec<(u64, Event)>, BTreeMap<u64, (u64, u64)>);
