"""Replaying a recorded trace at a device's capacity: the stress tool's ``fit`` subcommand, and the
search for the largest batch that fits under each allocator.

Layer: runs the ``stepalloc-stress`` binary (``stepalloc-stress fit TRACE --json``, the contract
in the stress tool's ``fit``); the recorder's side never imports this module. The binary is
found in one place, ``_stress_binary``.

Invariants: a failing binary is a ``ReplayError`` with its message; ``check`` refuses bad replay
inputs (``ValueError``) before anything is recorded, asking the binary itself; the search records each
candidate batch at most once and assumes that memory grows with the batch (it reports the
batches it tried, so a user can see the evidence).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import _kernels
from ._binary import StressBinaryNotFound, stress_binary

# Device memory that is not PyTorch's: the CUDA context, cuBLAS / cuDNN handles, kernel images
# loaded (lazily: CUDA_MODULE_LOADING=LAZY, the default since CUDA 11.7). A stated constant, not a
# measurement: about 0.5 GiB is what a PyTorch training process on an H100 shows in nvidia-smi
# beyond torch.cuda.memory_reserved(); the GPU kit measures it (--outside-mb overrides).
DEFAULT_OUTSIDE_MB = 512
MIB = 1 << 20


class ReplayError(RuntimeError):
    """The stress tool could not replay the trace."""


def _stress_binary() -> Path:
    """The ``stepalloc-stress`` binary (``_binary.stress_binary``: ``$STEPALLOC_STRESS``, the
    package's copy, a build in this repository), its lookup error as a ``ReplayError``."""
    try:
        return stress_binary()
    except StressBinaryNotFound as exc:
        raise ReplayError(str(exc)) from exc


def fit(
    trace: str | Path,
    device: Any = "h100",
    outside_mb: float = DEFAULT_OUTSIDE_MB,
    pytorch_conf: str | None = None,
    compare: list[str] | None = None,
    html: str | Path | None = None,
    svg: str | Path | None = None,
) -> dict[str, Any]:
    """``stepalloc-stress fit`` of ``trace`` on ``device``: its JSON report (per allocator: fits,
    peak reserved and allocated, headroom, the first out-of-memory). ``pytorch_conf`` defaults to
    the user's ``PYTORCH_CUDA_ALLOC_CONF`` (a 'yours' column) when that is set."""
    t = _kernels.target(device)
    check_outside(outside_mb, t)
    conf, from_env = _conf(pytorch_conf)
    cmd = _command(trace, t, outside_mb, conf)
    if compare:
        cmd += ["--compare", *compare]
    if html:
        cmd += ["--html", str(html)]
    if svg:
        cmd += ["--svg", str(svg)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ReplayError(f"{' '.join(cmd[:3])} ... failed ({done.returncode}): {_refusal(done, conf, from_env)}")
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError as exc:
        raise ReplayError(f"stepalloc-stress fit printed no JSON report: {done.stdout[:300]!r}") from exc
    report.setdefault("device", {})["name"] = t.name
    return report


def check(device: Any, outside_mb: float = DEFAULT_OUTSIDE_MB, pytorch_conf: str | None = None,
          name: str = "outside_mb") -> None:
    """Refuses (``ValueError``, named) what ``fit`` would refuse, before anything is recorded: the
    device, ``outside_mb`` (``name``: as the caller spells it), and the PyTorch settings, which the
    stress tool reads exactly as PyTorch 2.15 does (``stress/src/torch_conf.rs``): it is asked,
    replaying a trace of one allocation (milliseconds), rather than a second parser kept here."""
    t = _kernels.target(device)
    check_outside(outside_mb, t, name)
    conf, from_env = _conf(pytorch_conf)
    trace = temporary_trace()
    try:
        trace.write_text('{"op":"alloc","device":0,"addr":1,"size":1,"stream":0}\n')
        done = subprocess.run(_command(trace, t, outside_mb, conf), capture_output=True, text=True, check=False)
    finally:
        trace.unlink(missing_ok=True)
    if done.returncode == 2:
        raise ValueError(_refusal(done, conf, from_env))
    if done.returncode != 0:
        raise ReplayError(f"stepalloc-stress fit failed ({done.returncode}) on a one-allocation trace: {_refusal(done, conf, from_env)}")


def check_outside(outside_mb: Any, t: _kernels.Target, name: str = "outside_mb") -> None:
    """Device memory outside PyTorch: whole MiB (the stress tool's ``--outside-mb``), at least 0,
    less than the whole device."""
    if isinstance(outside_mb, bool) or not isinstance(outside_mb, (int, float)):
        raise ValueError(f"{name} {outside_mb!r}: a number of MiB")
    if outside_mb < 0:
        raise ValueError(f"{name} {outside_mb:g}: at least 0 (MiB of device memory outside PyTorch)")
    if not math.isfinite(outside_mb) or outside_mb != int(outside_mb):
        raise ValueError(f"{name} {outside_mb:g}: whole MiB (the stress tool's --outside-mb takes an integer)")
    if int(outside_mb) * MIB >= t.memory_bytes:
        raise ValueError(f"{name} {outside_mb:g}: as large as the whole device ({t.name}, {t.memory_bytes // MIB:,} MiB); "
                         f"the memory outside PyTorch is a few hundred MiB (default {DEFAULT_OUTSIDE_MB})")


def _conf(pytorch_conf: str | None) -> tuple[str | None, bool]:
    """The settings to add as 'yours', and whether they came from ``$PYTORCH_CUDA_ALLOC_CONF``."""
    if pytorch_conf is None:
        env = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None
        return env, env is not None
    return pytorch_conf or None, False


def _command(trace: str | Path, t: _kernels.Target, outside_mb: float, conf: str | None) -> list[str]:
    cmd = [str(_stress_binary()), "fit", str(trace), "--capacity-gb", f"{t.capacity_gib:.6f}",
           "--outside-mb", str(int(outside_mb)), "--json"]
    return cmd + ["--pytorch-conf", conf] if conf else cmd


def _refusal(done: subprocess.CompletedProcess, conf: str | None, from_env: bool) -> str:
    """The stress tool's message; for settings read from the environment, says so."""
    message = (done.stderr.strip() or done.stdout.strip()).removeprefix("error: ")
    if from_env and "--pytorch-conf" in message:
        message = (f"PYTORCH_CUDA_ALLOC_CONF {conf!r} from the environment; --pytorch-conf '' leaves it out: "
                   + message.replace("--pytorch-conf: ", "", 1))
    return message


def fits_by_config(report: dict[str, Any]) -> dict[str, bool]:
    return {c["name"]: bool(c.get("fits")) for c in report.get("configs", [])}


@dataclass
class BatchSearch:
    """The largest batch that fits under each allocator, and every batch tried."""

    largest: dict[str, int] = field(default_factory=dict)  # config -> batch (0: not even 1)
    tried: dict[int, dict[str, bool]] = field(default_factory=dict)  # batch -> config -> fits
    capped: bool = False  # the search stopped at its limit with some allocator still fitting


def largest_batch(fits_at: Callable[[int], dict[str, bool]], limit: int = 256) -> BatchSearch:
    """Doubling (1, 2, 4, ...) until no allocator fits (or ``limit``), then bisection between the
    last batch that fit and the first that did not, per allocator. ``fits_at(batch)`` records and
    replays once per batch (each call is a recording, so the search keeps them few: about
    2 log2(answer) recordings)."""
    search = BatchSearch()

    def at(batch: int) -> dict[str, bool]:
        if batch not in search.tried:
            search.tried[batch] = fits_at(batch)
        return search.tried[batch]

    batch = 1
    while True:
        result = at(batch)
        if not any(result.values()) or batch >= limit:
            break
        batch = min(batch * 2, limit)
    search.capped = batch >= limit and any(at(batch).values())
    for name in at(1):
        fitting = [b for b, r in search.tried.items() if r.get(name)]
        lo = max(fitting, default=0)
        failing = [b for b, r in search.tried.items() if not r.get(name) and b > lo]
        hi = min(failing, default=None)
        while hi is not None and hi - lo > 1:
            mid = (lo + hi) // 2
            if at(mid).get(name):
                lo = mid
            else:
                hi = mid
        search.largest[name] = lo
    return search


def temporary_trace() -> Path:
    fd, path = tempfile.mkstemp(prefix="stepalloc-fit-", suffix=".jsonl")
    os.close(fd)
    return Path(path)
