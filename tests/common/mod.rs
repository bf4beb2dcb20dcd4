//! Helpers shared by the metrics endpoint tests.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use stepalloc::{Allocator, Stream};

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
