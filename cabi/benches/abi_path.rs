//! The cached path through the C ABI: `stepalloc_malloc` + `stepalloc_free` looked up by name in
//! a dlopen'ed libstepalloc.so (as PyTorch calls them), against the same pattern on the core
//! `Allocator`. Target: the C ABI path within 1.2x of the core path.
//!
//! Pattern: the core bench's (`benches/cached_path.rs`): one malloc + free pair per iteration,
//! cycling through the same eight mixed sizes, on a busy heap with 10 k and then 100 k other
//! blocks live (every third setup block freed), the cache warmed so no pair reaches the
//! device. Both paths run the same setup sequence. Run with
//! `cargo bench -p stepalloc-cabi --bench abi_path`; after criterion's figures it prints the
//! ratio of the two paths (best of three interleaved medians).

#[path = "../tests/common/mod.rs"]
mod common;
mod victim;

use criterion::{BenchmarkId, Criterion};
use std::hint::black_box;
use stepalloc::{Allocator, Config, Stream};
use victim::{median_pair_ns, CAbi, CONF};

/// The core bench's sizes: small-pool and large-pool, odd sizes too.
const SIZES: [u64; 8] = [512, 3000, 65_536, 200_000, 1 << 20, 3 << 20, 12_345_678, 40 << 20];

/// A malloc/free pair of functions: the core allocator or the loaded library.
trait Path {
    fn malloc(&self, size: u64) -> u64;
    fn free(&self, ptr: u64, size: u64);
}

struct Core(Allocator);

impl Path for Core {
    #[inline]
    fn malloc(&self, size: u64) -> u64 {
        self.0.malloc(0, size, Stream(0)).expect("malloc")
    }
    #[inline]
    fn free(&self, ptr: u64, size: u64) {
        self.0.free(0, ptr, size).expect("free")
    }
}

impl Path for CAbi {
    #[inline]
    fn malloc(&self, size: u64) -> u64 {
        CAbi::malloc(self, size)
    }
    #[inline]
    fn free(&self, ptr: u64, size: u64) {
        CAbi::free(self, ptr, size)
    }
}

/// The core bench's setup, continued from `state` so that a second call adds more live blocks.
fn setup(path: &dyn Path, state: &mut u64, blocks: usize, kept: &mut Vec<(u64, u64)>) {
    let mut live = Vec::with_capacity(blocks);
    for _ in 0..blocks {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        let x = *state;
        let size = if x % 10 == 0 { 1 + x % (8 << 20) } else { 1 + x % 65_536 };
        live.push((path.malloc(size), size));
    }
    for (i, (p, size)) in live.into_iter().enumerate() {
        if i % 3 == 0 {
            path.free(p, size);
        } else {
            kept.push((p, size));
        }
    }
    for &size in &SIZES {
        let p = path.malloc(size);
        path.free(p, size);
    }
}

#[inline]
fn pair(path: &dyn Path, i: &mut usize) {
    let size = SIZES[*i % SIZES.len()];
    *i += 1;
    let p = path.malloc(black_box(size));
    path.free(black_box(p), size);
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    let core = Core(Allocator::new(Config::parse(CONF).expect("config")).expect("allocator"));
    let abi = CAbi::load(common::library());
    let (mut core_state, mut abi_state) = (0x9E37_79B9_7F4A_7C15u64, 0x9E37_79B9_7F4A_7C15u64);
    let (mut core_kept, mut abi_kept) = (Vec::new(), Vec::new());
    let mut ratios = Vec::new();
    for (added, live) in [(10_000, "10k_live"), (90_000, "100k_live")] {
        setup(&core, &mut core_state, added, &mut core_kept);
        setup(&abi, &mut abi_state, added, &mut abi_kept);
        let mut group = criterion.benchmark_group("cached_malloc_free_pair");
        let mut i = 0;
        group.bench_function(BenchmarkId::new("core", live), |b| b.iter(|| pair(&core, &mut i)));
        group.bench_function(BenchmarkId::new("c_abi_dlopen", live), |b| b.iter(|| pair(&abi, &mut i)));
        group.finish();
        // Interleaved, so both paths see the same machine state; best of three medians.
        let (mut core_ns, mut abi_ns) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..3 {
            let mut i = 0;
            core_ns = core_ns.min(median_pair_ns(|n| (0..n).for_each(|_| pair(&core, &mut i))));
            abi_ns = abi_ns.min(median_pair_ns(|n| (0..n).for_each(|_| pair(&abi, &mut i))));
        }
        ratios.push((live, core_ns, abi_ns));
    }
    criterion.final_summary();
    for (live, core_ns, abi_ns) in ratios {
        let ratio = abi_ns / core_ns;
        println!(
            "cached malloc+free pair, {live}: core {core_ns:.1} ns, C ABI {abi_ns:.1} ns, ratio {ratio:.3} \
             (target <= 1.2): {}",
            if ratio <= 1.2 { "within target" } else { "OVER TARGET" }
        );
    }
}
