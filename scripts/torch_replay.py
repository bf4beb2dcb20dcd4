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

Usage: torch_replay.py STRESS_BINARY TRACE... [--tolerance PCT] [--json OUT]
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


def torch_peaks(conf: str, traces: list[str]) -> dict[str, dict]:
    env = dict(os.environ)
    library_path = [str(HOSTCUDA / "runtime"), str(HOSTCUDA), str(HOSTCUDA / "standins"), env.get("LD_LIBRARY_PATH", "")]
    env.update(
        LD_PRELOAD=str(HOSTCUDA / "runtime" / "libcudart.so.13"),
        LD_LIBRARY_PATH=os.pathsep.join(p for p in library_path if p),
        HOSTCUDA_DEVICES="1",
        HOSTCUDA_CAPACITY_MB=str(CAPACITY_MB),
        PYTORCH_CUDA_ALLOC_CONF=conf,
    )
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary")
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--tolerance", type=float, default=0.5, help="percent")
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
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    bad = [r for r in rows if abs(r["diff_pct"]) > args.tolerance]
    if bad:
        print(f"FAIL: {len(bad)} of {len(rows)} differ from PyTorch's own allocator by more than {args.tolerance}%")
        return 1
    print(f"the stress tool's PyTorch columns are within {args.tolerance}% of PyTorch's own allocator on "
          f"{len(args.traces)} traces x {len(PAIRS)} settings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
