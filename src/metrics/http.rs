//! The `/metrics` endpoint: a small blocking HTTP/1 server on one background thread.
//! Layer: beside the collector; it touches the allocator only through a scrape.
//!
//! Why not a server crate: `tiny_http` (the obvious blocking one) reads header lines without a
//! length limit, sets no socket timeouts and spawns a thread per concurrent connection, so a
//! garbage or slow client grows memory and threads without bound. This server is a loop over
//! `accept` that handles one connection at a time, and `httparse` (hyper's parser) does the
//! parsing. Invariants that bound it:
//! - one thread, one connection at a time; others wait in the kernel's listen backlog;
//! - a request must arrive whole within `Limits::request_timeout` and fit in
//!   `Limits::max_request_bytes` (a fixed buffer), else 408 / 431 and the connection closes;
//! - writing the response is bounded by `Limits::write_timeout`;
//! - only `GET` and `HEAD` (else 405), only `/metrics` (else 404), one request per connection;
//! - after an error answer, at most 64 KiB / 50 ms of what the client still sends is drained so
//!   that closing does not reset the connection before the client reads the answer;
//! - the allocator's device locks are taken only while the collector copies statistics, never
//!   while a client is read from or written to.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The content type of the Prometheus text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Bounds on what one client may cost the server.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest request (request line and headers) accepted, in bytes.
    pub max_request_bytes: usize,
    /// Most headers accepted in a request.
    pub max_headers: usize,
    /// Time a client has to send its whole request after the connection is accepted.
    pub request_timeout: Duration,
    /// Time the response may take to write.
    pub write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_request_bytes: 8192,
            max_headers: 32,
            request_timeout: Duration::from_secs(1),
            write_timeout: Duration::from_secs(2),
        }
    }
}

/// Renders the page served at `/metrics`.
pub type RenderFn = Box<dyn Fn() -> String + Send + 'static>;

/// A running endpoint. Dropping it leaves the endpoint running for the rest of the process
/// (the usual case: it is started once, on request); `shutdown` stops it.
#[derive(Debug)]
pub struct MetricsServer {
    /// The address it listens on (with the port chosen by the system when asked for port 0).
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Stops the endpoint: no connection is accepted afterwards and the port is closed when
    /// this returns.
    pub fn shutdown(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the thread blocked in accept(); if the connection fails, the thread is not in
        // accept (or the socket is gone) and sees the flag anyway.
        let _ = TcpStream::connect_timeout(&wake_address(self.addr), Duration::from_secs(1));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Where to connect to reach a listener on `addr` (an unspecified address means loopback).
fn wake_address(addr: SocketAddr) -> SocketAddr {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, addr.port())
}

/// Binds `addr` and serves `render()` at `/metrics` on one new thread. Returns once listening.
pub fn start(addr: SocketAddr, limits: Limits, render: RenderFn) -> std::io::Result<MetricsServer> {
    let listener = TcpListener::bind(addr)?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let thread_stop = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name("stepalloc-http".into()) // <= 15 bytes: the kernel's thread name limit
        .spawn(move || accept_loop(listener, limits, render, thread_stop))?;
    Ok(MetricsServer { addr, stop, thread: Some(thread) })
}

fn accept_loop(listener: TcpListener, limits: Limits, render: RenderFn, stop: Arc<AtomicBool>) {
    let mut buf = vec![0u8; limits.max_request_bytes.max(64)];
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        match accepted {
            Ok((stream, _)) => handle(stream, &limits, &mut buf, &render),
            // Out of file descriptors or similar: back off instead of spinning.
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// What a request asked for, as far as this server cares.
enum Outcome {
    Metrics { head: bool },
    Status { code: u16, reason: &'static str },
}

fn handle(mut stream: TcpStream, limits: &Limits, buf: &mut [u8], render: &RenderFn) {
    let _ = stream.set_nodelay(true);
    let Some(outcome) = read_request(&mut stream, limits, buf) else {
        return; // the client went away
    };
    let deadline = Instant::now() + limits.write_timeout;
    let failed = matches!(outcome, Outcome::Status { .. });
    let response = match outcome {
        Outcome::Metrics { head } => {
            let body = render();
            let header = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let mut bytes = header.into_bytes();
            if !head {
                bytes.extend_from_slice(body.as_bytes());
            }
            bytes
        }
        Outcome::Status { code, reason } => {
            let allow = if code == 405 { "Allow: GET, HEAD\r\n" } else { "" };
            format!(
                "HTTP/1.1 {code} {reason}\r\n{allow}Content-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reason}\n",
                reason.len() + 1
            )
            .into_bytes()
        }
    };
    write_by(&mut stream, &response, deadline);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    if failed {
        drain(&mut stream, buf);
    }
}

/// After an error response, reads and drops what the client still sends, briefly and boundedly:
/// closing a socket with unread input resets the connection, and the client could lose the
/// response it has not read yet.
fn drain(stream: &mut TcpStream, buf: &mut [u8]) {
    const DRAIN_BYTES: usize = 64 * 1024;
    const DRAIN_TIME: Duration = Duration::from_millis(50);
    let deadline = Instant::now() + DRAIN_TIME;
    let mut drained = 0;
    while drained < DRAIN_BYTES {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => drained += n,
        }
    }
}

/// Reads one request into `buf` and decides the answer; `None` when the client closed or the
/// connection failed before a request arrived.
fn read_request(stream: &mut TcpStream, limits: &Limits, buf: &mut [u8]) -> Option<Outcome> {
    let deadline = Instant::now() + limits.request_timeout;
    let mut len = 0;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Some(Outcome::Status { code: 408, reason: "Request Timeout" });
        }
        if stream.set_read_timeout(Some(left)).is_err() {
            return None;
        }
        match stream.read(&mut buf[len..]) {
            Ok(0) => return None,
            Ok(n) => len += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Some(Outcome::Status { code: 408, reason: "Request Timeout" })
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return None,
        }
        // A few reads per request at most: a fresh header table each time is cheap.
        let mut headers = vec![httparse::EMPTY_HEADER; limits.max_headers];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&buf[..len]) {
            Ok(httparse::Status::Complete(_)) => return Some(route(request.method, request.path)),
            Ok(httparse::Status::Partial) if len == buf.len() => {
                return Some(Outcome::Status { code: 431, reason: "Request Header Fields Too Large" })
            }
            Ok(httparse::Status::Partial) => continue,
            Err(httparse::Error::TooManyHeaders) => {
                return Some(Outcome::Status { code: 431, reason: "Request Header Fields Too Large" })
            }
            Err(_) => return Some(Outcome::Status { code: 400, reason: "Bad Request" }),
        }
    }
}

fn route(method: Option<&str>, path: Option<&str>) -> Outcome {
    let head = match method {
        Some("GET") => false,
        Some("HEAD") => true,
        _ => return Outcome::Status { code: 405, reason: "Method Not Allowed" },
    };
    let path = path.unwrap_or("");
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    if path == "/metrics" {
        Outcome::Metrics { head }
    } else {
        Outcome::Status { code: 404, reason: "Not Found" }
    }
}

/// Writes `bytes`, giving up at `deadline` (a client that does not read loses its answer).
fn write_by(stream: &mut TcpStream, mut bytes: &[u8], deadline: Instant) {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_write_timeout(Some(left)).is_err() {
            return;
        }
        match stream.write(bytes) {
            Ok(0) => return,
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert!(matches!(route(Some("GET"), Some("/metrics")), Outcome::Metrics { head: false }));
        assert!(matches!(route(Some("HEAD"), Some("/metrics?x=1")), Outcome::Metrics { head: true }));
        assert!(matches!(route(Some("GET"), Some("/")), Outcome::Status { code: 404, .. }));
        assert!(matches!(route(Some("GET"), Some("/metricsx")), Outcome::Status { code: 404, .. }));
        assert!(matches!(route(Some("POST"), Some("/metrics")), Outcome::Status { code: 405, .. }));
    }

    #[test]
    fn unspecified_addresses_are_woken_on_loopback() {
        let a: SocketAddr = "0.0.0.0:9835".parse().expect("addr");
        assert_eq!(wake_address(a), "127.0.0.1:9835".parse().expect("addr"));
        let a: SocketAddr = "[::]:1".parse().expect("addr");
        assert_eq!(wake_address(a), "[::1]:1".parse().expect("addr"));
    }
}
