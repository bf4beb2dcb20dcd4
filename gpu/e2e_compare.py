#!/usr/bin/env python3
"""End-to-end comparison on a real model: stepalloc against PyTorch's own allocator.

The model is a LLaVA-style multimodal model built from a transformers configuration with random
weights, created on the device in bf16 (nothing is downloaded). Sizes (`--size`):

  full  a CLIP ViT-L/14-336 vision tower, a projector and a 1.1 B Llama: 1.4 B parameters;
        batch 4, 0-3 images and 128-768 prompt tokens per iteration; full fine-tuning; headroom
        under a cap of native_record's peak x --headroom-factor
  7b    the same tower and a Llama-2-7B-shaped language model (LLaVA-1.5-7B's shape): 7.06 B
        parameters; batch 2, each sample its own 0-3 images and 128-1024 prompt tokens
        (left-padded, with an attention mask); full fine-tuning (bf16 weights, gradients and
        fused AdamW's states: 8 bytes a parameter, 52.6 GiB) where that is at most 75% of the
        device, as on an H100 80 GB or an H200, else LoRA on the frozen base (`--train` forces
        one); headroom: the largest batch that fits the whole device

The workload is an agent loop: each iteration rolls out a batch (prefill with the images and
prompts, then a greedy decode loop under torch.no_grad with HF's growing KV cache) and then
trains on the episodes (gradient checkpointing, AdamW). Every configuration runs in its own
process:

  native_record      PyTorch's allocator, with torch.cuda.memory._record_memory_history; its
                     snapshot is replayed by `stepalloc-stress replay --compare pytorch stepalloc`
                     (not run for 7b by default: its figure is the cap, which 7b does not use)
  native             PyTorch's allocator, default settings
  native_expandable  PyTorch's allocator, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  stepalloc          stepalloc.install() (process-wide, the recommended configuration)
  stepalloc_mempool  stepalloc.mempool() around the loop (MemPool mode; the autograd thread's
                     allocations follow the pool: stepalloc.follow)

Per configuration: peak reserved, peak allocated, reserved / allocated, the driver's peak used
memory, the median step time, device mallocs (maps and creates under stepalloc) per steady
step, and the headroom: the largest batch whose largest iteration fits, found by doubling and
bisection over a few probes: for full under torch.cuda.set_per_process_memory_fraction(cap /
total), the cap being the native_record run's peak reserved times --headroom-factor (quick and
the same for every configuration); for 7b on the whole device. A configuration that runs out of
memory at the base batch reports that (its answer, not a failure); for 7b the report answers
whether the loop fits under stepalloc where it runs out of memory under PyTorch.

Dry run (`--dry-run`, or no CUDA device): the size's tiny counterpart (tiny, tiny7b: the same
structure) on the CPU through the same code; the allocator set-up, the statistics and the
headroom search are skipped with a message, and the PyTorch profiler's memory events stand in
for the memory history (written as a snapshot in torch's layout, so the replay path is the
same).

Beside the measurement, the prediction made on the CPU (e2e_predict.py): this loop recorded
ahead of time under fake tensors by stepalloc.fit (the bundle's fit/), replayed by
`stepalloc-stress fit` at the device's memory less --outside-mb for the steps each configuration
ran, its predicted peak reserved beside the measured one (goal: within 3%); and what that
prediction assumes, measured here: the memory outside PyTorch (every configuration), the SDPA
backend of every attention call and the attention backward's scratch (native_expandable).

Usage: e2e_compare.py --out DIR [--size full|7b] [--train auto|full|lora] [--stress BIN] [--budget S]
                      [--configs NAME...] [--fit-dir DIR] [--outside-mb M] [--dry-run]
Writes DIR/e2e.json, DIR/e2e.txt and one DIR/NAME.json / NAME.log per configuration.
Exit status: 0 when no configuration failed (one the time budget left no time for is skipped and
said so), 1 when one failed, 2 on bad input.

The parts beside this file: e2e_common.py (the configurations, units, log), e2e_model.py (the
model, its sizes and the agent loop), e2e_worker.py (one configuration in its own process:
measurements, snapshot, headroom search), e2e_report.py (targets and the text report). This
file is the command line and the orchestrator: it runs the workers, the replay and the report.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from e2e_common import CONFIGS, MEASURED, MIB, log, stress_json
from e2e_model import DRY, SIZES
from e2e_predict import ASSUMED_OUTSIDE_MB, default_fit_dir, predict
from e2e_report import answer, evaluate, prediction_targets, text_report
from e2e_worker import search, worker  # noqa: F401 - search: the headroom search, also e2e_compare.search

HERE = Path(__file__).resolve().parent
# Shares of the time for a size whose headroom is the device (the others: 2).
WEIGHTS = {"native": 3, "stepalloc": 3}


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
    if a.train != "auto":
        cmd += ["--train", a.train]
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
    report, failed = stress_json(cmd, timeout)
    if report is None:
        return {"failed": failed}
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


def orchestrate(a: argparse.Namespace) -> int:
    t0 = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    auto = a.device == "auto"
    if auto:
        # Ask NVML, not the CUDA runtime: this process must hold no CUDA context (the driver's
        # used-memory figures of the configurations would count it).
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
        if a.device == "cpu":
            log("no CUDA device: CPU dry run with the tiny configuration")
    if a.size is None:
        a.size = "full"
    if a.device == "cpu" and (a.dry_run or auto) and DRY[a.size] != a.size:
        log(f"CPU dry run: size {DRY[a.size]}, the structure of {a.size} at a tiny scale")
        a.size = DRY[a.size]
    if a.configs is None:
        # Sizes whose headroom is the whole device need no native_record (its peak is the cap of
        # the others') and leave out its replay to keep within the budget: PyTorch first, then
        # stepalloc, the pair that answers whether stepalloc fits where PyTorch does not.
        device_headroom = SIZES[a.size].headroom == "device"
        a.configs = (
            ["native", "stepalloc", "native_expandable", "stepalloc_mempool"] if device_headroom else list(CONFIGS)
        )
    if a.jobs is None:
        a.jobs = len(a.configs) if a.device == "cpu" else 1
    if a.jobs > 1 and a.device == "cuda":
        log("error: --jobs above 1 needs --device cpu (configurations sharing a GPU would distort each other)")
        return 2
    stress = find_stress(a.stress)
    work = Path(tempfile.mkdtemp(prefix="stepalloc-e2e-"))
    order = list(a.configs)
    capped = SIZES[a.size].headroom == "cap"
    if capped and any(c in MEASURED for c in order) and "native_record" not in order and a.device == "cuda":
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
    # One after another, native_record first: each gets its share of the time left (for sizes
    # whose headroom is the device, PyTorch's and stepalloc's runs 3 parts to the others' 2: they
    # answer the question, and their headroom probes are the slowest part). A configuration the
    # budget leaves no time for is skipped, said so, and not counted as failed.
    device_headroom = SIZES[a.size].headroom == "device"
    weights = [WEIGHTS.get(n, 2) if device_headroom else 1 for n in sequential]
    for i, name in enumerate(sequential):
        share = weights[i] / sum(weights[i:])
        timeout = (a.budget - (time.time() - t0) - replay_budget - 5) * share
        if timeout < 20:
            results[name] = {"config": name, "skipped": "the time budget is spent"}
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
    # The prediction made on the CPU (a recording shipped in the bundle) for the steps each
    # configuration ran, at this device's memory.
    fit_dir = Path(a.fit_dir) if a.fit_dir else default_fit_dir()
    prediction = predict(results, a.size, a.device, stress, fit_dir, a.outside_mb,
                         timeout=max(10.0, a.budget - (time.time() - t0)))  # fmt: skip
    log(f"--- prediction: {prediction.get('skipped') or prediction['trace'] + ' replayed'}")
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": a.device,
        "device_name": rec.get("device_name")
        or next((r.get("device_name") for r in results.values() if r.get("device_name")), "CPU (dry run)"),
        "size": a.size,
        "train": next((r["train"] for r in results.values() if r.get("train")), None),
        "order": order,
        "headroom_factor": a.headroom_factor,
        "configs": results,
        "replay": rp,
        "prediction": prediction,
        "wall_s": round(time.time() - t0, 1),
    }
    doc["targets"] = (
        evaluate(results) + prediction_targets(prediction)
        if a.device == "cuda"
        else [{"target": "all", "status": "n/a", "detail": "CPU dry run: the targets need a GPU"}]
    )
    if SIZES[a.size].headroom == "device":
        doc["answer"] = answer(results) if a.device == "cuda" else "n/a: CPU dry run"
    failed = [n for n, r in results.items() if "failed" in r or "error" in r]
    if "failed" in rp:
        failed.append("replay")
    doc["failed"] = failed
    (out / "e2e.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = text_report(doc)
    (out / "e2e.txt").write_text(text)
    print(text, end="")
    skipped = [n for n, r in results.items() if "skipped" in r]
    doc["skipped"] = skipped
    log(
        f"e2e: {len(order) - len(failed) - len(skipped)} of {len(order)} configurations ran"
        f"{'; failed: ' + ', '.join(failed) if failed else ''}"
        f"{'; skipped (time budget): ' + ', '.join(skipped) if skipped else ''} ({doc['wall_s']} s); {out / 'e2e.json'}"
    )
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument(
        "--size",
        choices=sorted(SIZES),
        help="model and workload size: full (1.4 B, the default), 7b; on the CPU (a dry run, or no CUDA device) the "
        "tiny size of the same structure (tiny, tiny7b)",
    )
    ap.add_argument(
        "--train",
        choices=["auto", "full", "lora"],
        default="auto",
        help="training variant: full fine-tuning, LoRA on the frozen base, or auto: the size's own (full for "
        "the 1.4 B; for 7b full where its state fits the device, else LoRA)",
    )
    ap.add_argument("--dry-run", action="store_true", help="the tiny configuration on the CPU")
    ap.add_argument(
        "--configs",
        nargs="+",
        metavar="NAME",
        help=f"of {', '.join(CONFIGS)} (default: all; for 7b all but native_record, PyTorch and stepalloc first)",
    )
    ap.add_argument("--stress", help="stepalloc-stress binary (default: the bundle's bin/, then target/release)")
    ap.add_argument("--budget", type=float, default=270.0, help="seconds for the whole comparison (default 270)")
    ap.add_argument("--headroom-factor", type=float, default=1.5, help="headroom cap = native peak reserved x this")
    ap.add_argument("--probes", type=int, default=5, help="headroom probes per configuration (default 5)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--fit-dir",
        help="recordings of the loop for the prediction (gpu/e2e_predict.py record; default: the bundle's fit/, "
        "else target/fit-traces)",
    )
    ap.add_argument(
        "--outside-mb",
        type=float,
        default=ASSUMED_OUTSIDE_MB,
        help=f"device memory outside PyTorch the prediction assumes, MiB (default {ASSUMED_OUTSIDE_MB}, as "
        "stepalloc.fit)",
    )
    ap.add_argument("--jobs", type=int, help="configurations run side by side (default: all on the CPU, 1 on a GPU)")
    # Internal: one configuration in this process.
    ap.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--cap-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--snapshot", help=argparse.SUPPRESS)
    a = ap.parse_args()
    unknown = [c for c in a.configs or [] if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown configuration(s) {', '.join(unknown)}; accepted: {', '.join(CONFIGS)}")
    if not 10 <= a.budget <= 3600:
        ap.error(f"--budget {a.budget}: out of range [10, 3600] seconds")
    if not 1.0 < a.headroom_factor <= 10:
        ap.error(f"--headroom-factor {a.headroom_factor}: out of range (1, 10]")
    if not 1 <= a.probes <= 20:
        ap.error(f"--probes {a.probes}: out of range [1, 20]")
    if not 0 <= a.outside_mb < 1 << 20:
        ap.error(f"--outside-mb {a.outside_mb}: out of range [0, 1048576) MiB")
    if a.jobs is not None and not 1 <= a.jobs <= 16:
        ap.error(f"--jobs {a.jobs}: out of range [1, 16]")
    if a.dry_run:
        if a.device == "cuda":
            ap.error("--dry-run runs on the CPU; it cannot be combined with --device cuda")
        a.device = "cpu"
    if a.worker:
        return worker(a)
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
