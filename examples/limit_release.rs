//! What `page_release` with a cache limit costs a free as blocks pile up: N pairs of live blocks
//! (3 MiB and 1.25 MiB; freeing every 3 MiB one leaves N free blocks of a page or more, many
//! holding no whole page, which a release can never take), then transient 96 MiB tensors
//! allocated and freed, each free taking the whole free pages over the 64 MiB limit. The time
//! per transient pair must not grow with N.
//!
//!   cargo build --release --example limit_release &&
//!   target/release/examples/limit_release [grace] [N...]
//!
//! Defaults: grace 0 (the release runs at the free itself, the costliest case), N = 10000,
//! 100000 and 1000000, on a simulated device of 16 TiB (so that the live blocks fit whatever N).

use std::time::Instant;
use stepalloc::units::MIB;
use stepalloc::{Allocator, Config, Stream};

const TRANSIENTS: u64 = 2000;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let grace: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(0);
    let mut counts: Vec<u64> = args.iter().skip(2).filter_map(|a| a.parse().ok()).collect();
    if counts.is_empty() {
        counts = vec![10_000, 100_000, 1_000_000];
    }
    for n in counts {
        let text = format!(
            "backend:sim,sim_capacity_mb:{},{},page_release:True,cache_limit_mb:64,page_release_grace:{grace}",
            16 << 20,
            stepalloc::config::RECOMMENDED
        );
        let a = Allocator::new(Config::parse(&text).expect("configuration")).expect("allocator");
        let s = Stream(0);
        let mut kept = Vec::with_capacity(n as usize);
        let mut gaps = Vec::with_capacity(n as usize);
        for _ in 0..n {
            gaps.push(a.malloc(0, 3 * MIB, s).expect("3 MiB block"));
            kept.push(a.malloc(0, 5 * MIB / 4, s).expect("1.25 MiB block"));
        }
        for &p in &gaps {
            a.free(0, p, 3 * MIB).expect("free");
        }
        let maps_before = a.stats(0).expect("stats").heap.num_map;
        let start = Instant::now();
        for _ in 0..TRANSIENTS {
            let p = a.malloc(0, 96 * MIB, s).expect("transient");
            a.free(0, p, 96 * MIB).expect("free");
        }
        let per_pair = start.elapsed().as_nanos() as f64 / TRANSIENTS as f64;
        let stats = a.stats(0).expect("stats");
        println!(
            "grace {grace}, {n} pairs live: {:.1} µs per transient malloc + free, {:.1} page maps per transient",
            per_pair / 1000.0,
            (stats.heap.num_map - maps_before) as f64 / TRANSIENTS as f64
        );
        a.check_invariants().expect("heap invariants");
        for &p in &kept {
            a.free(0, p, 5 * MIB / 4).expect("free");
        }
    }
}
