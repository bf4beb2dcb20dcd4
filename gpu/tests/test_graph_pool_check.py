"""The GPU kit's graph-pool and NCCL step (gpu/graph_pool_check.py) over testdrv's host-memory
driver, from the repository: every check runs its script under stock PyTorch and under
stepalloc and passes (the same answers, and stock PyTorch's the expected ones); the NCCL check
over testdrv/hostnccl.c (built here), which records the registrations, and skipped without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
HOSTCUDA = ROOT / "target" / "hostcuda"

pytestmark = pytest.mark.skipif(
    not (HOSTCUDA / "runtime" / "libcudart.so.13").exists(),
    reason="needs testdrv (testdrv/build.sh)",
)


def check(*args: str) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HOSTCUDA_") and k != "LD_PRELOAD"
    }
    library_path = [
        str(HOSTCUDA),
        str(HOSTCUDA / "standins"),
        os.environ.get("LD_LIBRARY_PATH", ""),
    ]
    env.update(
        {
            "STEPALLOC_HOSTCUDA": "1",
            "HOSTCUDA_DEVICES": "1",
            "HOSTCUDA_CAPACITY_MB": "1024",
            "LD_LIBRARY_PATH": os.pathsep.join(p for p in library_path if p),
            "STEPALLOC_LIBRARY": str(ROOT / "target" / "release" / "libstepalloc.so"),
        }
    )
    return subprocess.run(
        [sys.executable, str(ROOT / "gpu" / "graph_pool_check.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


def test_every_check_passes_over_testdrv(tmp_path: Path) -> None:
    lib = tmp_path / "libhostnccl.so"
    subprocess.run(
        [
            "cc",
            "-shared",
            "-fPIC",
            "-O1",
            "-o",
            str(lib),
            str(ROOT / "testdrv" / "hostnccl.c"),
            "-lpthread",
        ],
        check=True,
    )
    proc = check("--hostnccl", str(lib), "--json", str(tmp_path / "out.json"))
    results = [
        line.split()[1:3]
        for line in proc.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    assert proc.returncode == 0 and results == [
        ["PASS", "graph_checkpoints"],
        ["PASS", "graph_trees_compile"],
        ["PASS", "nccl_register"],
    ], proc.stdout + proc.stderr
    assert "registered=([20971520, 31457280], True)" in proc.stdout


def test_the_nccl_check_is_skipped_over_testdrv_without_a_stand_in() -> None:
    proc = check("--checks", "nccl_register")
    assert proc.returncode == 0 and "RESULT SKIP nccl_register" in proc.stdout, (
        proc.stdout + proc.stderr
    )
