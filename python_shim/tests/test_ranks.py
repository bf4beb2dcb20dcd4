"""Ranks under torchrun without launching it: torchrun's environment set by hand.

What is shown: the rank numbers and the rank's device read from the environment (bad values
named), the Prometheus target and its label set for a rank on another node, the target file,
``gather_stats`` without a process group, ``install()`` choosing the rank's device, and the
summary and callbacks naming the rank. The real launch is ``test_torchrun.py``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import socket
from pathlib import Path
from typing import Callable, Optional

import pytest

import stepalloc
from conftest import check_child, run_python, torch_available

TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK")
RankEnv = Callable[[Optional[str], Optional[str], Optional[str]], None]


@pytest.fixture
def rank_env(monkeypatch: pytest.MonkeyPatch) -> RankEnv:
    """Sets torchrun's variables for one test (the session's allocator has two devices)."""

    def set_env(rank: str | None, local_rank: str | None, node: str | None) -> None:
        for name, value in zip(TORCHRUN_ENV, (rank, local_rank, node)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)

    set_env(None, None, None)
    return set_env


def test_rank_numbers_come_from_torchruns_environment(rank_env: RankEnv) -> None:
    assert stepalloc.rank_info() == stepalloc.RankInfo(None, None, None)
    assert stepalloc.rank_info().labels() == {} and stepalloc.rank_info().describe() == ""
    rank_env("9", "1", "4")
    info = stepalloc.rank_info()
    assert (info.rank, info.local_rank, info.node) == (9, 1, 4)
    assert info.describe() == "rank 9 (local rank 1, node 4)"
    # Without RANK the rank is LOCAL_RANK, as the library's `rank` metric label.
    rank_env(None, "1", None)
    assert stepalloc.rank_info().labels() == {"rank": "1", "local_rank": "1"}
    for bad in ("-1", "x", "1.5"):
        rank_env("0", bad, "0")
        with pytest.raises(ValueError, match=rf"LOCAL_RANK='{bad}' \(from the torchrun environment\).*non-negative"):
            stepalloc.rank_info()


@pytest.mark.parametrize(
    ("local_rank", "count", "device"),
    [(None, 8, 0), ("0", 8, 0), ("5", 8, 5), ("7", 8, 7), ("5", 1, 0), ("0", 1, 0)],
)
def test_the_ranks_device(rank_env: RankEnv, local_rank: str | None, count: int, device: int) -> None:
    rank_env(local_rank, local_rank, "0")
    assert stepalloc.rank_device(count) == device


def test_a_local_rank_without_a_device_is_refused(rank_env: RankEnv) -> None:
    rank_env("2", "2", "0")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 .*sees 2 devices.*0\.\.1"):
        stepalloc.rank_device()  # the session's allocator: two simulated devices
    rank_env("1", "1", "0")
    assert stepalloc.rank_device() == 1


# In a child: the session's device 1 belongs to test_stats.py.
RANK_1 = {"RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0", "STEPALLOC_CONF": "backend:sim,sim_devices:2"}


def test_statistics_and_agent_loops_default_to_the_ranks_device() -> None:
    out = check_child(
        run_python(
            """
            import stepalloc
            ptr = stepalloc.raw_alloc(3 << 20, device=1)
            assert stepalloc.memory_allocated() == stepalloc.memory_allocated(1) == 3 << 20
            assert stepalloc.memory_allocated(0) == 0
            # An agent loop records the rank's device and names the rank.
            loop = stepalloc.AgentLoop()
            with loop.rollout():
                p2 = stepalloc.raw_alloc(7 << 20, device=1)
                stepalloc.raw_free(p2, 7 << 20, device=1)
            record = loop.history[-1]
            assert record.rank == 1 and record.peak_allocated_bytes == 10 << 20, record
            print("ok")
            """,
            env=RANK_1,
        )
    )
    assert "ok" in out


def test_the_target_of_a_rank_on_another_node(rank_env: RankEnv, tmp_path: Path) -> None:
    # Rank 11 is the fourth process (LOCAL_RANK 3) of the third node (GROUP_RANK 2), its
    # endpoint bound to every interface: the target names this machine.
    rank_env("11", "3", "2")
    target = stepalloc.prometheus_target("0.0.0.0:9838")
    assert target == {
        "targets": [f"{socket.gethostname()}:9838"],
        "labels": {"rank": "11", "local_rank": "3", "node": "2"},
    }
    assert stepalloc.prometheus_target("[::]:9838", host="gpu-7.cluster")["targets"] == ["gpu-7.cluster:9838"]
    assert stepalloc.prometheus_target("127.0.0.1:9838")["targets"] == ["127.0.0.1:9838"]
    assert stepalloc.prometheus_target("[::1]:9838")["targets"] == ["[::1]:9838"]
    path = stepalloc.write_prometheus_targets(tmp_path / "sd", "0.0.0.0:9838")
    assert Path(path) == tmp_path / "sd" / "stepalloc-rank-11.json"
    assert json.loads(Path(path).read_text()) == [target]
    assert [p.name for p in (tmp_path / "sd").iterdir()] == ["stepalloc-rank-11.json"]  # no temporary left
    # Outside torchrun: one file, no rank labels.
    rank_env(None, None, None)
    path = stepalloc.write_prometheus_targets(tmp_path / "sd", "127.0.0.1:9835")
    assert json.loads(Path(path).read_text()) == [{"targets": ["127.0.0.1:9835"], "labels": {}}]
    for bad in ("9835", "host:", "host:http", "host:0", "host:70000"):
        with pytest.raises(ValueError, match="expected host:port"):
            stepalloc.prometheus_target(bad)


def test_the_target_needs_an_endpoint_or_an_address() -> None:
    out = check_child(
        run_python(
            """
            import stepalloc
            try:
                stepalloc.prometheus_target()
                raise SystemExit("a target without an endpoint")
            except stepalloc.StepallocError as e:
                print("refused:", e)
            """
        )
    )
    assert "no metrics endpoint serves in this process" in out


def test_gather_without_a_process_group_is_this_process_alone() -> None:
    out = check_child(
        run_python(
            """
            import stepalloc
            ptr = stepalloc.raw_alloc(5 << 20, device=1)
            stepalloc.raw_free(ptr, 5 << 20, device=1)
            [own] = stepalloc.gather_stats()
            assert (own["rank"], own["local_rank"], own["node"], own["device"]) == (1, 1, 0, 1), own
            assert own["peak_reserved_bytes"] == stepalloc.max_memory_reserved(1) >= 5 << 20, own
            assert own["peak_allocated_bytes"] == 5 << 20, own
            assert own["stats"] == stepalloc.stepalloc_stats(1), own
            print("ok")
            """,
            env=RANK_1,
        )
    )
    assert "ok" in out


def test_summary_names_the_rank(rank_env: RankEnv) -> None:
    assert "| stepalloc memory summary, device ID 0 " in stepalloc.memory_summary(0)
    rank_env("3", "1", "1")
    title = stepalloc.memory_summary().splitlines()[1]
    assert title.startswith("| stepalloc memory summary, rank 3 (local rank 1, node 1), device ID 1 "), title
    assert len(title) == 80, title  # the table's width


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not has("transformers"), reason="transformers not installed")
def test_hf_callback_names_the_rank(rank_env: RankEnv, caplog: pytest.LogCaptureFixture) -> None:
    rank_env("5", "1", "2")
    callback = stepalloc.hf_callback("hf_rank")
    assert callback.rank == 5
    with caplog.at_level(logging.INFO, logger="stepalloc"):
        callback.on_step_begin(None, None, None)
        callback.on_step_end(None, None, None)
        callback.on_train_end(None, None, None)
    assert "stepalloc rank 5 (local rank 1, node 2), device 1: peak reserved" in caplog.text
    assert "steps: hf_rank 1" in caplog.text


@pytest.mark.skipif(not (has("lightning") or has("pytorch_lightning")), reason="lightning not installed")
def test_lightning_callback_names_the_rank(rank_env: RankEnv, caplog: pytest.LogCaptureFixture) -> None:
    rank_env("6", "0", "3")
    callback = stepalloc.lightning_callback("pl_rank_train", "pl_rank_eval")
    assert callback.rank == 6
    with caplog.at_level(logging.INFO, logger="stepalloc"):
        callback.on_train_batch_start(None, None, None, 0)
        callback.on_train_batch_end(None, None, None, None, 0)
        callback.on_train_end(None, None)
    assert "stepalloc rank 6 (local rank 0, node 3), device 0: peak reserved" in caplog.text
    assert "steps: pl_rank_train 1, pl_rank_eval 0" in caplog.text
    rank_env(None, None, None)
    assert stepalloc.lightning_callback().rank is None


@pytest.mark.skipif(not torch_available(), reason="torch is not installed: install() not tested")
def test_install_under_torchrun_takes_the_ranks_device() -> None:
    out = check_child(
        run_python(
            """
            import torch, stepalloc
            h = stepalloc.install(conf="backend:sim,sim_devices:2,sim_capacity_mb:256")
            assert h.device == 1, h
            # Queued for CUDA's initialisation (there is no GPU here to initialise).
            queued = [getattr(call, "__name__", "") for call, _ in torch.cuda._queued_calls]
            assert "stepalloc_set_rank_device" in queued, queued
            p = stepalloc.raw_alloc(1 << 20, device=1)
            assert stepalloc.memory_allocated() == 1 << 20 and stepalloc.memory_allocated(0) == 0
            print("ok")
            """,
            env={"RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0"},
        )
    )
    assert "ok" in out
    out = check_child(
        run_python(
            """
            import torch, stepalloc
            try:
                stepalloc.install(conf="backend:sim,sim_devices:2")
                raise SystemExit("a LOCAL_RANK without a device was accepted")
            except ValueError as e:
                print("refused:", e)
            assert not stepalloc.is_installed()
            assert torch._C._cuda_getAllocatorBackend() == "native", "nothing was swapped"
            h = stepalloc.install(conf="backend:sim,sim_devices:1")
            assert h.device == 0, h  # one device per process: the rank's own
            print("ok")
            """,
            env={"RANK": "3", "LOCAL_RANK": "3", "GROUP_RANK": "0"},
        )
    )
    assert "refused: LOCAL_RANK=3 (from the torchrun environment) has no device" in out and "ok" in out
