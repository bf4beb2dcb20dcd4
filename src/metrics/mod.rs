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
//! Addresses (parsed in `config::addr`, re-exported here): `host:port`, `:port` or `port`; the
//! empty string means `127.0.0.1:9835` ([`DEFAULT_HOST`], [`DEFAULT_PORT`]). A host name must
//! resolve to loopback; serving beyond this machine takes an IP address written out
//! (`0.0.0.0:9835`), and is logged on stderr. Under torchrun (`LOCAL_RANK` set) each rank listens
//! on `port + LOCAL_RANK`, so the ranks of one node do not collide; port 0 (any free port) is
//! left as is. Under torchrun every sample also carries a `rank` label (`RANK`, else
//! `LOCAL_RANK`).

pub mod collector;
pub mod http;

pub use collector::{Kind, MetricSpec, FREE_BLOCK_RANGE_LABELS, METRICS};
pub use http::{respond_to_bytes, Limits, MetricsServer, CONTENT_TYPE};

pub use crate::config::addr::{resolve_addr, torchrun_local_rank, DEFAULT_HOST, DEFAULT_PORT};

use crate::allocator::Allocator;
use crate::error::{Error, Result};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

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

    #[test]
    fn rank_label_prefers_rank() {
        assert_eq!(rank_label(Some("12"), Some("4")).as_deref(), Some("12"));
        assert_eq!(rank_label(None, Some("4")).as_deref(), Some("4"));
        assert_eq!(rank_label(Some("x"), None), None);
        assert_eq!(rank_label(None, None), None);
    }
}
