"""Snapshots: the pickle loads and has the structure PyTorch's memory viewer reads."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import stepalloc
from conftest import MIB, torch_available

SEGMENT_KEYS = {"device", "address", "total_size", "stream", "segment_type", "allocated_size", "active_size", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state"}
BLOCK_STATES = {"active_allocated", "active_pending_free", "inactive"}
TRACE_KEYS = {"action", "addr", "size", "stream", "time_us", "frames"}
TRACE_ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom", "snapshot"}


@pytest.fixture()
def snapshot_file(tmp_path: Path) -> Path:
    """A snapshot taken with live blocks, a freed block and two steps recorded."""
    with stepalloc.step("rollout"):
        kept = [stepalloc.raw_alloc(s, device=0) for s in (512, 3 * MIB, 3 * MIB)]
        freed = stepalloc.raw_alloc(2 * MIB, device=0)
        stepalloc.raw_free(freed, 2 * MIB, device=0)
    with stepalloc.step("train"), pytest.raises(MemoryError):
        stepalloc.raw_alloc(8 << 30, device=0)  # an OOM event in the trace
    try:
        path = Path(stepalloc.dump_snapshot(tmp_path / "snap.pickle"))
    finally:
        for p, s in zip(kept, (512, 3 * MIB, 3 * MIB)):
            stepalloc.raw_free(p, s, device=0)
    return path


def test_snapshot_pickle_structure(snapshot_file: Path) -> None:
    with open(snapshot_file, "rb") as f:
        snap = pickle.load(f)
    assert isinstance(snap, dict)
    assert {"segments", "device_traces"} <= set(snap)
    segments = snap["segments"]
    assert isinstance(segments, list) and segments
    for seg in segments:
        assert set(seg) >= SEGMENT_KEYS, set(seg)
        assert isinstance(seg["address"], int) and isinstance(seg["total_size"], int)
        assert seg["segment_type"] in ("small", "large")
        blocks = seg["blocks"]
        assert isinstance(blocks, list) and blocks
        assert sum(b["size"] for b in blocks) == seg["total_size"], "blocks tile their segment"
        address = seg["address"]
        for b in blocks:
            assert set(b) >= BLOCK_KEYS and b["state"] in BLOCK_STATES
            assert b["address"] == address, "blocks are in address order, without gaps"
            address += b["size"]
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        assert seg["allocated_size"] == allocated
    live = [b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
    assert {b["requested_size"] for b in live} >= {512, 3 * MIB}
    traces = snap["device_traces"]
    assert isinstance(traces, list) and len(traces) == stepalloc.device_count()
    assert all(isinstance(t, list) for t in traces)
    events = traces[0]
    assert events, "trace_entries is configured, so device 0 has a trace"
    for e in events:
        assert set(e) >= TRACE_KEYS and e["action"] in TRACE_ACTIONS
        assert isinstance(e["frames"], list)
    actions = {e["action"] for e in events}
    assert {"alloc", "free_requested", "segment_alloc", "oom"} <= actions
    notes = snap["external_annotations"]
    stages = [(n["name"], n["stage"]) for n in notes]
    assert ("rollout", "START") in stages and ("rollout", "END") in stages and ("train", "START") in stages


def test_memory_snapshot_is_the_same_structure() -> None:
    snap = stepalloc.memory_snapshot()
    assert set(snap) >= {"segments", "device_traces", "external_annotations", "allocator_settings"}


def test_trace_jsonl_has_steps() -> None:
    with stepalloc.step("rollout"):
        p = stepalloc.raw_alloc(MIB)
        stepalloc.raw_free(p, MIB)
    text = stepalloc.trace_jsonl()
    assert '"op":"step_begin"' in text.replace(" ", "") and '"op":"alloc"' in text.replace(" ", "")


needs_torch = pytest.mark.skipif(not torch_available(), reason="torch is not installed: PyTorch's viewer tools not run")


def _load(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)


@needs_torch
def test_pytorchs_segsum_reads_the_segments(snapshot_file: Path) -> None:
    from torch.cuda import _memory_viz

    summary = _memory_viz.segsum(_load(snapshot_file))  # asserts that blocks add up to each segment
    assert "allocated" in summary


@needs_torch
def test_pytorchs_viewer_page_is_built(snapshot_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "viz.html"
    subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(snapshot_file), "-o", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert out.stat().st_size > 1000


@needs_torch
def test_pytorchs_trace_reads_the_device_traces(snapshot_file: Path) -> None:
    from torch.cuda import _memory_viz

    snap = _load(snapshot_file)
    snap["device_traces"] = [[e for e in t if e["action"] != "oom"] for t in snap["device_traces"]]
    assert "entries" in _memory_viz.trace(snap)


@needs_torch
def test_pytorchs_trace_reads_an_oom_entry(snapshot_file: Path) -> None:
    from torch.cuda import _memory_viz

    snap = _load(snapshot_file)
    assert any(e["action"] == "oom" for e in snap["device_traces"][0])
    _memory_viz.trace(snap)
