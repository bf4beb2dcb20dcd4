//! The `/metrics` endpoint over real loopback sockets: `promtool check metrics` accepts what it
//! serves, and its HTTP behaviour (content type, HEAD, 404, 405, 400, 431, header timeout, shutdown).
//!
//! promtool comes from Debian's `prometheus` package. Without it the promtool test is skipped
//! with a printed reason, unless the environment variable `CI` is set: then it fails.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stepalloc::metrics::{self, Limits, CONTENT_TYPE};
use stepalloc::{Allocator, Config, Stream};

const MIB: u64 = 1 << 20;

struct Response {
    status: u16,
    headers: String,
    body: String,
}

/// Sends `request` raw and reads the answer until the server closes.
fn exchange(addr: SocketAddr, request: &[u8]) -> Response {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s.write_all(request).expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read answer");
    let text = String::from_utf8(raw).expect("utf-8 answer");
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no header end in {text:?}"));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("status in {head:?}"));
    Response { status, headers: head.to_string(), body: body.to_string() }
}

fn get(addr: SocketAddr, path: &str) -> Response {
    exchange(addr, format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
}

fn allocator_with_work() -> Arc<Allocator> {
    let config = Config::parse("backend:sim,sim_devices:2,sim_capacity_mb:2048,sim_cost_model:True,phase_trim:True")
        .expect("config");
    let a = Arc::new(Allocator::new(config).expect("allocator"));
    let s = Stream::DEFAULT;
    for phase in ["rollout", "train", "rollout"] {
        a.step_begin(phase).expect("step");
        let ptrs: Vec<u64> = (1..40).map(|i| a.malloc(0, i * 300_000, s).expect("malloc")).collect();
        for p in ptrs.iter().step_by(3) {
            a.free(0, *p, 0).expect("free");
        }
        a.step_end().expect("step");
    }
    a.malloc(1, 3 * MIB, s).expect("malloc");
    a
}

fn found(program: &str) -> bool {
    Command::new(program).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok()
}

/// `Some(())` when `program` can run; `None` (skip) when it is absent outside CI; panics in CI.
fn require(program: &str) -> Option<()> {
    if found(program) {
        return Some(());
    }
    if std::env::var_os("CI").is_some() {
        panic!("`{program}` is not installed; CI must install Debian's `prometheus` package");
    }
    eprintln!("SKIPPED: `{program}` not found (apt-get install prometheus); with CI set this test fails instead");
    None
}

#[test]
fn promtool_check_metrics_passes_on_endpoint_output() {
    let Some(()) = require("promtool") else { return };
    let a = allocator_with_work();
    let server = metrics::serve(Arc::clone(&a), "127.0.0.1:0").expect("serve");
    let r = get(server.addr, "/metrics");
    assert_eq!(r.status, 200);
    assert!(r.headers.contains(&format!("Content-Type: {CONTENT_TYPE}")), "{}", r.headers);
    assert!(r.body.contains("# TYPE stepalloc_device_alloc_duration_seconds histogram"));

    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child.stdin.take().expect("stdin").write_all(r.body.as_bytes()).expect("feed promtool");
    let out = child.wait_with_output().expect("promtool output");
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool check metrics failed:\n{report}");
    assert!(report.trim().is_empty(), "promtool reported problems:\n{report}");

    // And the lint really runs: a counter without `_total` is refused.
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run promtool");
    let bad = "# HELP stepalloc_oops A counter.\n# TYPE stepalloc_oops counter\nstepalloc_oops 1\n";
    child.stdin.take().expect("stdin").write_all(bad.as_bytes()).expect("feed promtool");
    assert!(!child.wait().expect("promtool").success(), "promtool accepts a counter without _total");
    server.shutdown();
}

#[test]
fn serves_the_same_text_as_render_and_follows_the_allocator() {
    let a = allocator_with_work();
    let server = metrics::serve(Arc::clone(&a), "127.0.0.1:0").expect("serve");
    assert_eq!(get(server.addr, "/metrics").body, metrics::render(&a));
    let before = a.stats(1).expect("stats").heap.num_mallocs;
    a.malloc(1, 1000, Stream::DEFAULT).expect("malloc");
    let body = get(server.addr, "/metrics?x=y").body;
    assert!(body.contains(&format!("stepalloc_allocations_total{{device=\"1\"}} {}\n", before + 1)), "{body}");
    server.shutdown();
}

#[test]
fn http_edges() {
    let a = allocator_with_work();
    let limits = Limits { request_timeout: Duration::from_millis(300), ..Limits::default() };
    let server = metrics::serve_with(Arc::clone(&a), "127.0.0.1:0", limits).expect("serve");
    let addr = server.addr;

    let head = exchange(addr, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty(), "HEAD has no body");
    let length: usize = head
        .headers
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .and_then(|v| v.parse().ok())
        .expect("content length");
    assert_eq!(length, metrics::render(&a).len());

    assert_eq!(exchange(addr, b"GET /metrics HTTP/1.0\r\n\r\n").status, 200);
    assert_eq!(get(addr, "/").status, 404);
    assert_eq!(get(addr, "/metrics/../etc/passwd").status, 404);
    let post = exchange(addr, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    assert_eq!(post.status, 405);
    assert!(post.headers.contains("Allow: GET, HEAD"));
    assert_eq!(exchange(addr, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n").status, 400);
    assert_eq!(exchange(addr, b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n").status, 400);

    // Oversized: one endless header line, and too many headers.
    let mut big = b"GET /metrics HTTP/1.1\r\nX-Big: ".to_vec();
    big.resize(big.len() + 64 * 1024, b'a');
    assert_eq!(exchange(addr, &big).status, 431);
    let many: String = (0..100).map(|i| format!("X-{i}: v\r\n")).collect();
    assert_eq!(exchange(addr, format!("GET /metrics HTTP/1.1\r\n{many}\r\n").as_bytes()).status, 431);

    // A client that never finishes its request is closed, unanswered, at the request timeout.
    let started = Instant::now();
    let mut slow = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    slow.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    slow.write_all(b"GET /metr").expect("send");
    let mut raw = Vec::new();
    slow.read_to_end(&mut raw).expect("closed by the server");
    assert!(raw.is_empty(), "{raw:?}");
    assert!(started.elapsed() >= Duration::from_millis(250), "{:?}", started.elapsed());

    // A request that arrives in pieces within the timeout is served.
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s.write_all(b"GET /met").expect("send");
    std::thread::sleep(Duration::from_millis(50));
    s.write_all(b"rics HTTP/1.1\r\nHost: x\r\n\r\n").expect("send");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read");
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");

    // After all that, it still serves.
    assert_eq!(get(addr, "/metrics").status, 200);

    server.shutdown();
    assert!(TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err(), "the port is closed after shutdown");
}

#[test]
fn bind_failure_is_an_error_that_names_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let a = allocator_with_work();
    let e = metrics::serve(a, &addr).expect_err("address in use");
    assert!(e.to_string().contains(&addr), "{e}");
}
