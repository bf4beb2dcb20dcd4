"""One configuration of the end-to-end comparison, run in its own process (e2e_compare.py
--worker NAME): the allocator set up as the configuration says, the agent loop measured, the
allocator's statistics read, the memory history (or the CPU profiler's stand-in) written as a
snapshot, and the headroom search under a memory cap. Beside them, what stepalloc.fit's
prediction assumes (e2e_predict.py): the device memory outside the allocator (used less
reserved, after each iteration) and, in native_expandable, the SDPA backend of every attention
call and the attention backward's scratch."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pickle
import statistics
import time
from collections import Counter
from pathlib import Path

from e2e_common import ASSUMPTIONS_IN, CONFIGS, MIB, log
from e2e_model import SIZES, Loop, Size, build_model, iteration_plan, largest, pick_variant
from e2e_predict import count_attention, probe_attention, smi_process_used, smi_total


class Stats:
    """Allocator statistics for this configuration (None on the CPU)."""

    def __init__(self, torch, alloc: str, device: str):
        self.torch, self.alloc, self.device = torch, alloc, device
        self.device_used_peak = 0
        self.outside = None  # device memory used less reserved at the last sample

    def reserved_now(self) -> int | None:
        """Bytes the allocator holds now (None in MemPool mode: two allocators share the loop)."""
        if self.alloc == "native":
            return self.torch.cuda.memory_reserved()
        if self.alloc == "stepalloc":
            import stepalloc

            return int(stepalloc.memory_stats(0).get("reserved_bytes.all.current", 0))
        return None

    def sample_device(self) -> None:
        if self.device == "cuda":
            free, total = self.torch.cuda.mem_get_info()
            self.device_used_peak = max(self.device_used_peak, total - free)
            reserved = self.reserved_now()
            if reserved is not None:
                # What stepalloc.fit's prediction assumes as --outside-mb: the CUDA context,
                # library handles, kernel images.
                self.outside = total - free - reserved

    def outside_report(self) -> dict | None:
        """The memory outside the allocator, by cudaMemGetInfo and by nvidia-smi (this process)."""
        if self.outside is None:
            return None
        used = smi_process_used(os.getpid())
        reserved = self.reserved_now()
        return {
            "memgetinfo_bytes": self.outside,
            "smi_bytes": used - reserved if used is not None and reserved is not None else None,
        }

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
    """The largest batch whose largest iteration fits under the cap, or with `cap` 0 on the
    whole device (see `search`)."""
    total = torch.cuda.mem_get_info()[1]
    fraction = min(1.0, cap / total) if cap > 0 else 1.0
    if cap > 0:
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
    if cap > 0:
        torch.cuda.set_per_process_memory_fraction(1.0)
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "cap_bytes": cap if cap > 0 else total,
        "cap": "device" if cap <= 0 else "native peak",
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


def host_memory() -> int:
    """The host's physical memory (the CPU dry run's stand-in for the device's)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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
                    "MemPool mode: backward's allocations (the autograd thread) follow the pool"
                    if stepalloc.follow.enabled()
                    else "MemPool mode: backward's allocations (the autograd thread) stay in PyTorch's default pool"
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
        result["capability"] = list(torch.cuda.get_device_capability(0))
    else:
        log(
            f"SKIP allocator set-up for {a.worker}: no CUDA device (CPU dry run); PyTorch's CPU allocator runs the loop"
        )
        notes.append("CPU dry run: allocator set-up, statistics and headroom skipped")
        result["host_bytes"] = host_memory()

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
        total = torch.cuda.mem_get_info()[1] if device == "cuda" else host_memory()
        forced = None if a.train == "auto" else a.train
        result["train"] = pick_variant(size, result["params"], total, forced)
        if device != "cuda":
            result["train"]["why"] += " (CPU dry run: host memory stands for the device)"
        loop = Loop(torch, model, size, device, marker, result["train"]["variant"])
        result["train"]["trainable_params"] = loop.trainable
        log(f"{a.worker}: training variant {result['train']['variant']}: {result['train']['why']}")
        plan = iteration_plan(size, a.seed, size.warmup + size.iters)
        its = []
        before = None
        # One configuration counts the SDPA backend of every attention call (a patch of the
        # function: a little time per call, so not in the configurations whose times are judged).
        attention = Counter()
        counting = count_attention(torch, attention) if a.worker == ASSUMPTIONS_IN else contextlib.nullcontext()
        with counting:
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
                try:
                    r = loop.iteration(shape, size.batch)
                except RuntimeError as e:
                    if not is_oom(e):
                        raise
                    # Not fitting at the base batch is this configuration's answer, not a failure.
                    result["oom"] = {"iteration": i, "batch": size.batch, "error": str(e)[:300]}
                    notes.append(f"out of memory at iteration {i} (batch {size.batch})")
                    log(f"{a.worker}: {notes[-1]}: {str(e)[:300]}")
                    loop.opt.zero_grad(set_to_none=True)
                    break
                stats.sample_device()
                r["i"] = i
                its.append(r)
                shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                log(f"{a.worker}: iteration {i}: {json.dumps(shown)}")
        if a.worker == ASSUMPTIONS_IN:
            result["attention"] = dict(attention)
        if before is None:  # out of memory in the warm-up
            before = stats.read()
        after = stats.read()
        steady = its[size.warmup :]
        result["iterations"] = its
        if steady:
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
        if device == "cuda":
            result["outside"] = stats.outside_report()
            result["device_totals"] = {"memgetinfo_bytes": result["total_bytes"], "smi_bytes": smi_total()}
        if a.worker == ASSUMPTIONS_IN:
            # After the measurement, before the headroom search (which empties the cache first).
            try:
                result["attention_probe"] = probe_attention(torch, a.size, device)
            except Exception as e:  # noqa: BLE001 - a probe that fails is reported, the run goes on
                notes.append(f"attention probe failed: {type(e).__name__}: {str(e)[:300]}")
                log(f"{a.worker}: {notes[-1]}")
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
            elif "oom" in result:
                result["headroom"] = {"largest_batch": 0, "first_failing_batch": size.batch, "exact": True,
                                      "scale": 0.0, "probes": [], "cap": size.headroom}  # fmt: skip
            elif a.cap_bytes <= 0 and size.headroom != "device":
                log(f"SKIP headroom for {a.worker}: no cap (the native_record run gave no peak)")
                notes.append("headroom skipped: no cap")
            else:
                # The measurements are kept even if the search fails or the process is killed.
                Path(a.result).write_text(json.dumps(result, indent=1) + "\n")
                per_probe = 3 * max(r["step_s"] for r in its)
                cap = 0 if size.headroom == "device" else a.cap_bytes
                try:
                    result["headroom"] = headroom(torch, loop, size, cap, a.probes, a.deadline, per_probe)
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
