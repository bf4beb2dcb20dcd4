//! Prometheus metrics over the allocator's statistics, and the HTTP endpoint that serves them.
//! Layer: above `allocator`; malloc and free never reach this module.
//!
//! - [`collector`]: a `prometheus` `Collector` in a registry of our own, reading each device's
//!   statistics when scraped. [`METRICS`] lists every metric with its HELP text.
//! - [`http`]: `/metrics` on one background thread (hyper on a current-thread runtime confined
//!   to it, connections served concurrently), started only on request: by [`serve`] (the C
//!   ABI's `stepalloc_metrics_serve`) or the `metrics_addr` configuration key when the
//!   process-wide allocator is created.
//!
//! Addresses: `host:port`, `:port` or `port`; the empty string means `127.0.0.1:9835`
//! ([`DEFAULT_HOST`], [`DEFAULT_PORT`]). A host name must resolve to loopback; serving beyond
//! this machine takes an IP address written out (`0.0.0.0:9835`), and is logged on stderr. Under torchrun (`LOCAL_RANK` set) each rank listens on
//! `port + LOCAL_RANK`, so the ranks of one node do not collide; port 0 (any free port) is left
//! as is. Under torchrun every sample also carries a `rank` label (`RANK`, else `LOCAL_RANK`).

pub mod collector;
pub mod http;

pub use collector::{Kind, MetricSpec, FREE_BLOCK_RANGE_LABELS, METRICS};
pub use http::{respond_to_bytes, Limits, MetricsServer, CONTENT_TYPE};

use crate::allocator::Allocator;
use crate::error::{Error, Result};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::{Arc, OnceLock};

/// Port of the endpoint when none is given (under torchrun: plus `LOCAL_RANK`).
pub const DEFAULT_PORT: u16 = 9835;
/// Host of the endpoint when none is given: loopback only.
pub const DEFAULT_HOST: &str = "127.0.0.1";

/// The allocator's metrics, all devices, in the Prometheus text exposition format 0.0.4.
pub fn render(allocator: &Allocator) -> String {
    let rendered = collector::StepallocCollector::taken(collector::read_devices(allocator))
        .and_then(|c| collector::registry(c, torchrun_rank().as_deref()))
        .and_then(|r| collector::encode(&r));
    rendered.unwrap_or_else(|e| format!("# stepalloc: metrics could not be rendered: {e}\n"))
}

/// Starts serving `/metrics` for `allocator` on `addr` (see the module docs for the forms and
/// the torchrun port offset) on one background thread. Returns once listening; the server's
/// `addr` holds the port actually bound.
pub fn serve(allocator: Arc<Allocator>, addr: &str) -> Result<MetricsServer> {
    serve_with(allocator, addr, Limits::default())
}

/// [`serve`] with explicit bounds on what one client may cost.
pub fn serve_with(allocator: Arc<Allocator>, addr: &str, limits: Limits) -> Result<MetricsServer> {
    let socket = resolve_addr(addr, torchrun_local_rank())?;
    let unavailable = |e: String| Error::Unavailable(format!("metrics endpoint: {e}"));
    let collector = collector::StepallocCollector::live(allocator).map_err(|e| unavailable(e.to_string()))?;
    let registry =
        collector::registry(collector, torchrun_rank().as_deref()).map_err(|e| unavailable(e.to_string()))?;
    let render: http::RenderFn = Box::new(move || {
        collector::encode(&registry).unwrap_or_else(|e| format!("# stepalloc: metrics could not be rendered: {e}\n"))
    });
    http::start(socket, limits, render).map_err(|e| unavailable(format!("cannot listen on {socket}: {e}")))
}

/// Turns an address as configured into the socket address to bind, adding `local_rank` to a
/// non-zero port.
pub fn resolve_addr(addr: &str, local_rank: Option<u16>) -> Result<SocketAddr> {
    parse_addr(addr, local_rank).map_err(|why| {
        Error::InvalidArgument(format!(
            "metrics address `{addr}`: {why}; expected host:port, :port or port (default {DEFAULT_HOST}:{DEFAULT_PORT})"
        ))
    })
}

/// [`resolve_addr`]'s work, with the reason for a refusal as plain text.
///
/// Serving beyond this machine must be an explicit choice: a host name is accepted only where
/// it resolves to a loopback address, and any other address must be written as an IP address
/// (`0.0.0.0:9835`, `10.1.2.3:9835`); binding one is logged on stderr.
pub(crate) fn parse_addr(addr: &str, local_rank: Option<u16>) -> std::result::Result<SocketAddr, String> {
    let addr = addr.trim();
    let (host, port) = if addr.is_empty() {
        (DEFAULT_HOST, DEFAULT_PORT.to_string())
    } else if let Some((host, port)) = addr.rsplit_once(':').filter(|(h, _)| !h.ends_with(':')) {
        (if host.is_empty() { DEFAULT_HOST } else { host }, port.to_string())
    } else {
        (DEFAULT_HOST, addr.to_string())
    };
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let base: u16 = port.parse().map_err(|_| format!("the port `{port}` is not a number from 0 to 65535"))?;
    let port = match (base, local_rank) {
        (0, _) | (_, None) => base,
        (base, Some(rank)) => {
            base.checked_add(rank).ok_or_else(|| format!("port {base} + LOCAL_RANK {rank} exceeds 65535"))?
        }
    };
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    let found: Vec<SocketAddr> =
        (host, port).to_socket_addrs().map_err(|e| format!("cannot resolve the host `{host}` ({e})"))?.collect();
    match found.iter().find(|a| a.ip().is_loopback()) {
        Some(loopback) => Ok(*loopback),
        None if found.is_empty() => Err(format!("the host `{host}` resolves to no address")),
        None => Err(format!(
            "the host `{host}` resolves to {}, not to loopback; to serve beyond this machine, write \
             the IP address to bind (e.g. 0.0.0.0:{port})",
            found.iter().map(|a| a.ip().to_string()).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// `LOCAL_RANK` when running under torchrun.
pub fn torchrun_local_rank() -> Option<u16> {
    std::env::var("LOCAL_RANK").ok()?.trim().parse().ok()
}

/// The `rank` label under torchrun: `RANK`, else `LOCAL_RANK`; `None` outside torchrun.
pub fn torchrun_rank() -> Option<String> {
    rank_label(std::env::var("RANK").ok().as_deref(), std::env::var("LOCAL_RANK").ok().as_deref())
}

/// The rank label from the values of `RANK` and `LOCAL_RANK` (numbers only).
pub fn rank_label(rank: Option<&str>, local_rank: Option<&str>) -> Option<String> {
    let number = |v: Option<&str>| v.and_then(|v| v.trim().parse::<u32>().ok());
    number(rank).or_else(|| number(local_rank)).map(|r| r.to_string())
}

static GLOBAL_SERVER_ADDR: OnceLock<SocketAddr> = OnceLock::new();

/// Starts the endpoint of the process-wide allocator when `metrics_addr` is configured.
/// Called once, when that allocator is created; a failure is reported on stderr and does not
/// stop allocation.
pub(crate) fn start_for_global(allocator: &Arc<Allocator>) {
    let Some(addr) = allocator.config().metrics_addr.as_deref() else {
        return;
    };
    match serve(Arc::clone(allocator), addr) {
        // Dropping the handle leaves the endpoint running for the life of the process.
        Ok(server) => {
            let _ = GLOBAL_SERVER_ADDR.set(server.addr);
        }
        Err(e) => eprintln!("stepalloc: metrics_addr `{addr}`: endpoint not started ({e}); allocation goes on"),
    }
}

/// Where the process-wide allocator's endpoint listens, if `metrics_addr` started one.
pub fn global_server_addr() -> Option<SocketAddr> {
    GLOBAL_SERVER_ADDR.get().copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    #[test]
    fn address_forms() {
        assert_eq!(resolve_addr("", None).expect("ok"), addr("127.0.0.1:9835"));
        assert_eq!(resolve_addr("9000", None).expect("ok"), addr("127.0.0.1:9000"));
        assert_eq!(resolve_addr(":9000", None).expect("ok"), addr("127.0.0.1:9000"));
        assert_eq!(resolve_addr("0.0.0.0:9000", None).expect("ok"), addr("0.0.0.0:9000"));
        assert_eq!(resolve_addr("[::1]:9000", None).expect("ok"), addr("[::1]:9000"));
        assert_eq!(resolve_addr("localhost:9000", None).expect("ok").port(), 9000);
        for bad in ["127.0.0.1:http", "127.0.0.1:70000", "nowhere", "::1"] {
            assert!(matches!(resolve_addr(bad, None), Err(Error::InvalidArgument(_))), "{bad}");
        }
    }

    #[test]
    fn torchrun_offsets_the_port_by_local_rank() {
        assert_eq!(resolve_addr("", Some(3)).expect("ok"), addr("127.0.0.1:9838"));
        assert_eq!(resolve_addr("127.0.0.1:9000", Some(1)).expect("ok"), addr("127.0.0.1:9001"));
        assert_eq!(resolve_addr("127.0.0.1:0", Some(5)).expect("ok"), addr("127.0.0.1:0"));
        assert!(resolve_addr("127.0.0.1:65535", Some(1)).is_err());
    }

    #[test]
    fn rank_label_prefers_rank() {
        assert_eq!(rank_label(Some("12"), Some("4")).as_deref(), Some("12"));
        assert_eq!(rank_label(None, Some("4")).as_deref(), Some("4"));
        assert_eq!(rank_label(Some("x"), None), None);
        assert_eq!(rank_label(None, None), None);
    }
}
