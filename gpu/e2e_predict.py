#!/usr/bin/env python3
"""The prediction made on the CPU beside the end-to-end comparison's measurement: the loop of
e2e_model.py (the same model, shapes and steps) recorded under fake tensors by stepalloc.fit and
replayed by `stepalloc-stress fit` at the device's capacity, and what that prediction assumes
and cannot know without the GPU, measured on it.

  record   ahead of time, where torch and transformers are installed (scripts/gpu-bundle.sh runs
           it; no GPU: over testdrv's host-memory stand-in): the loop of each size for a training
           variant and a compute capability, as FIT/<size>-<variant>-sm<XY>.jsonl.gz with its
           facts beside it (.json: allocations, steps, peak live bytes, attention backends
           assumed, torch and transformers versions). Recording a 7 B loop costs about 70 s of
           one CPU, too much of the GPU run's 8 minutes; the gzipped trace is about 1.3 MB.
           A cache (--cache) keeps each recording under a key of its inputs (this file,
           e2e_model.py, stepalloc.fit's sources, the versions, the arguments).
  predict  on the GPU run, after the configurations ran (e2e_compare.py calls `predict`): each
           configuration's steps (two per iteration it ran: rollout, train) replayed at the
           device's total memory (cudaMemGetInfo) less --outside-mb; per configuration the
           predicted peak reserved beside the measured one. stdlib only.
  probe    (AttentionProbe, in the native_expandable worker after its measurement): which SDPA
           backend this device runs the model's attention calls with (counted over the whole
           loop, as the recorder counts what it assumed) and, at the size's attention shapes,
           what each backend's backward allocates beyond its gradients (the recorder models
           cuDNN's with flash attention's figures).

e2e_report.py prints the prediction beside the measurement and the assumptions beside what the
device showed, and judges the 3% goal (GOAL).

Invariants: a recording is looked up by (size, variant, capability) and never stood in for by
another; the prediction reads the trace, never the measurement; a missing recording is a
reason printed in the report, not a failure of the run.

Usage: e2e_predict.py record --size NAME [--size NAME...] --out DIR [--variant full|lora]
                             [--capability 9.0] [--seed 1] [--cache DIR]
Exit status: 0 done, 1 a recording failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from e2e_common import GIB, MIB, log, stress_json
from e2e_model import SIZES, Loop, build_model, iteration_plan

HERE = Path(__file__).resolve().parent
# The Python package: the bundle's python/, or python_shim/ in the repository (the workers have
# it on PYTHONPATH; `record` puts it on sys.path).
PACKAGE_DIR = HERE.parent / "python" if (HERE.parent / "python").is_dir() else HERE.parent / "python_shim"

# What the prediction assumes of the memory outside PyTorch (stepalloc.fit's default).
ASSUMED_OUTSIDE_MB = 512
# Each iteration of the loop is two steps in the trace: its rollout and its training step.
STEPS_PER_ITERATION = 2
# Which predicted column stands for each measured configuration (MemPool mode runs stepalloc's
# allocator for the loop's pool: the nearest column, said so in the report).
COLUMN = {
    "native_record": "pytorch",
    "native": "pytorch",
    "native_expandable": "pytorch_expandable",
    "stepalloc": "stepalloc",
    "stepalloc_mempool": "stepalloc",
}
COLUMNS = ["pytorch", "pytorch_expandable", "split128", "stepalloc"]
# The goal: predicted peak reserved within this share of the measured one.
GOAL = 0.03


def trace_name(size: str, variant: str, capability: tuple[int, int]) -> str:
    return f"{size}-{variant}-sm{capability[0]}{capability[1]}"


def default_fit_dir() -> Path:
    """The bundle's fit/, else the repository's target/fit-traces."""
    bundled = HERE.parent / "fit"
    return (
        bundled
        if bundled.is_dir() or (HERE.parent / "MANIFEST.json").is_file()
        else HERE.parent / "target" / "fit-traces"
    )


# ---- record (ahead of time, no GPU) ------------------------------------------------------------


def cache_key(size: str, variant: str, capability: tuple[int, int], seed: int) -> str:
    """A hash of what decides the recording: the loop's code, the recorder's, the versions."""
    import torch
    import transformers

    h = hashlib.sha256()
    files = [HERE / "e2e_model.py", HERE / "e2e_common.py", Path(__file__).resolve()]
    files += sorted((PACKAGE_DIR / "stepalloc" / "fit").glob("*.py"))
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(f"{torch.__version__} {transformers.__version__} {size} {variant} {capability} {seed}".encode())
    return h.hexdigest()[:16]


def record_loop(size_name: str, variant: str, capability: tuple[int, int], seed: int, path: Path) -> dict:
    """Records the end-to-end loop of `size_name` (as e2e_worker.py runs it: model built on the
    device, warm-up and measured iterations of the seeded plan) and writes the trace to `path`
    (JSON lines). Returns the recording's facts."""
    import torch
    import transformers

    import stepalloc.fit as fit
    from stepalloc.fit import _kernels

    size = SIZES[size_name]
    target = _kernels.Target(f"sm{capability[0]}{capability[1]}", 80 * GIB, capability)
    plan = iteration_plan(size, seed, size.warmup + size.iters)

    def loop():
        torch.manual_seed(0)
        model = build_model(torch, size, "cuda")
        run = Loop(torch, model, size, "cuda", fit.step, variant)
        run.measure = False  # no synchronisation, no loss read: fake tensors have no values
        for shape in plan:
            run.iteration(shape, size.batch)
        return model

    t = time.time()
    rec = fit.record(loop, device=target, trace=path)
    summary = rec.summary()
    return {
        "size": size_name,
        "variant": variant,
        "capability": list(capability),
        "seed": seed,
        "iterations": len(plan),
        "steps": summary["steps"],
        "allocations": summary["allocations"],
        "peak_live_bytes": summary["peak_live_bytes"],
        "attention": dict(summary["attention"]),
        "attention_order": summary["attention_order"],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "record_s": round(time.time() - t, 1),
        "recorded": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def record_main(a: argparse.Namespace) -> int:
    if str(PACKAGE_DIR) not in sys.path:
        sys.path.insert(0, str(PACKAGE_DIR))
    from stepalloc.fit import _host

    # Without a device context (no GPU here), run again over testdrv's host-memory stand-in.
    try:
        status = _host.ensure_device([str(Path(__file__).resolve()), *sys.argv[1:]])
    except _host.NoDeviceError as exc:
        log(f"e2e_predict: {exc}")
        return 2
    if status is not None:
        return status
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(a.cache) if a.cache else None
    failed = 0
    for size in a.size:
        variant = a.variant or ("full" if SIZES[size].train in ("full", "auto") else SIZES[size].train)
        name = trace_name(size, variant, a.capability)
        key = cache_key(size, variant, a.capability, a.seed)
        cached = cache / f"{name}.{key}" if cache else None
        if cached is not None and (cached / f"{name}.json").is_file():
            for f in cached.iterdir():
                shutil.copy2(f, out / f.name)
            log(f"e2e_predict: {name}: from the cache ({cached})")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            plain = Path(tmp) / f"{name}.jsonl"
            try:
                facts = record_loop(size, variant, a.capability, a.seed, plain)
            except Exception as exc:  # noqa: BLE001 - one size failing is reported; the others still record
                log(f"e2e_predict: {name}: recording failed: {type(exc).__name__}: {exc}")
                failed += 1
                continue
            with open(plain, "rb") as f, gzip.open(out / f"{name}.jsonl.gz", "wb", compresslevel=6) as g:
                shutil.copyfileobj(f, g)
        (out / f"{name}.json").write_text(json.dumps(facts, indent=1) + "\n")
        log(
            f"e2e_predict: {name}: {facts['allocations']:,} allocations, {facts['steps']} steps, peak live "
            f"{facts['peak_live_bytes'] / GIB:.2f} GiB, attention {facts['attention']}, {facts['record_s']} s; "
            f"{(out / f'{name}.jsonl.gz').stat().st_size / MIB:.2f} MiB gzipped"
        )
        if cached is not None:
            cached.mkdir(parents=True, exist_ok=True)
            for suffix in (".jsonl.gz", ".json"):
                shutil.copy2(out / f"{name}{suffix}", cached / f"{name}{suffix}")
    return 1 if failed else 0


# ---- predict (on the GPU run, stdlib only) -----------------------------------------------------


def first_steps(src: Path, steps: int, dst: Path) -> int:
    """Writes the first `steps` steps of the gzipped trace `src` to `dst` (everything before the
    step after them: what a run that stopped there did). Returns the steps written."""
    done = 0
    with gzip.open(src, "rt") as f, open(dst, "w") as g:
        for line in f:
            if done >= steps and '"step_begin"' in line:
                break
            g.write(line)
            if '"step_end"' in line:
                done += 1
    return done


def replay(stress: str, trace: Path, capacity_bytes: int, outside_mb: float, timeout: float) -> dict:
    """`stepalloc-stress fit` of `trace`: its JSON report (configs by name) or {"failed": why}."""
    cmd = [stress, "fit", str(trace), "--capacity-gb", f"{capacity_bytes / GIB:.6f}", "--outside-mb", f"{outside_mb:g}",
           "--compare", *COLUMNS, "--json"]  # fmt: skip
    report, failed = stress_json(cmd, timeout)
    if report is None:
        return {"failed": failed}
    return {
        "command": " ".join([*cmd[:2], "TRACE", *cmd[3:]]),
        "floor_bytes": report["trace"]["floor_bytes"],
        "steps": report["trace"]["steps"],
        "usable_bytes": report["device"]["usable_bytes"],
        "columns": {
            c["name"]: {
                "fits": c["fits"],
                "peak_reserved": c["peak_reserved_bytes"],
                "peak_allocated": c["peak_allocated_bytes"],
                "first_oom": (c.get("first_oom") or {}).get("allocation"),
            }
            for c in report["configs"]
        },
    }


def steps_run(r: dict) -> int:
    """The trace steps a measured configuration ran: two per iteration, the one it ran out of
    memory in included."""
    n = len(r.get("iterations", []))
    if "oom" in r:
        n += 1
    return n * STEPS_PER_ITERATION


def predict(
    results: dict,
    size: str,
    device: str,
    stress: str | None,
    fit_dir: Path,
    outside_mb: float = ASSUMED_OUTSIDE_MB,
    timeout: float = 60.0,
) -> dict:
    """The prediction for each configuration in `results` (e2e_compare's, by name), from the
    recording of (size, variant, capability) in `fit_dir`, replayed at the device's total memory.
    On the CPU dry run the host's memory stands for the device's, as for the training variant,
    and the capability is the recording's (9.0)."""
    ran = {n: r for n, r in results.items() if r.get("iterations") or "oom" in r}
    if not ran:
        return {"skipped": "no configuration ran"}
    first = next(iter(ran.values()))
    variant = (first.get("train") or {}).get("variant", "full")
    capability = tuple(first.get("capability") or (9, 0))
    capacity = first.get("total_bytes") or first.get("host_bytes") or 0
    name = trace_name(size, variant, capability)
    doc: dict = {"trace": f"{name}.jsonl.gz", "capacity_bytes": capacity, "outside_mb": outside_mb,
                 "outside_assumed": True, "variant": variant, "capability": list(capability)}  # fmt: skip
    src, facts_path = fit_dir / f"{name}.jsonl.gz", fit_dir / f"{name}.json"
    if not src.is_file() or not facts_path.is_file():
        doc["skipped"] = (
            f"no recording {name} in {fit_dir} (recorded: "
            f"{', '.join(sorted(p.name[:-9] for p in fit_dir.glob('*.jsonl.gz'))) or 'none'}); make it where torch "
            f"and transformers are installed: gpu/e2e_predict.py record --size {size} --variant {variant} "
            f"--capability {capability[0]}.{capability[1]} --out {fit_dir}"
        )
        return doc
    if stress is None:
        doc["skipped"] = "no stepalloc-stress binary (bundle bin/, $STEPALLOC_STRESS or target/release)"
        return doc
    if capacity <= 0:
        doc["skipped"] = "the device's memory is unknown (no configuration reported it)"
        return doc
    doc["recording"] = json.loads(facts_path.read_text())
    doc["replays"] = {}
    doc["configs"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, r in ran.items():
            steps = min(steps_run(r), doc["recording"]["steps"])
            if str(steps) not in doc["replays"]:
                part = Path(tmp) / f"first{steps}.jsonl"
                first_steps(src, steps, part)
                doc["replays"][str(steps)] = replay(stress, part, capacity, outside_mb, timeout)
            rp = doc["replays"][str(steps)]
            column = COLUMN.get(n, "pytorch")
            p = rp.get("columns", {}).get(column, {})
            m = r.get("peak_reserved")
            doc["configs"][n] = {
                "column": column,
                "steps": steps,
                "predicted_peak_reserved": p.get("peak_reserved"),
                "predicted_fits": p.get("fits"),
                "measured_peak_reserved": m,
                "measured_fits": "oom" not in r,
                "ratio": (p["peak_reserved"] / m) if m and p.get("peak_reserved") else None,
            }
    return doc


# ---- what the prediction assumes, measured on the device ---------------------------------------

# The ATen operator each SDPA backend runs (what a dispatch mode sees inside the call).
BACKEND_OPS = {
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
}
BACKWARD_OPS = {
    "cudnn": "aten::_scaled_dot_product_cudnn_attention_backward",
    "flash": "aten::_scaled_dot_product_flash_attention_backward",
    "efficient": "aten::_scaled_dot_product_efficient_attention_backward",
}


@contextlib.contextmanager
def count_attention(torch, counts: Counter):
    """Counts every ``F.scaled_dot_product_attention`` call by the backend it ran on ("math" when
    no backend operator ran), "+mask" when it carried a mask: the recorder's own tally. A patch
    of the function, as the recorder's (checkpointed layers call it again on autograd's thread);
    a dispatch mode only inside each call, so the rest of the loop runs as it would."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        backend = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = getattr(getattr(func, "_schema", None), "name", "")
            if self.backend is None and name in BACKEND_OPS:
                self.backend = BACKEND_OPS[name]
            return func(*args, **(kwargs or {}))

    original = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        masked = (args[3] if len(args) > 3 else kwargs.get("attn_mask")) is not None
        seen = Seen()
        with seen:
            out = original(*args, **kwargs)
        counts[(seen.backend or "math") + ("+mask" if masked else "")] += 1
        return out

    F.scaled_dot_product_attention = sdpa
    try:
        yield counts
    finally:
        F.scaled_dot_product_attention = original


def attention_cases(size_name: str) -> list[dict]:
    """The size's attention calls, by kind: the language model's training step (causal, no mask:
    samples of one length), with padding (a boolean 4-D mask, as transformers passes one), and the
    vision tower (no mask). Sequence lengths capped at 2,048 (the scratch scales with them)."""
    s = SIZES[size_name]
    lm_len = min(2048, s.max_images * (s.image // s.patch) ** 2 + s.prompt[1])
    return [
        {"case": "language model, causal", "b": s.batch, "h": s.heads, "hk": s.kv_heads, "s": lm_len,
         "d": s.hidden // s.heads, "causal": True, "mask": False},
        {"case": "language model, padded (mask)", "b": s.batch, "h": s.heads, "hk": s.heads, "s": lm_len,
         "d": s.hidden // s.heads, "causal": False, "mask": True},
        {"case": "vision tower", "b": s.max_images, "h": s.v_heads, "hk": s.v_heads,
         "s": (s.image // s.patch) ** 2 + 1, "d": s.v_hidden // s.v_heads, "causal": False, "mask": False},
    ]  # fmt: skip


def attention_inputs(torch, case: dict, device: str) -> tuple:
    """Query, key, value (bf16, requiring gradients) and the mask of one of `attention_cases`:
    for a padded case, a causal boolean mask whose first sample is padded on the left by a
    quarter (no row fully masked)."""
    b, h, hk, s, d = case["b"], case["h"], case["hk"], case["s"], case["d"]
    q, k, v = (torch.randn(b, n, s, d, device=device, dtype=torch.bfloat16, requires_grad=True) for n in (h, hk, hk))
    mask = None
    if case["mask"]:
        mask = torch.ones(b, 1, s, s, device=device, dtype=torch.bool).tril()
        mask[0, :, :, : s // 4] = False
        mask[0, :, : s // 4, : s // 4] = True
    return q, k, v, mask


def attention_call(torch, case: dict, q, k, v, mask):
    """The call as transformers makes it (grouped K/V heads through enable_gqa)."""
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=case["causal"], enable_gqa=case["hk"] != case["h"]
    )


def backward_scratch(torch, case: dict, backend: str) -> dict:
    """What `backend`'s backward allocates beyond the three gradients at `case`'s shape (peak
    allocated during the backward, less what was allocated before it and the gradients),
    beside stepalloc.fit's model of it; or the error that kept the backend from running."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stepalloc.fit import _kernels

    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]  # fmt: skip
    q, k, v, mask = attention_inputs(torch, case, "cuda")
    try:
        with sdpa_kernel([kind]):
            o = attention_call(torch, case, q, k, v, mask)
        g = torch.randn_like(o)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o.backward(g)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    except RuntimeError as exc:
        return {"error": str(exc).splitlines()[0][:200]}
    grads = sum(t.grad.nbytes for t in (q, k, v))
    # The recorder's model is given the backward's own arguments (grad_out, q, k, v).
    modelled = sum(n for _, n in _kernels.attention_workspaces(BACKWARD_OPS[backend], (g, q, k, v)))
    return {"measured_bytes": max(0, peak - base - grads), "modelled_bytes": modelled}


def probe_attention(torch, size_name: str, device: str) -> list[dict]:
    """Per case of `attention_cases`: the backend this device picks and, on a CUDA device, each
    backend's backward scratch (`backward_scratch`). On the CPU only the pick is reported."""
    out = []
    for case in attention_cases(size_name):
        counts: Counter = Counter()
        with count_attention(torch, counts), torch.no_grad():
            attention_call(torch, case, *attention_inputs(torch, case, device))
        row = dict(case, picked=next(iter(counts)), backends={})
        if device == "cuda":
            for backend in BACKWARD_OPS:
                row["backends"][backend] = backward_scratch(torch, case, backend)
                torch.cuda.empty_cache()
        out.append(row)
    return out


def smi_process_used(pid: int) -> int | None:
    """This process's device memory as nvidia-smi reports it (bytes), None where it cannot say
    (no nvidia-smi, or a process namespace that hides the pid)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        p = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in p.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1]) * MIB
    return None


def smi_total() -> int | None:
    """The device's total memory as nvidia-smi reports it (bytes), None without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        p = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=20, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = p.stdout.strip().splitlines()[:1]
    return int(first[0]) * MIB if first and first[0].strip().isdigit() else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("record", help="record the loop of each size (no GPU needed)")
    r.add_argument("--size", action="append", required=True, choices=sorted(SIZES))
    r.add_argument("--out", required=True, help="folder for NAME.jsonl.gz and NAME.json")
    r.add_argument(
        "--variant", choices=["full", "lora"], help="training variant (default: full; a size's own if fixed)"
    )
    r.add_argument("--capability", default="9.0", help="the target's compute capability, MAJOR.MINOR (default 9.0)")
    r.add_argument("--seed", type=int, default=1, help="the iteration plan's seed (e2e_compare.py's --seed, default 1)")
    r.add_argument("--cache", help="keep and reuse recordings here, keyed by their inputs")
    a = ap.parse_args()
    try:
        major, minor = (int(x) for x in a.capability.split("."))
    except ValueError:
        ap.error(f"--capability {a.capability!r}: MAJOR.MINOR, e.g. 9.0 or 8.0")
    a.capability = (major, minor)
    return record_main(a)


if __name__ == "__main__":
    sys.exit(main())
