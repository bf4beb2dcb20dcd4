"""Layer: Prometheus metrics. ``serve_metrics()`` starts the library's own endpoint;
``register_prometheus()`` adds stepalloc's figures to an application's ``prometheus_client``
registry instead, for programs that already serve one.

Invariants:
- One definition of the metrics: the bridge reads the library's exposition text
  (``stepalloc_metrics_text``, the same text the endpoint serves) at scrape time and hands the
  parsed families to ``prometheus_client``; names, types, labels and help are the library's.
- ``prometheus_client`` is imported only by ``register_prometheus`` / ``StepallocCollector``.
- One bridge per registry: the collector describes its families (``describe()``), so
  prometheus_client refuses a second collector reporting the same series, and
  ``register_prometheus`` refuses a registry that already holds one.
- ``serve_metrics`` never creates the allocator before ``install()``: that would fix its
  configuration although nothing was allocated.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

from . import _lib

DEFAULT_PORT = 9835
_served: str | None = None  # the address serve_metrics() started the endpoint on
_register_lock = threading.Lock()  # check-then-register in `register_prometheus`


def serve_metrics(port: int | None = None, host: str = "127.0.0.1") -> str:
    """Starts the library's Prometheus endpoint (``/metrics``) on one background thread.

    ``port=None`` uses the default port, 9835. Under torchrun each rank listens on
    ``port + LOCAL_RANK``. Returns the address served. Only one endpoint per process: a second
    call, or a port that cannot be bound, raises ``StepallocError`` / ``ValueError`` with the
    library's message.
    """
    if port is None:
        port = DEFAULT_PORT
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"port must be an int in 1..65535, got {port!r}")
    address = _lib.c_string(f"{host}:{port}", "serve_metrics: address (host:port)")
    if not _lib.configuration_fixed():
        # The endpoint serves the allocator, and creating it now would fix the configuration
        # before install(conf=...) or the first allocation could choose it.
        raise _lib.StepallocError(
            "serve_metrics: the allocator does not exist yet (install() has not run and nothing is "
            "allocated), and starting the endpoint would create it and fix its configuration. Call "
            "serve_metrics() after install() (or pass install(metrics_port=...)), or after the first "
            "allocation; or configure `metrics_addr`",
            _lib.UNAVAILABLE,
        )
    _lib.check(_lib.lib().stepalloc_metrics_serve(address))
    global _served
    _served = served_address(port, host)
    return _served


def current_address() -> str | None:
    """Where ``serve_metrics()`` (or ``install(metrics_port=...)``) started the endpoint in this
    process, or None (an endpoint started by the ``metrics_addr`` key is not known here)."""
    return _served


def served_address(port: int | None, host: str = "127.0.0.1") -> str:
    """The address the endpoint listens on when asked for ``port``: under torchrun the library
    adds ``LOCAL_RANK``, so the ranks of one node do not collide."""
    if port is None:
        port = DEFAULT_PORT
    local_rank = os.environ.get("LOCAL_RANK", "")
    return f"{host}:{port + int(local_rank)}" if local_rank.isdigit() else f"{host}:{port}"


def metrics_text() -> str:
    """The metrics in the Prometheus text exposition format, as the endpoint serves them."""
    return _lib.read_text(_lib.lib().stepalloc_metrics_text)


class StepallocCollector:
    """A ``prometheus_client`` collector that reports stepalloc's metrics at scrape time.

    Families (gauges, counters, histograms) keep the library's names and labels, e.g.
    ``stepalloc_allocated_bytes{device="0"}``.
    """

    def collect(self) -> Iterator[Any]:
        from prometheus_client.parser import text_string_to_metric_families

        yield from text_string_to_metric_families(metrics_text())

    def describe(self) -> list[Any]:
        """The families ``collect()`` reports (names, types, help), read from the library, so
        that a registry can refuse a second collector reporting the same series. Before the
        allocator exists the library reports no family, and neither does this."""
        return list(self.collect())


def register_prometheus(registry: Any = None) -> StepallocCollector:
    """Registers a ``StepallocCollector`` with ``registry`` (default: prometheus_client's global
    ``REGISTRY``) and returns it (``registry.unregister(collector)`` removes it).

    Raises ``ValueError`` when ``registry`` already holds a ``StepallocCollector``: two would
    report every series twice, which Prometheus rejects."""
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError("register_prometheus needs prometheus_client; `pip install prometheus_client`") from e
    target = registry if registry is not None else prometheus_client.REGISTRY
    # prometheus_client keeps its collectors in `_collector_to_names` (stable for years, but
    # private: without it the check falls back to describe()'s names alone).
    with _register_lock:
        registered = getattr(target, "_collector_to_names", {})
        if any(isinstance(c, StepallocCollector) for c in list(registered)):
            raise ValueError(
                "a stepalloc collector is already registered with this registry; a second one would "
                "report every series twice (unregister the first with registry.unregister(collector))"
            )
        collector = StepallocCollector()
        target.register(collector)
    return collector
