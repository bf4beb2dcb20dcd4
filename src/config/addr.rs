//! Addresses of the metrics endpoint: the forms the `metrics_addr` key and
//! `stepalloc_metrics_serve` accept (`host:port`, `:port`, `port`, or empty for
//! [`DEFAULT_HOST`]:[`DEFAULT_PORT`]), the torchrun port offset (`port + LOCAL_RANK`) and the rule
//! that a host name must resolve to loopback. Parsed here, with the configuration, so that a
//! bad address is an error of the configuration; `metrics` binds what this returns.

use crate::error::{Error, Result};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

/// Port of the endpoint when none is given (under torchrun: plus `LOCAL_RANK`).
pub const DEFAULT_PORT: u16 = 9835;
/// Host of the endpoint when none is given: loopback only.
pub const DEFAULT_HOST: &str = "127.0.0.1";

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
}
