//! End to end with a real Prometheus server on loopback: it scrapes the endpoint every second,
//! and the values read back through its HTTP query API (`/api/v1/query`) are the allocator's.
//!
//! Prometheus comes from Debian's `prometheus` package. Without it the test is skipped with a
//! printed reason, unless the environment variable `CI` is set: then it fails. The server
//! runs in a temporary directory on a free 127.0.0.1 port and is killed at the end, also when
//! the test fails; every wait is bounded.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use stepalloc::{metrics, Allocator, Config, Stream};

const MIB: u64 = 1 << 20;
const WAIT: Duration = Duration::from_secs(30);

/// A Prometheus process and its directory; killed and removed when dropped.
struct Prometheus {
    child: Child,
    dir: PathBuf,
    addr: SocketAddr,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Prometheus {
    fn start(target: SocketAddr) -> Prometheus {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("stepalloc-prometheus-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(dir.join("data")).expect("temp dir");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: stepalloc\n    \
             static_configs:\n      - targets: ['{target}']\n"
        );
        std::fs::write(dir.join("prometheus.yml"), config).expect("config");
        let addr = free_port();
        let log = std::fs::File::create(dir.join("prometheus.log")).expect("log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        Prometheus { child, dir, addr }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// Polls `f` every 200 ms until it gives a value; panics with Prometheus's log after `WAIT`.
    fn wait_for<T>(&mut self, what: &str, mut f: impl FnMut(&Prometheus) -> Option<T>) -> T {
        let start = Instant::now();
        loop {
            if let Some(v) = f(self) {
                return v;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("prometheus exited ({status}) while waiting for {what}; log:\n{}", self.log());
            }
            if start.elapsed() > WAIT {
                panic!("no {what} within {WAIT:?}; prometheus log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The value of the single series `query` returns, if it returns one.
    fn query(&self, query: &str) -> Option<f64> {
        let (status, body) = http_get(self.addr, &format!("/api/v1/query?query={}", percent_encode(query)))?;
        if status != 200 {
            return None;
        }
        let json: serde_json::Value = serde_json::from_str(&body).ok()?;
        let result = json["data"]["result"].as_array()?;
        match result.as_slice() {
            [one] => one["value"][1].as_str()?.parse().ok(),
            _ => None,
        }
    }
}

fn free_port() -> SocketAddr {
    // Bound and closed again: the port is free for the child (a small race, on loopback only).
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr")
}

/// HTTP/1.0 GET (no chunked encoding in the answer); `None` on a connection failure.
fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[test]
fn prometheus_scrapes_the_endpoint_and_reads_back_the_allocator_figures() {
    if Command::new("prometheus").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_err() {
        if std::env::var_os("CI").is_some() {
            panic!("`prometheus` is not installed; CI must install Debian's `prometheus` package");
        }
        eprintln!("SKIPPED: `prometheus` not found (apt-get install prometheus); with CI set this test fails instead");
        return;
    }
    let config = Config::parse("backend:sim,sim_capacity_mb:4096,sim_cost_model:True").expect("config");
    let a = Arc::new(Allocator::new(config).expect("allocator"));
    let s = Stream::DEFAULT;
    a.step_begin("rollout").expect("step");
    let kv: Vec<u64> = (0..6).map(|i| a.malloc(0, (24 + i) * MIB, s).expect("malloc")).collect();
    for p in &kv[..4] {
        a.free(0, *p, 0).expect("free");
    }
    a.step_end().expect("step");
    a.step_begin("train").expect("step");
    let _keep = a.malloc(0, 300 * MIB + 12345, s).expect("malloc");
    a.step_end().expect("step");

    let server = metrics::serve(Arc::clone(&a), "127.0.0.1:0").expect("serve");
    let mut prometheus = Prometheus::start(server.addr);
    prometheus.wait_for("readiness", |p| http_get(p.addr, "/-/ready").filter(|(s, _)| *s == 200));
    let up = prometheus.wait_for("a successful scrape", |p| p.query("up{job=\"stepalloc\"}").filter(|&v| v == 1.0));
    assert_eq!(up, 1.0);

    let stats = a.stats(0).expect("stats");
    let h = &stats.heap;
    let expected = [
        ("stepalloc_reserved_bytes{device=\"0\",pool=\"large\"}", h.reserved_bytes.large_pool.current as f64),
        ("stepalloc_allocated_bytes{device=\"0\",pool=\"large\"}", h.allocated_bytes.large_pool.current as f64),
        ("stepalloc_requested_bytes{device=\"0\",pool=\"large\"}", h.requested_bytes.large_pool.current as f64),
        ("stepalloc_allocations_total{device=\"0\"}", h.num_mallocs as f64),
        ("stepalloc_device_allocs_total{device=\"0\"}", h.num_device_alloc as f64),
        ("stepalloc_steps_total{device=\"0\",phase=\"rollout\"}", 1.0),
        ("stepalloc_device_alloc_duration_seconds_count{device=\"0\"}", h.num_device_alloc as f64),
        ("stepalloc_external_fragmentation_ratio{device=\"0\"}", stats.external_fragmentation()),
        ("sum(stepalloc_cached_free_bytes{device=\"0\"})", stats.cached_free as f64),
    ];
    assert!(h.reserved_bytes.large_pool.current > 300 * MIB, "the workload reserved memory");
    for (query, want) in expected {
        let got = prometheus.wait_for(query, |p| p.query(query));
        assert_eq!(got, want, "{query} through Prometheus");
    }

    // Every query of the Grafana dashboard is valid PromQL that Prometheus runs.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/dashboards/stepalloc.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("dashboard")).expect("dashboard JSON");
    let mut checked = 0;
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().map(|t| t.as_slice()).unwrap_or_default() {
            let expr = target["expr"].as_str().expect("expr");
            let concrete = expr
                .replace("$device", ".*")
                .replace("$rank", ".*")
                .replace("$__rate_interval", "1m")
                .replace("$__range", "5m");
            let (status, body) =
                http_get(prometheus.addr, &format!("/api/v1/query?query={}", percent_encode(&concrete)))
                    .expect("query the dashboard expression");
            assert_eq!(status, 200, "dashboard query `{concrete}`: {body}");
            assert!(body.contains("\"status\":\"success\""), "dashboard query `{concrete}`: {body}");
            checked += 1;
        }
    }
    assert!(checked >= 10, "{checked} dashboard queries");
    drop(prometheus); // killed here; also on any panic above
    server.shutdown();
}
