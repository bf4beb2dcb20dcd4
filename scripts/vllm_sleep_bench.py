#!/usr/bin/env python3
"""vLLM 0.34's sleep-mode allocator against stepalloc.cumem on the same tensors, over testdrv's
host-memory driver, in vLLM's environment (scripts/vllm_venv.sh: torch 2.14, vLLM 0.34).

A cycle is what vLLM's default backend does: ``sleep(offload_tags=("weights", "runtime",
"cudagraph"))`` then ``wake_up()``, over ``--weights-mb`` (default 1 GiB) of weights in
``--tensors`` tensors (default 257, sizes varied like a model's), ``--kv-mb`` (default 512 MiB)
of KV cache (discarded), and a CUDA graph captured into ``cudagraph_pool()`` whose private pool
holds ``--graph-live-mb`` of outputs the replay writes and ``--graph-scratch-mb`` of
temporaries freed inside the capture (the graph's scratch). The first cycle allocates the host
buffers; the figures are the first cycle and the median of cycles 2..N. ``graph copied MiB``
is what a sleep backs up of the graph pool. Columns: vLLM's ``CuMemAllocator``;
``stepalloc.cumem`` as vLLM uses it (MemPool mode); ``stepalloc.cumem`` under
``stepalloc.install()``.

    scripts/vllm_sleep_bench.py --cycles 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOSTCUDA = ROOT / "target" / "hostcuda"
VENV_PYTHON = ROOT / "target" / "vllm-venv" / "bin" / "python"

CHILD = r"""
import json, sys, time, torch
A = json.loads(sys.argv[1])
MIB = 1 << 20
if A["mode"] == "installed":
    import stepalloc
    stepalloc.install("backend:cuda")
if A["impl"] == "vllm":
    from vllm.device_allocator.cumem import CuMemAllocator
else:
    from stepalloc.cumem import CuMemAllocator
allocator = CuMemAllocator.get_instance()
n, total = A["tensors"], A["weights_mb"] * MIB
shares = [1 + (i * 7919) % 3 for i in range(n)]
sizes = [max(512, int(total * s / sum(shares)) // 512 * 512) for s in shares]
with allocator.use_memory_pool("weights"):
    weights = [torch.full((s,), i % 251 + 1, dtype=torch.uint8).to("cuda") for i, s in enumerate(sizes)]
with allocator.use_memory_pool("kv_cache"):
    kv = torch.empty(A["kv_mb"] * MIB, dtype=torch.uint8, device="cuda")
src = torch.ones(A["graph_live_mb"] * MIB, dtype=torch.uint8).to("cuda")
graph = torch.cuda.CUDAGraph()
with allocator.cudagraph_pool() as pool, torch.cuda.graph(graph, pool=pool):
    scratch = torch.empty(A["graph_scratch_mb"] * MIB, dtype=torch.uint8, device="cuda")
    scratch[: min(scratch.numel(), src.numel())].copy_(src[: scratch.numel()])
    del scratch  # a temporary of the captured step: free inside the graph's pool
    out = torch.empty(A["graph_live_mb"] * MIB, dtype=torch.uint8, device="cuda")
    out.copy_(src)
torch.cuda.synchronize()

def graph_copied():
    if A["impl"] == "vllm":
        return sum(d.handle[1] for d in allocator.pointer_to_data.values()
                   if d.tag == "cudagraph" and d.cpu_backup_tensor is not None)
    import stepalloc.sleep
    return int(stepalloc.sleep.tags().get("cudagraph", {}).get("backup_bytes", 0))

cycles = []
for c in range(A["cycles"]):
    t0 = time.perf_counter()
    allocator.sleep(offload_tags=("weights", "runtime", "cudagraph"))
    t1 = time.perf_counter()
    copied = graph_copied()
    allocator.wake_up()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    cycles.append((t1 - t0, t2 - t1, copied))
graph.replay()
torch.cuda.synchronize()
assert bool((out.cpu() == 1).all()), "the graph's output is wrong after the cycles"
for i in (0, len(weights) // 2, len(weights) - 1):
    assert bool((weights[i].cpu() == i % 251 + 1).all()), f"weights[{i}] lost its bytes"
print("RESULT " + json.dumps(cycles), flush=True)
"""


def run(impl: str, mode: str, args: argparse.Namespace) -> list[tuple[float, float, int]]:
    env = {k: v for k, v in os.environ.items() if k not in ("STEPALLOC_CONF", "PYTHONPATH")}
    env.update(
        LD_PRELOAD=str(HOSTCUDA / "runtime" / "libcudart.so.13"),
        LD_LIBRARY_PATH=os.pathsep.join(str(p) for p in (HOSTCUDA / "runtime", HOSTCUDA, HOSTCUDA / "standins-vllm")),
        PYTHONPATH=str(ROOT / "python_shim"),
        HOSTCUDA_DEVICES="1",
        HOSTCUDA_CAPACITY_MB=str(args.capacity_mb),
        PYTORCH_CUDA_ALLOC_CONF="",
    )
    a = {k: getattr(args, k) for k in ("tensors", "weights_mb", "kv_mb", "graph_live_mb", "graph_scratch_mb", "cycles")}
    a.update(impl=impl, mode=mode)
    r = subprocess.run([str(VENV_PYTHON), "-c", CHILD, json.dumps(a)], env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        sys.exit(f"{impl} {mode} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return [tuple(c) for c in json.loads(lines[0][len("RESULT ") :])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights-mb", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=257)
    ap.add_argument("--kv-mb", type=int, default=512)
    ap.add_argument("--graph-live-mb", type=int, default=64)
    ap.add_argument("--graph-scratch-mb", type=int, default=256)
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--capacity-mb", type=int, default=4096)
    args = ap.parse_args()
    if not VENV_PYTHON.exists() or not (HOSTCUDA / "standins-vllm").is_dir():
        sys.exit("needs vLLM's environment: scripts/vllm_venv.sh, testdrv/build.sh, scripts/vllm_standins.sh")
    print(f"{args.weights_mb} MiB of weights in {args.tensors} tensors backed up, {args.kv_mb} MiB of KV cache "
          f"discarded, a graph pool of {args.graph_live_mb} MiB of outputs and {args.graph_scratch_mb} MiB of "
          f"scratch; {args.cycles} cycles")
    print(f"{'allocator':28} {'sleep 1st s':>11} {'wake 1st s':>10} {'sleep s':>8} {'wake s':>7} {'graph copied MiB':>17}")
    for impl, mode, label in (
        ("vllm", "mempool", "vLLM 0.34 CuMemAllocator"),
        ("stepalloc", "mempool", "stepalloc.cumem (MemPool)"),
        ("stepalloc", "installed", "stepalloc.cumem (install)"),
    ):
        cycles = run(impl, mode, args)
        rest = cycles[1:] or cycles
        sleep_s = statistics.median(c[0] for c in rest)
        wake_s = statistics.median(c[1] for c in rest)
        print(f"{label:28} {cycles[0][0]:11.3f} {cycles[0][1]:10.3f} {sleep_s:8.3f} {wake_s:7.3f} "
              f"{cycles[-1][2] / (1 << 20):17.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
