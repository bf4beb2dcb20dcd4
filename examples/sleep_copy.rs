//! The copy path of sleep and wake, measured: pause and resume cycles of a colocated loop's
//! engine memory — `weights_mb` of weights backed up, in `tensors` tensors, plus `kv_mb` of KV
//! cache discarded — against a plain host copy of the same backed-up bytes into warm buffers
//! (the least those bytes can cost on host memory). The first cycle allocates the pinned host
//! buffers; the second and later ones are the steady state an agent loop sees every iteration.
//!
//! Run on the host-memory driver (or a GPU, with `backend:cuda` and no LD_LIBRARY_PATH):
//!   testdrv/build.sh && LD_LIBRARY_PATH=target/hostcuda HOSTCUDA_CAPACITY_MB=8192 HOSTCUDA_DELAY_US=0 \
//!     cargo run --release --example sleep_copy -- [weights_mb] [tensors] [kv_mb] [cycles] [extra conf]
//! Defaults: 1024 MiB in 257 tensors, 512 MiB of KV cache, 5 cycles, `expandable_segments:True`.
//! Prints one line per cycle and the steady-state ratio to the plain copy.

use std::time::Instant;
use stepalloc::backend::cuda::tools::DeviceTools;
use stepalloc::units::MIB;
use stepalloc::{tags, Allocator, Config, Stream};

fn arg(i: usize, default: u64) -> u64 {
    std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (weights_mb, tensors, kv_mb, cycles) = (arg(1, 1024), arg(2, 257).max(1), arg(3, 512), arg(4, 5).max(2));
    let extra = std::env::args().nth(5).unwrap_or_else(|| "expandable_segments:True".into());
    let a = Allocator::new(Config::parse(&format!("backend:cuda,{extra}"))?)?;
    let tools = DeviceTools::open(0)?;
    // Tensors of unequal sizes (3/4 and 5/4 of an equal share, alternately; the last takes the
    // rest) summing to `weights_mb`.
    let total = weights_mb * MIB;
    let share = total / tensors;
    let mut sizes: Vec<u64> =
        (0..tensors - 1).map(|i| (if i % 2 == 0 { share * 3 / 4 } else { share * 5 / 4 }) / 512 * 512).collect();
    sizes.push(total - sizes.iter().sum::<u64>());
    tags::enter("weights", true)?;
    let weights: Vec<(u64, u64)> =
        sizes.iter().map(|&s| a.malloc(0, s, Stream(0)).map(|p| (p, s))).collect::<Result<_, _>>()?;
    tags::exit()?;
    tags::enter("kv_cache", false)?;
    let kv = a.malloc(0, kv_mb * MIB, Stream(0))?;
    tags::exit()?;
    for (i, &(p, s)) in weights.iter().enumerate() {
        tools.memset_d32(p, i as u32 ^ 0x5A5A_0000, (s / 4) as usize)?;
    }
    tools.memset_d32(kv, 7, (kv_mb * MIB / 4) as usize)?;

    // The floor: the same bytes copied once more between warm host buffers (best of three).
    let src = vec![1u8; total as usize];
    let mut dst = vec![0u8; total as usize];
    let mut plain = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        plain = plain.min(t.elapsed().as_secs_f64());
    }
    drop((src, dst));
    // Round trip: out and back, as a cycle moves them.
    let floor = 2.0 * plain;
    println!(
        "plain host copy of {weights_mb} MiB into warm buffers: {:.3} s each way ({:.1} GiB/s); round trip {:.3} s",
        plain,
        weights_mb as f64 / 1024.0 / plain,
        floor
    );
    let mut steady = Vec::new();
    for cycle in 1..=cycles {
        let t = Instant::now();
        let p = a.pause(None, None)?;
        let paused = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let r = a.resume(None)?;
        let resumed = t.elapsed().as_secs_f64();
        println!(
            "cycle {cycle}: pause {paused:.3} s (copied {} MiB at {:.1} GiB/s, discarded {} MiB, released {} MiB), \
             resume {resumed:.3} s (copied {} MiB at {:.1} GiB/s, mapped {} MiB): {:.3} s, {:.2}x the round trip",
            p.copied_bytes / MIB,
            p.gib_per_s,
            p.discarded_bytes / MIB,
            p.released_bytes / MIB,
            r.copied_bytes / MIB,
            r.gib_per_s,
            r.mapped_bytes / MIB,
            paused + resumed,
            (paused + resumed) / floor
        );
        if cycle > 1 {
            steady.push(paused + resumed);
        }
    }
    // The bytes survived every cycle.
    for (i, &(p, s)) in weights.iter().enumerate().step_by(16) {
        let mut word = [0u8; 4];
        tools.copy_to_host(&mut word, p + s - 4)?;
        assert_eq!(u32::from_ne_bytes(word), i as u32 ^ 0x5A5A_0000, "tensor {i} lost its bytes");
    }
    let mean = steady.iter().sum::<f64>() / steady.len() as f64;
    println!(
        "steady state (cycles 2..{cycles}): {mean:.3} s per cycle, {:.2}x a plain round trip of the backed-up bytes",
        mean / floor
    );
    Ok(())
}
