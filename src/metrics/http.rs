//! The `/metrics` endpoint: hyper's HTTP/1 server on one background thread, which runs a
//! current-thread tokio runtime of its own (no thread pool; nothing of it outside this thread).
//! Layer: beside the collector; it touches the allocator only through a scrape.
//!
//! Invariants that bound it:
//! - one thread; connections are served concurrently on it, so an idle or slow client never
//!   delays a scrape; at most `Limits::max_connections` at a time (further ones wait in the
//!   kernel's listen backlog until one ends);
//! - a request's head must arrive within `Limits::request_timeout` (hyper's header read
//!   timeout; a connection that sends nothing, or too little, is closed then), and fit in
//!   `Limits::max_request_bytes` and `Limits::max_headers` (else hyper answers 431; garbage
//!   gets 400);
//! - a connection lives at most `request_timeout + write_timeout` in all: a client that does
//!   not read its answer loses it;
//! - only `GET` and `HEAD` (else 405), only `/metrics` (else 404), one request per connection;
//! - when a connection ends, at most 64 KiB / 50 ms of what the client still sends is drained
//!   so that closing does not reset the connection before the client reads the answer;
//! - the allocator's device locks are taken only while the collector copies statistics, never
//!   while a client is read from or written to.

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_LENGTH, CONTENT_TYPE as CONTENT_TYPE_HEADER};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Semaphore};

/// The content type of the Prometheus text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// hyper's smallest read buffer; a smaller `max_request_bytes` is raised to it.
const MIN_REQUEST_BYTES: usize = 8192;
/// After a connection ends: what of the client's further input is read and dropped, at most.
const DRAIN_BYTES: usize = 64 * 1024;
const DRAIN_TIME: Duration = Duration::from_millis(50);

/// Bounds on what one client may cost the server.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest request head (request line and headers) accepted, in bytes (at least 8192).
    pub max_request_bytes: usize,
    /// Most headers accepted in a request.
    pub max_headers: usize,
    /// Time a client has to send its whole request head after the connection is accepted.
    pub request_timeout: Duration,
    /// Time the response may take to write.
    pub write_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_request_bytes: MIN_REQUEST_BYTES,
            max_headers: 32,
            request_timeout: Duration::from_secs(1),
            write_timeout: Duration::from_secs(2),
            max_connections: 64,
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
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Stops the endpoint: open connections are closed, and the port is closed when this
    /// returns.
    pub fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Binds `addr` and serves `render()` at `/metrics` on one new thread. Returns once listening.
/// An address other than loopback is logged on stderr: the endpoint is then reachable from
/// other machines.
pub fn start(addr: SocketAddr, limits: Limits, render: RenderFn) -> io::Result<MetricsServer> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    // Built here so that a failure is returned to the caller; it runs on the thread below only.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build()?;
    let (stop, stopped) = oneshot::channel();
    let thread = std::thread::Builder::new()
        .name("stepalloc-http".into()) // <= 15 bytes: the kernel's thread name limit
        .spawn(move || {
            // Connections are local tasks: the render function need not be shared across threads.
            let tasks = tokio::task::LocalSet::new();
            tasks.block_on(&runtime, accept_loop(listener, limits, render, stopped));
            // Dropping the runtime here drops every connection still open.
        })?;
    if !addr.ip().is_loopback() {
        eprintln!(
            "stepalloc: metrics endpoint listening on {addr}, which is not loopback: other machines \
             can read it (configured explicitly)"
        );
    }
    Ok(MetricsServer { addr, stop: Some(stop), thread: Some(thread) })
}

async fn accept_loop(
    listener: std::net::TcpListener,
    limits: Limits,
    render: RenderFn,
    stopped: oneshot::Receiver<()>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("stepalloc: metrics endpoint stopped: {e}");
            return;
        }
    };
    let render = Rc::new(render);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Only an explicit stop ends the loop; a dropped handle leaves the endpoint running.
    let stop = async {
        if stopped.await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::pin!(stop);
    loop {
        let slot = tokio::select! {
            _ = &mut stop => return,
            slot = Arc::clone(&slots).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => return,
            },
        };
        let stream = tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => {
                    // Out of file descriptors or similar: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let render = Rc::clone(&render);
        tokio::task::spawn_local(async move {
            serve_connection(stream, limits, render).await;
            drop(slot);
        });
    }
}

/// The HTTP/1 settings every connection is served with.
fn builder(limits: &Limits) -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.request_timeout)
        .max_buf_size(limits.max_request_bytes.max(MIN_REQUEST_BYTES))
        .max_headers(limits.max_headers)
        .keep_alive(false)
        // A client may shut its side after sending the request and still read the answer.
        .half_close(true)
        .title_case_headers(true);
    builder
}

async fn serve_connection(stream: TcpStream, limits: Limits, render: Rc<RenderFn>) {
    let _ = stream.set_nodelay(true);
    let (io, reclaimed) = Reclaim::new(stream);
    let service = service_fn(move |request: Request<Incoming>| {
        let response = respond(request.method(), request.uri().path(), &**render);
        async move { Ok::<_, Infallible>(response) }
    });
    let connection = builder(&limits).serve_connection(TokioIo::new(io), service);
    // Ends on completion, on a protocol error (after hyper's automatic 400 / 431), on the
    // header timeout, or at the connection's whole-life limit; dropping it closes nothing yet.
    let _ = tokio::time::timeout(limits.request_timeout.saturating_add(limits.write_timeout), connection).await;
    if let Ok(mut stream) = reclaimed.await {
        drain(&mut stream).await;
    }
}

/// Reads and drops what the client still sends, briefly and boundedly: closing a socket with
/// unread input resets the connection, and the client could lose an answer it has not read.
async fn drain(stream: &mut TcpStream) {
    let deadline = tokio::time::Instant::now() + DRAIN_TIME;
    let mut buf = [0u8; 4096];
    let mut drained = 0;
    while drained < DRAIN_BYTES {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => drained += n,
            _ => return,
        }
    }
}

/// The connection's stream as hyper's I/O; when hyper drops it (the connection is over, even
/// after an error), the stream comes back through the channel instead of closing, so that it
/// can be drained first.
struct Reclaim {
    stream: Option<TcpStream>,
    back: Option<oneshot::Sender<TcpStream>>,
}

impl Reclaim {
    fn new(stream: TcpStream) -> (Reclaim, oneshot::Receiver<TcpStream>) {
        let (back, reclaimed) = oneshot::channel();
        (Reclaim { stream: Some(stream), back: Some(back) }, reclaimed)
    }
}

impl Drop for Reclaim {
    fn drop(&mut self) {
        if let (Some(stream), Some(back)) = (self.stream.take(), self.back.take()) {
            let _ = back.send(stream);
        }
    }
}

impl AsyncRead for Reclaim {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().stream.as_mut() {
            Some(stream) => Pin::new(stream).poll_read(cx, buf),
            None => Poll::Ready(Ok(())),
        }
    }
}

impl AsyncWrite for Reclaim {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut().stream.as_mut() {
            Some(stream) => Pin::new(stream).poll_write(cx, buf),
            None => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().stream.as_mut() {
            Some(stream) => Pin::new(stream).poll_flush(cx),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().stream.as_mut() {
            Some(stream) => Pin::new(stream).poll_shutdown(cx),
            None => Poll::Ready(Ok(())),
        }
    }
}

/// What a request asked for, as far as this server cares.
#[derive(Debug, PartialEq)]
enum Outcome {
    Metrics { head: bool },
    Status(StatusCode),
}

fn route(method: &Method, path: &str) -> Outcome {
    let head = match *method {
        Method::GET => false,
        Method::HEAD => true,
        _ => return Outcome::Status(StatusCode::METHOD_NOT_ALLOWED),
    };
    if path == "/metrics" {
        Outcome::Metrics { head }
    } else {
        Outcome::Status(StatusCode::NOT_FOUND)
    }
}

/// The answer to one parsed request (`path` without its query).
fn respond(method: &Method, path: &str, render: &dyn Fn() -> String) -> Response<Full<Bytes>> {
    let (status, body, content_type, allow) = match route(method, path) {
        Outcome::Metrics { head } => {
            let page = render();
            let length = page.len();
            // HEAD: the length the GET body would have, no body.
            let body = if head { Bytes::new() } else { Bytes::from(page) };
            (StatusCode::OK, (body, length), CONTENT_TYPE, false)
        }
        Outcome::Status(status) => {
            let text = format!("{}\n", status.canonical_reason().unwrap_or(""));
            let length = text.len();
            (status, (Bytes::from(text), length), "text/plain; charset=utf-8", status == StatusCode::METHOD_NOT_ALLOWED)
        }
    };
    let (body, length) = body;
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE_HEADER, HeaderValue::from_static(content_type));
    headers.insert(CONTENT_LENGTH, HeaderValue::from(length));
    if allow {
        headers.insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
    }
    response
}

/// Serves one connection whose client sends `request` and then closes its side, exactly as the
/// endpoint would (same HTTP settings, same routing), and returns the bytes answered. For the
/// fuzz target and tests: the whole request path without a socket. Bounded in time (the
/// connection's limits) and in memory (the request head is bounded; `render`'s page is the
/// only body).
pub fn respond_to_bytes(request: &[u8], limits: Limits, render: &dyn Fn() -> String) -> Vec<u8> {
    thread_local! {
        static RUNTIME: Option<tokio::runtime::Runtime> =
            tokio::runtime::Builder::new_current_thread().enable_time().build().ok();
    }
    RUNTIME.with(|runtime| {
        let Some(runtime) = runtime else {
            return Vec::new();
        };
        runtime.block_on(async {
            let (server_io, mut client) = tokio::io::duplex(64 * 1024);
            let service = service_fn(|request: Request<Incoming>| {
                let response = respond(request.method(), request.uri().path(), render);
                async move { Ok::<_, Infallible>(response) }
            });
            let lifetime = limits.request_timeout.saturating_add(limits.write_timeout);
            let server = async {
                let connection = builder(&limits).serve_connection(TokioIo::new(server_io), service);
                let _ = tokio::time::timeout(lifetime, connection).await;
            };
            let client = async {
                let _ = client.write_all(request).await;
                let _ = client.shutdown().await;
                let mut answer = Vec::new();
                let _ = tokio::time::timeout(lifetime, client.read_to_end(&mut answer)).await;
                answer
            };
            tokio::join!(server, client).1
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(route(&Method::GET, "/metrics"), Outcome::Metrics { head: false });
        assert_eq!(route(&Method::HEAD, "/metrics"), Outcome::Metrics { head: true });
        assert_eq!(route(&Method::GET, "/"), Outcome::Status(StatusCode::NOT_FOUND));
        assert_eq!(route(&Method::GET, "/metricsx"), Outcome::Status(StatusCode::NOT_FOUND));
        assert_eq!(route(&Method::POST, "/metrics"), Outcome::Status(StatusCode::METHOD_NOT_ALLOWED));
    }

    #[test]
    fn request_bytes_get_the_endpoints_answers() {
        let limits = Limits { request_timeout: Duration::from_millis(200), ..Limits::default() };
        let page = || "# a page\n".to_string();
        let answer = |request: &[u8]| String::from_utf8_lossy(&respond_to_bytes(request, limits, &page)).to_string();
        let ok = answer(b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with("\r\n\r\n# a page\n"), "{ok}");
        assert!(ok.contains("Content-Type: text/plain; version=0.0.4"), "{ok}");
        // An HTTP/1.0 client is answered in its own version.
        let old = answer(b"HEAD /metrics HTTP/1.0\r\n\r\n");
        assert!(old.starts_with("HTTP/1.0 200 OK\r\n") && old.contains("Content-Length: 9\r\n"), "{old}");
        let head = answer(b"HEAD /metrics HTTP/1.1\r\n\r\n");
        assert!(head.contains("Content-Length: 9\r\n") && head.ends_with("\r\n\r\n"), "{head}");
        assert!(answer(b"GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(answer(b"PUT /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").contains("Allow: GET, HEAD"));
        let garbage = answer(b"\x00\xff garbage\r\n\r\n");
        assert!(garbage.starts_with("HTTP/1.1 400"), "{garbage:?}");
        let mut big = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        big.resize(100_000, b'a');
        assert!(answer(&big).starts_with("HTTP/1.1 431"));
        assert_eq!(answer(b"GET /metr"), "", "an unfinished request gets no answer");
        assert_eq!(answer(b""), "");
    }
}
