"""Recording on a machine without a GPU: where a CUDA device context comes from.

Layer: process environment only (no torch import at module level). The recorder's fake CUDA
tensors need no GPU for the forward pass, but autograd's engine asks for the device's primary
context before it runs a CUDA backward ("hasPrimaryContext expects a valid device index"). With
no driver, the recording runs in a child Python over stepalloc's host-memory CUDA stand-in
(``testdrv/``: a driver, ``libcuda.so.1``, and a CUDA runtime, ``libcudart.so.13``, preloaded so
that it answers torch's own ``NEEDED`` entry) which gives a device and its context and runs no
kernel (none is launched under fake tensors).

Where the stand-in is looked for, in order: ``$STEPALLOC_HOSTCUDA_DIR``, the package's
``stepalloc/lib/hostcuda/`` (``python_shim/setup.py`` builds it into the wheel), this
repository's ``target/hostcuda/`` (``testdrv/build.sh``).

Invariants: ``cuda_ready()`` never initialises CUDA in a way that changes the process (it asks
``torch.cuda.is_available``); the child's environment keeps the caller's and adds the stand-in.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
REPO = Path(__file__).resolve().parents[3]
CHILD_FLAG = "STEPALLOC_FIT_CHILD"


class NoDeviceError(RuntimeError):
    """Neither a CUDA device nor the host-memory stand-in is available."""


def hostcuda_dir() -> Path | None:
    explicit = os.environ.get("STEPALLOC_HOSTCUDA_DIR")
    candidates = [Path(explicit)] if explicit else []
    candidates += [PACKAGE / "lib" / "hostcuda", REPO / "target" / "hostcuda"]
    for d in candidates:
        if (d / "libcuda.so.1").is_file() and (d / "runtime" / "libcudart.so.13").is_file():
            return d
    return None


def cuda_ready() -> bool:
    """Whether this process can record a CUDA backward (a device and its context)."""
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)
    except Exception:  # noqa: BLE001 - a torch that cannot load CUDA at all has no device
        return False


def child_env(d: Path) -> dict[str, str]:
    """The environment of a child Python over the stand-in in ``d``."""
    env = dict(os.environ)
    paths = [str(d / "runtime"), str(d)]
    if (d / "standins").is_dir():
        paths.append(str(d / "standins"))
    if env.get("LD_LIBRARY_PATH"):
        paths.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(paths)
    preload = str(d / "runtime" / "libcudart.so.13")
    env["LD_PRELOAD"] = preload + (" " + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env.setdefault("HOSTCUDA_DEVICES", "1")
    env.setdefault("HOSTCUDA_CAPACITY_MB", "1024")
    env[CHILD_FLAG] = "1"
    return env


def no_device_message() -> str:
    return (
        "recording needs a CUDA device context for the backward pass, and this process has none (no GPU "
        "driver, or torch without CUDA). stepalloc.fit runs the recording over its host-memory CUDA "
        "stand-in instead when it finds one: build it with testdrv/build.sh in stepalloc's repository "
        "(or set STEPALLOC_HOSTCUDA_DIR to a folder holding libcuda.so.1 and runtime/libcudart.so.13), "
        "then run `python -m stepalloc.fit ...` (it re-runs itself over the stand-in) or "
        "`python -m stepalloc.fit.host your_script.py` for a script that calls stepalloc.fit.record. "
        "torch must be a CUDA build (the default `pip install torch` on Linux is one)."
    )


def run_child(argv: list[str]) -> int:
    """Runs ``python argv...`` over the stand-in; its exit status."""
    d = hostcuda_dir()
    if d is None:
        raise NoDeviceError(no_device_message())
    return subprocess.call([sys.executable, *argv], env=child_env(d))


def ensure_device(argv: list[str] | None = None) -> int | None:
    """None when this process can record; else, with ``argv``, the exit status of the same
    command re-run over the stand-in; without it, a ``NoDeviceError`` saying what to do."""
    if cuda_ready():
        return None
    if argv is None or os.environ.get(CHILD_FLAG):
        raise NoDeviceError(no_device_message())
    return run_child(argv)
