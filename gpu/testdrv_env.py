"""testdrv's stub CUDA runtime for the GPU kit's PyTorch steps when they run over the
host-memory driver (``STEPALLOC_HOSTCUDA=1``, as scripts/test.sh runs the kit): torch finds
CUDA through the stub ``libcudart.so.13`` preloaded, with the stub NVML beside it on the
library path (stock PyTorch's expandable segments ask NVML). On a GPU neither is used."""

from __future__ import annotations

import os
from pathlib import Path


def on_host_driver() -> bool:
    """testdrv's host-memory driver stands in for the device (as the Rust CUDA tests read it)."""
    return os.environ.get("STEPALLOC_HOSTCUDA", "") not in ("", "0")


def stub_runtime() -> Path | None:
    """testdrv's stub CUDA runtime beside the host-memory driver found on LD_LIBRARY_PATH."""
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if d and (Path(d) / "libcuda.so.1").exists() and (Path(d) / "runtime" / "libcudart.so.13").is_file():
            return Path(d) / "runtime" / "libcudart.so.13"
    return None


def with_stub(env: dict[str, str], runtime: Path) -> dict[str, str]:
    """`env` with `runtime` preloaded and its folder (the stub NVML) first on the library path."""
    env = dict(env)
    env["LD_PRELOAD"] = os.pathsep.join(p for p in (str(runtime), env.get("LD_PRELOAD", "")) if p)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(runtime.parent), env.get("LD_LIBRARY_PATH", "")) if p)
    return env
