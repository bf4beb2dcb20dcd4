#!/usr/bin/env python3
"""The colocated rollout/train loop at the 7 B model's size, under process-wide stepalloc: a
rollout engine (the 7 B LLaVA model's weights, e2e_model.py's ``7b`` size, one tensor per
parameter, backed up; and a KV cache, discarded) and a trainer (its own copy of the weights and
AdamW's two states, backed up, for full fine-tuning, or the frozen base alone for LoRA, as
e2e_model.pick_variant picks for this device; gradients and activations, discarded) take turns
on one device, each handing its memory to the other with ``stepalloc.pause`` / ``resume``.

One iteration, as a colocated RL loop runs it (verl's order): the engine wakes its KV cache and
rolls out, then sleeps (its weights copied out, the cache discarded); the trainer wakes (its
state copied in, its scratch mapped), runs a step, wakes the engine's weights and copies its new
weights into them on the device, then sleeps (its state copied out, the scratch discarded).
Copied per iteration: the weights out, the trainer's state in and out, the weights in. The
engine's own pauses and resumes are also reported apart (``engine_*``): that is the switch
``stepalloc-stress colocated`` models (its trainer stays resident), to be compared with it at
the measured link speed (``link_gbps``: ``--link-gbps``).

The switch time (every pause and resume of the iteration, wall clock with a synchronize) is set
against the pinned-copy floor: the same bytes at the bandwidth a pinned ``copy_()`` reaches in
this process, each way (a 1 GiB buffer on a GPU). Iteration 1 pins the host buffers; the figures
are the median of the iterations after it. Addresses and bytes are checked (samples of every
tensor; on testdrv the first and last bytes, its stub runtime runs no kernels).

Over testdrv's host-memory driver (``STEPALLOC_HOSTCUDA=1``) every size is divided by
``--scale`` (default 256 there, 1 on a GPU) and every 16 consecutive weight tensors are one
(``--group``: there every copy waits ``HOSTCUDA_DELAY_US``). Prints one JSON object (the last
line).
Usage: colocated_7b.py [--scale N] [--group N] [--kv-gb G] [--activations-gb G] [--iterations N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from e2e_model import SIZES, build_model, pick_variant  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
ENGINE, KV, TRAINER, SCRATCH = "engine_weights", "kv_cache", "trainer", "trainer_scratch"
# The engine's calls; its two tags go in one call where both switch together (stepalloc's
# pause_tags / resume_tags: the cache's unmaps and maps under the weights' copies).
ENGINE_CALLS = {"resume engine", "resume kv", "pause engine", "resume weights"}


def on_host_driver() -> bool:
    return os.environ.get("STEPALLOC_HOSTCUDA", "") not in ("", "0")


def weight_sizes(torch, scale: int, group: int) -> tuple[list[int], int]:
    """The 7 B model's parameter tensors in bytes (bf16), from the model built on the meta
    device, every `group` consecutive ones as one tensor, each divided by `scale` (at least 512,
    a multiple of 512); and the model's parameter count."""
    model = build_model(torch, SIZES["7b"], "meta")
    numels = [p.numel() for p in model.parameters()]
    grouped = [sum(numels[i : i + group]) for i in range(0, len(numels), group)]
    return [max(512, (2 * n // scale) // 512 * 512) for n in grouped], sum(numels)


def run(a: argparse.Namespace) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skip": "torch has no CUDA device here"}
    import stepalloc

    host = on_host_driver()
    sizes, params = weight_sizes(torch, a.scale, a.group)
    stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED)
    total = torch.cuda.mem_get_info()[1]
    train = pick_variant(SIZES["7b"], params // a.scale, total)
    full = train["variant"] == "full"
    kv_bytes = int(a.kv_gb * GIB) // a.scale // MIB * MIB
    act_bytes = int(a.activations_gb * GIB) // a.scale // MIB * MIB
    out: dict = {
        "device": torch.cuda.get_device_name(0),
        "host_memory_driver": host,
        "scale": a.scale,
        "group": a.group,
        "total_bytes": total,
        "train": train,
    }

    def fill(t, value: int) -> None:
        if host:  # no kernels on testdrv: a copy from the host
            t.copy_(torch.full(t.shape, value, dtype=t.dtype))
        else:
            t.fill_(value)

    def holds(t, value: int) -> bool:
        if host:
            n = min(64, t.numel())
            return bool((t[:n].cpu() == value).all()) and bool((t[-n:].cpu() == value).all())
        step = max(1, t.numel() // 4096)
        return bool((t[::step] == value).all()) and int(t[-1]) == value

    def tensors(byte_sizes: list[int]) -> list:
        return [torch.empty(n, dtype=torch.uint8, device="cuda") for n in byte_sizes]

    # The engine, then asleep so that the trainer can be built.
    with stepalloc.region(ENGINE, backup=True):
        weights = tensors(sizes)
    for w in weights:
        fill(w, 1)
    with stepalloc.region(KV):
        kv = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
    stepalloc.pause(KV)
    stepalloc.pause(ENGINE)
    with stepalloc.region(TRAINER, backup=True):
        params_t = tensors(sizes)  # the trainer's weights (the frozen base, for LoRA)
        # AdamW's two states in bf16 for full fine-tuning; LoRA's adapters and their states
        # are about 1% of the weights.
        states = tensors(sizes + sizes) if full else tensors([max(512, sum(sizes) // 100 // 512 * 512)])
    for p in params_t:
        fill(p, 1)
    with stepalloc.region(SCRATCH):
        grads = tensors(sizes) if full else tensors([max(512, sum(sizes) // 100 // 512 * 512)])
        acts = torch.empty(act_bytes, dtype=torch.uint8, device="cuda")
    stepalloc.pause(SCRATCH)
    stepalloc.pause(TRAINER)
    engine_bytes, state_bytes = sum(sizes), sum(sizes) + sum(t.numel() for t in states)
    scratch_bytes = sum(t.numel() for t in grads) + act_bytes
    out["sizes"] = {
        "weights_bytes": engine_bytes,
        "weight_tensors": len(sizes),
        "kv_bytes": kv_bytes,
        "trainer_backed_up_bytes": state_bytes,
        "trainer_discarded_bytes": scratch_bytes,
        "both_resident_bytes": engine_bytes + kv_bytes + state_bytes + scratch_bytes,
    }
    addresses = [t.data_ptr() for t in weights + params_t + states + grads] + [kv.data_ptr(), acts.data_ptr()]

    # The floor: a pinned copy_() of a buffer kept in this process, each way.
    n = min(GIB, engine_bytes)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(0)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    bw: dict[str, list[float]] = {"out": [], "in": []}
    for _ in range(3):
        for key, dst, src in (("out", pinned, dev), ("in", dev, pinned)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            bw[key].append(n / (time.perf_counter() - t0))
    del dev
    floor_out, floor_in = statistics.median(bw["out"][1:]), statistics.median(bw["in"][1:])
    out["copy_bytes_s"] = {"out": floor_out, "in": floor_in, "bytes": n}

    iterations = []
    peak = 0
    bytes_kept = True
    last = 1
    for it in range(1, a.iterations + 1):
        version = 2 + it % 200
        calls: list[tuple[str, float, int, int]] = []  # (call, seconds, copied out, copied in)

        def switch(name: str, fn, direction: str) -> None:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = fn()
            torch.cuda.synchronize()
            s = time.perf_counter() - t0
            copied = r.copied_bytes
            calls.append((name, s, copied if direction == "out" else 0, copied if direction == "in" else 0))

        def in_use() -> int:
            free, _ = torch.cuda.mem_get_info()
            return total - free

        # --- rollout (the engine's weights are awake: built so, or synced by the last step)
        if it == 1:
            switch("resume engine", lambda: stepalloc.resume([ENGINE, KV]), "in")
        else:
            switch("resume kv", lambda: stepalloc.resume(KV), "in")
        bytes_kept &= all(holds(w, last) for w in weights)
        fill(kv, version)  # the KV cache fills as tokens are generated
        peak = max(peak, in_use())
        switch("pause engine", lambda: stepalloc.pause([KV, ENGINE]), "out")
        # --- train
        switch("resume trainer", lambda: stepalloc.resume([TRAINER, SCRATCH]), "in")
        bytes_kept &= all(holds(p, last) for p in params_t)
        fill(acts, version)
        for g in grads:
            fill(g, version)
        for s in states:
            fill(s, version)
        for p in params_t:
            fill(p, version)  # the optimizer step
        peak = max(peak, in_use())
        switch("pause scratch", lambda: stepalloc.pause(SCRATCH), "out")
        # --- weight sync on the device, then the trainer sleeps
        switch("resume weights", lambda: stepalloc.resume(ENGINE), "in")
        for w, p in zip(weights, params_t):
            w.copy_(p)
        peak = max(peak, in_use())
        switch("pause trainer", lambda: stepalloc.pause(TRAINER), "out")
        last = version
        s = sum(c[1] for c in calls)
        copied_out, copied_in = sum(c[2] for c in calls), sum(c[3] for c in calls)
        floor = copied_out / floor_out + copied_in / floor_in
        # The engine's own calls: the switch the stress tool's colocated workload models (its
        # trainer stays resident), copied bytes against the same floor.
        engine = [c for c in calls if c[0] in ENGINE_CALLS]
        engine_s = sum(c[1] for c in engine)
        engine_floor = sum(c[2] for c in engine) / floor_out + sum(c[3] for c in engine) / floor_in
        iterations.append(
            {
                "iteration": it,
                "engine_switch_s": engine_s,
                "engine_floor_s": engine_floor,
                "engine_over_floor": engine_s / engine_floor if engine_floor else 0.0,
                "switch_s": s,
                "copied_out_bytes": copied_out,
                "copied_in_bytes": copied_in,
                "floor_s": floor,
                "over_floor": s / floor if floor else 0.0,
                "calls": [{"call": c[0], "s": c[1]} for c in calls],
            }
        )
    bytes_kept &= all(holds(w, last) for w in weights)
    now = [t.data_ptr() for t in weights + params_t + states + grads] + [kv.data_ptr(), acts.data_ptr()]
    steady = iterations[1:] or iterations
    out["iterations"] = iterations
    out["switch_s"] = statistics.median(r["switch_s"] for r in steady)
    out["floor_s"] = statistics.median(r["floor_s"] for r in steady)
    out["over_floor"] = statistics.median(r["over_floor"] for r in steady)
    out["engine_switch_s"] = statistics.median(r["engine_switch_s"] for r in steady)
    out["engine_over_floor"] = statistics.median(r["engine_over_floor"] for r in steady)
    # The link speed to give `stepalloc-stress colocated --link-gbps` for the same comparison.
    out["link_gbps"] = 2 / (1 / floor_out + 1 / floor_in) / 1e9
    out["first_switch_s"] = iterations[0]["switch_s"]
    out["peak_in_use_bytes"] = peak
    out["addresses_kept"] = now == addresses
    out["bytes_kept"] = bytes_kept
    out["needs_switch"] = out["sizes"]["both_resident_bytes"] > total
    return out


def main() -> int:
    host = on_host_driver()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=256 if host else 1, help="every size divided by this")
    ap.add_argument(
        "--group",
        type=int,
        default=16 if host else 1,
        help="consecutive weight tensors made one (testdrv: 16, as every copy there waits HOSTCUDA_DELAY_US)",
    )
    ap.add_argument("--kv-gb", type=float, default=16.0, help="the engine's KV cache, GiB before --scale")
    ap.add_argument("--activations-gb", type=float, default=4.0, help="the trainer's activations, GiB before --scale")
    ap.add_argument("--iterations", type=int, default=3, help="iterations (the first pins the host buffers)")
    a = ap.parse_args()
    if not (
        1 <= a.scale <= 65536
        and 1 <= a.group <= 1024
        and 0 < a.kv_gb <= 1024
        and 0 < a.activations_gb <= 1024
        and 2 <= a.iterations
    ):
        ap.error(
            "--scale 1..65536, --group 1..1024, --kv-gb and --activations-gb in (0, 1024], --iterations at least 2"
        )
    doc = run(a)
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
