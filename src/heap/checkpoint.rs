//! Checkpoints of a private pool (what torch.compile's CUDA-graph trees need of the allocator:
//! PyTorch's `getCheckpointState` / `setCheckpointPoolState`): `checkpoint_pool` records which
//! blocks of a pool's segments are allocated (address, size, bytes asked for, stream), and
//! `restore_pool` puts the pool back in that state: it frees the blocks allocated since and
//! allocates again, at the same addresses, the recorded blocks freed since. Part of the heap:
//! runs under the device lock. Not on the hot path, except one test in `malloc` for a pool
//! allocation while restored blocks wait to be adopted.
//!
//! Adoption: a caller that owns allocations through another layer's bookkeeping (PyTorch's
//! pluggable allocator keeps a table of what it handed out, and its deleters free through it)
//! restores with `adopt`; each block the restore allocated then waits, in order, for the next
//! allocation routed to its pool, which gets that block instead of a new one. So the caller
//! allocates through its own layer and gets exactly the restored addresses.
//!
//! Invariants: a restore changes nothing unless it can do all of it (every recorded segment
//! still in the pool with its address and size, no block of the pool pending, every block
//! to allocate free or freed by the same restore); segments are never created or released by
//! it; free blocks are merged and filed, and every statistic kept, as `free` and `malloc` keep
//! them.

use super::{Heap, PoolId};
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::segment::{BlockId, BlockState, SegmentId, NIL};
use crate::sizeclass::GRANULE;
use crate::trace::TraceAction;
use rustc_hash::FxHashMap;

/// An allocated block of a checkpoint, or one a restore freed or allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointBlock {
    pub addr: u64,
    /// The block's size (rounded).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    pub stream: Stream,
}

/// A private pool's state: its segments and its allocated blocks, in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolCheckpoint {
    pub pool: PoolId,
    /// (address, size) of each segment.
    pub segments: Vec<(u64, u64)>,
    pub allocated: Vec<CheckpointBlock>,
}

/// What a restore did (or, for a dry run, would do).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreDelta {
    /// Blocks allocated now and not in the checkpoint (or there with another size): freed.
    pub freed: Vec<CheckpointBlock>,
    /// Blocks of the checkpoint not allocated now: allocated at their recorded addresses.
    pub allocated: Vec<CheckpointBlock>,
}

/// First word of a checkpoint's encoding (`to_words`), with its version in the low byte.
const MAGIC: u64 = 0x5354_4550_434b_5001; // "STEPCKP" + version 1

impl PoolCheckpoint {
    /// The checkpoint as plain words, for the C ABI: magic, pool id (2), segment count, (address,
    /// size) per segment, block count, (address, size, requested, stream) per block.
    pub fn to_words(&self) -> Vec<u64> {
        let mut w = vec![MAGIC, self.pool.0, self.pool.1, self.segments.len() as u64];
        for &(addr, size) in &self.segments {
            w.extend([addr, size]);
        }
        w.push(self.allocated.len() as u64);
        for b in &self.allocated {
            w.extend([b.addr, b.size, b.requested, b.stream.0]);
        }
        w
    }

    /// A checkpoint from `to_words`'s encoding; a malformed one (wrong magic or length, blocks
    /// out of order, overlapping or outside every segment) is refused.
    pub fn from_words(w: &[u64]) -> Result<PoolCheckpoint> {
        let bad = |why: &str| Error::InvalidArgument(format!("not a stepalloc pool checkpoint: {why}"));
        if w.len() < 5 || w[0] != MAGIC {
            return Err(bad("wrong header"));
        }
        let segments_len = usize::try_from(w[3]).map_err(|_| bad("segment count"))?;
        let blocks_at = segments_len.checked_mul(2).and_then(|n| n.checked_add(4)).ok_or_else(|| bad("length"))?;
        let blocks_len = usize::try_from(*w.get(blocks_at).ok_or_else(|| bad("length"))?).map_err(|_| bad("count"))?;
        let total =
            blocks_len.checked_mul(4).and_then(|n| n.checked_add(blocks_at + 1)).ok_or_else(|| bad("length"))?;
        if total != w.len() {
            return Err(bad("length"));
        }
        let segments: Vec<(u64, u64)> = w[4..blocks_at].chunks_exact(2).map(|c| (c[0], c[1])).collect();
        let allocated: Vec<CheckpointBlock> = w[blocks_at + 1..]
            .chunks_exact(4)
            .map(|c| CheckpointBlock { addr: c[0], size: c[1], requested: c[2], stream: Stream(c[3]) })
            .collect();
        let mut end = 0;
        for b in &allocated {
            let inside = segments
                .iter()
                .any(|&(a, s)| a <= b.addr && b.addr.checked_add(b.size).is_some_and(|e| e <= a.saturating_add(s)));
            if b.addr < end || b.size == 0 || b.size % GRANULE != 0 || b.requested > b.size || !inside {
                return Err(bad(&format!("block {:#x} of {} bytes", b.addr, b.size)));
            }
            end = b.addr + b.size;
        }
        Ok(PoolCheckpoint { pool: (w[1], w[2]), segments, allocated })
    }
}

/// Restored blocks waiting for their pool's next allocations (`adopt`), oldest first.
#[derive(Default)]
pub(super) struct Adoptions {
    waiting: Vec<(u32, u64)>,
}

impl Adoptions {
    #[inline(always)]
    pub(super) fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

impl Heap {
    fn existing_pool_number(&self, id: PoolId) -> Result<u32> {
        self.private_pools.iter().position(|p| p.as_ref().is_some_and(|p| p.id == id)).map(|i| i as u32 + 1).ok_or_else(
            || Error::InvalidArgument(format!("no memory pool ({}, {}) on device {}", id.0, id.1, self.device)),
        )
    }

    fn pool_segment_ids(&self, number: u32) -> Vec<SegmentId> {
        self.arena.live_segment_ids().filter(|&s| self.arena.segment(s).pool == number).collect()
    }

    /// PyTorch's `getCheckpointState`: the state of pool `id`. A pool with paged (expandable)
    /// segments is refused: a graph pool under a tag pages its memory, which a checkpoint of
    /// blocks does not describe.
    pub fn checkpoint_pool(&mut self, id: PoolId) -> Result<PoolCheckpoint> {
        let number = self.existing_pool_number(id)?;
        let mut checkpoint = PoolCheckpoint { pool: id, segments: Vec::new(), allocated: Vec::new() };
        for seg_id in self.pool_segment_ids(number) {
            let seg = self.arena.segment(seg_id);
            if seg.expandable() {
                return Err(self.paged_pool(id));
            }
            checkpoint.segments.push((seg.addr, seg.size));
            for b in self.arena.segment_blocks(seg_id) {
                // A pending block (freed, other streams' work outstanding) is not allocated.
                if self.arena.state(b) == BlockState::Allocated {
                    let b = self.arena.block(b);
                    let block =
                        CheckpointBlock { addr: b.addr, size: b.size, requested: b.requested, stream: b.stream };
                    checkpoint.allocated.push(block);
                }
            }
        }
        checkpoint.segments.sort_unstable();
        checkpoint.allocated.sort_unstable_by_key(|b| b.addr);
        Ok(checkpoint)
    }

    fn paged_pool(&self, id: PoolId) -> Error {
        Error::InvalidArgument(format!(
            "memory pool ({}, {}) on device {} has paged segments (a CUDA graph captured inside a region): \
             checkpoints cover plain segments only",
            id.0, id.1, self.device
        ))
    }

    /// PyTorch's `setCheckpointPoolState`: frees the pool's blocks that are not allocated in
    /// `checkpoint` and allocates the checkpoint's blocks that are not allocated now, at their
    /// addresses. `dry_run`: only say what it would do. `adopt`: the allocated blocks wait for
    /// the pool's next allocations (see the file's comment). Refused, changing nothing, when a
    /// recorded segment is gone, a block of the pool waits for other streams' work, a block to
    /// free was used by other streams (`record_stream`), or a CUDA graph capture is underway.
    pub fn restore_pool(&mut self, checkpoint: &PoolCheckpoint, dry_run: bool, adopt: bool) -> Result<RestoreDelta> {
        let id = checkpoint.pool;
        let number = self.existing_pool_number(id)?;
        if self.captures_underway > 0 {
            return Err(Error::InvalidArgument(format!(
                "memory pool ({}, {}): no checkpoint is restored while a CUDA graph capture is underway",
                id.0, id.1
            )));
        }
        if !self.pending.is_empty() {
            self.process_events()?;
        }
        let segments = self.pool_segment_ids(number);
        let mut current: FxHashMap<u64, BlockId> = FxHashMap::default();
        for &seg_id in &segments {
            if self.arena.segment(seg_id).expandable() {
                return Err(self.paged_pool(id));
            }
            for b in self.arena.segment_blocks(seg_id) {
                match self.arena.state(b) {
                    BlockState::Allocated => {
                        current.insert(self.arena.block(b).addr, b);
                    }
                    BlockState::Pending => {
                        return Err(Error::InvalidArgument(format!(
                            "memory pool ({}, {}): block {:#x} was freed but other streams' work may still use \
                             it; synchronize before restoring a checkpoint",
                            id.0,
                            id.1,
                            self.arena.block(b).addr
                        )))
                    }
                    _ => {}
                }
            }
        }
        let mut checkpoint_segments = Vec::with_capacity(checkpoint.segments.len());
        for &(addr, size) in &checkpoint.segments {
            let found = segments.iter().copied().find(|&s| {
                let seg = self.arena.segment(s);
                seg.addr == addr && seg.size == size
            });
            let Some(seg_id) = found else {
                return Err(Error::InvalidArgument(format!(
                    "memory pool ({}, {}) on device {} no longer holds the segment {addr:#x} of {size} bytes its \
                     checkpoint records (released by empty_cache or by the pool's release): the checkpoint cannot \
                     be restored",
                    id.0, id.1, self.device
                )));
            };
            checkpoint_segments.push(seg_id);
        }
        let recorded: FxHashMap<u64, u64> = checkpoint.allocated.iter().map(|b| (b.addr, b.size)).collect();
        let block_of = |heap: &Heap, id: BlockId| {
            let b = heap.arena.block(id);
            CheckpointBlock { addr: b.addr, size: b.size, requested: b.requested, stream: b.stream }
        };
        let mut delta = RestoreDelta::default();
        for &b in current.values() {
            let block = block_of(self, b);
            if recorded.get(&block.addr) != Some(&block.size) {
                if self.arena.has_extra_streams(b) {
                    return Err(Error::InvalidArgument(format!(
                        "memory pool ({}, {}): block {:#x}, allocated since the checkpoint, was used on other \
                         streams (record_stream); free it and synchronize before restoring",
                        id.0, id.1, block.addr
                    )));
                }
                delta.freed.push(block);
            }
        }
        delta.freed.sort_unstable_by_key(|b| b.addr);
        for b in &checkpoint.allocated {
            let same = current.get(&b.addr).is_some_and(|&c| self.arena.block(c).size == b.size);
            if !same {
                self.check_room(&checkpoint_segments, b, &delta.freed)?;
                delta.allocated.push(*b);
            }
        }
        if dry_run {
            return Ok(delta);
        }
        self.adoptions.waiting.retain(|&(pool, _)| pool != number);
        for b in &delta.freed {
            self.checkpoint_free(b.addr)?;
        }
        for b in &delta.allocated {
            self.carve(&checkpoint_segments, b)?;
            if adopt {
                self.adoptions.waiting.push((number, b.addr));
            }
        }
        Ok(delta)
    }

    /// Whether block `b` of a checkpoint can be allocated again: inside one of its segments,
    /// over blocks that are free or freed by the restore.
    fn check_room(&self, segments: &[SegmentId], b: &CheckpointBlock, freed: &[CheckpointBlock]) -> Result<()> {
        let end = b.addr + b.size;
        let seg = segments.iter().copied().find(|&s| {
            let seg = self.arena.segment(s);
            seg.addr <= b.addr && end <= seg.addr + seg.size
        });
        let Some(seg) = seg else {
            return Err(Error::InvalidArgument(format!("checkpoint block {:#x} lies in none of its segments", b.addr)));
        };
        for id in self.arena.segment_blocks(seg) {
            let x = self.arena.block(id);
            let overlaps = x.addr < end && b.addr < x.addr + x.size;
            let state = self.arena.state(id);
            let ok = state == BlockState::Free
                || (state == BlockState::Allocated && freed.binary_search_by_key(&x.addr, |f| f.addr).is_ok());
            if overlaps && !ok {
                return Err(Error::InvalidArgument(format!(
                    "checkpoint block {:#x} of {} bytes overlaps block {:#x}, which is {:?}",
                    b.addr, b.size, x.addr, state
                )));
            }
        }
        Ok(())
    }

    /// `free` of the allocated block at `addr`, without giving its segment back: the restore
    /// keeps every segment (a later allocation of the same restore may need it).
    fn checkpoint_free(&mut self, addr: u64) -> Result<()> {
        let id = self
            .arena
            .take_allocated(addr, |_| true)
            .map_err(|_| Error::UnknownPointer { device: self.device, ptr: addr })?;
        let (size, stream, requested) = self.count_free_request(id, addr);
        self.trace.record(TraceAction::FreeCompleted, addr, size, requested, stream.0, 0);
        self.arena.set_state(id, BlockState::Free);
        let b = self.arena.block_mut(id);
        b.freed_at = self.alloc_clock;
        b.requested = 0;
        self.file_free(id);
        Ok(())
    }

    /// A free block not in a list and not counted in the inactive-split statistics: merged with
    /// its free neighbours, filed and counted (as `finish_free` does).
    fn file_free(&mut self, id: BlockId) {
        let (id, absorbed, absorbed_bytes) = self.merge_neighbours(id);
        self.enlist(id);
        self.count_merged_free(id, absorbed, absorbed_bytes);
    }

    /// Allocates checkpoint block `b` at its address, from the free blocks covering it (after
    /// `check_room`), splitting off what lies before and after.
    fn carve(&mut self, segments: &[SegmentId], b: &CheckpointBlock) -> Result<()> {
        let end = b.addr + b.size;
        let seg = segments
            .iter()
            .copied()
            .find(|&s| {
                let seg = self.arena.segment(s);
                seg.addr <= b.addr && end <= seg.addr + seg.size
            })
            .ok_or_else(|| Error::InvalidArgument(format!("checkpoint block {:#x} lies in no segment", b.addr)))?;
        let covering: Vec<BlockId> = self
            .arena
            .segment_blocks(seg)
            .filter(|&id| {
                let x = self.arena.block(id);
                x.addr < end && b.addr < x.addr + x.size
            })
            .collect();
        if covering.is_empty() || covering.iter().any(|&id| self.arena.state(id) != BlockState::Free) {
            return Err(Error::InvalidArgument(format!("checkpoint block {:#x} is not free to allocate", b.addr)));
        }
        // Out of their lists and uncounted, then one block (free neighbours of different
        // streams need not have merged).
        for &id in &covering {
            self.unlist(id);
            let x = self.arena.block(id);
            if x.is_split() {
                let (small, size) = (x.class.small(), x.size);
                self.stats.inactive_split.decrease(small, 1);
                self.stats.inactive_split_bytes.decrease(small, size);
            }
        }
        let first = covering[0];
        for &other in &covering[1..] {
            let (size, next) = {
                let o = self.arena.block(other);
                (o.size, o.next)
            };
            let f = self.arena.block_mut(first);
            f.size += size;
            f.next = next;
            if next != NIL {
                self.arena.block_mut(next).prev = first;
            }
            self.arena.drop_block(other);
        }
        let start = self.arena.block(first).addr;
        let (head, mut mid) =
            if start < b.addr { (Some(first), self.split_block(first, b.addr - start)) } else { (None, first) };
        let tail = if self.arena.block(mid).size > b.size { Some(self.split_block(mid, b.size)) } else { None };
        mid = self.arena.rehome(mid);
        self.arena.set_state(mid, BlockState::Allocated);
        let (small, seg_id) = {
            let m = self.arena.block_mut(mid);
            m.requested = b.requested;
            m.stream = b.stream;
            (m.class.small(), m.segment)
        };
        self.arena.file_allocated(mid);
        let usage = self.arena.segment_use_mut(seg_id);
        usage.last_used_step = self.step.step;
        let s = &mut self.stats;
        s.num_mallocs += 1;
        s.allocation.increase(small, 1);
        s.allocated_bytes.increase(small, b.size);
        s.requested_bytes.increase(small, b.requested);
        if s.active.any_pending() {
            s.active.note_increase(&s.allocation);
            s.active_bytes.note_increase(&s.allocated_bytes);
        }
        if b.size >= self.config.max_split_size {
            s.oversize_allocations.increase(1);
        }
        self.step.note_allocated(self.stats.allocated_bytes.current());
        self.trace.record(TraceAction::Alloc, b.addr, b.size, b.requested, b.stream.0, 0);
        for piece in [head, tail].into_iter().flatten() {
            self.arena.block_mut(piece).freed_at = self.alloc_clock;
            self.file_free(piece);
        }
        Ok(())
    }

    /// An allocation routed to private pool `number` while restored blocks wait (`adopt`): the
    /// oldest waiting block of the pool, asked for again as `size` bytes on `stream`. None when
    /// none waits for this pool. A block too small for `size` is refused (and no longer waits).
    #[cold]
    #[inline(never)]
    pub(super) fn adopt(&mut self, number: u32, size: u64, stream: Stream) -> Result<Option<u64>> {
        while let Some(i) = self.adoptions.waiting.iter().position(|&(pool, _)| pool == number) {
            let (_, addr) = self.adoptions.waiting.remove(i);
            let Some(id) = self.arena.find_allocated(addr) else { continue };
            let b = self.arena.block(id);
            if b.class.pool() != number {
                continue;
            }
            if size > b.size {
                return Err(Error::InvalidArgument(format!(
                    "an allocation of {size} bytes would take the restored block {addr:#x} of {} bytes",
                    b.size
                )));
            }
            let (small, old) = (b.class.small(), b.requested);
            self.stats.requested_bytes.decrease(small, old);
            self.stats.requested_bytes.increase(small, size);
            let b = self.arena.block_mut(id);
            b.requested = size;
            b.stream = stream;
            return Ok(Some(addr));
        }
        Ok(None)
    }

    /// Restored blocks still waiting to be adopted (tests).
    pub fn adoptions_waiting(&self) -> usize {
        self.adoptions.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::SimDevice;
    use crate::config::Config;
    use crate::units::MIB;

    const POOL: PoolId = (0, 7);
    const S: Stream = Stream(5);

    fn heap() -> Heap {
        let config = Config::parse("backend:sim,sim_capacity_mb:4096").expect("config");
        let mut heap = Heap::new(0, &config, Box::new(SimDevice::new(0, &config.sim)));
        heap.create_pool(POOL);
        heap
    }

    fn allocated(heap: &Heap) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = heap.live_blocks().into_iter().map(|(a, s, _, _)| (a, s)).collect();
        v.sort_unstable();
        v
    }

    /// Checkpoint, allocate and free more, restore: the pool's allocated blocks are exactly the
    /// checkpoint's again, at the same addresses, statistics and invariants intact; the delta
    /// names what was freed and allocated; a dry run changes nothing.
    #[test]
    fn restore_frees_blocks_allocated_since_and_reallocates_blocks_freed_since() {
        let mut heap = heap();
        let a = heap.malloc(3 * MIB, S, Some(POOL)).unwrap();
        let b = heap.malloc(MIB + 1000, S, Some(POOL)).unwrap();
        let c = heap.malloc(4000, S, Some(POOL)).unwrap();
        let cp = heap.checkpoint_pool(POOL).unwrap();
        assert_eq!(PoolCheckpoint::from_words(&cp.to_words()).unwrap(), cp);
        assert_eq!(cp.allocated.len(), 3);
        let before = allocated(&heap);
        let requested = heap.stats().heap.requested_bytes.all.current;
        heap.free(b, MIB + 1000).unwrap();
        heap.free(c, 4000).unwrap();
        let d = heap.malloc(MIB / 2, S, Some(POOL)).unwrap(); // may land where b was
        let e = heap.malloc(8 * MIB, S, Some(POOL)).unwrap();
        heap.check_invariants().unwrap();
        let dry = heap.restore_pool(&cp, true, false).unwrap();
        assert_eq!(allocated(&heap).len(), 3, "a dry run changes nothing");
        let mut freed: Vec<u64> = dry.freed.iter().map(|x| x.addr).collect();
        freed.sort_unstable();
        let mut want = vec![d, e];
        want.sort_unstable();
        assert_eq!(freed, want);
        let mut again: Vec<u64> = dry.allocated.iter().map(|x| x.addr).collect();
        again.sort_unstable();
        let mut want = vec![b, c];
        want.sort_unstable();
        assert_eq!(again, want);
        let delta = heap.restore_pool(&cp, false, false).unwrap();
        assert_eq!(delta, dry);
        heap.check_invariants().unwrap();
        assert_eq!(allocated(&heap), before);
        assert_eq!(heap.stats().heap.requested_bytes.all.current, requested);
        // The restored blocks free as any other, with the size recorded.
        heap.free(b, MIB + 1000).unwrap();
        heap.free(c, 4000).unwrap();
        heap.free(a, 3 * MIB).unwrap();
        heap.check_invariants().unwrap();
        assert_eq!(heap.stats().heap.allocated_bytes.all.current, 0);
        // Restoring a checkpoint equal to the state changes nothing.
        let cp2 = heap.checkpoint_pool(POOL).unwrap();
        assert_eq!(heap.restore_pool(&cp2, false, false).unwrap(), RestoreDelta::default());
    }

    /// With `adopt`, the restored blocks are what the pool's next allocations get, in order; a
    /// general allocation is not affected.
    #[test]
    fn adopted_blocks_go_to_the_pools_next_allocations() {
        let mut heap = heap();
        let a = heap.malloc(MIB, S, Some(POOL)).unwrap();
        let b = heap.malloc(2 * MIB, S, Some(POOL)).unwrap();
        let cp = heap.checkpoint_pool(POOL).unwrap();
        heap.free(a, MIB).unwrap();
        heap.free(b, 2 * MIB).unwrap();
        let delta = heap.restore_pool(&cp, false, true).unwrap();
        assert_eq!(delta.allocated.iter().map(|x| x.addr).collect::<Vec<_>>(), vec![a.min(b), a.max(b)]);
        assert_eq!(heap.adoptions_waiting(), 2);
        let general = heap.malloc(MIB, S, None).unwrap();
        assert!(general != a && general != b);
        let first = heap.malloc(100, Stream(9), Some(POOL)).unwrap();
        assert_eq!(first, a.min(b));
        let second = heap.malloc(2 * MIB, S, Some(POOL)).unwrap();
        assert_eq!(second, a.max(b));
        assert_eq!(heap.adoptions_waiting(), 0);
        heap.check_invariants().unwrap();
        heap.free(first, 100).unwrap();
        heap.free(second, 2 * MIB).unwrap();
        heap.check_invariants().unwrap();
        // Nothing waits now: a pool allocation is a plain one again.
        let c = heap.malloc(MIB, S, Some(POOL)).unwrap();
        assert!(heap.is_live(c));
    }

    /// A checkpoint whose segment is gone is refused, changing nothing; so are a malformed
    /// encoding and a pool that does not exist.
    #[test]
    fn a_checkpoint_whose_segment_is_gone_is_refused() {
        let mut heap = heap();
        let a = heap.malloc(3 * MIB, S, Some(POOL)).unwrap();
        let cp = heap.checkpoint_pool(POOL).unwrap();
        heap.free(a, 3 * MIB).unwrap();
        heap.empty_cache().unwrap();
        let b = heap.malloc(5 * MIB, S, Some(POOL)).unwrap();
        let err = heap.restore_pool(&cp, false, false).unwrap_err().to_string();
        assert!(err.contains("no longer holds the segment"), "{err}");
        assert!(heap.is_live(b));
        heap.check_invariants().unwrap();
        let mut words = cp.to_words();
        words.push(1);
        assert!(PoolCheckpoint::from_words(&words).is_err());
        assert!(PoolCheckpoint::from_words(&[1, 2, 3]).is_err());
        let mut other = cp.clone();
        other.pool = (0, 99);
        assert!(heap.restore_pool(&other, false, false).unwrap_err().to_string().contains("no memory pool"));
    }

    /// Random programs: checkpoint at random moments, allocate and free at random, restore a
    /// random earlier checkpoint whose segments remain; after each restore the pool's blocks
    /// are exactly the checkpoint's and the invariants hold.
    #[test]
    fn random_checkpoints_restore_exactly() {
        let mut heap = heap();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut live: Vec<(u64, u64)> = Vec::new();
        let mut checkpoints: Vec<PoolCheckpoint> = Vec::new();
        for round in 0..400 {
            match next() % 10 {
                0..=4 => {
                    let size = 1 + next() % (3 * MIB);
                    live.push((heap.malloc(size, S, Some(POOL)).unwrap(), size));
                }
                5..=7 if !live.is_empty() => {
                    let (p, size) = live.swap_remove((next() % live.len() as u64) as usize);
                    heap.free(p, size).unwrap();
                }
                8 => checkpoints.push(heap.checkpoint_pool(POOL).unwrap()),
                _ if !checkpoints.is_empty() => {
                    let cp = checkpoints[(next() % checkpoints.len() as u64) as usize].clone();
                    heap.restore_pool(&cp, false, false).unwrap();
                    // A block allocated then and now, at the same address and size, is left to
                    // its current owner (bytes asked for included).
                    let now = heap.checkpoint_pool(POOL).unwrap();
                    let shape = |c: &PoolCheckpoint| c.allocated.iter().map(|b| (b.addr, b.size)).collect::<Vec<_>>();
                    assert_eq!(shape(&now), shape(&cp), "round {round}");
                    live = now.allocated.iter().map(|b| (b.addr, b.requested)).collect();
                }
                _ => {}
            }
            heap.check_invariants().unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
    }
}
