//! The allocator: one heap per device, each behind its own lock. This is the only lock layer;
//! everything below takes `&mut Heap`. The process-wide instance that the C ABI and PyTorch use
//! is `process`'s.
//!
//! The device lock (`DeviceLock`) is std's mutex: on Linux a futex word taken with a
//! compare-and-swap and released with a swap that says in the same instruction whether a thread
//! sleeps on it, so no wake-up is lost and no sleep needs a deadline; waiters spin briefly, then
//! sleep in the kernel. A panic under the lock (an overflow check, a bug; the C ABI's guard turns
//! it into an error) may leave the heap half way through an operation: the next caller to take
//! the lock checks the heap's invariants. Whole, the device goes on; broken, every later call
//! that could change or hand out memory on it is refused (`Error::Unavailable` naming what is
//! broken), so no block is handed out twice over bookkeeping a panic left behind.
//! parking_lot's mutex measured the same on the hot path and slower under contention. Rules for
//! holders:
//! - a call that needs several devices (pause, resume: `sleep.rs`) takes their locks in device
//!   order, 0 first, and holds them all until it returns; every other call holds one device's
//!   lock at a time, so no two callers wait on each other in a circle;
//! - under a device lock only leaf locks are taken (the tag registry, `tags.rs`; the backup
//!   directory, `heap/backup.rs`), and nothing is called that may call back into the allocator
//!   (segment listeners must not: `heap/listeners.rs`).

use crate::backend::{self, sim::SimDevice, Backend, Stream};
use crate::config::{BackendKind, Config};
use crate::error::{Error, Result};
use crate::heap::{Heap, PoolId};
use crate::segment::HomeHint;
use crate::snapshot::{SnapshotAnnotation, SnapshotSegment, SnapshotTraceEvent};
use crate::stats::{DeviceStats, StepFigures};
use serde_json::json;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// A device's heap behind its lock (see the module's rules).
pub(crate) struct DeviceLock {
    heap: Mutex<Heap>,
    /// Set when a panic under the lock left the heap's invariants broken: what is broken.
    broken: OnceLock<String>,
}

/// A device's heap, locked.
pub(crate) type HeapGuard<'a> = MutexGuard<'a, Heap>;

impl DeviceLock {
    fn new(heap: Heap) -> DeviceLock {
        DeviceLock { heap: Mutex::new(heap), broken: OnceLock::new() }
    }

    /// Waits for the lock and takes it, for a call that only reads the heap; after a panic of
    /// an earlier holder, the heap is checked first (see the module's rules).
    #[inline]
    pub(crate) fn lock(&self) -> HeapGuard<'_> {
        match self.heap.lock() {
            Ok(heap) => heap,
            Err(poisoned) => self.after_panic(poisoned.into_inner()),
        }
    }

    /// The lock for a call that may change the heap or hand out its memory: refused when a
    /// panic left device `device`'s heap broken. The common path is the mutex alone: a broken
    /// heap keeps its mutex poisoned, so only the poisoned path looks at `broken`.
    #[inline]
    pub(crate) fn lock_usable(&self, device: usize) -> Result<HeapGuard<'_>> {
        match self.heap.lock() {
            Ok(heap) => Ok(heap),
            Err(poisoned) => self.usable_after_panic(poisoned.into_inner(), device),
        }
    }

    #[cold]
    fn usable_after_panic<'a>(&'a self, heap: HeapGuard<'a>, device: usize) -> Result<HeapGuard<'a>> {
        let heap = self.after_panic(heap);
        match self.broken.get() {
            None => Ok(heap),
            Some(why) => Err(Error::Unavailable(format!(
                "device {device}: an internal error (a panic, reported when it happened) left stepalloc's \
                 bookkeeping of this device inconsistent ({why}); every later call on it is refused so that \
                 no memory is handed out twice. Restart the process, and please report the first error"
            ))),
        }
    }

    /// A lock after a panic under it: checks the heap once. Whole, the poisoning is cleared;
    /// broken, it is noted in `broken` and the mutex stays poisoned.
    #[cold]
    fn after_panic<'a>(&'a self, heap: HeapGuard<'a>) -> HeapGuard<'a> {
        if self.broken.get().is_none() {
            match heap.check_invariants() {
                Ok(()) => self.heap.clear_poison(),
                Err(why) => {
                    let _ = self.broken.set(why);
                }
            }
        }
        heap
    }
}

pub struct Allocator {
    config: Config,
    pub(crate) devices: Vec<DeviceLock>,
    /// Each device's `HomeHint`, read without its lock (`home_lines`).
    hints: Vec<Arc<HomeHint>>,
}

impl Allocator {
    /// Builds the allocator on the backend the configuration names.
    pub fn new(config: Config) -> Result<Allocator> {
        let backends: Vec<Box<dyn Backend>> = match config.backend {
            BackendKind::Sim => {
                (0..config.sim.devices).map(|i| Box::new(SimDevice::new(i, &config.sim)) as Box<dyn Backend>).collect()
            }
            BackendKind::Cuda => backend::cuda::open_all()?,
            BackendKind::Auto => backend::cuda::open_all().map_err(|e| {
                Error::Unavailable(format!(
                    "backend:auto found no usable CUDA device ({e}); set backend:sim to use the simulated device"
                ))
            })?,
        };
        Ok(Allocator::with_backends(config, backends))
    }

    /// Builds the allocator over the given devices (device `i` is `backends[i]`).
    pub fn with_backends(config: Config, backends: Vec<Box<dyn Backend>>) -> Allocator {
        let devices: Vec<_> =
            backends.into_iter().enumerate().map(|(i, b)| DeviceLock::new(Heap::new(i, &config, b))).collect();
        let hints = devices.iter().map(|heap| heap.lock().arena.home_hint()).collect();
        Allocator { config, devices, hints }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    #[inline]
    fn heap(&self, device: usize) -> Result<HeapGuard<'_>> {
        match self.devices.get(device) {
            Some(heap) => heap.lock_usable(device),
            None => Err(self.no_device(device)),
        }
    }

    /// Every device's lock, in device order (the order calls on several devices take them),
    /// for a call that changes them: refused when one is broken (see `DeviceLock`).
    pub(crate) fn lock_all(&self) -> Result<Vec<HeapGuard<'_>>> {
        self.devices.iter().enumerate().map(|(device, heap)| heap.lock_usable(device)).collect()
    }

    #[cold]
    fn no_device(&self, device: usize) -> Error {
        Error::InvalidArgument(format!("device {device} does not exist ({} devices)", self.devices.len()))
    }

    #[inline]
    pub fn malloc(&self, device: usize, size: u64, stream: Stream) -> Result<u64> {
        // The calling thread's region tags the block (`tags`: a thread-local load once any
        // thread has entered a region).
        self.heap(device)?.malloc_tagged(size, stream, None, crate::tags::current())
    }

    /// Allocates into a CUDA graph's private pool (`None`: the general pool).
    #[inline]
    pub fn malloc_in_pool(&self, device: usize, size: u64, stream: Stream, pool: Option<PoolId>) -> Result<u64> {
        self.heap(device)?.malloc_tagged(size, stream, pool, crate::tags::current())
    }

    /// The addresses of the state bytes and the first of the four records where `free(ptr)`
    /// will look first on `device` (`HomeHint`): read without the lock, possibly stale, for a
    /// prefetch only. None for a device that does not exist.
    #[inline]
    pub fn home_lines(&self, device: usize, ptr: u64) -> Option<(usize, usize)> {
        Some(self.hints.get(device)?.lines(ptr))
    }

    /// Frees `ptr`; `size` is the size asked for at malloc, or 0 when unknown.
    #[inline]
    pub fn free(&self, device: usize, ptr: u64, size: u64) -> Result<()> {
        self.heap(device)?.free(ptr, size)
    }

    pub fn record_stream(&self, device: usize, ptr: u64, stream: Stream) -> Result<()> {
        self.heap(device)?.record_stream(ptr, stream)
    }

    /// Releases every unused cached segment on every device. Returns bytes released.
    pub fn empty_cache(&self) -> Result<u64> {
        let mut released = 0;
        for (device, heap) in self.devices.iter().enumerate() {
            released += heap.lock_usable(device)?.empty_cache()?;
        }
        Ok(released)
    }

    pub fn set_memory_fraction(&self, device: usize, fraction: f64) -> Result<()> {
        // 0 is accepted, as PyTorch does: nothing may be reserved.
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidArgument(format!("memory fraction {fraction} is not in [0, 1]")));
        }
        self.heap(device)?.set_memory_fraction(fraction);
        Ok(())
    }

    /// Whether the general pool's new segments are expandable, on every device (PyTorch's
    /// `_set_allocator_settings("expandable_segments:...")`; `Heap::set_expandable_segments`).
    pub fn set_expandable_segments(&self, on: bool) {
        for heap in &self.devices {
            heap.lock().set_expandable_segments(on);
        }
    }

    /// `torch.cuda.caching_allocator_enable(enabled)` on every device
    /// (`Heap::set_caching_enabled`).
    pub fn set_caching_enabled(&self, enabled: bool) {
        for heap in &self.devices {
            heap.lock().set_caching_enabled(enabled);
        }
    }

    /// Whether caching is enabled (device 0 speaks for all: they are switched together).
    pub fn caching_enabled(&self) -> bool {
        self.devices.first().is_none_or(|heap| heap.lock().caching_enabled())
    }

    /// The per-process memory fraction of `device` (`set_memory_fraction`, else the
    /// configuration's `per_process_memory_fraction`).
    pub fn memory_fraction(&self, device: usize) -> Result<f64> {
        Ok(self.heap(device)?.memory_fraction())
    }

    /// A capture into `pool` begins (before the stream's capture does, as PyTorch calls it). A
    /// capture into the same pool that never ended counts as ended; work that captures held
    /// back runs first when no other capture is underway.
    pub fn begin_allocate_to_pool(&self, device: usize, pool: PoolId) -> Result<()> {
        let mut heap = self.heap(device)?;
        heap.abandon_capture(pool);
        // A failure here must not fail the capture; the work is retried at the next malloc/free.
        let _ = heap.run_deferred_work();
        heap.begin_pool(pool);
        // A capture begun inside a region puts the graph's pool under its tag (`heap/graphs.rs`).
        heap.tag_pool(pool, crate::tags::current());
        Ok(())
    }

    /// A route into `pool` begins (`use_mem_pool`; `beginAllocateToPool` whose filter claims
    /// the default stream, which no capture can): the pool gets a reference, and nothing that a
    /// capture holds back (events, releases, `empty_cache`) waits for it.
    pub fn begin_route_to_pool(&self, device: usize, pool: PoolId) -> Result<()> {
        self.heap(device)?.begin_route(pool);
        Ok(())
    }

    /// The route into `pool` ends; the pool keeps its references until `release_pool`.
    pub fn end_route_to_pool(&self, device: usize, pool: PoolId) -> Result<()> {
        self.heap(device)?.end_route(pool);
        Ok(())
    }

    /// The capture into `pool` ends; when it was the last one, what captures held back runs.
    pub fn end_allocate_to_pool(&self, device: usize, pool: PoolId) -> Result<()> {
        let mut heap = self.heap(device)?;
        heap.end_pool(pool);
        heap.run_deferred_work()
    }

    /// Releases a graph's pool; a capture into it that never ended counts as ended.
    pub fn release_pool(&self, device: usize, pool: PoolId) -> Result<()> {
        let mut heap = self.heap(device)?;
        heap.release_pool(pool)?;
        heap.run_deferred_work()
    }

    /// Counts a capture into `pool` that will never end (it failed) as ended, so that the
    /// out-of-memory path and deferred work are no longer held back by it. Returns whether
    /// one was underway.
    pub fn abandon_capture(&self, device: usize, pool: PoolId) -> Result<bool> {
        let mut heap = self.heap(device)?;
        let abandoned = heap.abandon_capture(pool);
        heap.run_deferred_work()?;
        Ok(abandoned)
    }

    /// Captures into `pool` that the heap counts as underway.
    pub fn pool_captures(&self, device: usize, pool: PoolId) -> Result<u32> {
        Ok(self.heap(device)?.pool_captures(pool))
    }

    /// Whether the device reports `stream` as being captured (`Backend::stream_is_capturing`).
    pub fn stream_is_capturing(&self, device: usize, stream: Stream) -> Result<bool> {
        self.heap(device)?.stream_is_capturing(stream)
    }

    /// MemPool mode on every device (see `Heap::set_mempool_mode`): frees that leave a segment
    /// entirely free give it back to the device, since the caller caches in front of us.
    pub fn set_mempool_mode(&self, on: bool) {
        for heap in &self.devices {
            heap.lock().set_mempool_mode(on);
        }
    }

    /// Begins a step of `phase` on every device.
    pub fn step_begin(&self, phase: &str) -> Result<()> {
        for (device, heap) in self.devices.iter().enumerate() {
            heap.lock_usable(device)?.step_begin(phase)?;
        }
        Ok(())
    }

    /// Ends the current step on every device; returns each device's figures.
    pub fn step_end(&self) -> Result<Vec<StepFigures>> {
        self.devices.iter().enumerate().map(|(device, heap)| heap.lock_usable(device)?.step_end()).collect()
    }

    pub fn stats(&self, device: usize) -> Result<DeviceStats> {
        Ok(self.heap(device)?.stats())
    }

    /// torch.cuda.memory_stats() as JSON: the flat key/value map.
    pub fn stats_json(&self, device: usize) -> Result<String> {
        Ok(serde_json::to_string(&self.stats(device)?.to_map()).unwrap_or_default())
    }

    pub fn reset_peak_stats(&self, device: usize) -> Result<()> {
        self.heap(device)?.stats.reset_peaks();
        Ok(())
    }

    pub fn reset_accumulated_stats(&self, device: usize) -> Result<()> {
        self.heap(device)?.stats.reset_accumulated();
        Ok(())
    }

    /// Statistics as `stats_json` reports them before any allocator exists: all zero, as torch
    /// reports before the first allocation. Reading statistics must not create the allocator,
    /// since creating it fixes the configuration.
    pub fn empty_stats_json(device: usize) -> String {
        let stats = DeviceStats { device, max_split_size: u64::MAX, ..Default::default() };
        serde_json::to_string(&stats.to_map()).unwrap_or_default()
    }

    /// A snapshot with no segments and no trace, for before any allocator exists.
    pub fn empty_snapshot() -> serde_json::Value {
        json!({"segments": [], "device_traces": [], "external_annotations": [], "allocator_settings": {}})
    }

    /// The whole state in the layout of `torch.cuda.memory._snapshot()`.
    pub fn snapshot(&self) -> serde_json::Value {
        serde_json::to_value(self.snapshot_data()).unwrap_or_default()
    }

    /// [`Allocator::snapshot`] as JSON text, written straight from the records in one pass
    /// (no intermediate JSON tree: a few hundred thousand blocks stay cheap).
    pub fn snapshot_json(&self) -> String {
        serde_json::to_string(&self.snapshot_data()).unwrap_or_default()
    }

    fn snapshot_data(&self) -> SnapshotData {
        let mut data = SnapshotData {
            segments: Vec::new(),
            device_traces: Vec::with_capacity(self.devices.len()),
            external_annotations: Vec::new(),
            allocator_settings: AllocatorSettings {
                pytorch_cuda_alloc_conf: "",
                // An int64 as PyTorch writes it: -1 when unlimited.
                max_split_size: crate::config::torch_int64(self.config.max_split_size),
                garbage_collection_threshold: self.config.garbage_collection_threshold,
                expandable_segments: self.config.expandable_segments,
                pinned_num_register_threads: 1,
                release_lock_on_malloc: false,
                pinned_use_host_register: false,
                roundup_power2_divisions: self.config.roundup_power2_divisions,
            },
        };
        for heap in &self.devices {
            let heap = heap.lock();
            data.segments.extend(heap.snapshot_segment_records());
            let (trace, notes) = heap.snapshot_trace();
            data.device_traces.push(trace);
            data.external_annotations.extend(notes);
        }
        data
    }

    /// Starts recording allocator events anew on every device, keeping the newest `entries`
    /// (at most `trace_entries`' limit); 0 stops recording and drops what was kept. Returns
    /// the limit in force. For `torch.cuda.memory._record_memory_history` under stepalloc.
    pub fn record_history(&self, entries: usize) -> usize {
        let limit = entries.min(crate::config::MAX_TRACE_ENTRIES);
        for heap in &self.devices {
            heap.lock().trace.restart(limit);
        }
        limit
    }

    /// The recorded trace of every device, in stepalloc's JSON-lines trace format.
    pub fn trace_jsonl(&self) -> String {
        let mut out = String::new();
        for heap in &self.devices {
            heap.lock().trace_jsonl(&mut out);
        }
        out
    }

    /// For `set_base_alloc_fn`: the segment (base address, size) holding `ptr`, on any device;
    /// refused for an expandable segment (see `Heap::base_allocation`).
    pub fn base_allocation(&self, ptr: u64) -> Result<Option<(u64, u64)>> {
        for heap in &self.devices {
            if let Some(found) = heap.lock().base_allocation(ptr)? {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }

    /// The device whose live allocation starts at `ptr` (for callers that are not told the
    /// device, such as PyTorch's record_stream hook).
    pub fn device_of(&self, ptr: u64) -> Option<usize> {
        self.devices.iter().position(|heap| heap.lock().is_live(ptr))
    }

    /// Lets simulated time pass on every device (no effect on CUDA devices).
    pub fn advance_time(&self, ns: u64) {
        for heap in &self.devices {
            heap.lock().advance_time(ns);
        }
    }

    /// Runs `f` with one device's heap locked (for tests and tools that inspect the heap).
    pub fn with_heap<R>(&self, device: usize, f: impl FnOnce(&mut Heap) -> R) -> Result<R> {
        let mut heap = self.heap(device)?;
        Ok(f(&mut heap))
    }

    /// Checks every device's invariants (O(blocks)).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        for heap in &self.devices {
            heap.lock().check_invariants()?;
        }
        Ok(())
    }
}

/// The snapshot's top level, in torch's layout.
#[derive(serde::Serialize)]
struct SnapshotData {
    segments: Vec<SnapshotSegment>,
    device_traces: Vec<Vec<SnapshotTraceEvent>>,
    external_annotations: Vec<SnapshotAnnotation>,
    allocator_settings: AllocatorSettings,
}

/// `allocator_settings` as PyTorch writes them (its own names, int64 sizes).
#[derive(serde::Serialize)]
struct AllocatorSettings {
    #[serde(rename = "PYTORCH_CUDA_ALLOC_CONF")]
    pytorch_cuda_alloc_conf: &'static str,
    max_split_size: i64,
    garbage_collection_threshold: f64,
    expandable_segments: bool,
    pinned_num_register_threads: u32,
    release_lock_on_malloc: bool,
    pinned_use_host_register: bool,
    roundup_power2_divisions: [u64; crate::config::ROUNDUP_INTERVALS],
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    /// A panic under a device's lock (an overflow check; the C ABI's guard turns it into an
    /// error) leaves the device usable: its lock is taken again, not refused as poisoned.
    #[test]
    fn a_panic_under_the_lock_leaves_the_device_usable() {
        let a = Allocator::new(Config::parse("backend:sim").expect("config")).expect("sim");
        let p = a.malloc(0, 4096, Stream(0)).expect("malloc");
        let caught = catch_unwind(AssertUnwindSafe(|| a.with_heap(0, |_| panic!("a check failed under the lock"))));
        assert!(caught.is_err());
        a.free(0, p, 4096).expect("free after the panic");
        let q = a.malloc(0, 4096, Stream(0)).expect("malloc after the panic");
        a.free(0, q, 4096).expect("free");
        a.check_invariants().expect("invariants");
    }
}
