//! The copy path of sleep and wake, measured: pause and resume cycles of a colocated loop's
//! engine memory — `weights_mb` of weights backed up, in `tensors` tensors, plus `kv_mb` of KV
//! cache discarded — then the same bytes in one tensor (the least a cycle of them costs through
//! the driver: the same maps, unmaps and copies, without per-tensor work), and a plain host copy
//! of the backed-up bytes into warm buffers (what the copies alone cost on host memory). The
//! first cycle allocates the pinned host buffers; the second and later ones are the steady
//! state an agent loop sees every iteration, and the figures compare those.
//!
//! Run on the host-memory driver (or on a GPU: no LD_LIBRARY_PATH):
//!   testdrv/build.sh && cargo build --release --example sleep_copy &&
//!   LD_LIBRARY_PATH=target/hostcuda HOSTCUDA_CAPACITY_MB=8192 HOSTCUDA_DELAY_US=0 \
//!     target/release/examples/sleep_copy [weights_mb] [tensors] [kv_mb] [cycles] [extra conf]
//! Defaults: 1024 MiB in 257 tensors, 512 MiB of KV cache, 5 cycles, `expandable_segments:True`.

use std::time::Instant;
use stepalloc::backend::cuda::tools::DeviceTools;
use stepalloc::units::MIB;
use stepalloc::{tags, Allocator, Config, Stream};

fn arg(i: usize, default: u64) -> u64 {
    std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Sizes of `tensors` tensors summing to `total`: 3/4 and 5/4 of an equal share, alternately
/// (whole 512-byte granules), the last taking the rest.
fn sizes(total: u64, tensors: u64) -> Vec<u64> {
    let share = total / tensors;
    let mut sizes: Vec<u64> =
        (0..tensors - 1).map(|i| (if i % 2 == 0 { share * 3 / 4 } else { share * 5 / 4 }) / 512 * 512).collect();
    sizes.push(total - sizes.iter().sum::<u64>());
    sizes
}

/// Allocates the weights (backed up) and the KV cache (discarded), fills them, runs `cycles`
/// pause/resume cycles, checks the weights' bytes, frees everything. Returns the mean seconds
/// of cycles 2 and later.
fn run(a: &Allocator, tools: &DeviceTools, label: &str, sizes: &[u64], kv_bytes: u64, cycles: u64) -> f64 {
    tags::enter("weights", true).expect("region");
    let weights: Vec<(u64, u64)> = sizes.iter().map(|&s| (a.malloc(0, s, Stream(0)).expect("weights"), s)).collect();
    tags::exit().expect("region");
    tags::enter("kv_cache", false).expect("region");
    let kv = a.malloc(0, kv_bytes, Stream(0)).expect("kv cache");
    tags::exit().expect("region");
    for (i, &(p, s)) in weights.iter().enumerate() {
        tools.memset_d32(p, i as u32 ^ 0x5A5A_0000, (s / 4) as usize).expect("fill");
    }
    tools.memset_d32(kv, 7, (kv_bytes / 4) as usize).expect("fill");
    let mut steady = Vec::new();
    for cycle in 1..=cycles {
        let t = Instant::now();
        let p = a.pause(None, None).expect("pause");
        let paused = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let r = a.resume(None).expect("resume");
        let resumed = t.elapsed().as_secs_f64();
        println!(
            "{label} cycle {cycle}: pause {paused:.3} s (copied {} MiB, {:.2} GiB/s; discarded {} MiB; released {} MiB), \
             resume {resumed:.3} s (copied {} MiB, {:.2} GiB/s; mapped {} MiB): {:.3} s",
            p.copied_bytes / MIB,
            p.gib_per_s,
            p.discarded_bytes / MIB,
            p.released_bytes / MIB,
            r.copied_bytes / MIB,
            r.gib_per_s,
            r.mapped_bytes / MIB,
            paused + resumed,
        );
        if cycle > 1 {
            steady.push(paused + resumed);
        }
    }
    for (i, &(p, s)) in weights.iter().enumerate() {
        let mut word = [0u8; 4];
        tools.copy_to_host(&mut word, p + s / 4 * 4 - 4).expect("read back");
        assert_eq!(u32::from_ne_bytes(word), i as u32 ^ 0x5A5A_0000, "tensor {i} lost its bytes");
        a.free(0, p, s).expect("free");
    }
    a.free(0, kv, kv_bytes).expect("free");
    a.release_backup().expect("release_backup");
    a.empty_cache().expect("empty_cache");
    steady.iter().sum::<f64>() / steady.len() as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (weights_mb, tensors, kv_mb, cycles) = (arg(1, 1024), arg(2, 257).max(1), arg(3, 512), arg(4, 5).max(2));
    let extra = std::env::args().nth(5).unwrap_or_else(|| "expandable_segments:True".into());
    let a = Allocator::new(Config::parse(&format!("backend:cuda,{extra}"))?)?;
    let tools = DeviceTools::open(0)?;
    let total = weights_mb * MIB;
    let many = run(&a, &tools, &format!("{tensors} tensors"), &sizes(total, tensors), kv_mb * MIB, cycles);
    let one = run(&a, &tools, "1 tensor", &[total], kv_mb * MIB, cycles);
    // The copies alone: the backed-up bytes between warm host buffers, out and back (best of 3).
    let src = vec![1u8; total as usize];
    let mut dst = vec![0u8; total as usize];
    let mut plain = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        plain = plain.min(t.elapsed().as_secs_f64());
    }
    println!(
        "steady state, {weights_mb} MiB backed up + {kv_mb} MiB discarded per cycle: {tensors} tensors {many:.3} s, \
         1 tensor {one:.3} s ({:.2}x); plain host copy into warm buffers {:.3} s out and back ({:.2} GiB/s each way; \
         {:.2}x)",
        many / one,
        2.0 * plain,
        weights_mb as f64 / 1024.0 / plain,
        many / (2.0 * plain)
    );
    Ok(())
}
