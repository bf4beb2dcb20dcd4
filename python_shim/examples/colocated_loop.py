"""A colocated agent loop: a rollout engine and a trainer take turns on one device, each
handing its memory to the other between phases with ``stepalloc.pause`` / ``resume``.

  * engine: weights (tag ``engine_weights``, backed up to host memory while asleep) and a KV
    cache (tag ``kv_cache``, discarded while asleep, refilled by the next rollout);
  * trainer: parameters and optimizer state (tag ``trainer``, backed up), gradients and
    activations (tag ``trainer_scratch``, discarded: they are rebuilt every step).

Each iteration: wake the engine, roll out (fill the KV cache), put it to sleep; wake the
trainer, run a step (activations, gradients, an optimizer update), sync the new weights into
the engine's, put the trainer to sleep. Together the two sides need more than the device has;
each alone fits. The loop checks that every tensor kept its bytes and its address through the
sleeps, and prints per phase the device memory in use, the bytes copied and the switch time.

The work is done with copies (a fill stands in for a kernel), so the loop runs on any CUDA
device and on testdrv's host-memory driver (scripts/test.sh; the numbers then are host-memory
numbers). Run from the repository root after ``cargo build --release -p stepalloc-cabi``::

    python python_shim/examples/colocated_loop.py --iterations 4 --unit-mb 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import stepalloc
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import stepalloc

try:
    import torch
except ImportError:
    sys.exit("This example needs PyTorch: `pip install torch`.")

MIB = 1 << 20


def fill(t: torch.Tensor, value: int) -> None:
    """Sets every byte of ``t`` (a copy from the host: no kernel needed)."""
    t.copy_(torch.full(t.shape, value, dtype=t.dtype))


def check(t: torch.Tensor, value: int, what: str) -> None:
    host = t.cpu()
    if not bool((host[:: max(1, host.numel() // 64)] == value).all()) or int(host[-1]) != value:
        raise SystemExit(f"{what}: bytes changed across a sleep")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument(
        "--unit-mb",
        type=int,
        default=64,
        help="size unit: weights 3, KV 6, params 2, optimizer 4, grads 2, activations 4 units",
    )
    ap.add_argument("--tensors", type=int, default=16, help="tensors per weight set (models are many tensors)")
    ap.add_argument("--conf", default="backend:cuda," + stepalloc.RECOMMENDED)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("This example needs a CUDA device (or testdrv's host-memory driver).", file=sys.stderr)
        return 1
    stepalloc.install(args.conf)
    u = args.unit_mb * MIB
    n = args.tensors

    def tensors(total: int) -> list[torch.Tensor]:
        return [torch.empty(total // n, dtype=torch.uint8, device="cuda") for _ in range(n)]

    # The engine is built first, then put to sleep so that the trainer can be built.
    with stepalloc.region("engine_weights", backup=True):
        weights = tensors(3 * u)
    for w in weights:
        fill(w, 1)
    with stepalloc.region("kv_cache"):
        kv = torch.empty(6 * u, dtype=torch.uint8, device="cuda")
    stepalloc.pause()  # every tag so far
    with stepalloc.region("trainer", backup=True):
        params = tensors(2 * u)
        optim = tensors(4 * u)
    for p in params:
        fill(p, 1)
    with stepalloc.region("trainer_scratch"):
        grads = tensors(2 * u)
    stepalloc.pause("trainer")
    stepalloc.pause("trainer_scratch")
    addresses = [t.data_ptr() for t in weights + params + optim + grads] + [kv.data_ptr()]

    _, total = torch.cuda.mem_get_info()
    print(
        f"device {total / MIB:.0f} MiB; engine {9 * u / MIB:.0f} MiB, trainer {12 * u / MIB:.0f} MiB "
        f"(both: {21 * u / MIB:.0f} MiB)"
    )
    print(f"{'iter':>4} {'phase':<8} {'in use MiB':>10} {'copied MiB':>10} {'switch ms':>9} {'GiB/s':>6}")
    peak = 0
    switch_s = 0.0
    last = 1  # the value the weights and parameters hold
    for it in range(1, args.iterations + 1):
        version = 2 + it % 200
        # --- rollout -------------------------------------------------------------------
        # Both engine tags in one call: the cache's maps run under the weights' copies.
        woke = stepalloc.resume(["engine_weights", "kv_cache"])
        for w in weights:
            check(w, last, "engine weights")
        for i in range(0, kv.numel(), u):  # the KV cache grows as tokens are generated
            fill(kv[i : i + u], version)
        free, _ = torch.cuda.mem_get_info()
        in_use = total - free
        peak = max(peak, in_use)
        slept = stepalloc.pause(["kv_cache", "engine_weights"])
        seconds = woke.seconds + slept.seconds
        copied = woke.copied_bytes + slept.copied_bytes
        switch_s += seconds
        gibs = copied / (1 << 30) / seconds if seconds else 0.0
        print(f"{it:>4} {'rollout':<8} {in_use / MIB:>10.0f} {copied / MIB:>10.0f} {seconds * 1e3:>9.1f} {gibs:>6.2f}")
        # --- train ---------------------------------------------------------------------
        woke = stepalloc.resume(["trainer", "trainer_scratch"])
        for p in params:
            check(p, last, "trainer parameters")
        with stepalloc.region("trainer_scratch"):
            activations = tensors(4 * u)  # built by the forward pass, freed by the backward
            for a in activations:
                fill(a, version)
            for g in grads:
                fill(g, version)
            del activations
        for o in optim:
            fill(o, version)
        for p in params:
            fill(p, version)  # the optimizer step
        free, _ = torch.cuda.mem_get_info()
        in_use = total - free
        peak = max(peak, in_use)
        slept = stepalloc.pause(["trainer_scratch", "trainer"])
        # Weight sync: the engine takes the trainer's new weights (through the host here; a
        # real loop copies device to device or broadcasts).
        synced = stepalloc.resume("engine_weights")
        for w in weights:
            fill(w, version)
        sync_pause = stepalloc.pause("engine_weights")
        seconds = woke.seconds + slept.seconds + synced.seconds + sync_pause.seconds
        copied = woke.copied_bytes + slept.copied_bytes + synced.copied_bytes + sync_pause.copied_bytes
        switch_s += seconds
        last = version
        gibs = copied / (1 << 30) / seconds if seconds else 0.0
        print(f"{it:>4} {'train':<8} {in_use / MIB:>10.0f} {copied / MIB:>10.0f} {seconds * 1e3:>9.1f} {gibs:>6.2f}")

    now = [t.data_ptr() for t in weights + params + optim + grads] + [kv.data_ptr()]
    if now != addresses:
        raise SystemExit("an address moved across a sleep")
    fits = peak <= total and 21 * u > total
    print(
        f"peak in use {peak / MIB:.0f} MiB of {total / MIB:.0f} MiB; "
        f"both sides resident would need {21 * u / MIB:.0f} MiB"
    )
    print(
        f"addresses kept: yes; bytes kept: yes; switch time {switch_s * 1e3:.0f} ms over {args.iterations} iterations"
    )
    print("fits: " + ("yes" if fits else "no"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
