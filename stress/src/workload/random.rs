//! The `random` workload: many threads share one allocator; each allocates random sizes on its
//! own streams, frees its own blocks or hands them to the next thread to free (cross-thread
//! frees), and records some blocks on other streams. Thread 0 also drives steps.
//!
//! Integrity: a shadow interval map of every live block (requested bytes from its address) is
//! updated under its own lock; an allocation overlapping a live block is counted as a
//! violation. A block leaves the shadow map before it is freed, so reuse of its address by
//! another thread cannot look like an overlap. At the end every block is freed and the heap's
//! invariants are checked (blocks tile segments, statistics equal their sums, nothing leaks).
//!
//! On the CUDA backend the threads use real driver streams (created in the device's primary
//! context through `stepalloc::backend::cuda::tools`, destroyed at the end), the live budget
//! is a share of the device's memory, and every block carries a tag: right after its malloc, its
//! first and last `--tag-kib` KiB (the whole block when smaller) are set to the block's id as
//! 32-bit words with `cuMemsetD32Async` on its stream; right before its free the stream is
//! synchronized and the words read back (`cuMemcpyDtoH`). A word that differs is a corrupted tag:
//! another block's tag (or anything else) was written over live memory. Tags are written in
//! malloc order, so of two overlapping blocks the first one's check fails at its free.

use crate::replay::RunConfig;
use crate::report::{DeviceFigures, RunReport};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;
use stepalloc::backend::cuda::tools::DeviceTools;
use stepalloc::{Allocator, BackendKind, Config, Error, Stream};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SizeDist {
    /// Log-uniform from 1 B to 1 MiB (the small pool).
    Small,
    /// 80% 512 B–1 MiB, 17% 1–32 MiB, 3% 32–512 MiB, log-uniform within each.
    Mixed,
    /// Log-uniform from 1 MiB to 1 GiB.
    Large,
}

/// `--tag-kib` unless given (the simulated device holds no bytes, so no tags: another value is
/// refused there).
pub const DEFAULT_TAG_KIB: u64 = 4;

#[derive(Clone, Debug, clap::Args, Serialize)]
pub struct RandomArgs {
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    /// Operations per thread.
    #[arg(long, default_value_t = 200_000)]
    pub ops: u64,
    /// Streams per thread.
    #[arg(long, default_value_t = 3)]
    pub streams: u64,
    #[arg(long, value_enum, default_value = "mixed")]
    pub sizes: SizeDist,
    /// Share of frees handed to another thread.
    #[arg(long, default_value_t = 0.1)]
    pub cross_free: f64,
    /// Share of allocations also recorded on another stream.
    #[arg(long, default_value_t = 0.05)]
    pub record_stream: f64,
    /// Share of device memory the threads keep live at most, together.
    #[arg(long, default_value_t = 0.5)]
    pub live_fraction: f64,
    /// Thread 0 ends a step and begins the next every N of its operations (0: no steps).
    #[arg(long, default_value_t = 5000)]
    pub step_every: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// CUDA backend: KiB at each end of every block that hold its tag (0: the whole block).
    #[arg(long, default_value_t = DEFAULT_TAG_KIB)]
    pub tag_kib: u64,
    /// Tests only (no flag): worker `.0` panics at its operation `.1`, to show that a failed
    /// worker ends the run with an error and never a hang.
    #[arg(skip)]
    #[serde(skip)]
    pub panic_at: Option<(usize, u64)>,
}

/// What the integrity checks found.
#[derive(Clone, Debug, Serialize)]
pub struct Integrity {
    pub config: String,
    /// Allocations that overlapped a live block (must be 0).
    pub overlaps: u64,
    pub invariants: Result<(), String>,
    /// Bytes still allocated after every block was freed (must be 0).
    pub leaked_bytes: u64,
    pub refused_calls: u64,
    pub first_refusal: Option<String>,
    /// Blocks whose tag was written and checked (CUDA backend; 0 on the simulated device).
    pub tagged_blocks: u64,
    /// Blocks whose tag had changed when they were freed (must be 0).
    pub corrupted_tags: u64,
    pub first_corruption: Option<String>,
}

impl Integrity {
    pub fn ok(&self) -> bool {
        self.overlaps == 0
            && self.invariants.is_ok()
            && self.leaked_bytes == 0
            && self.refused_calls == 0
            && self.corrupted_tags == 0
    }
}

/// Where tags are written and read back: device memory through the driver, or host memory in
/// tests.
pub trait TagMemory: Send + Sync {
    /// Sets `words` 32-bit words from `ptr` to `value`, as work queued on `stream`.
    fn fill(&self, ptr: u64, value: u32, words: usize, stream: Stream) -> Result<(), String>;
    /// Waits for the work queued on `stream`, then reads `out.len()` words from `ptr`.
    fn read(&self, ptr: u64, out: &mut [u32], stream: Stream) -> Result<(), String>;
}

impl TagMemory for DeviceTools {
    fn fill(&self, ptr: u64, value: u32, words: usize, stream: Stream) -> Result<(), String> {
        self.memset_d32_async(ptr, value, words, stream).map_err(|e| e.to_string())
    }

    fn read(&self, ptr: u64, out: &mut [u32], stream: Stream) -> Result<(), String> {
        self.synchronize_stream(stream).map_err(|e| e.to_string())?;
        let mut bytes = vec![0u8; out.len() * 4];
        self.copy_to_host(&mut bytes, ptr).map_err(|e| e.to_string())?;
        for (w, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *w = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }
}

/// The ranges (address, 32-bit words) of a block of `size` bytes at `ptr` that hold its tag:
/// its first and last `span` bytes in whole words, or the whole block (in words) when it is at
/// most two spans or `span` is 0; none when it is smaller than a word.
pub fn tag_ranges(ptr: u64, size: u64, span: u64) -> Vec<(u64, usize)> {
    let words = size / 4;
    let span_words = span / 4;
    if words == 0 {
        Vec::new()
    } else if span_words == 0 || words <= 2 * span_words {
        vec![(ptr, words as usize)]
    } else {
        vec![(ptr, span_words as usize), (ptr + (words - span_words) * 4, span_words as usize)]
    }
}

/// The index of the first word of `words` that is not `tag`.
pub fn first_mismatch(words: &[u32], tag: u32) -> Option<usize> {
    words.iter().position(|&w| w != tag)
}

/// Writes `tag` over the tag ranges of the block (see `tag_ranges`), on `stream`.
pub fn write_tag(mem: &dyn TagMemory, ptr: u64, size: u64, span: u64, tag: u32, stream: Stream) -> Result<(), String> {
    for (at, words) in tag_ranges(ptr, size, span) {
        mem.fill(at, tag, words, stream)?;
    }
    Ok(())
}

/// Reads the block's tag ranges back: `Ok(None)` when every word is `tag`, `Ok(Some(what))`
/// describing the first word that is not, `Err` when the memory could not be read.
pub fn verify_tag(
    mem: &dyn TagMemory,
    ptr: u64,
    size: u64,
    span: u64,
    tag: u32,
    stream: Stream,
) -> Result<Option<String>, String> {
    for (at, words) in tag_ranges(ptr, size, span) {
        let mut found = vec![0u32; words];
        mem.read(at, &mut found, stream)?;
        if let Some(i) = first_mismatch(&found, tag) {
            return Ok(Some(format!(
                "block {tag} ({size} bytes at {ptr:#x}): word at {:#x} is {} (another block's id if it is at most the blocks allocated)",
                at + 4 * i as u64,
                found[i]
            )));
        }
    }
    Ok(None)
}

struct Block {
    ptr: u64,
    size: u64,
    stream: Stream,
    tag: u32,
}

/// The CUDA backend's tags: where they go and how much of each block they cover.
struct Tags {
    mem: Arc<dyn TagMemory>,
    span: u64,
    next: std::sync::atomic::AtomicU32,
    checked: AtomicU64,
    corrupted: AtomicU64,
    first_corruption: Mutex<Option<String>>,
}

struct Shared {
    allocator: Arc<Allocator>,
    shadow: Mutex<BTreeMap<u64, u64>>,
    live: AtomicU64,
    floor: AtomicU64,
    ooms: AtomicU64,
    overlaps: AtomicU64,
    refused: AtomicU64,
    first_refusal: Mutex<Option<String>>,
    tags: Option<Tags>,
    /// Every thread's streams, thread-major (`streams[i * per_thread + k]`).
    streams: Vec<Stream>,
}

impl Shared {
    fn refuse(&self, what: String) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut first) = self.first_refusal.lock() {
            first.get_or_insert(what);
        }
    }

    fn alloc(&self, size: u64, stream: Stream) -> Option<Block> {
        match self.allocator.malloc(0, size, stream) {
            Ok(ptr) => {
                let end = ptr + size.max(1);
                if let Ok(mut shadow) = self.shadow.lock() {
                    if overlaps_live(&shadow, ptr, end) {
                        self.overlaps.fetch_add(1, Ordering::Relaxed);
                    }
                    shadow.insert(ptr, end);
                }
                let live = self.live.fetch_add(size, Ordering::Relaxed) + size;
                self.floor.fetch_max(live, Ordering::Relaxed);
                let mut tag = 0;
                if let Some(t) = &self.tags {
                    tag = t.next.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = write_tag(t.mem.as_ref(), ptr, size, t.span, tag, stream) {
                        self.refuse(format!("tag of malloc({size}) at {ptr:#x}: {e}"));
                    }
                }
                Some(Block { ptr, size, stream, tag })
            }
            Err(Error::OutOfMemory(_)) => {
                self.ooms.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(e) => {
                self.refuse(format!("malloc({size}): {e}"));
                None
            }
        }
    }

    fn free(&self, b: Block) {
        if let Some(t) = &self.tags {
            match verify_tag(t.mem.as_ref(), b.ptr, b.size, t.span, b.tag, b.stream) {
                Ok(None) => {
                    t.checked.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Some(what)) => {
                    t.checked.fetch_add(1, Ordering::Relaxed);
                    t.corrupted.fetch_add(1, Ordering::Relaxed);
                    if let Ok(mut first) = t.first_corruption.lock() {
                        first.get_or_insert(what);
                    }
                }
                Err(e) => self.refuse(format!("tag of the block at {:#x}: {e}", b.ptr)),
            }
        }
        if let Ok(mut shadow) = self.shadow.lock() {
            shadow.remove(&b.ptr);
        }
        self.live.fetch_sub(b.size, Ordering::Relaxed);
        if let Err(e) = self.allocator.free(0, b.ptr, b.size) {
            self.refuse(format!("free({:#x}): {e}", b.ptr));
        }
    }
}

/// Whether [start, end) overlaps a live block of `shadow` (start -> end). The live block with
/// the greatest start below `end` is the only one to look at: blocks never overlap each other.
pub fn overlaps_live(shadow: &BTreeMap<u64, u64>, start: u64, end: u64) -> bool {
    shadow.range(..end).next_back().is_some_and(|(_, &e)| e > start)
}

fn log_uniform(rng: &mut XorShiftRng, lo: u64, hi: u64) -> u64 {
    let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
    (a + (b - a) * rng.random::<f64>()).exp() as u64
}

fn size(rng: &mut XorShiftRng, dist: SizeDist) -> u64 {
    const MIB: u64 = 1 << 20;
    match dist {
        SizeDist::Small => log_uniform(rng, 1, MIB),
        SizeDist::Large => log_uniform(rng, MIB, 1024 * MIB),
        SizeDist::Mixed => {
            let u: f64 = rng.random();
            if u < 0.8 {
                log_uniform(rng, 512, MIB)
            } else if u < 0.97 {
                log_uniform(rng, MIB, 32 * MIB)
            } else {
                log_uniform(rng, 32 * MIB, 512 * MIB)
            }
        }
    }
}

/// Threads at most (each has its own channel and streams).
pub const MAX_THREADS: usize = 1024;
/// Streams per thread at most.
pub const MAX_STREAMS: u64 = 1024;

impl RandomArgs {
    /// Checks every flag against its range; the error names the flag, its value and the range.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_THREADS).contains(&self.threads) {
            return Err(format!("--threads {} is out of range: accepted 1..={MAX_THREADS}", self.threads));
        }
        if !(1..=MAX_STREAMS).contains(&self.streams) {
            return Err(format!("--streams {} is out of range: accepted 1..={MAX_STREAMS}", self.streams));
        }
        // The report counts ops over all threads in a u64.
        if self.ops.checked_mul(self.threads as u64).is_none() {
            return Err(format!("--ops {} times --threads {} overflows", self.ops, self.threads));
        }
        for (name, p) in [("cross-free", self.cross_free), ("record-stream", self.record_stream)] {
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("--{name} {p} is out of range: a probability, accepted 0..=1"));
            }
        }
        if !(self.live_fraction > 0.0 && self.live_fraction <= 1.0) {
            return Err(format!("--live-fraction {} is out of range: accepted above 0, at most 1", self.live_fraction));
        }
        if self.tag_kib.checked_mul(1024).is_none() {
            return Err(format!("--tag-kib {} is out of range: at most {}", self.tag_kib, u64::MAX / 1024));
        }
        Ok(())
    }
}

/// Runs the random workload under `rc`; returns the run's figures and the integrity findings.
/// A worker that panics ends the run with an error (the others finish their work first).
pub fn run(args: &RandomArgs, rc: &RunConfig) -> Result<(RunReport, Integrity), String> {
    args.validate()?;
    let config = Config::parse(&rc.conf).map_err(|e| format!("configuration `{}`: {e}", rc.conf))?;
    let cuda = config.backend != BackendKind::Sim;
    let allocator = Arc::new(Allocator::new(config).map_err(|e| format!("cannot create the allocator: {e}"))?);
    // The device's memory: the simulated capacity, or the CUDA device's total.
    let capacity = allocator.stats(0).map_err(|e| e.to_string())?.device_total;
    let n_streams = args.threads * args.streams as usize;
    let (tools, streams) = if cuda {
        let tools = Arc::new(DeviceTools::open(0).map_err(|e| format!("CUDA device 0: {e}"))?);
        let mut streams = Vec::with_capacity(n_streams);
        for _ in 0..n_streams {
            match tools.create_stream(true) {
                Ok(s) => streams.push(s),
                Err(e) => {
                    destroy_streams(&tools, &streams);
                    return Err(format!("cannot create a CUDA stream: {e}"));
                }
            }
        }
        (Some(tools), streams)
    } else {
        // The simulated device accepts any value as a stream.
        (None, (1..=n_streams as u64).map(Stream).collect())
    };
    let tags = tools.as_ref().map(|tools| Tags {
        mem: tools.clone() as Arc<dyn TagMemory>,
        span: args.tag_kib * 1024,
        next: std::sync::atomic::AtomicU32::new(1),
        checked: AtomicU64::new(0),
        corrupted: AtomicU64::new(0),
        first_corruption: Mutex::new(None),
    });
    let shared = Arc::new(Shared {
        allocator: allocator.clone(),
        shadow: Mutex::new(BTreeMap::new()),
        live: AtomicU64::new(0),
        floor: AtomicU64::new(0),
        ooms: AtomicU64::new(0),
        overlaps: AtomicU64::new(0),
        refused: AtomicU64::new(0),
        first_refusal: Mutex::new(None),
        tags,
        streams,
    });
    let budget = (capacity as f64 * args.live_fraction / args.threads as f64) as u64;
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..args.threads).map(|_| mpsc::channel::<Block>()).unzip();
    let started = Instant::now();
    let mut handles = Vec::new();
    for (i, rx) in receivers.into_iter().enumerate() {
        let to_next = senders[(i + 1) % args.threads].clone();
        let (shared, args) = (shared.clone(), args.clone());
        handles.push(std::thread::spawn(move || {
            let mut rng = XorShiftRng::seed_from_u64(args.seed.wrapping_mul(1_000_003).wrapping_add(i as u64));
            let mut mine: Vec<Block> = Vec::new();
            let mut mine_bytes = 0u64;
            let stream_of = |k: u64| shared.streams[i * args.streams as usize + k as usize];
            if i == 0 && args.step_every > 0 {
                let _ = shared.allocator.step_begin("even");
            }
            for n in 0..args.ops {
                if args.panic_at == Some((i, n)) {
                    panic!("injected failure at operation {n}");
                }
                while let Ok(b) = rx.try_recv() {
                    mine_bytes += b.size;
                    mine.push(b);
                }
                if i == 0 && args.step_every > 0 && n > 0 && n % args.step_every == 0 {
                    let phase = if (n / args.step_every) % 2 == 0 { "even" } else { "odd" };
                    if let Err(e) = shared.allocator.step_begin(phase) {
                        shared.refuse(format!("step_begin: {e}"));
                    }
                }
                let free_now = !mine.is_empty() && (mine_bytes > budget || rng.random_bool(0.45));
                if free_now {
                    let k = rng.random_range(0..mine.len());
                    let b = mine.swap_remove(k);
                    mine_bytes -= b.size;
                    if rng.random_bool(args.cross_free) {
                        if let Err(mpsc::SendError(b)) = to_next.send(b) {
                            shared.free(b);
                        }
                    } else {
                        shared.free(b);
                    }
                } else {
                    let stream = stream_of(rng.random_range(0..args.streams));
                    if let Some(b) = shared.alloc(size(&mut rng, args.sizes), stream) {
                        if rng.random_bool(args.record_stream) {
                            let other = shared.streams[rng.random_range(0..shared.streams.len())];
                            if let Err(e) = shared.allocator.record_stream(0, b.ptr, other) {
                                shared.refuse(format!("record_stream: {e}"));
                            }
                        }
                        mine_bytes += b.size;
                        mine.push(b);
                    }
                }
            }
            // Stop sending, then take what the previous thread sends until it stops too (its
            // sender is dropped when it finishes or panics, so this never waits forever).
            drop(to_next);
            for b in mine {
                shared.free(b);
            }
            for b in rx.iter() {
                shared.free(b);
            }
            if i == 0 && args.step_every > 0 {
                let _ = shared.allocator.step_end();
            }
        }));
    }
    drop(senders);
    let mut panicked = None;
    for (i, h) in handles.into_iter().enumerate() {
        if let Err(payload) = h.join() {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            panicked.get_or_insert(format!("worker thread {i} panicked: {what}"));
        }
    }
    if let Some(what) = panicked {
        if let Some(tools) = &tools {
            destroy_streams(tools, &shared.streams);
        }
        return Err(what);
    }
    let wall = started.elapsed().as_secs_f64();
    let stats = allocator.stats(0).map_err(|e| e.to_string())?;
    // What the cache holds at the end, as the report's step ends are measured (`fragmentation`).
    let (free, stranded) = crate::fragmentation::of_allocator(&allocator);
    let h = &stats.heap;
    let floor = shared.floor.load(Ordering::Relaxed);
    let ops = args.ops * args.threads as u64;
    let report = RunReport {
        name: rc.name.clone(),
        conf: rc.conf.clone(),
        ops,
        worst: DeviceFigures {
            floor,
            stats_peak_requested: h.requested_bytes.all.peak,
            peak_allocated: h.allocated_bytes.all.peak,
            peak_reserved: h.reserved_bytes.all.peak,
            reserved_over_floor: crate::replay::ratio(h.reserved_bytes.all.peak, floor),
            allocated_over_floor: crate::replay::ratio(h.allocated_bytes.all.peak, floor),
            final_reserved: h.reserved_bytes.all.current,
            device_mallocs: h.num_device_alloc,
            device_frees: h.num_device_free,
            device_malloc_time_s: stats.driver_time.reserve_ns as f64 * 1e-9,
            device_free_time_s: stats.driver_time.release_ns as f64 * 1e-9,
            ..Default::default()
        },
        alloc_retries: h.num_alloc_retries,
        ooms: shared.ooms.load(Ordering::Relaxed),
        errors: shared.refused.load(Ordering::Relaxed),
        first_error: shared.first_refusal.lock().ok().and_then(|f| f.clone()),
        wall_s: wall,
        ops_per_s: ops as f64 / wall.max(1e-9),
        external_fragmentation_mean: crate::fragmentation::share(free, stranded),
        stranded_free_at_step_end_mean: stranded as f64,
        ..Default::default()
    };
    let tags = shared.tags.as_ref();
    let integrity = Integrity {
        config: rc.name.clone(),
        overlaps: shared.overlaps.load(Ordering::Relaxed),
        invariants: allocator.check_invariants(),
        leaked_bytes: h.allocated_bytes.all.current,
        refused_calls: report.errors,
        first_refusal: report.first_error.clone(),
        tagged_blocks: tags.map_or(0, |t| t.checked.load(Ordering::Relaxed)),
        corrupted_tags: tags.map_or(0, |t| t.corrupted.load(Ordering::Relaxed)),
        first_corruption: tags.and_then(|t| t.first_corruption.lock().ok().and_then(|f| f.clone())),
    };
    // Give the memory back before the next configuration runs (on a GPU they share the device),
    // then the streams: no work of ours is left on them.
    let _ = allocator.empty_cache();
    if let Some(tools) = &tools {
        destroy_streams(tools, &shared.streams);
    }
    Ok((report, integrity))
}

/// Synchronizes and destroys the workload's streams (best effort: the run is over).
fn destroy_streams(tools: &DeviceTools, streams: &[Stream]) {
    for &s in streams {
        let _ = tools.synchronize_stream(s);
        let _ = tools.destroy_stream(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Host memory standing in for a device: a word array from address 0.
    struct HostWords(Mutex<Vec<u32>>);

    impl TagMemory for HostWords {
        fn fill(&self, ptr: u64, value: u32, words: usize, _stream: Stream) -> Result<(), String> {
            let mut m = self.0.lock().unwrap();
            let at = (ptr / 4) as usize;
            m.get_mut(at..at + words).ok_or("out of range")?.fill(value);
            Ok(())
        }

        fn read(&self, ptr: u64, out: &mut [u32], _stream: Stream) -> Result<(), String> {
            let m = self.0.lock().unwrap();
            let at = (ptr / 4) as usize;
            out.copy_from_slice(m.get(at..at + out.len()).ok_or("out of range")?);
            Ok(())
        }
    }

    #[test]
    fn tag_ranges_cover_both_ends_in_whole_words() {
        assert_eq!(tag_ranges(512, 3, 4096), vec![]);
        assert_eq!(tag_ranges(512, 4098, 4096), vec![(512, 1024)]);
        assert_eq!(tag_ranges(512, 8192, 4096), vec![(512, 2048)]);
        assert_eq!(tag_ranges(512, 10_001, 4096), vec![(512, 1024), (512 + 10_000 - 4096, 1024)]);
        assert_eq!(tag_ranges(0, 1 << 20, 0), vec![(0, 1 << 18)]);
    }

    #[test]
    fn first_mismatch_finds_the_first_foreign_word() {
        assert_eq!(first_mismatch(&[7, 7, 7], 7), None);
        assert_eq!(first_mismatch(&[7, 9, 9], 7), Some(1));
        assert_eq!(first_mismatch(&[], 7), None);
    }

    /// Two blocks handed out over the same bytes: the first one's tag is overwritten by the
    /// second's, at its head, its tail or both, and its check at free says so; blocks apart
    /// keep their tags.
    #[test]
    fn tags_catch_overlapping_blocks() {
        const KIB: u64 = 1024;
        let s = Stream(1);
        let cases = [
            // (second block's start, size): over the first one's head, its tail, inside it, apart.
            (0, 4 * KIB, true),
            (60 * KIB, 8 * KIB, true),
            (20 * KIB + 4, 100, false),
            (64 * KIB, 16 * KIB, false),
        ];
        for (start, size, head_or_tail_hit) in cases {
            let mem = HostWords(Mutex::new(vec![0; (128 * KIB / 4) as usize]));
            write_tag(&mem, 0, 64 * KIB, 4 * KIB, 1, s).unwrap();
            write_tag(&mem, start, size, 4 * KIB, 2, s).unwrap();
            let first = verify_tag(&mem, 0, 64 * KIB, 4 * KIB, 1, s).unwrap();
            assert_eq!(first.is_some(), head_or_tail_hit, "second block at {start}: {first:?}");
            if let Some(what) = first {
                assert!(what.contains("is 2"), "{what}");
            }
            assert_eq!(verify_tag(&mem, start, size, 4 * KIB, 2, s).unwrap(), None);
            // Tagging whole blocks (span 0) catches an overlap anywhere.
            write_tag(&mem, 0, 64 * KIB, 0, 3, s).unwrap();
            write_tag(&mem, start, size, 0, 4, s).unwrap();
            let whole = verify_tag(&mem, 0, 64 * KIB, 0, 3, s).unwrap();
            assert_eq!(whole.is_some(), start < 64 * KIB, "whole-block tags, second block at {start}");
        }
    }

    #[test]
    fn unreadable_memory_is_an_error_not_a_corruption() {
        let mem = HostWords(Mutex::new(vec![0; 16]));
        assert!(verify_tag(&mem, 0, 4096, 1024, 1, Stream(1)).is_err());
    }
}
