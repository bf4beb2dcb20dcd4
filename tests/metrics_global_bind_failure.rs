//! `metrics_addr` on a port already taken: the process-wide allocator is still created and
//! allocates; the failure is reported on stderr only. Its own test binary, since the
//! process-wide allocator is created once per process.

use stepalloc::{configure_global, global, metrics, Stream};

#[test]
fn a_taken_port_does_not_fail_allocation() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    configure_global(&format!("backend:sim,sim_capacity_mb:1024,metrics_addr:127.0.0.1:{port}")).expect("configure");
    let a = global().expect("the allocator is created although the endpoint is not");
    let p = a.malloc(0, 1 << 20, Stream::DEFAULT).expect("malloc");
    a.free(0, p, 1 << 20).expect("free");
    assert_eq!(metrics::global_server_addr(), None);
}
