"""Snapshots: the pickle loads and has the structure PyTorch's memory viewer reads."""

from __future__ import annotations

import errno
import os
import pickle
import stat
import subprocess
import sys
import threading
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


def _is_snapshot(data: bytes) -> bool:
    return set(pickle.loads(data)) >= {"segments", "device_traces"}


def test_dump_snapshot_replaces_a_regular_file_whole_keeping_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(b"old")
    path.chmod(0o640)
    assert stepalloc.dump_snapshot(path) == str(path)
    assert _is_snapshot(path.read_bytes())
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["snap.pickle"], "a temporary file was left"


def test_dump_snapshot_writes_through_a_symlink(tmp_path: Path) -> None:
    # It once replaced the link with a regular file and left its target as it was.
    real = tmp_path / "real.pickle"
    real.write_bytes(b"old")
    link = tmp_path / "link.pickle"
    link.symlink_to(real)
    stepalloc.dump_snapshot(link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert _is_snapshot(real.read_bytes())


def test_dump_snapshot_writes_into_a_fifo(tmp_path: Path) -> None:
    # It once replaced the FIFO with a regular file; its reader got nothing.
    fifo = tmp_path / "snap.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def reader() -> None:
        with open(fifo, "rb") as f:
            got.append(f.read())

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    stepalloc.dump_snapshot(fifo)
    t.join(timeout=30)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced"
    assert not t.is_alive() and got and _is_snapshot(got[0])


def _full_device(tmp_path: Path) -> Path:
    """A device node like /dev/full (every write: no space left) that the test may lose."""
    node = tmp_path / "full"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 7))
        with open(node, "wb"):
            return node
    except OSError:
        pass
    if os.access("/dev", os.W_OK) or not os.path.exists("/dev/full"):
        # Code under test that replaced device nodes would replace the machine's /dev/full.
        pytest.skip("no device node of the test's own, and /dev/full is not safe to use")
    return Path("/dev/full")


def test_dump_snapshot_to_a_full_device_is_an_error_naming_it(tmp_path: Path) -> None:
    # Run as root it once replaced /dev/full with a regular file and reported success.
    full = _full_device(tmp_path)
    with pytest.raises(OSError) as e:
        stepalloc.dump_snapshot(full)
    assert e.value.errno == errno.ENOSPC and str(full) in str(e.value), e.value
    assert stat.S_ISCHR(os.lstat(full).st_mode), "the device node was replaced"


def test_dump_snapshot_errors_name_the_path_given(tmp_path: Path) -> None:
    missing = tmp_path / "no such dir" / "x.pickle"
    with pytest.raises(FileNotFoundError) as e:
        stepalloc.dump_snapshot(missing)
    assert e.value.filename == str(missing) and ".tmp" not in str(e.value), e.value
    with pytest.raises(IsADirectoryError) as d:
        stepalloc.dump_snapshot(tmp_path)
    assert d.value.filename == str(tmp_path), d.value
    assert tmp_path.is_dir()
