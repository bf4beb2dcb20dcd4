//! Listeners of a private pool's segments: what NCCL buffer registration needs of the allocator
//! (PyTorch's `ProcessGroupNCCL.register_mem_pool` registers every segment of a pool with the
//! communicator, and each segment the pool creates later; `deregister_mem_pool` and a segment's
//! release deregister it). Part of the heap: runs under the device lock, off the hot path (a
//! segment's creation and release only).
//!
//! Invariants: a listener hears `added` once for each segment of its pool that exists while it
//! listens (those there when it starts included) and `removed` once for each of them, before
//! the segment's memory goes back or when the listener stops, whichever comes first. Paged
//! (expandable) pool segments are refused: their memory is mapped page by page.

use super::{Heap, PoolId};
use crate::error::{Error, Result};
use crate::segment::SegmentId;

/// Hears a pool's segments come and go. Called under the device lock: it must not call back
/// into this allocator.
pub trait SegmentListener: Send {
    /// The segment `[addr, addr + size)` of the pool exists. An error leaves it unregistered.
    fn added(&mut self, device: usize, addr: u64, size: u64) -> std::result::Result<(), String>;
    /// The segment is about to be released, or the listener stops.
    fn removed(&mut self, device: usize, addr: u64, size: u64);
}

/// The listeners of each pool, by pool id and the caller's key (one communicator each).
#[derive(Default)]
pub(super) struct Listeners {
    by_pool: Vec<(PoolId, u64, Box<dyn SegmentListener>)>,
}

impl Listeners {
    #[inline(always)]
    pub(super) fn is_empty(&self) -> bool {
        self.by_pool.is_empty()
    }
}

impl Heap {
    fn plain_pool_segments(&self, id: PoolId) -> Result<Vec<SegmentId>> {
        let Some(number) = self.private_pools.iter().position(|p| p.as_ref().is_some_and(|p| p.id == id)) else {
            return Err(Error::InvalidArgument(format!(
                "no memory pool ({}, {}) on device {}",
                id.0, id.1, self.device
            )));
        };
        let number = number as u32 + 1;
        let segments: Vec<SegmentId> =
            self.arena.live_segment_ids().filter(|&s| self.arena.segment(s).pool == number).collect();
        if segments.iter().any(|&s| self.arena.segment(s).expandable()) {
            return Err(Error::InvalidArgument(format!(
                "memory pool ({}, {}) has paged segments (a CUDA graph captured inside a region); their \
                 memory cannot be registered segment by segment",
                id.0, id.1
            )));
        }
        Ok(segments)
    }

    /// Starts `listener` (under the caller's `key`) on pool `id`: it hears `added` for every
    /// segment the pool holds now, then for each new one. A `key` already listening is refused.
    /// If `added` fails for a segment, the ones added are removed again and the error returned.
    pub fn listen_to_pool(&mut self, id: PoolId, key: u64, mut listener: Box<dyn SegmentListener>) -> Result<()> {
        let segments = self.plain_pool_segments(id)?;
        if self.listeners.by_pool.iter().any(|(p, k, _)| *p == id && *k == key) {
            return Err(Error::InvalidArgument(format!(
                "memory pool ({}, {}) is already registered with {key:#x}",
                id.0, id.1
            )));
        }
        for (i, &s) in segments.iter().enumerate() {
            let (addr, size) = (self.arena.segment(s).addr, self.arena.segment(s).size);
            if let Err(why) = listener.added(self.device, addr, size) {
                for &done in &segments[..i] {
                    let seg = self.arena.segment(done);
                    listener.removed(self.device, seg.addr, seg.size);
                }
                return Err(Error::InvalidArgument(format!(
                    "registering segment {addr:#x} of {size} bytes of memory pool ({}, {}): {why}",
                    id.0, id.1
                )));
            }
        }
        self.listeners.by_pool.push((id, key, listener));
        Ok(())
    }

    /// Stops the listener `key` of pool `id`: it hears `removed` for every segment the pool still
    /// holds. Returns whether one was listening.
    pub fn stop_listening(&mut self, id: PoolId, key: u64) -> bool {
        let Some(i) = self.listeners.by_pool.iter().position(|(p, k, _)| *p == id && *k == key) else {
            return false;
        };
        let (_, _, mut listener) = self.listeners.by_pool.swap_remove(i);
        let number = self.private_pools.iter().position(|p| p.as_ref().is_some_and(|p| p.id == id));
        if let Some(number) = number {
            let number = number as u32 + 1;
            let segments: Vec<(u64, u64)> = self
                .arena
                .live_segment_ids()
                .map(|s| self.arena.segment(s))
                .filter(|s| s.pool == number && !s.expandable())
                .map(|s| (s.addr, s.size))
                .collect();
            for (addr, size) in segments {
                listener.removed(self.device, addr, size);
            }
        }
        true
    }

    /// A segment of private pool `pool` was created (`new_segment`).
    #[cold]
    pub(super) fn segment_added(&mut self, pool: u32, addr: u64, size: u64) {
        let id = self.pool_id_of(pool);
        let device = self.device;
        for (p, _, listener) in &mut self.listeners.by_pool {
            if *p == id {
                // A failure leaves the segment unregistered: NCCL works on any device memory.
                let _ = listener.added(device, addr, size);
            }
        }
    }

    /// A segment of private pool `pool` is about to be released (`release_segment`).
    #[cold]
    pub(super) fn segment_removed(&mut self, pool: u32, addr: u64, size: u64) {
        let id = self.pool_id_of(pool);
        let device = self.device;
        for (p, _, listener) in &mut self.listeners.by_pool {
            if *p == id {
                listener.removed(device, addr, size);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::SimDevice;
    use crate::backend::Stream;
    use crate::config::Config;
    use crate::units::MIB;
    use std::sync::{Arc, Mutex};

    type Log = Arc<Mutex<Vec<(char, u64, u64)>>>;

    struct Recorder(Log, bool);

    impl SegmentListener for Recorder {
        fn added(&mut self, _: usize, addr: u64, size: u64) -> std::result::Result<(), String> {
            if self.1 {
                return Err("refused".into());
            }
            self.0.lock().unwrap().push(('+', addr, size));
            Ok(())
        }
        fn removed(&mut self, _: usize, addr: u64, size: u64) {
            self.0.lock().unwrap().push(('-', addr, size));
        }
    }

    /// A listener hears the pool's segments that exist when it starts, each new one, each one
    /// released, and the rest when it stops; another pool's segments never.
    #[test]
    fn a_listener_hears_each_segment_of_its_pool_once_each_way() {
        let config = Config::parse("backend:sim,sim_capacity_mb:4096").expect("config");
        let mut heap = Heap::new(0, &config, Box::new(SimDevice::new(0, &config.sim)));
        let (pool, other) = ((0, 1), (0, 2));
        heap.create_pool(pool);
        heap.create_pool(other);
        let a = heap.malloc(3 * MIB, Stream(0), Some(pool)).unwrap();
        let log: Log = Arc::default();
        heap.listen_to_pool(pool, 7, Box::new(Recorder(log.clone(), false))).unwrap();
        assert!(heap.listen_to_pool(pool, 7, Box::new(Recorder(log.clone(), false))).is_err());
        let seg_a = heap.segment_holding(a).unwrap();
        assert_eq!(*log.lock().unwrap(), vec![('+', seg_a.0, seg_a.1)]);
        let b = heap.malloc(30 * MIB, Stream(0), Some(pool)).unwrap();
        let seg_b = heap.segment_holding(b).unwrap();
        let c = heap.malloc(30 * MIB, Stream(0), Some(other)).unwrap();
        assert_eq!(log.lock().unwrap().len(), 2);
        assert_eq!(log.lock().unwrap()[1], ('+', seg_b.0, seg_b.1));
        heap.free(b, 30 * MIB).unwrap();
        heap.free(c, 30 * MIB).unwrap();
        heap.empty_cache().unwrap();
        assert_eq!(log.lock().unwrap()[2..], [('-', seg_b.0, seg_b.1)]);
        assert!(heap.stop_listening(pool, 7));
        assert!(!heap.stop_listening(pool, 7));
        assert_eq!(log.lock().unwrap()[3..], [('-', seg_a.0, seg_a.1)]);
        let _d = heap.malloc(30 * MIB, Stream(0), Some(pool)).unwrap();
        assert_eq!(log.lock().unwrap().len(), 4, "a stopped listener hears nothing");
        // A listener whose registration fails is refused and hears nothing more.
        let failing: Log = Arc::default();
        assert!(heap.listen_to_pool(pool, 8, Box::new(Recorder(failing.clone(), true))).is_err());
        heap.free(a, 3 * MIB).unwrap();
        assert!(failing.lock().unwrap().is_empty());
        assert!(heap.listen_to_pool((9, 9), 1, Box::new(Recorder(failing, false))).is_err());
    }
}
