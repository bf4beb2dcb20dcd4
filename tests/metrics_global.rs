//! `metrics_addr`: creating the process-wide allocator starts the endpoint. Its own test
//! binary, since the process-wide allocator is created once per process.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use stepalloc::{configure_global, global, metrics, Stream};

#[test]
fn metrics_addr_starts_the_endpoint_with_the_global_allocator() {
    assert_eq!(metrics::global_server_addr(), None, "nothing listens before first use");
    configure_global("backend:sim,sim_capacity_mb:1024,metrics_addr:127.0.0.1:0").expect("configure");
    let a = global().expect("global allocator");
    let p = a.malloc(0, 4096, Stream::DEFAULT).expect("malloc");
    let addr = metrics::global_server_addr().expect("endpoint started");
    assert!(addr.ip().is_loopback());

    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").expect("send");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read");
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.contains("stepalloc_allocations_total{device=\"0\"} 1\n"), "{answer}");
    assert!(answer.contains("stepalloc_allocated_bytes{device=\"0\",pool=\"small\"} 4096\n"), "{answer}");
    a.free(0, p, 4096).expect("free");
}
