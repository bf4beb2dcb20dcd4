"""Where vLLM 0.34 runs as the control beside stepalloc: its own virtual environment
(``scripts/vllm_venv.sh``: torch 2.14 without CUDA wheels, vLLM 0.34 without its dependencies),
over testdrv's host-memory driver and stub runtime, with the stand-ins of
``scripts/vllm_standins.sh``. Layer: tests (helpers, no tests of its own).

Without that environment the vLLM columns skip, saying how to make it; under CI (``CI`` set)
they fail instead, since ``.ci/run`` always makes it.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from conftest import SHIM, check_child

ROOT = SHIM.parent
HOSTCUDA = ROOT / "target" / "hostcuda"
RUNTIME = HOSTCUDA / "runtime"
STUB_RUNTIME = RUNTIME / "libcudart.so.13"
VENV = ROOT / "target" / "vllm-venv"
VENV_PYTHON = VENV / "bin" / "python"
STANDINS = HOSTCUDA / "standins-vllm"
ABSENT = (
    f"vLLM 0.34's environment {VENV} (or its stand-ins {STANDINS}) is absent: "
    "scripts/vllm_venv.sh makes it (.ci/run always does)"
)


def ready() -> bool:
    return VENV_PYTHON.exists() and STANDINS.is_dir() and STUB_RUNTIME.exists()


def require() -> None:
    """Skips the calling test without the environment (fails under CI, which always has it)."""
    if ready():
        return
    if os.environ.get("CI"):
        pytest.fail(ABSENT)
    pytest.skip(ABSENT)


def env(extra_path: list[Path] | None = None) -> dict[str, str]:
    """The environment of a child in vLLM's venv: testdrv's stub runtime preloaded, its driver,
    the stand-ins, stepalloc from this source tree (and ``extra_path``) on the import path."""
    library_path = [str(RUNTIME), str(HOSTCUDA), str(STANDINS)]
    python_path = [str(SHIM), *(str(p) for p in extra_path or [])]
    full = {k: v for k, v in os.environ.items() if k not in ("STEPALLOC_CONF", "PYTHONPATH", "LD_PRELOAD")}
    full.update(
        {
            "LD_PRELOAD": str(STUB_RUNTIME),
            "LD_LIBRARY_PATH": os.pathsep.join(library_path),
            "PYTHONPATH": os.pathsep.join(python_path),
            "HOSTCUDA_DEVICES": "1",
            "HOSTCUDA_CAPACITY_MB": "1024",
            "PYTORCH_CUDA_ALLOC_CONF": "",
            "STEPALLOC_CONF": "backend:cuda",
        }
    )
    return full


def run(code: str, extra_env: dict[str, str] | None = None, extra_path: list[Path] | None = None) -> str:
    """Runs ``code`` in vLLM's venv; fails the test with the child's output when it fails."""
    full = env(extra_path)
    full.update(extra_env or {})
    result = subprocess.run(
        [str(VENV_PYTHON), "-c", textwrap.dedent(code)],
        env=full,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return check_child(result)
