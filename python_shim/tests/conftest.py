"""Test harness for the stepalloc Python package.

Layer: tests. The library keeps one configuration per process, fixed at first use, so this
process is configured once here (simulated device, two devices, a trace ring) before any test
runs; tests that need another configuration or a fresh process (torch's allocator swap) run a
child Python through ``run_python``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SHIM = Path(__file__).resolve().parent.parent
# Test the source tree, not an installed copy.
sys.path.insert(0, str(SHIM))

import stepalloc  # noqa: E402

MIB = 1 << 20
# Simulated device: 2 devices of 1 GiB, 4096 trace entries for snapshots.
SESSION_CONF = "backend:sim,sim_devices:2,sim_capacity_mb:1024,trace_entries:4096"


def pytest_configure(config: pytest.Config) -> None:
    stepalloc.configure(SESSION_CONF)
    # The first allocation creates the allocator: the configuration is now fixed.
    stepalloc.raw_free(stepalloc.raw_alloc(0))
    assert stepalloc.device_count() == 2


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except Exception:  # noqa: BLE001 - an installed but broken torch counts as missing
        return False
    return True


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter that imports stepalloc from this source tree."""
    full_env = {k: v for k, v in os.environ.items() if k != "STEPALLOC_CONF"}
    full_env["PYTHONPATH"] = os.pathsep.join([str(SHIM), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_child(result: subprocess.CompletedProcess) -> str:
    """Fails the test with the child's output when it failed; returns its stdout."""
    assert result.returncode == 0, f"child failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result.stdout
