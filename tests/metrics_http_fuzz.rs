//! The endpoint's request path (`metrics::respond_to_bytes`: hyper with the endpoint's settings,
//! then its routing) on generated input, bounded for CI: random bytes, mutated valid
//! requests, and oversized heads. Every answer is nothing or one HTTP/1.1 response; valid
//! requests are answered as the endpoint answers them. The coverage-guided version of this is
//! the cargo-fuzz target `fuzz/fuzz_targets/http_request.rs`.

use proptest::prelude::*;
use std::time::Duration;
use stepalloc::metrics::{respond_to_bytes, Limits};

fn limits() -> Limits {
    Limits {
        request_timeout: Duration::from_millis(100),
        write_timeout: Duration::from_millis(100),
        ..Limits::default()
    }
}

fn page() -> String {
    "stepalloc_up 1\n".to_string()
}

fn check(answer: &[u8]) {
    assert!(answer.is_empty() || answer.starts_with(b"HTTP/1.1 "), "{:?}", String::from_utf8_lossy(answer));
    assert!(answer.len() < 4096, "{} bytes", answer.len());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        check(&respond_to_bytes(&data, limits(), &page));
    }

    #[test]
    fn mutated_requests(flips in proptest::collection::vec((0usize..64, any::<u8>()), 0..6), cut in 0usize..80) {
        let mut request = b"GET /metrics HTTP/1.1\r\nHost: localhost:9835\r\nAccept: */*\r\n\r\n".to_vec();
        for (at, byte) in flips {
            let at = at % request.len();
            request[at] = byte;
        }
        request.truncate(cut.max(1).min(request.len()));
        check(&respond_to_bytes(&request, limits(), &page));
    }

    #[test]
    fn long_heads(name in "[A-Za-z-]{1,20}", len in 0usize..20_000, headers in 0usize..80) {
        let mut request = b"GET /metrics HTTP/1.1\r\n".to_vec();
        for i in 0..headers {
            request.extend_from_slice(format!("X-{i}: v\r\n").as_bytes());
        }
        request.extend_from_slice(format!("{name}: ").as_bytes());
        request.resize(request.len() + len, b'a');
        request.extend_from_slice(b"\r\n\r\n");
        let answer = respond_to_bytes(&request, limits(), &page);
        check(&answer);
        let small = request.len() <= 8192 && headers < 32;
        if small {
            prop_assert!(answer.starts_with(b"HTTP/1.1 200 OK\r\n"), "{:?}", String::from_utf8_lossy(&answer));
        } else if request.len() > 8192 || headers + 1 > 32 {
            prop_assert!(answer.starts_with(b"HTTP/1.1 431"), "{:?}", String::from_utf8_lossy(&answer));
        }
    }
}
