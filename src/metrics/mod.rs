//! Prometheus metrics over the allocator's statistics (placeholder until the metrics work lands).
//!
//! Contract: `render(&Allocator) -> String` gives the Prometheus text format;
//! `serve(Arc<Allocator>, addr) -> Result<MetricsServer>` starts the endpoint on one thread.

use crate::allocator::Allocator;
use crate::error::{Error, Result};
use std::net::SocketAddr;
use std::sync::Arc;

/// A running metrics endpoint.
pub struct MetricsServer {
    pub addr: SocketAddr,
}

/// The allocator's metrics in the Prometheus text exposition format.
pub fn render(_allocator: &Allocator) -> String {
    String::new()
}

/// Starts serving `/metrics` on `addr` on one background thread.
pub fn serve(_allocator: Arc<Allocator>, _addr: &str) -> Result<MetricsServer> {
    Err(Error::Unavailable("metrics endpoint not built yet".into()))
}
