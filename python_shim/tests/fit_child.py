"""Shared by the stepalloc.fit tests: running code in a child Python whose torch sees a CUDA
device (testdrv's host-memory driver and stub runtime, as test_real_torch.py does), so the
recorder's fake CUDA tensors get a device context for the backward.

Skipped when torch or the stubs are missing (``testdrv/build.sh``).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from conftest import check_child, run_python, torch_available

ROOT = Path(__file__).resolve().parents[2]
HOSTCUDA = ROOT / "target" / "hostcuda"
STUB_RUNTIME = HOSTCUDA / "runtime" / "libcudart.so.13"

needs_torch = pytest.mark.skipif(
    not STUB_RUNTIME.exists() or not torch_available(), reason="needs torch and testdrv's stubs (testdrv/build.sh)"
)


def child_env() -> dict[str, str]:
    """The environment stepalloc.fit itself gives a child over the stand-in (``_host.child_env``),
    with the settings that would change the recorded figures cleared."""
    from stepalloc.fit import _host

    env = _host.child_env(HOSTCUDA)
    env.update(
        PYTORCH_CUDA_ALLOC_CONF="", TORCH_CUDNN_SDPA_DEPRIORITIZED="", CUBLAS_WORKSPACE_CONFIG="", CUBLASLT_WORKSPACE_SIZE=""
    )
    return env


def run_fit(code: str, timeout: float = 300) -> dict:
    """Runs ``code`` (which sets ``RESULT``, a JSON-able value) in a child with the stubs; returns
    RESULT."""
    prelude = "import json, torch\nimport stepalloc.fit as fit\nRESULT = None\n"
    tail = "\nprint('RESULT=' + json.dumps(RESULT))\n"
    out = check_child(run_python(prelude + textwrap.dedent(code) + tail, env=child_env(), timeout=timeout))
    line = next(line for line in reversed(out.splitlines()) if line.startswith("RESULT="))
    return json.loads(line[len("RESULT=") :])
