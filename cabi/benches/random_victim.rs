//! The hot path at scale, through the C ABI: each iteration frees a *random* live block and
//! allocates the same size again (`victim/mod.rs`), at 1 k, 10 k and 100 k live blocks, and at
//! 10 k again after the 100 k phase (the history case: a heap that once was large should not
//! stay slower). One process, one allocator: the live set grows 1 k -> 10 k -> 100 k, then
//! shrinks to 10 k. Run with `cargo bench -p stepalloc-cabi --bench random_victim`; after
//! criterion's figures it prints each case's best of five medians (`STEPALLOC_VICTIM_ROUNDS`
//! sets how many) and the history ratio (10 k after 100 k / 10 k before, target within 10%).
//!
//! With `STEPALLOC_BASELINE=/path/to/other/libstepalloc.so` the same churn also runs on that
//! library (loaded beside this one, with its own allocator), interleaved, so both figures come
//! from one run on the same machine state: how docs/performance.md compares two builds.
//! With `STEPALLOC_TORCH_VICTIM=/path/to/libtorch_victim.so` PyTorch's own CUDA caching
//! allocator runs the same churn too, and each case prints stepalloc's time per pair over
//! PyTorch's, the hot path's target (at most 1/4 at 1 k, 10 k and 100 k live blocks;
//! scripts/torch_victim.sh builds the shim and runs this over testdrv/, no GPU).
//!
//! Instruction and cache-miss counts per pair, which a busy machine does not disturb, come
//! from the `random_victim` example under cachegrind (docs/performance.md, "Instructions and misses per pair").

#[path = "../tests/common/mod.rs"]
mod common;
mod victim;

use criterion::{BenchmarkId, Criterion};
use victim::{median_pair_ns, Churn};

const CASES: [(usize, &str); 4] =
    [(1_000, "1k_live"), (10_000, "10k_live"), (100_000, "100k_live"), (10_000, "10k_after_100k")];

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    let mut churns = vec![("c_abi", Churn::load(common::library()))];
    if let Some(baseline) = std::env::var_os("STEPALLOC_BASELINE") {
        churns.push(("baseline", Churn::load(std::path::Path::new(&baseline))));
    }
    if let Some(shim) = std::env::var_os("STEPALLOC_TORCH_VICTIM") {
        churns.push(("pytorch", Churn::new(victim::CAbi::load_torch(std::path::Path::new(&shim)))));
    }
    // STEPALLOC_VICTIM_ROUNDS: more rounds for a busy machine (default 5).
    let rounds: usize = std::env::var("STEPALLOC_VICTIM_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(5).max(1);
    let mut figures = Vec::new();
    for (live, case) in CASES {
        let mut group = criterion.benchmark_group("random_victim_pair");
        for (name, churn) in &mut churns {
            churn.resize(live);
            // Settle: a churn reaches its steady mix of free and live blocks.
            churn.pairs(live as u64 * 2);
            group.bench_function(BenchmarkId::new(*name, case), |b| b.iter(|| churn.pair()));
        }
        group.finish();
        // Interleaved, so every library sees the same machine state; best of `rounds` medians.
        let mut best = vec![f64::INFINITY; churns.len()];
        for _ in 0..rounds {
            for (b, (_, churn)) in best.iter_mut().zip(&mut churns) {
                *b = b.min(median_pair_ns(|n| churn.pairs(n)));
            }
        }
        for (b, (name, _)) in best.into_iter().zip(&churns) {
            figures.push((*name, case, b));
        }
    }
    criterion.final_summary();
    for (name, case, ns) in &figures {
        println!("random-victim malloc+free pair, {name}, {case}: {ns:.1} ns (best of {rounds} medians)");
    }
    let ns = |name: &str, case: &str| figures.iter().find(|f| f.0 == name && f.1 == case).map_or(f64::NAN, |f| f.2);
    for (name, _) in churns.iter().filter(|c| c.0 != "pytorch") {
        let history = ns(name, "10k_after_100k") / ns(name, "10k_live");
        println!("{name}: 10k after 100k / 10k before {history:.2} (target <= 1.10)");
    }
    if churns.iter().any(|c| c.0 == "pytorch") {
        for (name, _) in churns.iter().filter(|c| c.0 != "pytorch") {
            for (_, case) in CASES {
                let ratio = ns(name, case) / ns("pytorch", case);
                // The target holds at 1 k, 10 k and 100 k; the history case is printed beside them.
                let target = if case == "10k_after_100k" { "" } else { " (target <= 0.25)" };
                println!("{name} / pytorch, {case}: {ratio:.3}{target}");
            }
        }
    }
}
