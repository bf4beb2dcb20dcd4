//! Over many cycles nothing grows (vLLM #21336: pinned memory 13.2 -> 24.1 GiB after three
//! sleep cycles, garbage after four): 300 cycles of a colocated agent loop on the simulated
//! device, each with a KV cache of a new size (discarded at pause, sometimes freed while paused,
//! sometimes before), weights and optimizer state backed up, a CUDA graph's pool under a tag,
//! and churn of the default tag. Checked every cycle: device memory in use while paused is the
//! trainer's own, the same every cycle; the pinned host memory held for backups and the bytes
//! backed up are the same every cycle (also on the Prometheus endpoint); the backed-up blocks
//! keep their addresses. Checked at the end: the address space, the segment count and the
//! live blocks reached their high marks in the first half and did not move after.

mod common;

use common::used;
use stepalloc::units::MIB;
use stepalloc::{metrics, tags, Allocator, Config, Stream};

const S: Stream = Stream(0);
const GRAPH_STREAM: Stream = Stream(9);
const CYCLES: u64 = 300;

/// A small deterministic generator (xorshift), so that every run is the same loop.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn in_region<T>(tag: &str, backup: bool, f: impl FnOnce() -> T) -> T {
    tags::enter(tag, backup).unwrap();
    let out = f();
    tags::exit().unwrap();
    out
}

/// The value of a per-tag sample of device 0 on the Prometheus endpoint.
fn metric(text: &str, name: &str, tag: &str) -> u64 {
    let prefix = format!("{name}{{device=\"0\",tag=\"{tag}\"}} ");
    let line = text.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("no {prefix}"));
    line[prefix.len()..].parse::<f64>().unwrap() as u64
}

#[test]
fn three_hundred_agent_loop_cycles_hold_device_and_host_memory_flat() {
    for conf in ["", ",expandable_segments:True,page_reuse:True,big_page_mb:16"] {
        run(conf);
    }
}

fn run(conf: &str) {
    let a = Allocator::new(Config::parse(&format!("backend:sim,sim_capacity_mb:16384{conf}")).unwrap()).unwrap();
    let (w, opt, kv, graph) = ("cycles_weights", "cycles_optim", "cycles_kv", "cycles_graph");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // The engine's weights (backed up): many tensors of varied sizes, like a model's.
    let weight_sizes: Vec<u64> = (0..40).map(|i| (i % 7 + 1) * MIB + (i * 4099) % 65_536).collect();
    let weights: Vec<u64> = in_region(w, true, || weight_sizes.iter().map(|&s| a.malloc(0, s, S).unwrap()).collect());
    // The trainer's optimizer state (backed up while the engine runs).
    let opt_sizes = [300 * MIB, 300 * MIB, 5 * MIB + 3];
    let optim: Vec<u64> = in_region(opt, true, || opt_sizes.iter().map(|&s| a.malloc(0, s, S).unwrap()).collect());
    // The trainer's parameters: default tag, never paused.
    let params = a.malloc(0, 200 * MIB, S).unwrap();
    // A CUDA graph captured once in the graph tag: its pool is released and mapped each cycle.
    let pool = (77, 0);
    let graph_out = in_region(graph, false, || {
        a.begin_allocate_to_pool(0, pool).unwrap();
        let tmp = a.malloc_in_pool(0, 40 * MIB, GRAPH_STREAM, Some(pool)).unwrap();
        let out = a.malloc_in_pool(0, 8 * MIB, GRAPH_STREAM, Some(pool)).unwrap();
        a.free(0, tmp, 40 * MIB).unwrap();
        a.end_allocate_to_pool(0, pool).unwrap();
        out
    });
    in_region(kv, false, || ()); // named before the first rollout resumes it
    let backed_up: u64 = weight_sizes.iter().sum::<u64>() + opt_sizes.iter().sum::<u64>();

    let mut first: Option<(u64, u64, u64)> = None; // (used while paused, host bytes, copied bytes)
    let mut marks: Vec<(u64, u64, u64)> = Vec::new(); // (virtual reserved, segments, live blocks)
    let mut kv_live: Option<(u64, u64)> = None;
    for cycle in 0..CYCLES {
        // Rollout: the optimizer state sleeps, the engine takes a KV cache of a new size.
        let optim_copied = a.pause(Some(opt), None).unwrap().copied_bytes;
        a.resume(Some(w)).unwrap();
        a.resume(Some(kv)).unwrap();
        a.resume(Some(graph)).unwrap();
        if let Some((p, s)) = kv_live.take() {
            a.free(0, p, s).unwrap(); // last rollout's cache, kept through the pause
        }
        let kv_size = (64 + rng.below(1024)) * MIB + rng.below(1 << 20);
        let cache = in_region(kv, false, || a.malloc(0, kv_size, S).unwrap());
        let scratch: Vec<(u64, u64)> = (0..1 + rng.below(12))
            .map(|_| {
                let s = 1 + rng.below(48 * MIB);
                (a.malloc(0, s, S).unwrap(), s)
            })
            .collect();
        for (p, s) in scratch {
            a.free(0, p, s).unwrap();
        }
        match cycle % 3 {
            0 => a.free(0, cache, kv_size).unwrap(), // freed before the pause
            _ => kv_live = Some((cache, kv_size)),   // kept through it (freed while paused below, or after)
        }
        // Training: the engine sleeps (weights backed up, KV cache and graph pool discarded).
        let before = used(&a, 0);
        let r = a.pause(None, None).unwrap();
        if cycle % 3 == 1 {
            let (p, s) = kv_live.take().unwrap();
            a.free(0, p, s).unwrap(); // a free of a paused block
        }
        let paused_used = used(&a, 0);
        assert!(paused_used < before, "cycle {cycle}: the pause gave nothing back");
        a.resume(Some(opt)).unwrap();
        let grads: Vec<(u64, u64)> = (0..2 + rng.below(20))
            .map(|_| {
                let s = 1 + rng.below(64 * MIB);
                (a.malloc(0, s, S).unwrap(), s)
            })
            .collect();
        for (p, s) in grads {
            a.free(0, p, s).unwrap();
        }
        let host = a.with_heap(0, |h| h.backup_host_bytes()).unwrap();
        let text = metrics::render(&a);
        let weights_backup = metric(&text, "stepalloc_tag_backup_bytes", w);
        assert_eq!(weights_backup, weight_sizes.iter().sum::<u64>(), "cycle {cycle}: weights backed up");
        let now = (paused_used, host, optim_copied + r.copied_bytes);
        match first {
            None => {
                assert_eq!(now.2, backed_up, "a cycle backs up the weights and the optimizer state");
                first = Some(now);
            }
            Some(f) => assert_eq!(now, f, "cycle {cycle}: (used while paused, host held, copied) moved"),
        }
        let hs = a.stats(0).unwrap();
        let live_blocks = hs.heap.allocation.all.current;
        marks.push((hs.heap.virtual_reserved_bytes, hs.heap.segment.all.current, live_blocks));
        if cycle % 50 == 0 {
            a.check_invariants().unwrap();
        }
    }
    let half = (CYCLES / 2) as usize;
    for (i, what) in ["virtual reserved bytes", "segments", "live blocks"].iter().enumerate() {
        let pick = |m: &(u64, u64, u64)| [m.0, m.1, m.2][i];
        let early = marks[..half].iter().map(pick).max().unwrap();
        let late = marks[half..].iter().map(pick).max().unwrap();
        assert!(late <= early, "{conf}: {what} grew after cycle {half}: {early} -> {late}");
    }
    // Everything still there: the weights kept their addresses through 300 pauses.
    a.resume(None).unwrap();
    for (&p, &s) in weights.iter().zip(&weight_sizes) {
        assert!(a.with_heap(0, |h| h.is_live(p)).unwrap());
        a.free(0, p, s).unwrap();
    }
    for (&p, &s) in optim.iter().zip(&opt_sizes) {
        a.free(0, p, s).unwrap();
    }
    if let Some((p, s)) = kv_live {
        a.free(0, p, s).unwrap();
    }
    a.free(0, graph_out, 8 * MIB).unwrap();
    a.release_pool(0, pool).unwrap();
    a.free(0, params, 200 * MIB).unwrap();
    a.check_invariants().unwrap();
    a.release_backup().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(used(&a, 0), 0, "{conf}: everything back at the end");
    assert_eq!(a.with_heap(0, |h| h.backup_host_bytes()).unwrap(), 0);
    let (p, h, c) = first.unwrap();
    eprintln!(
        "{conf}: {CYCLES} cycles: {} MiB in use while paused, {} MiB host held, {c} bytes backed up each cycle",
        p / MIB,
        h / MIB
    );
}
