#!/usr/bin/env python3
"""What autograd's thread following a pool costs (``stepalloc.follow``) in MemPool mode: the
time of one small ``torch.autograd.grad()`` (a custom Function, one allocation each way) with the
follow off and on, outside any pool and inside ``use_mem_pool(stepalloc.mempool())`` (a
``stepalloc.region`` needs ``install()``, so MemPool mode has none to measure): the fastest of
five runs of 1000 calls each (the machines this runs on are shared; the fastest run is the one
least disturbed), after 200 to warm up, the configurations interleaved.

Runs over testdrv's stub CUDA runtime (kernels do not run; see docs/testing.md, "Real PyTorch
over stubs"), so the figures are the Python and allocator overhead per backward call:

    testdrv/build.sh && python3 testdrv/standins.py target/hostcuda/standins
    cargo build --release -p stepalloc-cabi
    LD_PRELOAD=$PWD/target/hostcuda/runtime/libcudart.so.13 \\
    LD_LIBRARY_PATH=$PWD/target/hostcuda/runtime:$PWD/target/hostcuda:$PWD/target/hostcuda/standins \\
    HOSTCUDA_DEVICES=2 HOSTCUDA_CAPACITY_MB=1024 PYTHONPATH=python_shim python3 scripts/follow_bench.py
"""

from __future__ import annotations

import os
import sys
import time

import torch

import stepalloc


class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return torch.empty(1024, device="cuda")

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return torch.empty(1024, device="cuda")


def main() -> None:
    stepalloc.configure("backend:cuda")
    pool = stepalloc.mempool()
    x = torch.empty(1024, device="cuda", requires_grad=True)
    g = torch.empty(1024, device="cuda")

    def once() -> None:
        torch.autograd.grad(_F.apply(x), x, grad_outputs=g)

    def run(n: int, where: str) -> float:
        t = time.perf_counter()
        for _ in range(n):
            if where == "use_mem_pool":
                with torch.cuda.use_mem_pool(pool):
                    once()
            else:
                once()
        return (time.perf_counter() - t) / n * 1e6

    figures: dict[tuple[bool, str], list[float]] = {}
    for _ in range(5):
        for on in (False, True):
            (stepalloc.follow.enable if on else stepalloc.follow.disable)()
            for where in ("outside", "use_mem_pool"):
                run(200, where)
                figures.setdefault((on, where), []).append(run(1000, where))
    print("| where | follow off, us per backward | follow on | on - off |")
    print("|---|---|---|---|")
    for where in ("outside", "use_mem_pool"):
        off, on = (min(figures[(f, where)]) for f in (False, True))
        print(f"| {where} | {off:.1f} | {on:.1f} | {on - off:+.1f} |")
    if os.environ.get("FOLLOW_BENCH_RAW"):
        print(figures)
    sys.stdout.flush()
    os._exit(0)  # autograd's threads and the stub runtime: skip interpreter teardown


if __name__ == "__main__":
    main()
