#!/usr/bin/env python3
"""Sleep/wake cycle benchmark on testdrv's host-memory driver: stepalloc's pause/resume against
torch_memory_saver 0.0.10's wheel on the same tensors, and against a plain host copy into warm
buffers.

A cycle is ``pause()`` then ``resume()`` of everything: ``--backup-mb`` (default 1 GiB) backed
up in ``--tensors`` tensors (default 257, sizes varied like a model's) plus ``--discard-mb``
(default 512 MiB) discarded. The first cycle allocates host buffers and warms memory; the
figures are the median of cycles 2..N (steady state: agent loops pause and resume every
iteration). Columns:

  * stepalloc: ``stepalloc.pause()`` / ``stepalloc.resume()`` (backup policy per region);
  * tms default: torch_memory_saver with its defaults on the same tensors (host buffers
    allocated at every pause, freed at resume);
  * tms floor: torch_memory_saver moving the same bytes in ONE tensor with
    ``retain_cpu_backup=True`` (host buffers kept): about the least a cycle can cost here;
  * host copy: ``copy_`` of each backed-up tensor into pinned buffers allocated once, and back
    (no unmapping, no discard): the copy alone.

Wall-clock columns, and the process's CPU time per cycle (every thread): on a shared, loaded
host the CPU figure is the steadier (testdrv's copies and page-table work are CPU work).

Each variant runs in its own child process (PyTorch over testdrv's stub runtime,
``HOSTCUDA_CAPACITY_MB`` = ``--capacity-mb``). Needs torch, ``testdrv/build.sh``,
``python3 testdrv/standins.py target/hostcuda/standins`` (a torch without CUDA wheels), the
release library, and for the tms columns ``pip install torch_memory_saver==0.0.10``.

    python3 scripts/sleep_bench.py --cycles 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOSTCUDA = ROOT / "target" / "hostcuda"
MIB = 1 << 20

COMMON = """
import json, sys, time, torch
MIB = 1 << 20
A = json.loads(sys.argv[1])
def sizes(total, n):
    # n sizes summing to `total`, varied (1x..3x a base) like a model's tensors, 512-byte multiples
    weights = [1 + (i * 7919) % 3 for i in range(n)]
    base = total / sum(weights)
    out = [max(512, int(base * w) // 512 * 512) for w in weights]
    out[-1] += total - sum(out)
    return out
def host_values(n, seed):
    return torch.full((n,), seed % 251 + 1, dtype=torch.uint8)
def timed(pause, resume, check):
    # wall seconds of pause and resume, and the process's CPU seconds (all threads) for the
    # cycle: on a loaded host the CPU figure is the steadier one (testdrv's copies, maps and
    # page-table work are all CPU work of this process)
    cycles = []
    for _ in range(A["cycles"]):
        torch.cuda.synchronize()
        c0 = time.process_time()
        t0 = time.perf_counter()
        pause()
        t1 = time.perf_counter()
        resume()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        cycles.append((t1 - t0, t2 - t1, time.process_time() - c0))
    check()
    print("RESULT " + json.dumps(cycles), flush=True)
"""

STEPALLOC = """
import stepalloc
stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED)
with stepalloc.region("weights", backup=True):
    ws = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes(A["backup"], A["tensors"])]
with stepalloc.region("kv"):
    kv = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes(A["discard"], 8)]
for i, w in enumerate(ws):
    w.copy_(host_values(w.numel(), i))
def check():
    for i, w in enumerate(ws):
        assert int(w[-1:].cpu()) == i % 251 + 1
timed(lambda: stepalloc.pause(), lambda: stepalloc.resume(), check)
"""

TMS = """
from torch_memory_saver import torch_memory_saver as tms
tms.hook_mode = "torch"
if A["one_tensor"]:
    tms.retain_cpu_backup = True
    backup_sizes = [A["backup"]]
else:
    backup_sizes = sizes(A["backup"], A["tensors"])
with tms.region(tag="weights", enable_cpu_backup=True):
    ws = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in backup_sizes]
with tms.region(tag="kv"):
    kv = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes(A["discard"], 1 if A["one_tensor"] else 8)]
for i, w in enumerate(ws):
    w.copy_(host_values(w.numel(), i))
def check():
    for i, w in enumerate(ws):
        assert int(w[-1:].cpu()) == i % 251 + 1
timed(lambda: tms.pause(), lambda: tms.resume(), check)
import os
os._exit(0)  # 0.0.10's torch hook mode fails at interpreter teardown (tms_torch_free)
"""

HOST_COPY = """
ws = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes(A["backup"], A["tensors"])]
for i, w in enumerate(ws):
    w.copy_(host_values(w.numel(), i))
bufs = [torch.empty(w.numel(), dtype=torch.uint8, pin_memory=True) for w in ws]
for b in bufs:
    b.fill_(0)  # warm: touched once before the cycles
side = torch.cuda.Stream()
def out():
    with torch.cuda.stream(side):
        for w, b in zip(ws, bufs):
            b.copy_(w, non_blocking=True)
    side.synchronize()
def back():
    with torch.cuda.stream(side):
        for w, b in zip(ws, bufs):
            w.copy_(b, non_blocking=True)
    side.synchronize()
def check():
    for i, w in enumerate(ws):
        assert int(w[-1:].cpu()) == i % 251 + 1
timed(out, back, check)
"""


def run(
    name: str, body: str, args: argparse.Namespace, one_tensor: bool = False
) -> list[tuple[float, float]] | str:
    runtime = HOSTCUDA / "runtime"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HOSTCUDA_") and k != "STEPALLOC_CONF"
    }
    env.update(
        {
            "LD_PRELOAD": str(runtime / "libcudart.so.13"),
            "LD_LIBRARY_PATH": os.pathsep.join(
                [
                    str(runtime),
                    str(HOSTCUDA),
                    str(HOSTCUDA / "standins"),
                    os.environ.get("LD_LIBRARY_PATH", ""),
                ]
            ),
            "HOSTCUDA_DEVICES": "1",
            "HOSTCUDA_CAPACITY_MB": str(args.capacity_mb),
            "PYTORCH_CUDA_ALLOC_CONF": "",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "python_shim"), env.get("PYTHONPATH", "")]),
        }
    )
    params = {
        "backup": args.backup_mb * MIB,
        "discard": args.discard_mb * MIB,
        "tensors": args.tensors,
        "cycles": args.cycles,
        "one_tensor": one_tensor,
    }
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(COMMON) + textwrap.dedent(body),
            json.dumps(params),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return [tuple(c) for c in json.loads(line[len("RESULT ") :])]
    tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
    return f"{name} failed ({r.returncode}): " + " | ".join(tail)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backup-mb", type=int, default=1024)
    ap.add_argument("--discard-mb", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=257)
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--capacity-mb", type=int, default=4096)
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated columns to run (stepalloc,tms_default,tms_floor,host_copy)",
    )
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if args.cycles < 2:
        ap.error("--cycles must be at least 2 (the first cycle is warm-up)")
    variants = [
        ("stepalloc", STEPALLOC, False),
        ("tms_default", TMS, False),
        ("tms_floor", TMS, True),
        ("host_copy", HOST_COPY, False),
    ]
    only = {v for v in args.only.split(",") if v}
    results: dict[str, object] = {}
    for name, body, one in variants:
        if only and name not in only:
            continue
        results[name] = run(name, body, args, one)
    print(
        f"one cycle: pause + resume of {args.backup_mb} MiB backed up in {args.tensors} tensors + "
        f"{args.discard_mb} MiB discarded; median of cycles 2..{args.cycles} on testdrv (host memory)"
    )
    print(
        f"{'variant':<12} {'pause ms':>9} {'resume ms':>10} {'cycle ms':>9} {'GiB/s':>7}"
        f" {'vs floor':>9} {'cycle CPU ms':>13} {'vs floor':>9}"
    )
    floor = floor_cpu = None
    rows = {}
    for name, res in results.items():
        if isinstance(res, str):
            print(f"{name:<12} {res}")
            continue
        steady = res[1:]
        rows[name] = {
            "pause_s": statistics.median(c[0] for c in steady),
            "resume_s": statistics.median(c[1] for c in steady),
            "cycle_s": statistics.median(c[0] + c[1] for c in steady),
            "cycle_cpu_s": statistics.median(c[2] for c in steady),
            "cycles": res,
        }
        if name == "tms_floor":
            floor, floor_cpu = rows[name]["cycle_s"], rows[name]["cycle_cpu_s"]
    for name, row in rows.items():
        # backed-up bytes, out and back, per wall second
        gibs = 2 * args.backup_mb / 1024 / row["cycle_s"]
        ratio = f"{row['cycle_s'] / floor:.2f}x" if floor else "-"
        ratio_cpu = f"{row['cycle_cpu_s'] / floor_cpu:.2f}x" if floor_cpu else "-"
        print(
            f"{name:<12} {row['pause_s'] * 1e3:>9.1f} {row['resume_s'] * 1e3:>10.1f}"
            f" {row['cycle_s'] * 1e3:>9.1f} {gibs:>7.2f} {ratio:>9}"
            f" {row['cycle_cpu_s'] * 1e3:>13.1f} {ratio_cpu:>9}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "rows": rows,
                    "errors": {k: v for k, v in results.items() if isinstance(v, str)},
                },
                indent=1,
            )
        )
    return 0 if all(not isinstance(v, str) for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
