//! Fuzz target: arbitrary bytes as one client's request to the metrics endpoint, through the
//! endpoint's real request path (hyper with the endpoint's settings, then its routing), without
//! a socket. No input may panic, hang or grow memory: the answer is nothing (the client's
//! request never completed) or exactly one HTTP/1 response (HTTP/1.0 to an HTTP/1.0 request,
//! as hyper answers in the client's version), and it is small.
//!
//! cargo fuzz run http_request

#![no_main]

use libfuzzer_sys::fuzz_target;
use std::time::Duration;
use stepalloc::metrics::{respond_to_bytes, Limits};

fuzz_target!(|data: &[u8]| {
    // Short timeouts: an input that stops mid-request is closed at once (the client side
    // ends after `data`), and nothing may wait longer than these.
    let limits = Limits {
        request_timeout: Duration::from_millis(100),
        write_timeout: Duration::from_millis(100),
        ..Limits::default()
    };
    let page = || "# HELP stepalloc_up 1\n# TYPE stepalloc_up gauge\nstepalloc_up 1\n".to_string();
    let answer = respond_to_bytes(data, limits, &page);
    let http1 = answer.starts_with(b"HTTP/1.1 ") || answer.starts_with(b"HTTP/1.0 ");
    assert!(answer.is_empty() || http1, "{:?}", String::from_utf8_lossy(&answer));
    assert!(answer.len() < 4096, "answer of {} bytes", answer.len());
});
