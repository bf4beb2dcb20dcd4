#!/usr/bin/env python3
"""Replays allocation traces through PyTorch's own caching allocator and compares the peaks
with the stress tool's PyTorch columns.

PyTorch's allocator is the real one: libc10_cuda.so of the installed torch, driven through
``c10::cuda::CUDACachingAllocator`` (``torch.cuda.caching_allocator_alloc`` is
``raw_alloc_with_stream``, ``caching_allocator_delete`` is ``raw_delete``,
``max_memory_reserved`` reads ``getDeviceStats``), on the CPU over testdrv's stub CUDA runtime
and host-memory driver (no GPU; the run sets LD_PRELOAD itself). Each PyTorch configuration runs
in its own process, since ``PYTORCH_CUDA_ALLOC_CONF`` is read once.

For each trace (stepalloc JSON lines: ``{"op":"alloc","addr","size"}``, ``{"op":"free","addr"}``)
and each pair (PYTORCH_CUDA_ALLOC_CONF, stress preset) it prints both peaks reserved and their
difference, and fails when one differs by more than --tolerance (default 0.5%).

Then the out-of-memory check: each trace again on a device too small for it (--oom-share of
its PyTorch peak reserved, default 85%; testdrv's capacity set with ``hostcuda_set``), where
PyTorch's allocator raises ``torch.OutOfMemoryError`` (after freeing its cache and retrying) and
the replay goes on past it, as ``stepalloc-stress fit`` does (``--outside-mb 0``, the same
capacity). The first allocation that fails, the number that fail and the peak reserved must be
the same as ``fit``'s PyTorch columns report, and so must the retries (``num_alloc_retries``:
the cache freed to serve a request); the script fails otherwise.

Usage: torch_replay.py STRESS_BINARY TRACE... [--tolerance PCT] [--oom-share FRACTION] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOSTCUDA = ROOT / "target" / "hostcuda"
# PyTorch's setting -> the stress tool's preset that models it.
PAIRS = [
    ("", "pytorch"),
    ("max_split_size_mb:128", "split128"),
    ("expandable_segments:True", "pytorch_expandable"),
]
CAPACITY_MB = 81920  # the stress tool's default simulated device

CHILD = r"""
import json, sys
import torch
assert torch.cuda.is_available(), "the stub runtime is not loaded"
out = {}
for trace in sys.argv[1:]:
    live = {}
    skipped = 0
    with open(trace) as f:
        for raw in f:
            if not raw.strip():
                continue
            e = json.loads(raw)
            op = e["op"]
            if op == "alloc":
                live[(e.get("device", 0), e["addr"])] = torch.cuda.caching_allocator_alloc(e["size"], 0)
            elif op == "free":
                ptr = live.pop((e.get("device", 0), e["addr"]), None)
                if ptr is None:
                    skipped += 1
                else:
                    torch.cuda.caching_allocator_delete(ptr)
    peak = torch.cuda.max_memory_reserved(0)
    allocs = torch.cuda.memory_stats(0)["num_device_alloc"]
    for ptr in live.values():
        torch.cuda.caching_allocator_delete(ptr)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(0)
    torch.cuda.reset_accumulated_memory_stats(0)
    out[trace] = {"peak_reserved": peak, "device_allocs": allocs, "skipped_frees": skipped}
print(json.dumps(out))
"""


# The out-of-memory run: each trace on its own capacity (MiB), set on testdrv's driver before
# it starts; an allocation that raises is skipped (its free too), as `fit` skips it.
CHILD_OOM = r"""
import ctypes, json, sys
import torch
assert torch.cuda.is_available(), "the stub runtime is not loaded"
torch.cuda.init()
driver = ctypes.CDLL("libcuda.so.1")
driver.hostcuda_set.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
out = {}
for trace, capacity_mb in zip(sys.argv[1::2], sys.argv[2::2]):
    assert driver.hostcuda_set(b"capacity_mb", capacity_mb.encode()) == 0
    torch.cuda.reset_peak_memory_stats(0)
    torch.cuda.reset_accumulated_memory_stats(0)
    live, failed, n = {}, [], 0
    with open(trace) as f:
        for raw in f:
            if not raw.strip():
                continue
            e = json.loads(raw)
            key = (e.get("device", 0), e.get("addr"))
            if e["op"] == "alloc":
                n += 1
                try:
                    live[key] = torch.cuda.caching_allocator_alloc(e["size"], 0)
                except torch.OutOfMemoryError:
                    failed.append(n)
            elif e["op"] == "free":
                ptr = live.pop(key, None)
                if ptr is not None:
                    torch.cuda.caching_allocator_delete(ptr)
    stats = torch.cuda.memory_stats(0)
    for ptr in live.values():
        torch.cuda.caching_allocator_delete(ptr)
    torch.cuda.empty_cache()
    out[trace] = {"first_oom": failed[0] if failed else None, "ooms": len(failed),
                  "peak_reserved": stats["reserved_bytes.all.peak"], "alloc_retries": stats["num_alloc_retries"]}
print(json.dumps(out))
"""


def torch_env(conf: str) -> dict[str, str]:
    env = dict(os.environ)
    library_path = [str(HOSTCUDA / "runtime"), str(HOSTCUDA), str(HOSTCUDA / "standins"), env.get("LD_LIBRARY_PATH", "")]
    env.update(
        LD_PRELOAD=str(HOSTCUDA / "runtime" / "libcudart.so.13"),
        LD_LIBRARY_PATH=os.pathsep.join(p for p in library_path if p),
        HOSTCUDA_DEVICES="1",
        HOSTCUDA_CAPACITY_MB=str(CAPACITY_MB),
        PYTORCH_CUDA_ALLOC_CONF=conf,
    )
    return env


def torch_peaks(conf: str, traces: list[str]) -> dict[str, dict]:
    env = torch_env(conf)
    result = subprocess.run([sys.executable, "-c", CHILD, *traces], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"PyTorch replay under {conf!r} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def stress_peaks(binary: str, trace: str) -> dict[str, int]:
    presets = [p for _, p in PAIRS]
    out = subprocess.run(
        [binary, "replay", trace, "--json", "--capacity-mb", str(CAPACITY_MB), "--compare", *presets],
        check=True, capture_output=True, text=True,
    ).stdout
    return {r["name"]: r["peak_reserved"] for r in json.loads(out)["runs"]}


def torch_ooms(conf: str, capacities: dict[str, int]) -> dict[str, dict]:
    args = [str(a) for trace, mb in capacities.items() for a in (trace, mb)]
    result = subprocess.run(
        [sys.executable, "-c", CHILD_OOM, *args], env=torch_env(conf), capture_output=True, text=True
    )
    if result.returncode != 0:
        sys.exit(f"PyTorch out-of-memory replay under {conf!r} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def stress_ooms(binary: str, trace: str, capacity_mb: int) -> dict[str, dict]:
    """`fit`'s PyTorch columns on a device of exactly capacity_mb MiB, nothing outside PyTorch."""
    presets = [p for _, p in PAIRS]
    out = subprocess.run(
        [binary, "fit", trace, "--json", "--capacity-gb", repr(capacity_mb / 1024), "--outside-mb", "0",
         "--compare", *presets],
        check=True, capture_output=True, text=True,
    ).stdout
    report = json.loads(out)
    assert report["device"]["usable_bytes"] == capacity_mb << 20, report["device"]
    return {c["name"]: {"first_oom": (c["first_oom"] or {}).get("allocation"), "ooms": c["ooms"],
                        "peak_reserved": c["peak_reserved_bytes"], "alloc_retries": c["alloc_retries"]}
            for c in report["configs"]}


def oom_check(binary: str, traces: list[str], share: float, defaults: dict[str, int]) -> list[dict]:
    """Each trace at `share` of its PyTorch peak: the same first failing allocation, failures and peak."""
    capacities = {t: max(2, int(defaults[t] * share) >> 20) for t in traces}
    rows = []
    model = {t: stress_ooms(binary, t, capacities[t]) for t in traces}
    for conf, preset in PAIRS:
        real = torch_ooms(conf, capacities)
        for t in traces:
            r, m = real[t], model[t][preset]
            rows.append({"trace": Path(t).name, "capacity_mb": capacities[t], "pytorch_conf": conf or "(default)",
                         "preset": preset, "pytorch": r, "stress": m,
                         "same": all(r[k] == m[k] for k in ("first_oom", "ooms", "peak_reserved", "alloc_retries"))})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary")
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--tolerance", type=float, default=0.5, help="percent")
    parser.add_argument("--oom-share", type=float, default=0.85,
                        help="the out-of-memory check's device, as a share of each trace's PyTorch peak reserved")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for conf, preset in PAIRS:
        real = torch_peaks(conf, args.traces)
        for trace in args.traces:
            model = stress_peaks(args.binary, trace)[preset]
            torch_peak = real[trace]["peak_reserved"]
            diff = 100.0 * (model - torch_peak) / torch_peak
            rows.append({"trace": Path(trace).name, "pytorch_conf": conf or "(default)", "preset": preset,
                         "pytorch_peak_reserved": torch_peak, "stress_peak_reserved": model, "diff_pct": diff,
                         "pytorch_device_allocs": real[trace]["device_allocs"]})
    width = max(len(r["trace"]) for r in rows)
    print(f"{'trace':<{width}}  {'PyTorch setting':<26} {'PyTorch peak':>14} {'stress tool':>14} {'diff':>8}")
    for r in rows:
        print(f"{r['trace']:<{width}}  {r['pytorch_conf']:<26} {r['pytorch_peak_reserved']:>14,} "
              f"{r['stress_peak_reserved']:>14,} {r['diff_pct']:>+7.3f}%")
    defaults = {
        t: next(r["pytorch_peak_reserved"] for r in rows if r["preset"] == "pytorch" and r["trace"] == Path(t).name)
        for t in args.traces
    }
    oom = oom_check(args.binary, args.traces, args.oom_share, defaults)
    print(f"\nout of memory at {args.oom_share:.0%} of each trace's PyTorch peak (first failing allocation, "
          "failures, retries, peak reserved MiB):")
    print(f"{'trace':<{width}}  {'capacity':>9}  {'PyTorch setting':<26} {'PyTorch':>24} {'stress tool fit':>24}")
    for r in oom:
        fmt = lambda x: f"#{x['first_oom']} {x['ooms']}x {x['alloc_retries']}r {x['peak_reserved'] >> 20}"  # noqa: E731
        print(f"{r['trace']:<{width}}  {r['capacity_mb']:>6} MiB  {r['pytorch_conf']:<26} {fmt(r['pytorch']):>24} "
              f"{fmt(r['stress']):>24}{'' if r['same'] else '  DIFFERENT'}")
    if args.json:
        args.json.write_text(json.dumps({"peaks": rows, "out_of_memory": oom}, indent=2))
    bad = [r for r in rows if abs(r["diff_pct"]) > args.tolerance]
    if bad:
        print(f"FAIL: {len(bad)} of {len(rows)} differ from PyTorch's own allocator by more than {args.tolerance}%")
        return 1
    bad_oom = [r for r in oom if not r["same"]]
    if bad_oom:
        print(f"FAIL: {len(bad_oom)} of {len(oom)} out-of-memory runs differ from PyTorch's own allocator")
        return 1
    print(f"the stress tool's PyTorch columns are within {args.tolerance}% of PyTorch's own allocator on "
          f"{len(args.traces)} traces x {len(PAIRS)} settings, and fail at the same allocation as it on a device "
          f"of {args.oom_share:.0%} of each peak")
    return 0


if __name__ == "__main__":
    sys.exit(main())
