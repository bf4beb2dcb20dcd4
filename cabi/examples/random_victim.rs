//! A driver for cachegrind: the `random_victim` bench's churn (`benches/victim/mod.rs`) with
//! no timing, so instruction and cache-miss counts per pair can be read off two runs.
//!
//! `random_victim LIVE PAIRS [HISTORY]`: settles LIVE live blocks (after a 100 k phase when
//! HISTORY is `history`) with 2 x LIVE pairs, then runs PAIRS more. Counts per pair are the
//! difference between a run with PAIRS = N and one with PAIRS = 0, divided by N:
//!
//! ```text
//! cargo build --release -p stepalloc-cabi --example random_victim
//! valgrind --tool=cachegrind --cache-sim=yes --LL=2097152,16,64 \
//!     target/release/examples/random_victim 100000 200000
//! ```
//!
//! The library is `libstepalloc.so` of the same profile (`STEPALLOC_LIBRARY` overrides it);
//! with `STEPALLOC_TORCH_VICTIM=/path/to/libtorch_victim.so` the churn runs on PyTorch's own
//! caching allocator instead (built as scripts/torch_victim.sh builds it, run in its environment).

#[path = "../benches/victim/mod.rs"]
mod victim;

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: random_victim LIVE PAIRS [history]";
    let (Some(live), Some(pairs)) = (args.get(1), args.get(2)) else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    let (live, pairs) = match (live.parse::<usize>(), pairs.parse::<u64>()) {
        (Ok(l), Ok(p)) if l > 0 => (l, p),
        _ => {
            eprintln!(
                "random_victim: LIVE ({live}) must be a positive integer and PAIRS ({pairs}) an integer; {usage}"
            );
            return ExitCode::from(2);
        }
    };
    let history = match args.get(3).map(String::as_str) {
        None => false,
        Some("history") => true,
        Some(other) => {
            eprintln!("random_victim: third argument {other:?} is not `history`; {usage}");
            return ExitCode::from(2);
        }
    };
    let library = std::env::var_os("STEPALLOC_LIBRARY").map(PathBuf::from).unwrap_or_else(|| {
        // target/<profile>/examples/random_victim -> target/<profile>/libstepalloc.so
        let exe = std::env::current_exe().expect("current_exe");
        exe.parent().and_then(|p| p.parent()).expect("target/<profile>/examples").join("libstepalloc.so")
    });
    let mut churn = match std::env::var_os("STEPALLOC_TORCH_VICTIM") {
        Some(shim) => victim::Churn::new(victim::CAbi::load_torch(std::path::Path::new(&shim))),
        None => victim::Churn::load(&library),
    };
    if history {
        churn.resize(100_000);
        churn.pairs(200_000);
    }
    churn.resize(live);
    churn.pairs(live as u64 * 2);
    churn.pairs(pairs);
    println!("{} live blocks, {pairs} pairs", churn.live.len());
    ExitCode::SUCCESS
}
