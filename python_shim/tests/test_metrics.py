"""Metrics: the prometheus_client bridge and the library's own endpoint."""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

import pytest

import stepalloc
from conftest import MIB


def pool_sum(registry: Any, name: str, device: str) -> float:
    return sum(registry.get_sample_value(name, {"device": device, "pool": pool}) or 0.0 for pool in ("small", "large"))


def test_bridge_exposes_the_figures() -> None:
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed: the bridge not tested")
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    collector = stepalloc.register_prometheus(registry)
    ptr = stepalloc.raw_alloc(9 * MIB, device=0)
    try:
        with stepalloc.step("rollout"):
            pass
        # Read at scrape time: the values are the allocator's now.
        assert pool_sum(registry, "stepalloc_allocated_bytes", "0") == stepalloc.memory_allocated(0)
        assert pool_sum(registry, "stepalloc_reserved_bytes", "0") == stepalloc.memory_reserved(0)
        assert pool_sum(registry, "stepalloc_allocated_bytes", "0") >= 9 * MIB
        stats = stepalloc.memory_stats(0, include_stepalloc=True)
        assert (
            registry.get_sample_value("stepalloc_steps_total", {"device": "0", "phase": "rollout"})
            == stats["stepalloc.steps.rollout"]
        )
        assert registry.get_sample_value("stepalloc_ooms_total", {"device": "0"}) == stats["num_ooms"]
        ratio = registry.get_sample_value("stepalloc_external_fragmentation_ratio", {"device": "0"})
        assert ratio is not None and 0.0 <= ratio <= 1.0
    finally:
        stepalloc.raw_free(ptr, 9 * MIB, device=0)
    assert pool_sum(registry, "stepalloc_allocated_bytes", "0") == stepalloc.memory_allocated(0)
    text = generate_latest(registry).decode()
    assert "# TYPE stepalloc_allocations_total counter" in text
    assert "# TYPE stepalloc_reserved_bytes gauge" in text
    assert 'stepalloc_reserved_bytes{device="1",pool="large"}' in text  # every device
    registry.unregister(collector)
    assert "stepalloc_" not in generate_latest(registry).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_metrics_endpoint() -> None:
    port = free_port()
    address = stepalloc.serve_metrics(port)
    assert address == f"127.0.0.1:{port}"
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        body = response.read().decode()
    assert 'stepalloc_allocated_bytes{device="0",pool="large"}' in body
    with pytest.raises(stepalloc.StepallocError, match="already serving"):
        stepalloc.serve_metrics(free_port())


def test_serve_metrics_rejects_bad_ports() -> None:
    for bad in (0, 70000, "9835"):
        with pytest.raises(ValueError):
            stepalloc.serve_metrics(bad)  # type: ignore[arg-type]


def test_bridge_registered_twice_is_refused() -> None:
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed: the bridge not tested")
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    collector = stepalloc.register_prometheus(registry)
    try:
        with pytest.raises(ValueError, match="already registered"):
            stepalloc.register_prometheus(registry)
        # describe() names the families, so prometheus_client itself sees the duplicate.
        names = {family.name for family in collector.describe()}
        assert "stepalloc_allocated_bytes" in names
        with pytest.raises(ValueError, match="Duplicated"):
            registry.register(stepalloc.StepallocCollector())
    finally:
        registry.unregister(collector)
    again = stepalloc.register_prometheus(registry)  # after unregister(), registering again works
    registry.unregister(again)


def test_serve_metrics_host_with_nul_is_refused() -> None:
    with pytest.raises(ValueError, match="NUL"):
        stepalloc.serve_metrics(free_port(), host="127.0.0.1\x00junk")
