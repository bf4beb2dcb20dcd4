//! The cached path: one malloc + free pair of mixed sizes served from the cache (no device
//! call), on the simulated device, with 10 k and 100 k other blocks live, with PyTorch's
//! defaults and with the recommended configuration (expandable segments: the free blocks
//! holding whole pages are filed for page reuse and the cache limit too). The allocator's cost
//! must not grow with the number of cached or live blocks.
//!
//! Run: `cargo bench --bench cached_path` (figures in docs/performance.md).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use std::hint::black_box;
use stepalloc::{Allocator, Config, Stream};

/// Request sizes the measured pairs cycle through: small-pool and large-pool, odd sizes too.
const SIZES: [u64; 8] = [512, 3000, 65_536, 200_000, 1 << 20, 3 << 20, 12_345_678, 40 << 20];

fn setup(conf: &str, live_blocks: usize) -> (Allocator, Vec<(u64, u64)>) {
    // 16 TiB simulated device, so 100 k live blocks fit whatever their sizes.
    let text = format!("backend:sim,sim_capacity_mb:16777216,{conf}");
    let a = Allocator::new(Config::parse(&text).expect("config")).expect("sim");
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut live = Vec::with_capacity(live_blocks);
    for _ in 0..live_blocks {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Mostly small blocks, some large ones: a fragmented, busy heap.
        let size = if x % 10 == 0 { 1 + x % (8 << 20) } else { 1 + x % 65_536 };
        live.push((a.malloc(0, size, Stream(0)).expect("setup malloc"), size));
    }
    // Free every third block so the cache holds many free pieces between live ones.
    let mut kept = Vec::new();
    for (i, (p, size)) in live.into_iter().enumerate() {
        if i % 3 == 0 {
            a.free(0, p, size).expect("setup free");
        } else {
            kept.push((p, size));
        }
    }
    // Warm the cache for every measured size.
    for &size in &SIZES {
        let p = a.malloc(0, size, Stream(0)).expect("warm malloc");
        a.free(0, p, size).expect("warm free");
    }
    (a, kept)
}

fn cached_path(c: &mut Criterion) {
    for (group_name, conf) in
        [("cached_malloc_free_pair", ""), ("cached_malloc_free_pair_recommended", stepalloc::config::RECOMMENDED)]
    {
        pairs(c, group_name, conf);
    }
}

fn pairs(c: &mut Criterion, group_name: &str, conf: &str) {
    let mut group = c.benchmark_group(group_name);
    for live in [10_000usize, 100_000] {
        let (a, _kept) = setup(conf, live);
        let device_allocs = a.stats(0).expect("stats").heap.num_device_alloc;
        let mut i = 0usize;
        group.bench_with_input(BenchmarkId::from_parameter(format!("{}k_live", live / 1000)), &live, |b, _| {
            b.iter(|| {
                let size = SIZES[i % SIZES.len()];
                i += 1;
                let p = a.malloc(0, black_box(size), Stream(0)).expect("malloc");
                a.free(0, black_box(p), size).expect("free");
            })
        });
        let after = a.stats(0).expect("stats").heap.num_device_alloc;
        assert_eq!(after, device_allocs, "the measured path must be served from the cache");
    }
    group.finish();
}

criterion_group!(benches, cached_path);
criterion_main!(benches);
