//! Idle connections do not delay scrapes: 10 sockets that send nothing and
//! reconnect as soon as the server closes them, while the allocator's hot path runs; every
//! scrape meanwhile is answered at once (the server used to take one connection at a time,
//! and each scrape waited ~10 s behind the idle ones). Also: binding an address other than
//! loopback is logged.
//!
//! Its own test binary: timing figures are not shared with other tests.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use stepalloc::metrics;
use stepalloc::{Allocator, Config};

const IDLE_SOCKETS: usize = 10;
const SCRAPES: usize = 20;
const ATTACK: Duration = Duration::from_millis(2500);

fn scrape(addr: SocketAddr) -> (Duration, String) {
    let started = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(15)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").expect("send");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read");
    (started.elapsed(), answer)
}

#[test]
fn idle_reconnecting_sockets_do_not_delay_scrapes() {
    let config = Config::parse("backend:sim,sim_capacity_mb:4096").expect("config");
    let a = Arc::new(Allocator::new(config).expect("allocator"));
    let server = metrics::serve(Arc::clone(&a), "127.0.0.1:0").expect("serve");
    let addr = server.addr;
    let stop = Arc::new(AtomicBool::new(false));

    // The attack: each socket connects, sends nothing, and reconnects when closed.
    let reconnects = Arc::new(AtomicU64::new(0));
    let idle: Vec<_> = (0..IDLE_SOCKETS)
        .map(|_| {
            let (stop, reconnects) = (Arc::clone(&stop), Arc::clone(&reconnects));
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else { continue };
                    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
                    let mut byte = [0u8; 1];
                    // Wait for the server to close it (or for the test to end).
                    loop {
                        match s.read(&mut byte) {
                            Ok(0) => break,
                            Ok(_) => {}
                            Err(_) if !stop.load(Ordering::Relaxed) => {}
                            Err(_) => break,
                        }
                    }
                    reconnects.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();

    // The hot path meanwhile, recording the longest wait between two malloc/free pairs.
    let pairs = Arc::new(AtomicU64::new(0));
    let worker = common::spawn_churn(Arc::clone(&a), Arc::clone(&stop), Arc::clone(&pairs));

    thread::sleep(Duration::from_millis(200)); // the idle sockets are connected
    let started = Instant::now();
    let mut latencies = Vec::new();
    for _ in 0..SCRAPES {
        let (took, answer) = scrape(addr);
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.contains("stepalloc_allocations_total{device=\"0\"}"), "{answer}");
        latencies.push(took);
        thread::sleep(ATTACK / SCRAPES as u32);
    }
    let attack_time = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for t in idle {
        t.join().expect("idle client");
    }
    let max_gap = worker.join().expect("worker");
    latencies.sort();
    let median = latencies[SCRAPES / 2];
    let worst = latencies[SCRAPES - 1];
    let reconnected = reconnects.load(Ordering::Relaxed);
    println!(
        "{SCRAPES} scrapes over {attack_time:?} against {IDLE_SOCKETS} idle sockets ({reconnected} closed and \
         reopened): median {median:?}, worst {worst:?}; {} malloc/free pairs, longest gap {max_gap:?}",
        pairs.load(Ordering::Relaxed)
    );
    assert!(reconnected >= IDLE_SOCKETS as u64, "the idle sockets were closed at the header timeout and came back");
    assert!(median < Duration::from_millis(100), "median scrape {median:?}: {latencies:?}");
    assert!(worst < Duration::from_secs(1), "worst scrape {worst:?}: {latencies:?}");
    assert!(max_gap < Duration::from_millis(500), "malloc/free stalled for {max_gap:?}");
    server.shutdown();
}

/// Run as a child process by the test below: serves on all interfaces and exits.
#[test]
fn child_serves_on_all_interfaces() {
    if std::env::var_os("STEPALLOC_TEST_CHILD").is_none() {
        return;
    }
    let a = Arc::new(Allocator::new(Config::parse("backend:sim").expect("config")).expect("allocator"));
    let server = metrics::serve(a, "0.0.0.0:0").expect("serve");
    server.shutdown();
}

#[test]
fn binding_beyond_loopback_is_logged() {
    let exe = std::env::current_exe().expect("test binary");
    let output = std::process::Command::new(exe)
        .args(["--exact", "child_serves_on_all_interfaces", "--nocapture"])
        .env("STEPALLOC_TEST_CHILD", "1")
        .output()
        .expect("run the child");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("metrics endpoint listening on 0.0.0.0:") && stderr.contains("not loopback"), "{stderr}");
}

#[test]
fn connections_beyond_the_cap_wait_for_a_free_slot() {
    let a = Arc::new(Allocator::new(Config::parse("backend:sim").expect("config")).expect("allocator"));
    let limits = metrics::Limits {
        max_connections: 4,
        request_timeout: Duration::from_millis(400),
        ..metrics::Limits::default()
    };
    let server = metrics::serve_with(a, "127.0.0.1:0", limits).expect("serve");
    let idle: Vec<TcpStream> =
        (0..4).map(|_| TcpStream::connect_timeout(&server.addr, Duration::from_secs(5)).expect("connect")).collect();
    thread::sleep(Duration::from_millis(100)); // the four are accepted and hold every slot
    let (took, answer) = scrape(server.addr);
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    // Served once the idle ones were closed at their header timeout, not before.
    assert!(took >= Duration::from_millis(200), "served beyond the cap after {took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    drop(idle);
    server.shutdown();
}
