#!/usr/bin/env python3
"""Benchmarks of stepalloc.fit's recorder (figures, not tests): fidelity against real CPU runs,
agreement with PyTorch's MemTracker, and the cost of recording a 7B step.

fidelity   For the small transformers workloads of stress/tests/data/record_model_trace.py
           (sft: a Llama LM; vlm-agent: CLIP + projector + Llama with generate() rollouts), the
           same code and inputs run three times on the CPU: for real under the profiler (every
           allocation, as the checked-in traces were made), for real under the recorder (what
           dispatch sees of that run), and under fake CPU tensors with the recorder. Prints peak
           live bytes, allocation counts, and the peak reserved that `stepalloc-stress replay`
           gives each stream under PyTorch's allocator (default settings).
memtracker The same step under PyTorch's MemTracker (fake CUDA tensors) and under the recorder:
           peak live bytes (the recorder's rounded to 512 B as MemTracker counts), and what the
           recorder adds that MemTracker does not model (cuBLAS workspaces, attention scratch).
           MemTracker runs twice: with AdamW's foreach kernels, as a GPU run and the recorder
           take them, and as it runs by itself, where fake parameters take the per-parameter
           loop and the foreach step's temporaries are missing.
cost       Wall time, CPU time (user + system, all threads: what a quiet machine's wall time would
           be, the load average aside) and peak RSS of recording LLaVA-1.5-7B and Qwen2-VL-7B at
           batch 2 (one child process each, resource.getrusage), with the load average at the end.

Usage (from the repository root, torch over testdrv's stubs as scripts/test.sh sets them up):
    LD_PRELOAD=$PWD/target/hostcuda/runtime/libcudart.so.13 \\
    LD_LIBRARY_PATH=$PWD/target/hostcuda/runtime:$PWD/target/hostcuda:$PWD/target/hostcuda/standins \\
        python3 scripts/fit_fidelity.py [fidelity|memtracker|cost|all] [--stress target/release/stepalloc-stress]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_shim"))
sys.path.insert(0, str(ROOT / "stress" / "tests" / "data"))

GIB = 1 << 30


def workload_args(workload: str) -> argparse.Namespace:
    """record_model_trace.py's defaults for the workload (its small sizes)."""
    sft = workload == "sft"
    return argparse.Namespace(
        workload=workload, seed=0, steps=12 if sft else 2, batch=4 if sft else 3, hidden=512, layers=4 if sft else 2,
        vocab=8192, max_len=512, max_new=16, vision_layers=2, vision_hidden=256, image_size=224, train_vision=False,
        eval_every=4,
    )


def _marked(rec_step):
    """record_model_trace marks steps with record_function ranges; the recorder with its own."""
    import contextlib

    import record_model_trace as rmt
    from torch.profiler import record_function

    @contextlib.contextmanager
    def mark(name: str):
        with record_function(name):
            if rec_step is not None and name.startswith(rmt.MARK):
                with rec_step(name[len(rmt.MARK) :]):
                    yield
            else:
                yield

    return mark


def run_workload(workload: str, rec_step=None) -> None:
    import record_model_trace as rmt
    import torch

    args = workload_args(workload)
    torch.manual_seed(args.seed)
    rmt.record_function = _marked(rec_step)
    (rmt.sft if workload == "sft" else rmt.vlm_agent)(args, random.Random(args.seed))


def replay_peak(stress: Path, trace: Path) -> int:
    out = subprocess.run([str(stress), "replay", str(trace), "--compare", "pytorch", "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["runs"][0]["peak_reserved"]


def fidelity(stress: Path, workloads: tuple[str, ...] = ("sft", "vlm-agent")) -> list[dict]:
    import record_model_trace as rmt
    import torch
    from torch.profiler import ProfilerActivity, profile

    from stepalloc.fit._recorder import Recording
    from stepalloc.fit._trace import peak_live, read_jsonl

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="fit-fidelity-"))
    for workload in workloads:
        real_trace = tmp / f"{workload}-real.jsonl"
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run_workload(workload)
        rmt.write(rmt.collect(prof), real_trace)
        dispatch = Recording(device="cpu", fake=False)
        with dispatch:
            run_workload(workload, dispatch.step)
        fake = Recording(device="cpu")
        t0 = time.perf_counter()
        with fake:
            run_workload(workload, fake.step)
        fake_s = time.perf_counter() - t0
        row = {"workload": workload, "fake_record_s": round(fake_s, 1)}
        for name, path in (("real", real_trace), ("dispatch", tmp / f"{workload}-dispatch.jsonl"), ("fake", tmp / f"{workload}-fake.jsonl")):
            if name != "real":
                (dispatch if name == "dispatch" else fake).trace.write(path)
            peak, n = peak_live(read_jsonl(path))
            row[name] = {"peak_live": peak, "allocations": n, "replay_peak_reserved": replay_peak(stress, path)}
        r, f = row["real"], row["fake"]
        row["peak_live_diff"] = (f["peak_live"] - r["peak_live"]) / r["peak_live"]
        row["reserved_diff"] = (f["replay_peak_reserved"] - r["replay_peak_reserved"]) / r["replay_peak_reserved"]
        row["count_diff_vs_dispatch"] = f["allocations"] - row["dispatch"]["allocations"]
        # Where the two streams of what dispatch sees differ: allocations by operator.
        by_op = {}
        for name, rec in (("dispatch", dispatch), ("fake", fake)):
            for a in rec.trace.allocations():
                by_op.setdefault(a.torch_op, {"dispatch": 0, "fake": 0})[name] += 1
        row["ops_that_differ"] = {op: c for op, c in by_op.items() if c["dispatch"] != c["fake"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def memtracker() -> dict:
    """One LLaVA (tiny widths, full depth of the data path) training step, under MemTracker and
    under the recorder, both with fake CUDA tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from stepalloc.fit import _recipes
    from stepalloc.fit._recorder import Recording

    # Every parameter trained: MemTracker hooks every parameter (a frozen one makes it raise).
    recipe = _recipes.Recipe(model="llava-1.5-7b", batch=2, images=(1, 1), tokens=(256, 256), iterations=1,
                             checkpointing=False, train_vision=True)

    def step(model, opt, m, batch, to_device):
        inputs = to_device(batch)
        out = model(**inputs)
        out.loss.backward()
        del out, inputs
        opt.step()
        opt.zero_grad(set_to_none=True)

    m = _recipes._Model(recipe)
    rng = random.Random(0)
    batch = _recipes.sample(rng, recipe, m)
    # The recorder (its own fake mode), one step after building.
    rec = Recording(target="h100")
    with rec:
        model, opt = _recipes.build(rec, recipe, m)
        with rec.step("train"):
            step(model, opt, m, batch, lambda b: _recipes.to_device(rec, b, m))
        del model, opt
    mine = [a for a in rec.trace.allocations()]
    # MemTracker: same model and batch; data-dependent checks off (it cannot serve them). Twice:
    # as it runs (AdamW takes its per-parameter loop for fake parameters) and with the foreach
    # kernels a GPU run takes (the recorder's own choice, _patches.foreach_like_a_real_run).
    import os

    from stepalloc.fit._patches import foreach_like_a_real_run

    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"

    def tracked(foreach: bool) -> int:
        with FakeTensorMode(allow_non_fake_inputs=True), (foreach_like_a_real_run() if foreach else contextlib.nullcontext()):
            model, opt = _recipes.build(_NoRec(), recipe, m)
            inputs = {k: (v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in batch.items() if k != "images"}
            inputs["pixel_values"] = torch.randn(batch["images"], 3, m.image_side, m.image_side, device="cuda")
            mt = MemTracker()
            mt.track_external(model, opt)
            with mt:
                out = model(**inputs)
                out.loss.backward()
                del out
                opt.step()
                opt.zero_grad(set_to_none=True)
            return max(v["Total"] for v in mt.get_tracker_snapshot("peak").values())

    mt_loop, mt_peak = tracked(foreach=False), tracked(foreach=True)
    rounded = _rounded_peak(rec.trace)
    extra = {}
    for a in mine:
        if a.torch_op.endswith("workspace") or "(" in a.torch_op:
            extra[a.torch_op.split(" (")[0] if "(" in a.torch_op else a.torch_op] = extra.get(a.torch_op, 0) + a.size
    row = {"memtracker_peak": mt_peak, "recorder_peak_rounded": rounded, "diff": (rounded - mt_peak) / mt_peak,
           "recorder_only": extra, "memtracker_peak_per_parameter_loop": mt_loop}
    print(json.dumps(row), flush=True)
    return row


class _NoRec:
    """Stands in for a Recording where the recipe builder asks one for names and a device."""

    device_type = "cuda"

    def name_parameters(self, model) -> None:
        pass


def _rounded_peak(trace) -> int:
    """Peak live bytes of a recording with each allocation rounded up to 512 B, as MemTracker
    counts a CUDA storage."""
    cur = peak = 0
    for kind, payload in trace.events:
        if kind == "alloc":
            cur += -(-payload.size // 512) * 512
            peak = max(peak, cur)
        elif kind == "free":
            cur -= -(-trace.allocs[payload].size // 512) * 512
    return peak


def cost() -> list[dict]:
    rows = []
    for model in ("llava-1.5-7b", "qwen2-vl-7b"):
        for finetune in ("full", "lora"):
            code = (
                "import json, os, resource, time\n"
                "t0 = time.perf_counter()\n"
                "from stepalloc.fit import Recipe, record_recipe\n"
                f"rec = record_recipe(Recipe(model={model!r}, batch=2, finetune={finetune!r}))\n"
                "s = rec.summary()\n"
                "ru = resource.getrusage(resource.RUSAGE_SELF)\n"
                "print(json.dumps({'wall_s': round(time.perf_counter() - t0, 1), 'cpu_s': round(ru.ru_utime + ru.ru_stime, 1),"
                " 'max_rss_mib': ru.ru_maxrss // 1024, 'load': round(os.getloadavg()[0], 1),"
                " 'allocations': s['allocations'], 'peak_live_gib': round(s['peak_live_bytes'] / 2**30, 2), 'attention': s['attention']}))\n"
            )
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "python_shim")
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                continue
            row = dict(json.loads(out.stdout.strip().splitlines()[-1]), model=model, finetune=finetune)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="all", choices=["fidelity", "memtracker", "cost", "all"])
    p.add_argument("--stress", type=Path, default=ROOT / "target" / "release" / "stepalloc-stress")
    p.add_argument("--workload", action="append", choices=["sft", "vlm-agent"], help="fidelity: only these (default both)")
    args = p.parse_args()
    if args.what in ("fidelity", "all"):
        fidelity(args.stress, tuple(args.workload or ("sft", "vlm-agent")))
    if args.what in ("memtracker", "all"):
        memtracker()
    if args.what in ("cost", "all"):
        cost()


if __name__ == "__main__":
    main()
