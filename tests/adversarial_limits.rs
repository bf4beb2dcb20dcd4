//! Fourth adversarial pass: `page_release` with `cache_limit_mb` and
//! `page_release_grace` under live load from several threads and streams on two simulated
//! devices, with tagged regions mixed in. What must hold: no block handed out over a live one,
//! no block lost, no page mapped twice (the simulated device refuses a map over mapped bytes,
//! which would fail an allocation), the heap's reserved bytes equal to what the device has in
//! use at every check (the figures users read against `cuMemGetInfo`), and the limit in force
//! once the load stops. docs/testing.md ("Fourth adversarial pass") records the outcome.

mod common;

use common::{next, Shadow};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use stepalloc::units::MIB;
use stepalloc::{tags, Allocator, Config, Stream};

/// Reserved bytes as the heap counts them, and bytes in use as the device reports them, read
/// under one lock so that no allocation runs between the two.
fn reserved_and_used(a: &Allocator, device: usize) -> (u64, u64) {
    a.with_heap(device, |h| {
        let reserved = h.stats().heap.reserved_bytes.all.current;
        let (free, total) = h.device_mem_info().unwrap();
        (reserved, total - free)
    })
    .unwrap()
}

fn run_load(limit_mb: u64, grace: u64) {
    let conf = format!(
        "backend:sim,sim_devices:2,sim_capacity_mb:4096,sim_event_delay_us:20,{},page_release:True,\
         cache_limit_mb:{limit_mb},page_release_grace:{grace}",
        stepalloc::config::RECOMMENDED
    );
    let a = Arc::new(Allocator::new(Config::parse(&conf).unwrap()).unwrap());
    let shadow = Arc::new(Shadow::default());
    let stop = Arc::new(AtomicBool::new(false));
    let ops_done = Arc::new(AtomicU64::new(0));
    a.step_begin("rollout").unwrap();
    let mut workers = Vec::new();
    for t in 0..4u64 {
        let (a, shadow, stop, ops_done) =
            (Arc::clone(&a), Arc::clone(&shadow), Arc::clone(&stop), Arc::clone(&ops_done));
        workers.push(std::thread::spawn(move || {
            // One thread allocates in a tag's region: tagged segments are virtual ranges too.
            if t == 3 {
                tags::enter("adv_limit_kv", false).unwrap();
            }
            let mut rng = 0x11_31 + t + limit_mb * 7 + grace * 131;
            let mut mine: Vec<(usize, u64, u64)> = Vec::new();
            let stream = Stream(t + 1);
            for op in 0..2500u64 {
                let r = next(&mut rng);
                if mine.len() < 32 && (r % 3 != 0 || mine.is_empty()) {
                    let device = (r >> 8) as usize % 2;
                    let size = match (r >> 16) % 4 {
                        0 => 512 + (r >> 24) % 8192,
                        1 => MIB + (r >> 24) % (3 * MIB),
                        2 => 4 * MIB + (r >> 24) % (4 * MIB),
                        _ => 1 + (r >> 24) % 511,
                    };
                    let p = a
                        .malloc(device, size, stream)
                        .unwrap_or_else(|e| panic!("thread {t}: op {op}: malloc {size} on {device}: {e}"));
                    shadow.insert(device, p, size);
                    mine.push((device, p, size));
                } else {
                    let (device, p, size) = mine.swap_remove((r >> 8) as usize % mine.len());
                    if r % 5 == 0 {
                        // Used on another stream too: reused only after that stream's work.
                        a.record_stream(device, p, Stream(50 + t)).unwrap();
                    }
                    shadow.remove(device, p);
                    a.free(device, p, size).unwrap_or_else(|e| panic!("thread {t}: op {op}: free {p:#x}: {e}"));
                }
                if t == 0 && op % 300 == 299 {
                    a.step_end().unwrap();
                    a.step_begin(if op % 600 == 299 { "train" } else { "rollout" }).unwrap();
                }
                if op % 64 == 0 {
                    a.advance_time(50_000);
                }
                ops_done.fetch_add(1, Ordering::Relaxed);
            }
            if t == 3 {
                tags::exit().unwrap();
            }
            stop.load(Ordering::Relaxed);
            mine
        }));
    }
    // A checker: the heap's figures against the device's, and the invariants, under load.
    let checker = {
        let (a, stop) = (Arc::clone(&a), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut checks = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for device in 0..2 {
                    let (reserved, used) = reserved_and_used(&a, device);
                    assert_eq!(reserved, used, "device {device}: reserved {reserved} but the device has {used} in use");
                }
                a.check_invariants().unwrap_or_else(|e| panic!("under load: {e}"));
                checks += 1;
                std::thread::yield_now();
            }
            checks
        })
    };
    let kept: Vec<Vec<(usize, u64, u64)>> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    let checks = checker.join().unwrap();
    assert!(checks > 0 && ops_done.load(Ordering::Relaxed) == 10_000);
    a.check_invariants().unwrap();
    for &(device, p, size) in kept.iter().flatten() {
        assert!(a.with_heap(device, |h| h.is_live(p)).unwrap(), "block {p:#x} ({size}) on {device} lost");
        a.free(device, p, size).unwrap();
    }
    a.advance_time(10_000_000);
    // Everything free and the streams' work done: a step end applies the limit at once.
    a.step_end().unwrap();
    for device in 0..2 {
        let (reserved, used) = reserved_and_used(&a, device);
        assert_eq!(reserved, used, "device {device}, after the load");
        // Whole free pages over the limit went back; what stays is at most the limit plus the
        // partial pages of segment ends (a page of 16 MiB at most per segment, bounded here).
        let stats = a.stats(device).unwrap();
        let segments = stats.heap.segment.all.current;
        assert!(
            reserved <= limit_mb * MIB + segments * 16 * MIB,
            "device {device}: {reserved} reserved over a limit of {limit_mb} MiB with {segments} segments"
        );
    }
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    for device in 0..2 {
        assert_eq!(reserved_and_used(&a, device), (0, 0), "device {device}: left after empty_cache");
    }
}

#[test]
fn page_release_under_a_cache_limit_with_a_grace_holds_under_live_load() {
    run_load(64, 4);
}

#[test]
fn page_release_under_a_tight_limit_released_at_the_free_holds_under_live_load() {
    run_load(1, 0);
}

#[test]
fn page_release_with_a_long_grace_holds_under_live_load() {
    run_load(8, 1024);
}

/// A block used on a second stream (`record_stream`) is freed; that stream's work completes
/// before the step ends. The step end applies the cache limit "at once" (heap/limit.rs), so the
/// free, complete in all but bookkeeping, must count: reserved bytes fall to the limit at the
/// step end, not at some later allocation.
#[test]
fn a_step_end_counts_frees_whose_streams_finished_against_the_cache_limit() {
    for conf in ["page_release:True,cache_limit_mb:8", "page_release:True,cache_limit_mb:8,page_release_grace:0"] {
        let text =
            format!("backend:sim,sim_capacity_mb:4096,sim_event_delay_us:20,{},{conf}", stepalloc::config::RECOMMENDED);
        let a = Allocator::new(Config::parse(&text).unwrap()).unwrap();
        a.step_begin("train").unwrap();
        let p = a.malloc(0, 96 * MIB, Stream(0)).unwrap();
        a.record_stream(0, p, Stream(1)).unwrap();
        a.free(0, p, 96 * MIB).unwrap();
        a.advance_time(1_000_000); // stream 1's work is done
        a.step_end().unwrap();
        let (reserved, used) = reserved_and_used(&a, 0);
        assert_eq!(reserved, used, "{conf}");
        assert!(reserved <= 8 * MIB, "{conf}: {reserved} bytes reserved after the step end, over the 8 MiB limit");
        a.check_invariants().unwrap();
    }
}
