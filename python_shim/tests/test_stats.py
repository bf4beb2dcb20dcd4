"""torch-compatible statistics on the simulated device."""

from __future__ import annotations

import itertools

import pytest

import stepalloc
from conftest import MIB, check_child, run_python

# The keys torch.cuda.memory_stats() documents (torch 2.15 docstring, "Core statistics",
# event counters, max_split_size / oversize_*, requested_bytes). Written out here from the
# documentation, not derived from stepalloc's output. The docstring's "allocated.{...}" is a
# typo in torch's docs for the key torch actually returns, "allocation.{...}".
_CORE = [
    "allocation",
    "allocated_bytes",
    "segment",
    "reserved_bytes",
    "active",
    "active_bytes",
    "inactive_split",
    "inactive_split_bytes",
    "requested_bytes",
]
_POOLS = ["all", "large_pool", "small_pool"]
_METRICS = ["current", "peak", "allocated", "freed"]
TORCH_DOCUMENTED_KEYS = (
    {f"{c}.{p}.{m}" for c, p, m in itertools.product(_CORE, _POOLS, _METRICS)}
    | {f"oversize_allocations.{m}" for m in _METRICS}
    | {f"oversize_segments.{m}" for m in _METRICS}
    | {
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "num_oom_rejections",
        "max_split_size",
    }
)
# "reserved_bytes_by_private_pools.*" appears in torch only while private pools exist.
NOT_YET_REPORTED: set[str] = set()


def test_memory_stats_keys_are_torchs() -> None:
    stats = stepalloc.memory_stats(0)
    assert set(stats) == TORCH_DOCUMENTED_KEYS - NOT_YET_REPORTED
    assert list(stats) == sorted(stats)  # torch returns an OrderedDict sorted by key
    assert all(isinstance(v, int) for v in stats.values())
    # Counts and bytes are never negative; max_split_size is torch's int64, -1 when unlimited.
    assert all(v >= 0 for k, v in stats.items() if k != "max_split_size")
    assert stats["max_split_size"] == -1


def test_memory_stats_has_num_oom_rejections() -> None:
    assert "num_oom_rejections" in stepalloc.memory_stats(0)


def test_stepalloc_figures_are_separate() -> None:
    full = stepalloc.memory_stats(0, include_stepalloc=True)
    own = stepalloc.stepalloc_stats(0)
    assert {k for k in full if k.startswith("stepalloc.")} == {f"stepalloc.{k}" for k in own}
    for key in ("fragmentation.external", "fragmentation.internal", "fragmentation.step", "steps"):
        assert key in own


def test_allocations_move_the_figures() -> None:
    device = 1  # device 1 is used by this test only
    base = stepalloc.memory_stats(device)
    ptrs = [stepalloc.raw_alloc(3 * MIB, device=device) for _ in range(4)]
    assert len(set(ptrs)) == 4 and all(ptrs)
    stats = stepalloc.memory_stats(device)
    assert stats["allocation.all.current"] == base["allocation.all.current"] + 4
    assert stepalloc.memory_allocated(device) == base["allocated_bytes.all.current"] + 12 * MIB
    assert stats["requested_bytes.all.current"] == base["requested_bytes.all.current"] + 12 * MIB
    assert stepalloc.memory_reserved(device) >= stepalloc.memory_allocated(device)
    assert stats["num_device_alloc"] > base["num_device_alloc"]
    peak = stepalloc.max_memory_allocated(device)
    for p in ptrs:
        stepalloc.raw_free(p, 3 * MIB, device=device)
    assert stepalloc.memory_allocated(device) == base["allocated_bytes.all.current"]
    assert stepalloc.max_memory_allocated(device) == peak
    assert stepalloc.max_memory_reserved(device) >= stepalloc.memory_reserved(device)
    released = stepalloc.stepalloc_stats(device)["released_bytes.empty_cache"]
    cached = stepalloc.memory_reserved(device)
    stepalloc.empty_cache()
    assert stepalloc.memory_reserved(device) == 0, "nothing is live on this device: every segment goes back"
    assert stepalloc.stepalloc_stats(device)["released_bytes.empty_cache"] == released + cached
    stepalloc.reset_peak_memory_stats(device)
    assert stepalloc.max_memory_allocated(device) == stepalloc.memory_allocated(device)
    stepalloc.reset_accumulated_memory_stats(device)
    after = stepalloc.memory_stats(device)
    assert after["allocation.all.allocated"] == 0 and after["num_device_alloc"] == 0


def test_devices_are_separate_and_read_like_torch() -> None:
    p = stepalloc.raw_alloc(5 * MIB, device=0)
    try:
        assert stepalloc.memory_allocated("cuda:0") == stepalloc.memory_allocated(0)
        assert stepalloc.memory_allocated(0) >= 5 * MIB
        assert stepalloc.memory_stats("cuda:1")["allocated_bytes.all.current"] == stepalloc.memory_allocated(1)
    finally:
        stepalloc.raw_free(p, 5 * MIB, device=0)
    with pytest.raises(ValueError):
        stepalloc.memory_stats("cpu")
    with pytest.raises(ValueError, match="device 7"):
        stepalloc.memory_stats(7)


def test_nested_dict() -> None:
    nested = stepalloc.memory_stats_as_nested_dict(0)
    flat = stepalloc.memory_stats(0)
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"]
    assert nested["num_ooms"] == flat["num_ooms"]


def test_memory_summary_is_a_table_of_the_figures() -> None:
    p = stepalloc.raw_alloc(7 * MIB, device=0)
    try:
        text = stepalloc.memory_summary(0)
    finally:
        stepalloc.raw_free(p, 7 * MIB, device=0)
    lines = text.splitlines()
    assert "device ID 0" in lines[1]
    assert len({len(line) for line in lines}) == 1, "every row has the same width"
    for title in ("Allocated memory", "GPU reserved memory", "Allocations", "from large pool", "fragmentation"):
        assert title in text
    row = next(line for line in lines if line.startswith("| Allocated memory"))
    assert row.split("|")[2].strip() == "7168 KiB"  # current usage: the 7 MiB block
    short = stepalloc.memory_summary(0, abbreviated=True)
    assert "from large pool" not in short


def test_reading_statistics_does_not_fix_the_configuration() -> None:
    # Before the first allocation, statistics, snapshots and metrics read zeros and leave the
    # allocator uncreated, so configuring afterwards still works.
    out = check_child(
        run_python(
            """
            import stepalloc
            assert stepalloc.memory_stats(0)["reserved_bytes.all.current"] == 0
            assert stepalloc.memory_snapshot()["segments"] == []
            stepalloc.configure("backend:sim,sim_capacity_mb:1024")
            ptr = stepalloc.raw_alloc(4096)
            assert stepalloc.memory_stats(0)["allocated_bytes.all.current"] == 4096
            stepalloc.raw_free(ptr)
            print("ok")
            """
        )
    )
    assert out.strip() == "ok"


def test_memory_summary_keeps_its_width_with_long_lists() -> None:
    out = check_child(
        run_python(
            """
            import stepalloc
            stepalloc.configure("backend:sim,sim_capacity_mb:64")
            p = stepalloc.raw_alloc(1 << 20)
            for phase in ("rollout_generation", "reward_model_scoring", "policy_training", "evaluation"):
                with stepalloc.step(phase):
                    pass
            widths = {len(line) for line in stepalloc.memory_summary(0).splitlines()}
            print(sorted(widths))
            stepalloc.raw_free(p)
            """
        )
    )
    assert out.split() == ["[80]"]
