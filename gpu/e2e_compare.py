#!/usr/bin/env python3
"""End-to-end comparison on a real model: stepalloc against PyTorch's own allocator.

The model is a LLaVA-style multimodal model built from a transformers configuration with random
weights (a CLIP ViT-L/14-336 vision tower, a projector and a 1.1 B Llama language model: 1.4 B
parameters in bf16; nothing is downloaded). The workload is an agent loop: each iteration
rolls out a batch (prefill with 0-3 images per sample and a prompt of variable length, then a
greedy decode loop under torch.no_grad with HF's growing KV cache) and then trains on the
episodes (gradient checkpointing, AdamW). Every configuration runs in its own process:

  native_record      PyTorch's allocator, with torch.cuda.memory._record_memory_history; its
                     snapshot is replayed by `stepalloc-stress replay --compare pytorch stepalloc`
  native             PyTorch's allocator, default settings
  native_expandable  PyTorch's allocator, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  stepalloc          stepalloc.install() (process-wide, the recommended configuration)
  stepalloc_mempool  stepalloc.mempool() around the loop (MemPool mode; the autograd thread's
                     allocations stay in PyTorch's default pool, as torch.cuda.use_mem_pool says)

Per configuration: peak reserved, peak allocated, reserved / allocated, the driver's peak used
memory, the median step time, device mallocs (maps and creates under stepalloc) per steady
step, and the headroom: the largest batch whose largest iteration fits under
torch.cuda.set_per_process_memory_fraction(cap / total), found by doubling and bisection over a
few probes. The cap is the native_record run's peak reserved times --headroom-factor, so the
search is quick and the same for every configuration.

Dry run (`--dry-run`, or no CUDA device): a tiny configuration on the CPU through the same
code; the allocator set-up, the statistics and the headroom search are skipped with a message,
and the PyTorch profiler's memory events stand in for the memory history (written as a snapshot
in torch's layout, so the replay path is the same).

Usage: e2e_compare.py --out DIR [--stress BIN] [--budget S] [--configs NAME...] [--dry-run]
Writes DIR/e2e.json, DIR/e2e.txt and one DIR/NAME.json / NAME.log per configuration.
Exit status: 0 when every configuration ran, 1 when one failed, 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import gzip
import json
import math
import os
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
MIB = 1 << 20

CONFIGS = {
    "native_record": {"alloc": "native", "env": {}, "record": True, "headroom": False},
    "native": {"alloc": "native", "env": {}},
    "native_expandable": {"alloc": "native", "env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}},
    "stepalloc": {"alloc": "stepalloc", "env": {}},
    "stepalloc_mempool": {"alloc": "mempool", "env": {}},
}
MEASURED = ["native", "native_expandable", "stepalloc", "stepalloc_mempool"]


@dataclasses.dataclass(frozen=True)
class Size:
    """The model and the workload: vision tower, language model, batch, shapes, iterations."""

    v_hidden: int
    v_layers: int
    v_heads: int
    v_inter: int
    image: int
    patch: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int
    batch: int
    max_images: int
    prompt: tuple[int, int]
    new_tokens: tuple[int, int]
    warmup: int
    iters: int


SIZES = {
    # CLIP ViT-L/14-336 (0.30 B) + projector + a 1.1 B Llama (TinyLlama's shape): 1.4 B params.
    "full": Size(1024, 24, 16, 4096, 336, 14, 2048, 22, 16, 4, 5632, 32064, 4, 3, (128, 768), (8, 32), 2, 6),
    "tiny": Size(64, 2, 4, 128, 56, 14, 64, 2, 4, 2, 176, 1024, 2, 2, (8, 32), (2, 6), 1, 2),
}


def log(*a: object) -> None:
    print(*a, flush=True)


# ----- the worker: one configuration in this process ----------------------------------------


def build_model(torch, size: Size, device: str):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=size.v_hidden,
        intermediate_size=size.v_inter,
        num_hidden_layers=size.v_layers,
        num_attention_heads=size.v_heads,
        image_size=size.image,
        patch_size=size.patch,
        projection_dim=size.v_hidden,
    )
    text = LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.inter,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=8192,
    )
    # The image token is the last id of the vocabulary; text tokens are drawn below it.
    cfg = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=size.vocab - 1, image_seq_length=image_tokens(size)
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # weights created in place, in bf16
            model = LlavaForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(old)
    return model


def image_tokens(size: Size) -> int:
    return (size.image // size.patch) ** 2  # "default" feature selection drops CLS


def iteration_plan(size: Size, seed: int, count: int) -> list[dict]:
    """The shapes of every iteration, the same in every configuration (seeded)."""
    rng = random.Random(seed)
    return [
        {
            "images": rng.randint(0, size.max_images),
            "prompt": rng.randint(*size.prompt),
            "new": rng.randint(*size.new_tokens),
        }
        for _ in range(count)
    ]


def largest(size: Size) -> dict:
    return {"images": size.max_images, "prompt": size.prompt[1], "new": size.new_tokens[1]}


class Loop:
    """The agent loop: rollout (no grad, growing KV cache), then a training step."""

    def __init__(self, torch, model, size: Size, device: str, step_marker):
        self.torch, self.model, self.size, self.device = torch, model, size, device
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.step_marker = step_marker
        import inspect

        from transformers import DynamicCache

        self.cache_cls = DynamicCache
        # transformers renamed past_key_values to cache (5.2x); use whichever forward takes.
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.gen = torch.Generator(device="cpu").manual_seed(0)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def inputs(self, shape: dict, batch: int):
        torch, size = self.torch, self.size
        n_img = shape["images"]
        text = torch.randint(0, size.vocab - 1, (batch, shape["prompt"]), generator=self.gen)
        img = torch.full((batch, n_img * image_tokens(size)), size.vocab - 1)
        ids = torch.cat([img, text], 1).to(self.device)
        pixels = None
        if n_img:
            pixels = torch.randn(batch * n_img, 3, size.image, size.image, generator=self.gen).to(
                self.device, torch.bfloat16
            )
        return ids, pixels

    def rollout(self, shape: dict, batch: int):
        torch = self.torch
        ids, pixels = self.inputs(shape, batch)
        self.model.eval()
        with self.step_marker("rollout"), torch.no_grad():
            cache = self.cache_cls()
            out = self.model(
                input_ids=ids, pixel_values=pixels, use_cache=True, logits_to_keep=1, **{self.cache_kw: cache}
            )
            tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
            del out
            for _ in range(shape["new"] - 1):
                out = self.model(input_ids=tokens[-1], use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
                tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
                del out
            del cache
            episode = torch.cat([ids, *tokens], 1)
        return episode, pixels

    def train(self, episode, pixels, shape: dict) -> float:
        self.model.train()
        with self.step_marker("train"):
            labels = episode.clone()
            labels[:, : shape["images"] * image_tokens(self.size)] = -100
            loss = self.model(input_ids=episode, pixel_values=pixels, labels=labels).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return float(loss.detach())

    def iteration(self, shape: dict, batch: int) -> dict:
        self.sync()
        t0 = time.perf_counter()
        episode, pixels = self.rollout(shape, batch)
        self.sync()
        t1 = time.perf_counter()
        loss = self.train(episode, pixels, shape)
        del episode, pixels
        self.sync()
        t2 = time.perf_counter()
        return {**shape, "batch": batch, "rollout_s": t1 - t0, "train_s": t2 - t1, "step_s": t2 - t0, "loss": loss}


class Stats:
    """Allocator statistics for this configuration (None on the CPU)."""

    def __init__(self, torch, alloc: str, device: str):
        self.torch, self.alloc, self.device = torch, alloc, device
        self.device_used_peak = 0

    def sample_device(self) -> None:
        if self.device == "cuda":
            free, total = self.torch.cuda.mem_get_info()
            self.device_used_peak = max(self.device_used_peak, total - free)

    def read(self) -> dict | None:
        if self.device != "cuda":
            return None
        if self.alloc == "stepalloc":
            import stepalloc

            s = dict(stepalloc.memory_stats(0))
        else:
            s = dict(self.torch.cuda.memory_stats())
        out = {
            k: int(s.get(k, 0))
            for k in (
                "reserved_bytes.all.peak",
                "reserved_bytes.all.current",
                "allocated_bytes.all.peak",
                "allocated_bytes.all.current",
                "num_device_alloc",
                "num_device_free",
                "num_alloc_retries",
                "num_ooms",
            )
        }
        if self.alloc in ("stepalloc", "mempool"):
            import stepalloc

            own = stepalloc.stepalloc_stats(0)
            out["stepalloc"] = {k: own.get(k) for k in ("num_create", "num_map", "num_unmap", "mapped_bytes")}
            out["stepalloc"]["driver_s"] = sum(v for k, v in own.items() if k.startswith("driver_seconds."))
            out["stepalloc"]["reserved_peak"] = int(stepalloc.memory_stats(0).get("reserved_bytes.all.peak", 0))
        return out


def is_oom(e: BaseException) -> bool:
    return "out of memory" in str(e).lower()


def search(fits, base: int, probes: int, time_left) -> tuple[int, int | None, bool]:
    """The largest batch that fits: doubling from `base` until one fails, then bisection, at
    most `probes` tries while `time_left()` holds. Returns (largest fitting batch, 0 when not
    even `base` fits; the smallest failing batch tried, None when none failed; whether the
    search finished, i.e. they are adjacent or `base` failed)."""
    lo, hi, tries = 0, None, 0
    b = base
    while tries < probes and time_left():
        if hi is None:
            tries += 1
            if fits(b):
                lo, b = b, b * 2
            else:
                hi = b
        elif hi - lo > 1 and lo > 0:
            tries += 1
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        else:
            break
    return lo, hi, hi is not None and (lo == 0 or hi - lo <= 1)


def headroom(torch, loop: Loop, size: Size, cap: int, probes: int, deadline: float, per_probe_s: float) -> dict:
    """The largest batch whose largest iteration fits under the cap (see `search`)."""
    total = torch.cuda.mem_get_info()[1]
    fraction = min(1.0, cap / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    shape = largest(size)
    tried: list[dict] = []

    def fits(batch: int) -> bool:
        gc.collect()
        torch.cuda.empty_cache()  # as a batch-size finder does between tries
        t = time.perf_counter()
        try:
            loop.iteration(shape, batch)
            ok = True
        except RuntimeError as e:
            if not is_oom(e):
                raise
            ok = False
        loop.opt.zero_grad(set_to_none=True)
        tried.append({"batch": batch, "fits": ok, "s": round(time.perf_counter() - t, 3)})
        log(f"headroom probe: batch {batch}: {'fits' if ok else 'out of memory'}")
        return ok

    lo, hi, exact = search(fits, size.batch, probes, lambda: time.time() + per_probe_s < deadline)
    if not exact:
        log(f"headroom search stopped after {len(tried)} probes (limit {probes} or the time budget)")
    torch.cuda.set_per_process_memory_fraction(1.0)
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "cap_bytes": cap,
        "fraction": round(fraction, 5),
        "probes": tried,
        "largest_batch": lo,
        "first_failing_batch": hi,
        "scale": lo / size.batch,
        "exact": exact,
    }


def cpu_snapshot(prof, path: Path) -> int:
    """The profiler's CPU memory events as a snapshot in torch's layout (device_traces only)."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if str(f.device) == "cpu" and f.alloc_size != 0:
                events.append((node.start_time_ns, f.ptr, f.alloc_size))
        stack.extend(node.children)
    events.sort(key=lambda e: e[0])
    trace = []
    for t, ptr, n in events:
        action = "alloc" if n > 0 else "free_completed"
        trace.append({"action": action, "addr": ptr, "size": abs(n), "stream": 0, "time_us": t // 1000})
    with open(path, "wb") as f:
        pickle.dump({"segments": [], "device_traces": [trace]}, f, protocol=4)
    return len(trace)


def worker(a: argparse.Namespace) -> int:
    spec = CONFIGS[a.worker]
    size = SIZES[a.size]
    t_start = time.time()
    import torch

    device = a.device
    notes: list[str] = []
    result: dict = {"config": a.worker, "device": device, "size": a.size, "alloc": spec["alloc"], "notes": notes}
    pool_ctx = None
    if device == "cuda":
        if spec["alloc"] in ("stepalloc", "mempool"):
            import stepalloc

            if spec["alloc"] == "stepalloc":
                inst = stepalloc.install(patch_torch=True)
                result["conf"] = inst.conf
            else:
                pool = stepalloc.mempool()
                pool_ctx = torch.cuda.use_mem_pool(pool)
                notes.append(
                    "MemPool mode: backward's allocations (the autograd thread) stay in PyTorch's default pool"
                )
            result["stepalloc_library"] = stepalloc.library_path()
        else:
            result["conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if spec.get("record"):
            torch.cuda.memory._record_memory_history(
                enabled="all", context=None, stacks="python", max_entries=4_000_000
            )
        result["device_name"] = torch.cuda.get_device_name(0)
        result["total_bytes"] = torch.cuda.mem_get_info()[1]
    else:
        log(
            f"SKIP allocator set-up for {a.worker}: no CUDA device (CPU dry run); PyTorch's CPU allocator runs the loop"
        )
        notes.append("CPU dry run: allocator set-up, statistics and headroom skipped")

    import transformers

    result["torch"], result["transformers"] = torch.__version__, transformers.__version__
    stats = Stats(torch, spec["alloc"], device)
    prof = None
    if device == "cpu" and spec.get("record"):
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.__enter__()
        log("CPU dry run: the profiler's memory events stand in for _record_memory_history")

    if spec["alloc"] in ("stepalloc", "mempool") and device == "cuda":
        import stepalloc

        marker = stepalloc.step
    else:
        import contextlib

        def marker(_phase):
            return contextlib.nullcontext()

    def body() -> None:
        torch.manual_seed(0)
        t = time.time()
        model = build_model(torch, size, device)
        result["params"] = sum(p.numel() for p in model.parameters())
        result["build_s"] = round(time.time() - t, 2)
        log(
            f"{a.worker}: model of {result['params'] / 1e9:.3f} B parameters built in {result['build_s']} s on {device}"
        )
        loop = Loop(torch, model, size, device, marker)
        plan = iteration_plan(size, a.seed, size.warmup + size.iters)
        its = []
        before = None
        for i, shape in enumerate(plan):
            if i == size.warmup:
                before = stats.read()
            # Near the deadline, stop early (with at least two measured iterations) rather than
            # be killed with nothing written: the time left is kept for the snapshot.
            slowest = max((r["step_s"] for r in its), default=0.0)
            if a.deadline and i >= size.warmup + 2 and time.time() + 3 * slowest + 10 > a.deadline:
                notes.append(f"stopped after {i - size.warmup} measured iterations of {size.iters}: time budget")
                log(f"{a.worker}: {notes[-1]}")
                break
            r = loop.iteration(shape, size.batch)
            stats.sample_device()
            r["i"] = i
            its.append(r)
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
            log(f"{a.worker}: iteration {i}: {json.dumps(shown)}")
        after = stats.read()
        steady = its[size.warmup :]
        result["iterations"] = its
        result["median_step_s"] = statistics.median(r["step_s"] for r in steady)
        result["median_rollout_s"] = statistics.median(r["rollout_s"] for r in steady)
        result["median_train_s"] = statistics.median(r["train_s"] for r in steady)
        if after is not None:
            result["stats"] = after
            result["peak_reserved"] = after["reserved_bytes.all.peak"]
            result["peak_allocated"] = after["allocated_bytes.all.peak"]
            result["reserved_over_allocated"] = after["reserved_bytes.all.peak"] / max(
                1, after["allocated_bytes.all.peak"]
            )
            result["peak_device_used"] = stats.device_used_peak
            n = max(1, len(steady))
            result["device_allocs_per_step"] = (after["num_device_alloc"] - before["num_device_alloc"]) / n
            if "stepalloc" in after:
                sa, sb = after["stepalloc"], before["stepalloc"]
                result["maps_per_step"] = ((sa["num_map"] or 0) - (sb["num_map"] or 0)) / n
                result["creates_per_step"] = ((sa["num_create"] or 0) - (sb["num_create"] or 0)) / n
        else:
            log(f"SKIP allocator statistics for {a.worker}: CPU dry run")
        if spec.get("record"):
            snap = Path(a.snapshot)
            if device == "cuda":
                torch.cuda.memory._dump_snapshot(str(snap))
                torch.cuda.memory._record_memory_history(enabled=None)
            else:
                prof.__exit__(None, None, None)
                result["snapshot_events"] = cpu_snapshot(prof, snap)
            result["snapshot"] = str(snap)
            log(f"{a.worker}: snapshot written to {snap} ({snap.stat().st_size / MIB:.1f} MiB)")
        if spec.get("headroom", True):
            if device != "cuda":
                log(f"SKIP headroom for {a.worker}: needs a CUDA device")
            elif a.cap_bytes <= 0:
                log(f"SKIP headroom for {a.worker}: no cap (the native_record run gave no peak)")
                notes.append("headroom skipped: no cap")
            else:
                # The measurements are kept even if the search fails or the process is killed.
                Path(a.result).write_text(json.dumps(result, indent=1) + "\n")
                per_probe = 3 * max(r["step_s"] for r in its)
                try:
                    result["headroom"] = headroom(torch, loop, size, a.cap_bytes, a.probes, a.deadline, per_probe)
                except Exception as e:  # noqa: BLE001 - any failure here is a finding to report, not a crash
                    result["error"] = f"headroom search: {type(e).__name__}: {str(e)[:400]}"
                    log(f"{a.worker}: {result['error']}")

    if pool_ctx is not None:
        with pool_ctx:
            body()
    else:
        body()
    result["wall_s"] = round(time.time() - t_start, 2)
    Path(a.result).write_text(json.dumps(result, indent=1) + "\n")
    log(f"{a.worker}: done in {result['wall_s']} s")
    return 0


# ----- the orchestrator ---------------------------------------------------------------------


def find_stress(given: str | None) -> str | None:
    for c in [
        given,
        os.environ.get("STEPALLOC_STRESS"),
        HERE.parent / "bin" / "stepalloc-stress",
        HERE.parent / "target" / "release" / "stepalloc-stress",
    ]:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return str(Path(c).resolve())
    return None


def run_worker(name: str, a: argparse.Namespace, out: Path, work: Path, timeout: float, cap: int) -> dict:
    spec = CONFIGS[name]
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.update(spec["env"])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # the dry run's processes run side by side
    python_dir = HERE.parent / "python"  # the bundle's package; python_shim/ in the repository
    if not python_dir.is_dir():
        python_dir = HERE.parent / "python_shim"
    env["PYTHONPATH"] = str(python_dir) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    result = out / f"{name}.json"
    result.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--out",
        str(out),
        "--result",
        str(result),
        "--device",
        a.device,
        "--size",
        a.size,
        "--seed",
        str(a.seed),
        "--cap-bytes",
        str(cap),
        "--probes",
        str(a.probes),
        "--deadline",
        str(time.time() + timeout - 5),
        "--snapshot",
        str(work / "native_snapshot.pickle"),
    ]
    log(f"--- {name} (timeout {timeout:.0f} s)")
    t = time.time()
    with open(out / f"{name}.log", "w") as logf:
        try:
            rc = subprocess.run(
                cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout, check=False
            ).returncode
            why = f"exited with status {rc}" if rc else ""
        except subprocess.TimeoutExpired:
            why = f"timed out after {timeout:.0f} s"
    if result.is_file():
        r = json.loads(result.read_text())
        if why:  # killed or failed after writing its measurements (during the headroom search)
            r["error"] = f"{r.get('error', '')}; process {why}".lstrip("; ")
        log(f"{name}: {'ok' if 'error' not in r else 'ERROR: ' + r['error']} in {time.time() - t:.1f} s")
        return r
    tail = (out / f"{name}.log").read_text().splitlines()[-15:]
    log(f"{name}: FAILED ({why or 'no result file'}); last lines of {name}.log:")
    for line in tail:
        log("    " + line)
    return {"config": name, "failed": why or "no result file"}


def replay(stress: str | None, snapshot: Path, capacity_mb: int, timeout: float) -> dict:
    if stress is None:
        return {"skipped": "no stepalloc-stress binary (bundle bin/, $STEPALLOC_STRESS or target/release)"}
    if not snapshot.is_file():
        return {"skipped": f"no snapshot at {snapshot} (the native_record run failed?)"}
    cmd = [stress, "replay", str(snapshot), "--compare", "pytorch", "stepalloc", "--json"]
    if capacity_mb > 0:
        cmd += ["--capacity-mb", str(capacity_mb)]
    log(f"--- replay: {' '.join(cmd)}")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {timeout:.0f} s"}
    if p.returncode != 0:
        return {"failed": f"status {p.returncode}: {p.stderr.strip()[-500:]}"}
    report = json.loads(p.stdout)
    runs = {
        r["name"]: {
            "peak_reserved": r["peak_reserved"],
            "peak_allocated": r["peak_allocated"],
            "floor": r["floor"],
            "ooms": r["ooms"],
        }
        for r in report["runs"]
    }
    return {"command": " ".join(cmd), "runs": runs, "source": report.get("source")}


def gib(v) -> str:
    """Bytes in GiB, or in MiB below 0.1 GiB (the dry run's tiny model)."""
    if v is None:
        return "-"
    return f"{v / GIB:.2f} GiB" if v >= GIB // 10 else f"{v / MIB:.2f} MiB"


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def evaluate(res: dict) -> list[dict]:
    """The issue's targets on the end-to-end loop: met, missed or not measurable."""
    n, x, s = res.get("native", {}), res.get("native_expandable", {}), res.get("stepalloc", {})

    def target(name, ok, detail):
        return {"target": name, "status": "n/a" if ok is None else ("MET" if ok else "MISSED"), "detail": detail}

    def both(*vals):
        return all(v is not None for v in vals)

    pr, px, ps = n.get("peak_reserved"), x.get("peak_reserved"), s.get("peak_reserved")
    tn, ts = n.get("median_step_s"), s.get("median_step_s")
    hn, hx, hs = (r.get("headroom", {}).get("largest_batch") for r in (n, x, s))
    return [
        target(
            "peak reserved >= 15% below native",
            ps <= 0.85 * pr if both(pr, ps) else None,
            f"stepalloc {gib(ps)} vs native {gib(pr)}",
        ),
        target(
            "peak reserved not above native expandable",
            ps <= px if both(px, ps) else None,
            f"stepalloc {gib(ps)} vs expandable {gib(px)}",
        ),
        target(
            "median step time within 2% of native",
            ts <= 1.02 * tn if both(tn, ts) else None,
            f"stepalloc {fmt(ts, '.3f')} s vs native {fmt(tn, '.3f')} s",
        ),
        target(
            "headroom above both native configurations",
            hs > max(hn, hx) if both(hn, hx, hs) else None,
            f"largest batch: stepalloc {hs}, native {hn}, expandable {hx}",
        ),
    ]


def text_report(doc: dict) -> str:
    res, lines = doc["configs"], []
    names = [c for c in doc["order"] if c != "native_record"]
    first = next((r for r in res.values() if "params" in r), {})
    lines.append(f"stepalloc end-to-end comparison, {doc['date']}, device: {doc['device_name']}")
    lines.append(
        f"model: LLaVA-style (CLIP vision tower + Llama), {first.get('params', 0) / 1e9:.3g} B params, bf16, "
        f"random weights; size '{doc['size']}'; torch {first.get('torch', '?')}, transformers "
        f"{first.get('transformers', '?')}"
    )
    lines.append("")
    rows = [
        ("peak reserved", lambda r: gib(r.get("peak_reserved"))),
        ("peak allocated", lambda r: gib(r.get("peak_allocated"))),
        ("reserved / allocated", lambda r: fmt(r.get("reserved_over_allocated"), ".3f")),
        ("driver peak used", lambda r: gib(r.get("peak_device_used"))),
        ("median step, s", lambda r: fmt(r.get("median_step_s"), ".3f")),
        (
            "step vs native",
            lambda r: fmt(ratio(r.get("median_step_s"), res.get("native", {}).get("median_step_s")), ".3f"),
        ),
        ("device mallocs / steady step", lambda r: fmt(r.get("device_allocs_per_step"), ".1f")),
        ("maps + creates / steady step", lambda r: fmt(add(r.get("maps_per_step"), r.get("creates_per_step")), ".1f")),
        ("headroom: largest batch", lambda r: headroom_text(r)),
    ]
    width = max(len(r[0]) for r in rows) + 2
    col = 20
    lines.append(" " * width + "".join(n.rjust(col) for n in names))
    for label, f in rows:
        cells = []
        for n in names:
            r = res.get(n, {})
            cells.append(("FAILED" if "failed" in r else f(r)).rjust(col))
        lines.append(label.ljust(width) + "".join(cells))
    cap = next((r["headroom"]["cap_bytes"] for r in res.values() if "headroom" in r), None)
    if cap:
        lines.append(
            f"(headroom: base batch {SIZES[doc['size']].batch}, the largest iteration, under a cap of "
            f"{gib(cap)} = native peak x {doc['headroom_factor']})"
        )
    lines.append("")
    lines.append("replay of the native run's snapshot (stepalloc-stress) beside the measured peaks:")
    rp = doc.get("replay", {})
    if "runs" in rp:
        src = (rp.get("source") or {}).get("native") or {}
        pairs = [
            ("native (pytorch)", "pytorch", res.get("native_record", {}), src.get("peak_reserved")),
            ("stepalloc", "stepalloc", res.get("stepalloc", {}), None),
        ]
        lines.append(f"{'':22}{'measured':>14}{'predicted':>15}{'predicted/measured':>20}")
        for label, key, measured, _ in pairs:
            m, p = measured.get("peak_reserved"), rp["runs"].get(key, {}).get("peak_reserved")
            lines.append(f"{label:22}{gib(m):>14}{gib(p):>15}{fmt(ratio(p, m), '.3f'):>20}")
        lines.append(
            f"{'floor (peak live)':22}{gib(res.get('native_record', {}).get('peak_allocated')):>14}"
            f"{gib(rp['runs'].get('pytorch', {}).get('floor')):>15}"
        )
        if src.get("peak_reserved") is not None:
            lines.append(
                f"(the snapshot's own segment events give native a peak reserved of {gib(src['peak_reserved'])})"
            )
    else:
        lines.append(f"  replay: {rp.get('skipped') or rp.get('failed')}")
    lines.append("")
    lines.append("targets (issue 11):")
    for t in doc["targets"]:
        lines.append(f"  {t['status']:7} {t['target']}: {t['detail']}")
    for n in doc["order"]:
        for note in res.get(n, {}).get("notes", []):
            lines.append(f"  note ({n}): {note}")
        for key in ("failed", "error"):
            if key in res.get(n, {}):
                lines.append(f"  {key.upper()} ({n}): {res[n][key]}")
    return "\n".join(lines) + "\n"


def ratio(a, b):
    return None if a is None or not b else a / b


def add(a, b):
    return None if a is None and b is None else (a or 0) + (b or 0)


def headroom_text(r: dict) -> str:
    h = r.get("headroom")
    if not h:
        return "-"
    return f"{h['largest_batch']} ({h['scale']:.2f}x){'' if h['exact'] else '+'}"


def orchestrate(a: argparse.Namespace) -> int:
    t0 = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.device == "auto":
        # Ask NVML, not the CUDA runtime: this process must hold no CUDA context (the driver's
        # used-memory figures of the configurations would count it).
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
        if a.device == "cpu":
            log("no CUDA device: CPU dry run with the tiny configuration")
    if a.size is None:
        a.size = "full" if a.device == "cuda" else "tiny"
    if a.jobs is None:
        a.jobs = len(a.configs) if a.device == "cpu" else 1
    if a.jobs > 1 and a.device == "cuda":
        log("error: --jobs above 1 needs --device cpu (configurations sharing a GPU would distort each other)")
        return 2
    stress = find_stress(a.stress)
    work = Path(tempfile.mkdtemp(prefix="stepalloc-e2e-"))
    order = list(a.configs)
    if any(c in MEASURED for c in order) and "native_record" not in order and a.device == "cuda":
        log("note: without native_record there is no headroom cap and no replay")
    results: dict[str, dict] = {}
    cap = 0
    replay_budget = 40.0 if a.device == "cpu" else 15.0  # on a GPU the replay runs in the background
    from concurrent.futures import ThreadPoolExecutor

    background = ThreadPoolExecutor(max_workers=1)
    replay_job = None
    sequential = order
    if a.jobs > 1:
        # The dry run tests the script, not the timings: the configurations side by side (each
        # still in its own process), so that it fits CI's minute.
        timeout = a.budget - replay_budget - 5
        with ThreadPoolExecutor(max_workers=a.jobs) as pool:
            futures = {name: pool.submit(run_worker, name, a, out, work, timeout, 0) for name in order}
        results = {name: f.result() for name, f in futures.items()}
        sequential = []
    # One after another, native_record first: each gets an equal share of the time left.
    for i, name in enumerate(sequential):
        timeout = (a.budget - (time.time() - t0) - replay_budget - 5) / (len(sequential) - i)
        if timeout < 20:
            results[name] = {"config": name, "failed": "skipped: the time budget is spent"}
            log(f"--- {name}: skipped, the time budget ({a.budget:.0f} s) is spent")
            continue
        results[name] = run_worker(name, a, out, work, timeout, cap)
        if name == "native_record":
            if "peak_reserved" in results[name]:
                cap = math.ceil(results[name]["peak_reserved"] * a.headroom_factor / MIB) * MIB
            # The replay runs beside the other configurations (one CPU thread of many).
            replay_job = background.submit(
                replay,
                stress,
                work / "native_snapshot.pickle",
                int(results[name].get("total_bytes", 0) // MIB),
                max(10.0, a.budget - (time.time() - t0) - 5),
            )
    rec = results.get("native_record", {})
    snap = work / "native_snapshot.pickle"
    if "native_record" not in order:
        rp = {"skipped": "native_record not run"}
    else:
        if replay_job is None:
            replay_job = background.submit(
                replay,
                stress,
                snap,
                int(rec.get("total_bytes", 0) // MIB),
                max(10.0, a.budget - (time.time() - t0) - 3),
            )
        rp = replay_job.result()
    background.shutdown()
    if snap.is_file():
        packed = out / "native_snapshot.pickle.gz"
        with open(snap, "rb") as f, gzip.open(packed, "wb", compresslevel=1) as g:
            shutil.copyfileobj(f, g)
        if packed.stat().st_size > 16 * MIB:
            packed.unlink()
            rp["snapshot_kept"] = False
        else:
            rp["snapshot_kept"] = packed.name
    shutil.rmtree(work, ignore_errors=True)
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": a.device,
        "device_name": rec.get("device_name")
        or next((r.get("device_name") for r in results.values() if r.get("device_name")), "CPU (dry run)"),
        "size": a.size,
        "order": order,
        "headroom_factor": a.headroom_factor,
        "configs": results,
        "replay": rp,
        "wall_s": round(time.time() - t0, 1),
    }
    doc["targets"] = (
        evaluate(results)
        if a.device == "cuda"
        else [{"target": "all", "status": "n/a", "detail": "CPU dry run: the targets need a GPU"}]
    )
    failed = [n for n, r in results.items() if "failed" in r or "error" in r]
    if "failed" in rp:
        failed.append("replay")
    doc["failed"] = failed
    (out / "e2e.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = text_report(doc)
    (out / "e2e.txt").write_text(text)
    print(text, end="")
    log(
        f"e2e: {len(order) - len(failed)} of {len(order)} configurations ran"
        f"{'; failed: ' + ', '.join(failed) if failed else ''} ({doc['wall_s']} s); {out / 'e2e.json'}"
    )
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument(
        "--size", choices=sorted(SIZES), help="model and workload size (default: full on CUDA, tiny on CPU)"
    )
    ap.add_argument("--dry-run", action="store_true", help="the tiny configuration on the CPU")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), metavar="NAME", help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--stress", help="stepalloc-stress binary (default: the bundle's bin/, then target/release)")
    ap.add_argument("--budget", type=float, default=270.0, help="seconds for the whole comparison (default 270)")
    ap.add_argument("--headroom-factor", type=float, default=1.5, help="headroom cap = native peak reserved x this")
    ap.add_argument("--probes", type=int, default=5, help="headroom probes per configuration (default 5)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, help="configurations run side by side (default: all on the CPU, 1 on a GPU)")
    # Internal: one configuration in this process.
    ap.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--cap-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--snapshot", help=argparse.SUPPRESS)
    a = ap.parse_args()
    unknown = [c for c in a.configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown configuration(s) {', '.join(unknown)}; accepted: {', '.join(CONFIGS)}")
    if not 10 <= a.budget <= 3600:
        ap.error(f"--budget {a.budget}: out of range [10, 3600] seconds")
    if not 1.0 < a.headroom_factor <= 10:
        ap.error(f"--headroom-factor {a.headroom_factor}: out of range (1, 10]")
    if not 1 <= a.probes <= 20:
        ap.error(f"--probes {a.probes}: out of range [1, 20]")
    if a.jobs is not None and not 1 <= a.jobs <= 16:
        ap.error(f"--jobs {a.jobs}: out of range [1, 16]")
    if a.dry_run:
        if a.device == "cuda":
            ap.error("--dry-run runs on the CPU; it cannot be combined with --device cuda")
        a.device, a.size = "cpu", a.size or "tiny"
    if a.worker:
        return worker(a)
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
