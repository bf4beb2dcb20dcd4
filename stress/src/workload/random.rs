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
//! Writing a tag into each block on the CUDA backend is not implemented: cudarc's safe API only
//! reaches memory it allocated itself; writing into the allocator's blocks needs its unsafe
//! `result::memcpy_htod` on raw pointers.

use crate::replay::RunConfig;
use crate::report::RunReport;
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::time::Instant;
use stepalloc::{Allocator, Config, Error, Stream};

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
}

impl Integrity {
    pub fn ok(&self) -> bool {
        self.overlaps == 0 && self.invariants.is_ok() && self.leaked_bytes == 0 && self.refused_calls == 0
    }
}

struct Block {
    ptr: u64,
    size: u64,
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
}

impl Shared {
    fn refuse(&self, what: String) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut first) = self.first_refusal.lock() {
            first.get_or_insert(what);
        }
    }

    fn alloc(&self, size: u64, stream: u64) -> Option<Block> {
        match self.allocator.malloc(0, size, Stream(stream)) {
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
                Some(Block { ptr, size })
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

/// Runs the random workload under `rc`; returns the run's figures and the integrity findings.
pub fn run(args: &RandomArgs, rc: &RunConfig) -> Result<(RunReport, Integrity), String> {
    if args.threads == 0 || args.streams == 0 {
        return Err("--threads and --streams must be at least 1".into());
    }
    let config = Config::parse(&rc.conf).map_err(|e| format!("configuration `{}`: {e}", rc.conf))?;
    let capacity = config.sim.capacity;
    let allocator = Arc::new(Allocator::new(config).map_err(|e| format!("cannot create the allocator: {e}"))?);
    let shared = Arc::new(Shared {
        allocator: allocator.clone(),
        shadow: Mutex::new(BTreeMap::new()),
        live: AtomicU64::new(0),
        floor: AtomicU64::new(0),
        ooms: AtomicU64::new(0),
        overlaps: AtomicU64::new(0),
        refused: AtomicU64::new(0),
        first_refusal: Mutex::new(None),
    });
    let budget = (capacity as f64 * args.live_fraction / args.threads as f64) as u64;
    let barrier = Arc::new(Barrier::new(args.threads));
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..args.threads).map(|_| mpsc::channel::<Block>()).unzip();
    let started = Instant::now();
    let mut handles = Vec::new();
    for (i, rx) in receivers.into_iter().enumerate() {
        let to_next = senders[(i + 1) % args.threads].clone();
        let (shared, barrier, args) = (shared.clone(), barrier.clone(), args.clone());
        handles.push(std::thread::spawn(move || {
            let mut rng = XorShiftRng::seed_from_u64(args.seed.wrapping_mul(1_000_003).wrapping_add(i as u64));
            let mut mine: Vec<Block> = Vec::new();
            let mut mine_bytes = 0u64;
            let stream_of = |k: u64| 1 + i as u64 * args.streams + k;
            if i == 0 && args.step_every > 0 {
                let _ = shared.allocator.step_begin("even");
            }
            for n in 0..args.ops {
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
                            let other = rng.random_range(1..=args.threads as u64 * args.streams);
                            if let Err(e) = shared.allocator.record_stream(0, b.ptr, Stream(other)) {
                                shared.refuse(format!("record_stream: {e}"));
                            }
                        }
                        mine_bytes += b.size;
                        mine.push(b);
                    }
                }
            }
            // Everyone stops sending before anyone drains its channel for the last time.
            barrier.wait();
            while let Ok(b) = rx.try_recv() {
                mine.push(b);
            }
            for b in mine {
                shared.free(b);
            }
            if i == 0 && args.step_every > 0 {
                let _ = shared.allocator.step_end();
            }
        }));
    }
    drop(senders);
    for h in handles {
        h.join().map_err(|_| "a worker thread panicked".to_string())?;
    }
    let wall = started.elapsed().as_secs_f64();
    let stats = allocator.stats(0).map_err(|e| e.to_string())?;
    let h = &stats.heap;
    let floor = shared.floor.load(Ordering::Relaxed);
    let ops = args.ops * args.threads as u64;
    let report = RunReport {
        name: rc.name.clone(),
        conf: rc.conf.clone(),
        ops,
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
        alloc_retries: h.num_alloc_retries,
        ooms: shared.ooms.load(Ordering::Relaxed),
        errors: shared.refused.load(Ordering::Relaxed),
        first_error: shared.first_refusal.lock().ok().and_then(|f| f.clone()),
        wall_s: wall,
        ops_per_s: ops as f64 / wall.max(1e-9),
        external_fragmentation_mean: stats.external_fragmentation(),
        ..Default::default()
    };
    let integrity = Integrity {
        config: rc.name.clone(),
        overlaps: shared.overlaps.load(Ordering::Relaxed),
        invariants: allocator.check_invariants(),
        leaked_bytes: h.allocated_bytes.all.current,
        refused_calls: report.errors,
        first_refusal: report.first_error.clone(),
    };
    Ok((report, integrity))
}
