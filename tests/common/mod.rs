//! Test support shared by the integration tests of `tests/` (`mod common;` at the top of a test
//! file, then `use common::{...}`): allocators on the simulated device, the figures tests read
//! (device memory in use, reserved bytes, a tag's figures), regions, a seeded random sequence, a
//! shadow of live blocks that fails on any overlap, a parser of the Prometheus text, and the hot
//! path under load for the metrics tests. Nothing here asserts a rule of its own; each helper
//! panics with what it could not do, so a failing test names its cause.
//!
//! Each test binary compiles this file by itself and uses a part of it.
#![allow(dead_code)]

pub mod watched;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};
use stepalloc::heap::TagFigures;
use stepalloc::stats::DeviceStats;
use stepalloc::tags::{self, Store};
use stepalloc::{Allocator, Config, Stream};

/// Streams the tests allocate on (`S0` is the default stream).
pub const S0: Stream = Stream(0);
pub const S1: Stream = Stream(0x1111);
pub const S2: Stream = Stream(0x2222);

/// An allocator on the simulated device: `backend:sim,` followed by `conf`.
pub fn sim(conf: &str) -> Allocator {
    let text = format!("backend:sim,{conf}");
    Allocator::new(Config::parse(&text).expect("valid config")).expect("sim backend")
}

/// An allocator on a simulated device of 4 GiB (the sleep tests' device), `conf` appended as it
/// stands: empty, or starting with a comma (`",sim_devices:2"`).
pub fn sim_4gib(conf: &str) -> Allocator {
    let text = format!("backend:sim,sim_capacity_mb:4096{conf}");
    Allocator::new(Config::parse(&text).expect("valid config")).expect("sim backend")
}

/// Device 0's statistics.
pub fn stats(a: &Allocator) -> DeviceStats {
    a.stats(0).expect("device 0")
}

/// Device 0's reserved bytes, as the heap counts them.
pub fn reserved(a: &Allocator) -> u64 {
    stats(a).heap.reserved_bytes.all.current
}

/// Device memory in use on `device`, as the device reports it (total - free).
pub fn used(a: &Allocator, device: usize) -> u64 {
    let (free, total) = a.with_heap(device, |h| h.device_mem_info()).unwrap().unwrap();
    total - free
}

/// Allocates `sizes` on device 0 in a region of `tag` (backed up to pinned memory at a pause
/// when `backup`); returns each block's (address, size).
pub fn in_region(a: &Allocator, tag: &str, backup: bool, sizes: &[u64]) -> Vec<(u64, u64)> {
    in_region_on(a, 0, tag, backup, sizes)
}

/// [`in_region`] on `device`.
pub fn in_region_on(a: &Allocator, device: usize, tag: &str, backup: bool, sizes: &[u64]) -> Vec<(u64, u64)> {
    in_region_with(a, device, tag, if backup { Store::Pinned } else { Store::None }, sizes)
}

/// [`in_region`] on `device`, backed up to `store` at a pause.
pub fn in_region_with(a: &Allocator, device: usize, tag: &str, store: Store, sizes: &[u64]) -> Vec<(u64, u64)> {
    tags::enter_with(tag, store).unwrap();
    let blocks = sizes.iter().map(|&s| (a.malloc(device, s, S0).unwrap(), s)).collect();
    tags::exit().unwrap();
    blocks
}

/// The figures of `tag` (every device's).
pub fn figures(a: &Allocator, tag: &str) -> TagFigures {
    a.tag_figures().into_iter().find(|f| f.tag == tag).unwrap_or_else(|| panic!("no figures for {tag}"))
}

/// splitmix64: the next number of the sequence `state` is in (for sizes and choices that are
/// the same on every run).
pub fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Live blocks of every thread, by (device, address) -> size: a block handed out over a live
/// one fails the test. A block leaves before its free (so its address may come back at once).
#[derive(Default)]
pub struct Shadow(Mutex<BTreeMap<(usize, u64), u64>>);

impl Shadow {
    pub fn insert(&self, device: usize, p: u64, size: u64) {
        let mut live = self.0.lock().unwrap();
        let end = p + size.max(1);
        if let Some((&(d, q), &s)) = live.range(..(device, end)).next_back() {
            assert!(
                d != device || q + s.max(1) <= p,
                "block {p:#x}+{size} overlaps live {q:#x}+{s} on device {device}"
            );
        }
        assert!(live.insert((device, p), size).is_none());
    }

    pub fn remove(&self, device: usize, p: u64) {
        self.0.lock().unwrap().remove(&(device, p)).expect("shadowed");
    }
}

/// Samples of a Prometheus text exposition: (name, labels) -> value.
pub type Samples = BTreeMap<(String, BTreeMap<String, String>), f64>;

/// Parses a text exposition as stepalloc writes it; panics on a line that is not a `# HELP`,
/// a `# TYPE` or a sample (a render error shows as a stray comment), on a malformed or
/// negative value (stepalloc exports none) and on a series given twice.
pub fn samples(text: &str) -> Samples {
    let mut out = Samples::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with("# HELP ") || line.starts_with("# TYPE ") {
            continue;
        }
        assert!(!line.starts_with('#'), "unexpected comment (a render error?): {line}");
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value in `{line}`"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in `{line}`")),
        };
        assert!(value >= 0.0, "negative sample: {line}");
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').unwrap_or_else(|| panic!("unclosed labels in `{line}`"));
                let mut labels = BTreeMap::new();
                for pair in body.split("\",").filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once("=\"").unwrap_or_else(|| panic!("bad label in `{line}`"));
                    labels.insert(k.to_string(), v.trim_end_matches('"').to_string());
                }
                (name.to_string(), labels)
            }
        };
        assert!(out.insert((name, labels), value).is_none(), "duplicate series `{series}`");
    }
    out
}

/// The sample of `name` with exactly `labels`, if there is one.
pub fn sample(samples: &Samples, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let key = (name.to_string(), labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    samples.get(&key).copied()
}

/// The hot path under load: malloc/free pairs of mixed sizes on device 0 until `stop`, counting
/// them in `pairs`; returns the longest wait between two completed pairs.
pub fn spawn_churn(a: Arc<Allocator>, stop: Arc<AtomicBool>, pairs: Arc<AtomicU64>) -> thread::JoinHandle<Duration> {
    thread::spawn(move || {
        let (mut max_gap, mut last, mut i) = (Duration::ZERO, Instant::now(), 0u64);
        while !stop.load(Ordering::Relaxed) {
            let size = 512 + (i * 7919) % (4 << 20);
            let p = a.malloc(0, size, Stream::DEFAULT).expect("malloc");
            a.free(0, p, size).expect("free");
            pairs.fetch_add(1, Ordering::Relaxed);
            let now = Instant::now();
            max_gap = max_gap.max(now - last);
            last = now;
            i += 1;
            if i % 64 == 0 {
                thread::yield_now();
            }
        }
        max_gap
    })
}
