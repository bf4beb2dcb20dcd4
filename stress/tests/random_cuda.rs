//! The random workload on backend:cuda, with real driver streams and a tag in every block. Runs
//! when `STEPALLOC_HOSTCUDA=1` (the host-memory driver of `testdrv/`, found through
//! `LD_LIBRARY_PATH=target/hostcuda`; `scripts/test.sh` runs it so) or `STEPALLOC_GPU_TESTS=1`
//! (a real device); otherwise each test prints why it was skipped.

use stepalloc::backend::cuda::tools::DeviceTools;
use stepalloc::{Allocator, Config};
use stepalloc_stress::compare::{self, Base};
use stepalloc_stress::workload::random::{self, RandomArgs, SizeDist};

fn wanted(test: &str) -> bool {
    let on = |name: &str| std::env::var(name).as_deref() == Ok("1");
    if on("STEPALLOC_HOSTCUDA") || on("STEPALLOC_GPU_TESTS") {
        return true;
    }
    eprintln!("skipped {test}: set STEPALLOC_HOSTCUDA=1 (testdrv, LD_LIBRARY_PATH=target/hostcuda) or STEPALLOC_GPU_TESTS=1 to run it");
    false
}

#[test]
fn random_workload_on_cuda_keeps_every_tag() {
    if !wanted("random_workload_on_cuda_keeps_every_tag") {
        return;
    }
    let args = RandomArgs {
        threads: 2,
        ops: 1000,
        streams: 2,
        sizes: SizeDist::Mixed,
        cross_free: 0.2,
        record_stream: 0.1,
        live_fraction: 0.3,
        step_every: 300,
        seed: 3,
        tag_kib: 4,
        panic_at: None,
    };
    let base = Base { cuda: true, capacity_mb: 0, devices: 1 };
    for rc in compare::resolve(&["pytorch".into(), "stepalloc".into()], &base).unwrap() {
        let (run, integrity) = random::run(&args, &rc).unwrap();
        assert!(integrity.ok(), "{integrity:?}");
        assert!(integrity.tagged_blocks > 100, "{integrity:?}");
        assert_eq!(run.ops, 2000);
    }
}

/// A block whose memory is written over while it is live fails its tag check on the device.
#[test]
fn device_tags_catch_a_block_written_over() {
    if !wanted("device_tags_catch_a_block_written_over") {
        return;
    }
    const KIB: u64 = 1024;
    let allocator = Allocator::new(Config::parse("backend:cuda").unwrap()).unwrap();
    let tools = DeviceTools::open(0).unwrap();
    let stream = tools.create_stream(true).unwrap();
    let size = 64 * KIB;
    let ptr = allocator.malloc(0, size, stream).unwrap();
    random::write_tag(&tools, ptr, size, 4 * KIB, 7, stream).unwrap();
    assert_eq!(random::verify_tag(&tools, ptr, size, 4 * KIB, 7, stream).unwrap(), None);
    // Another block's tag over the last words (verify_tag synchronized the stream already).
    tools.memset_d32(ptr + size - 64, 8, 16).unwrap();
    let found = random::verify_tag(&tools, ptr, size, 4 * KIB, 7, stream).unwrap();
    assert!(found.as_deref().is_some_and(|w| w.contains("is 8")), "{found:?}");
    // A range that is not device memory is a driver error, not a corruption.
    assert!(random::verify_tag(&tools, 4096, 64, 0, 7, stream).is_err());
    allocator.free(0, ptr, size).unwrap();
    allocator.empty_cache().unwrap();
    tools.synchronize_stream(stream).unwrap();
    tools.destroy_stream(stream).unwrap();
}
