//! The endpoint under abuse, on loopback, with bounded counts: garbage, oversized and
//! never-finished requests and many concurrent connections. Meanwhile a thread runs
//! malloc/free on the allocator and records its progress. Afterwards: the endpoint still
//! answers with the allocator's figures, the hot path never stalled, the server stayed on one
//! thread, and its memory did not grow with what clients sent.
//!
//! Its own test binary, so that the thread count and memory figures are the endpoint's alone.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use stepalloc::metrics;
use stepalloc::{Allocator, Config};

/// Clients of each kind; each concurrent kind runs on its own threads.
const GARBAGE_CLIENTS: usize = 60;
const OVERSIZED_CLIENTS: usize = 10;
const OVERSIZED_BYTES: usize = 256 * 1024;
const SILENT_CLIENTS: usize = 2;
const CONCURRENT_SCRAPERS: usize = 48;
/// A malloc/free pair that waited this long would mean the endpoint blocked the hot path.
const MAX_HOT_PATH_GAP: Duration = Duration::from_millis(500);

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    s
}

/// Sends `request` (ignoring a reset once the server gave up on it) and returns the status
/// the server answered, if any.
fn send(addr: SocketAddr, request: &[u8]) -> Option<u16> {
    let mut s = connect(addr);
    let _ = s.write_all(request);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw);
    text.split(' ').nth(1).and_then(|code| code.parse().ok())
}

fn metrics_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|name| name.trim() == "stepalloc-http")
                .count()
        })
        .unwrap_or(0)
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[test]
fn abuse_neither_blocks_the_allocator_nor_the_endpoint() {
    let config = Config::parse("backend:sim,sim_capacity_mb:4096").expect("config");
    let a = Arc::new(Allocator::new(config).expect("allocator"));
    let server = metrics::serve(Arc::clone(&a), "127.0.0.1:0").expect("serve");
    let addr = server.addr;
    assert_eq!(send(addr, b"GET /metrics HTTP/1.1\r\n\r\n"), Some(200));
    let rss_before = rss_bytes();

    // The hot path: malloc/free pairs, recording the longest wait between two completions.
    let stop = Arc::new(AtomicBool::new(false));
    let pairs = Arc::new(AtomicU64::new(0));
    let worker = common::spawn_churn(Arc::clone(&a), Arc::clone(&stop), Arc::clone(&pairs));

    let started = Instant::now();
    let pairs_at_start = pairs.load(Ordering::Relaxed);
    let mut clients = Vec::new();
    // Never-finished requests: each holds its connection until the request timeout.
    for i in 0..SILENT_CLIENTS {
        clients.push(thread::spawn(move || {
            let request: &[u8] = if i % 2 == 0 { b"" } else { b"GET /metr" };
            send(addr, request).map(|s| ("silent", s))
        }));
    }
    for i in 0..GARBAGE_CLIENTS {
        clients.push(thread::spawn(move || {
            let garbage: Vec<u8> = match i % 4 {
                0 => (0..512u32).map(|b| (b.wrapping_mul(2654435761) >> 13) as u8).collect(),
                1 => b"\r\n\r\nGET\r\n\r\n".to_vec(),
                2 => b"GET /metrics HTTP/9.9\r\n\r\n".to_vec(),
                _ => b"BREW /pot HTCPCP/1.0\r\nAccept-Additions: milk\r\n\r\n".to_vec(),
            };
            send(addr, &garbage).map(|s| ("garbage", s))
        }));
    }
    for _ in 0..OVERSIZED_CLIENTS {
        clients.push(thread::spawn(move || {
            let mut big = b"GET /metrics HTTP/1.1\r\nCookie: ".to_vec();
            big.resize(OVERSIZED_BYTES, b'x');
            send(addr, &big).map(|s| ("oversized", s))
        }));
    }
    for _ in 0..CONCURRENT_SCRAPERS {
        clients.push(thread::spawn(move || send(addr, b"GET /metrics HTTP/1.1\r\n\r\n").map(|s| ("scrape", s))));
    }
    let mut peak_threads = 0;
    while clients.iter().any(|c| !c.is_finished()) {
        peak_threads = peak_threads.max(metrics_threads());
        assert!(started.elapsed() < Duration::from_secs(60), "abuse did not finish within 60 s");
        thread::sleep(Duration::from_millis(20));
    }
    let abuse_time = started.elapsed();
    let pairs_during = pairs.load(Ordering::Relaxed) - pairs_at_start;
    let mut answers = std::collections::BTreeMap::<(&str, Option<u16>), usize>::new();
    for c in clients {
        let (kind, status) = match c.join().expect("client") {
            Some((kind, status)) => (kind, Some(status)),
            None => ("no answer", None),
        };
        *answers.entry((kind, status)).or_default() += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let max_gap = worker.join().expect("worker");
    println!(
        "abuse: {abuse_time:?}, {pairs_during} malloc/free pairs meanwhile, longest gap {max_gap:?}, \
         peak server threads {peak_threads}, answers {answers:?}, RSS {} -> {} KiB",
        rss_before / 1024,
        rss_bytes() / 1024
    );

    // The hot path kept completing the whole time.
    assert!(pairs_during > 1000, "only {pairs_during} malloc/free pairs during the abuse");
    assert!(max_gap < MAX_HOT_PATH_GAP, "malloc/free stalled for {max_gap:?}");
    // Every request got the answer it deserved, one thread serving them all.
    assert_eq!(answers.get(&("scrape", Some(200))), Some(&CONCURRENT_SCRAPERS), "{answers:?}");
    assert_eq!(answers.get(&("oversized", Some(431))), Some(&OVERSIZED_CLIENTS), "{answers:?}");
    let garbage_answered: usize =
        answers.iter().filter(|((k, s), _)| *k == "garbage" && s.is_some_and(|s| s >= 400)).map(|(_, n)| n).sum();
    assert_eq!(garbage_answered, GARBAGE_CLIENTS, "{answers:?}");
    // A client that never finishes its request is closed at the header timeout, unanswered.
    assert_eq!(answers.get(&("no answer", None)), Some(&SILENT_CLIENTS), "{answers:?}");
    assert_eq!(peak_threads, 1, "the endpoint serves on one thread");
    // 10 clients sent 256 KiB each; the server keeps one 8 KiB buffer.
    let growth = rss_bytes().saturating_sub(rss_before);
    assert!(growth < 16 << 20, "memory grew by {growth} bytes");

    // It still answers, with the allocator's figures.
    let mut s = connect(addr);
    s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").expect("send");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("read");
    let stats = a.stats(0).expect("stats");
    assert!(body.starts_with("HTTP/1.1 200 OK\r\n"));
    let line = format!("stepalloc_allocations_total{{device=\"0\"}} {}\n", stats.heap.num_mallocs);
    assert!(body.contains(&line), "expected {line}");
    server.shutdown();
    assert_eq!(metrics_threads(), 0, "shutdown ends the server thread");
}
