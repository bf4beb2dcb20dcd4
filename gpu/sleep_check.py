"""Sleep and wake under real PyTorch: ``stepalloc.pause`` / ``resume`` with stepalloc installed
process-wide, measured against a plain pinned ``copy_()`` of the same bytes in the same process,
with what they must keep checked.

Parts, each in its own child process (the allocator is chosen once per process; ``cycle`` and
``tms`` run gpu/sleep_worker.py, this script judges what they print):
- ``cycle``, with stepalloc installed process-wide:
  * ``--backup-mb`` backed up (tag ``sleep_weights``, ``--tensors`` tensors of varied sizes, like
    a model's) and ``--discard-mb`` discarded (tag ``sleep_kv``, 8 tensors); each of
    ``--cycles`` cycles copies the backed-up tensors into one pinned buffer allocated (and
    touched) once and back with ``copy_()`` on a side stream, then runs ``pause("sleep_weights")``,
    ``pause("sleep_kv")``, ``resume("sleep_kv")``, ``resume("sleep_weights")``. Figures are the
    medians of cycles 2 and later (the first allocates the host buffers): milliseconds and
    GiB/s of each call, and pause / resume bandwidth as a share of ``copy_()`` out / back (the
    goal on a GPU: at least 80%; on testdrv's host-memory driver reported, not judged).
  * every backed-up tensor keeps its ``data_ptr()`` and its bytes (compared on the host with the
    bytes written); ``torch.cuda.mem_get_info()`` gains at least each tag's bytes when it is
    paused (from the second cycle on: at the first pause the driver may keep some device memory
    for the new copy stream and pinned buffers); the discarded tensors are usable after the
    resume;
  * a CUDA graph captured before a pause (tag ``sleep_graph``, backed up) replays after the
    resume with the right result: copies from a paused tensor into its own output and into a
    paused tensor, and on a GPU also an elementwise kernel into a paused tensor (testdrv's
    graphs replay copies only; it runs no kernels).
  * the graph-pool release (``graph_pool_check``): a graph captured inside a region has its
    private pool under the tag; pausing the tag gives the pool's bytes back per
    ``mem_get_info`` and the same graph replays right after the resume, with no recapture.
- ``colocated``: the example ``colocated_loop.py`` (``python/examples`` in a bundle) end to end
  with ``--unit-mb`` and ``--iterations``: addresses and bytes kept, switch time, peak; then
  ``switch_costs.py``: the switch's component costs on the device (create, map, unmap and
  release a page, pinned copy bandwidth each way, a small synchronous copy) beside the stress
  tool's colocated cost model's constants; then ``colocated_7b.py``: the loop with a 7 B engine
  (weights backed up, KV cache discarded) and trainer (full fine-tuning's or LoRA's state, as
  the device fits), switch time per iteration against the pinned-copy floor of its bytes.
- ``tms``: torch_memory_saver's own wheel (``hook_mode = "torch"``, its defaults) on the same
  tensors and bytes, pause and resume timed alike; skipped with the reason when it does not
  import.

On testdrv (``STEPALLOC_HOSTCUDA=1``) the children preload its stub CUDA runtime, found as
``runtime/libcudart.so.13`` beside the ``libcuda.so.1`` on ``LD_LIBRARY_PATH`` (or given with
``--stub-runtime``), and the default sizes are small.

Output: ``RESULT PASS|FAIL|SKIP <name> <detail>`` lines (sleep_cycle, sleep_bandwidth, sleep_graph,
sleep_graph_pool, sleep_colocated, sleep_switch_costs, sleep_colocated_7b, sleep_tms), the table on stdout, and with
``--json FILE`` the figures there and the table beside it (FILE with ``.txt``). Exit status 1
when a check failed: a correctness check, or on a GPU the bandwidth target (torch_memory_saver
failing is recorded as a skip: it is a comparison, not a check of stepalloc; the 7 B loop's and
the component costs' figures are reported, not judged).
Usage: python3 sleep_check.py [--json FILE] [--backup-mb N] [--discard-mb N] [--tensors N]
                              [--cycles N] [--graph-mb N] [--unit-mb N] [--iterations N]
                              [--parts cycle,colocated,tms] [--scale-7b N] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sleep_worker import GIB, MIB, SIZE_ARGS
from testdrv_env import on_host_driver, stub_runtime, with_stub

HERE = Path(__file__).resolve().parent
TARGET = 0.8  # pause / resume bandwidth as a share of copy_()'s, on a GPU
PARTS = ("cycle", "colocated", "tms")
# Default sizes: (GPU, testdrv's host-memory driver).
DEFAULTS = {
    "backup_mb": (1024, 64),
    "discard_mb": (512, 32),
    "tensors": (257, 33),
    "cycles": (5, 4),
    "graph_mb": (64, 4),
    "unit_mb": (256, 8),
    "iterations": (3, 3),
}



def python_path() -> str:
    """The stepalloc package: the bundle's python/, or python_shim/ in the repository."""
    for candidate in (HERE.parent / "python", HERE.parent / "python_shim"):
        if (candidate / "stepalloc").is_dir():
            return str(candidate)
    return ""


def example_path() -> Path | None:
    root = python_path()
    path = Path(root) / "examples" / "colocated_loop.py" if root else None
    return path if path is not None and path.is_file() else None


def child_env(runtime: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (python_path(), env.get("PYTHONPATH", "")) if p)
    return with_stub(env, runtime) if runtime is not None else env


def run_child(role: str, a: argparse.Namespace, env: dict[str, str], timeout: float) -> dict:
    args = [sys.executable, str(HERE / "sleep_worker.py"), "--role", role]
    for k in SIZE_ARGS:
        args += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    try:
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        return {"error": f"timed out after {timeout:.0f}s {out[-1500:]}".strip()}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"status {done.returncode}: " + (done.stdout + done.stderr)[-2000:]}
    return json.loads(lines[-1])


def run_colocated(a: argparse.Namespace, env: dict[str, str], timeout: float) -> dict:
    example = example_path()
    if example is None:
        return {"error": f"colocated_loop.py not found under {python_path() or '(no stepalloc package)'}/examples"}
    args = [sys.executable, str(example), "--iterations", str(a.iterations), "--unit-mb", str(a.unit_mb)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    text = done.stdout
    out: dict = {
        "status": done.returncode,
        "seconds": time.perf_counter() - t0,
        "unit_mb": a.unit_mb,
        "iterations": a.iterations,
        "addresses_kept": "addresses kept: yes" in text,
        "bytes_kept": "bytes kept: yes" in text,
        "fits": "fits: yes" in text,
        "output": text[-3000:],
    }
    for line in text.splitlines():
        if line.startswith("peak in use "):
            out["peak_mib"] = float(line.split()[3])
        if "switch time " in line:
            out["switch_ms"] = float(line.split("switch time ")[1].split()[0])
    if done.returncode != 0:
        out["error"] = f"status {done.returncode}: " + (text + done.stderr)[-2000:]
    return out


def run_script(script: str, args: list[str], env: dict[str, str], timeout: float) -> dict:
    """One of the colocated part's measurements (switch_costs.py, colocated_7b.py) in its own
    process: its JSON (the last line of colocated_7b.py's output, or --json's file)."""
    cmd = [sys.executable, str(HERE / script), *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"{script} timed out after {timeout:.0f}s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"{script}: status {done.returncode}: " + (done.stdout + done.stderr)[-2000:]}
    return json.loads(lines[-1])


def run_switch_costs(a: argparse.Namespace, env: dict[str, str], timeout: float) -> dict:
    """The switch's component costs on the device (switch_costs.py), beside the cost model's."""
    small = on_host_driver()
    args = ["--pages", "32" if small else "256", "--big-pages", "4" if small else "32"]
    args += ["--copy-mb", "64" if small else "1024", "--json-stdout"]
    return run_script("switch_costs.py", args, env, timeout)


def run_colocated_7b(a: argparse.Namespace, env: dict[str, str], timeout: float) -> dict:
    """The colocated loop with the 7 B engine and trainer (colocated_7b.py)."""
    args = ["--scale", str(a.scale_7b)] if a.scale_7b else []
    return run_script("colocated_7b.py", args, env, timeout)


def judge_colocated_7b(doc: dict) -> list[tuple[str, str, str]]:
    """sleep_switch_costs and sleep_colocated_7b: the figures, reported; failed only when a
    measurement failed or an address or a byte moved."""
    res = []
    sc = doc.get("switch_costs")
    if sc is not None:
        if "skip" in sc or "error" in sc:
            why = one_line(sc.get("skip") or sc["error"], 600)
            res.append(("SKIP" if "skip" in sc else "FAIL", "sleep_switch_costs", why))
        else:
            res.append(("PASS", "sleep_switch_costs", "; ".join(cost_phrases(sc))))
    c7 = doc.get("colocated_7b")
    if c7 is not None:
        if "skip" in c7 or "error" in c7:
            why = one_line(c7.get("skip") or c7["error"], 600)
            res.append(("SKIP" if "skip" in c7 else "FAIL", "sleep_colocated_7b", why))
        else:
            ok = c7["addresses_kept"] and c7["bytes_kept"]
            res.append(("PASS" if ok else "FAIL", "sleep_colocated_7b", colocated_7b_phrase(c7)))
    return res


def cost_phrases(sc: dict) -> list[str]:
    out = []
    for r in sc["compare"]:
        if "measured_s" in r:
            out.append(f"{r['what']} {r['measured_s'] * 1e6:.1f} us ({r['ratio']:.2f}x the model's)")
        else:
            out.append(f"{r['what']} {r['measured_gbps']:.1f}")
    return out


def colocated_7b_phrase(c7: dict) -> str:
    sz = c7["sizes"]
    grouped = f", tensors in groups of {c7['group']}" if c7.get("group", 1) > 1 else ""
    return (
        f"7 B engine ({sz['weights_bytes'] / GIB:.2f} GiB weights in {sz['weight_tensors']} tensors, "
        f"{sz['kv_bytes'] / GIB:.2f} GiB KV) and {c7['train']['variant']} trainer "
        f"({sz['trainer_backed_up_bytes'] / GIB:.2f} GiB backed up, {sz['trainer_discarded_bytes'] / GIB:.2f} GiB "
        f"discarded), 1/{c7['scale']} scale{grouped}: switch "
        f"{c7['switch_s'] * 1e3:.0f} ms an iteration against a pinned-copy floor of {c7['floor_s'] * 1e3:.0f} ms "
        f"({c7['over_floor']:.2f}x; the first, pinning the host buffers, {c7['first_switch_s'] * 1e3:.0f} ms); "
        f"the engine's own {c7.get('engine_switch_s', 0) * 1e3:.0f} ms, "
        f"{c7.get('engine_over_floor', 0):.2f}x its floor "
        f"(stepalloc-stress colocated --link-gbps {c7.get('link_gbps', 0):.1f} models it); "
        f"peak {c7['peak_in_use_bytes'] / GIB:.2f} GiB of {c7['total_bytes'] / GIB:.2f}; addresses kept "
        f"{c7['addresses_kept']}, bytes kept {c7['bytes_kept']}"
    )


def one_line(text: str, n: int) -> str:
    return text[-n:].replace("\n", " | ")


def judge_cycle(doc: dict) -> list[tuple[str, str, str]]:
    """sleep_cycle, sleep_bandwidth and sleep_graph: (status, name, detail)."""
    c = doc["cycle"]
    if "skip" in c:
        return [("SKIP", "sleep_cycle", c["skip"])]
    if "error" in c:
        return [("FAIL", "sleep_cycle", one_line(c["error"], 600))]
    b, d, cp = c["stepalloc_backup"], c["stepalloc_discard"], c["copy"]
    ok = all(c[k] for k in ("ptrs_kept", "bytes_kept", "memory_released", "discard_usable", "copied_bytes_ok"))
    cycle = (
        f"{b['bytes'] / GIB:.3f} GiB backed up in {c['sizes']['tensors']} tensors: pause "
        f"{b['pause_s'] * 1e3:.1f} ms ({b['pause_gib_s']:.2f} GiB/s), resume {b['resume_s'] * 1e3:.1f} ms "
        f"({b['resume_gib_s']:.2f} GiB/s); copy_ out {cp['pause_gib_s']:.2f}, back {cp['resume_gib_s']:.2f} "
        f"GiB/s; {d['bytes'] / GIB:.3f} GiB discarded: pause {d['pause_s'] * 1e3:.1f} ms, resume "
        f"{d['resume_s'] * 1e3:.1f} ms; ptrs_kept={c['ptrs_kept']}, bytes_kept={c['bytes_kept']}, "
        f"memory_released={c['memory_released']}, discard_usable={c['discard_usable']}"
    )
    bw = doc["bandwidth"]
    ratios = (
        f"pause at {bw['pause_ratio']:.0%} of copy_ out, resume at {bw['resume_ratio']:.0%} of copy_ back "
        f"(target {TARGET:.0%})"
    )
    if bw["applies"]:
        bandwidth_line = ("PASS" if bw["target_met"] else "FAIL", "sleep_bandwidth", ratios)
    else:
        bandwidth_line = ("SKIP", "sleep_bandwidth", f"host-memory driver: the target is a GPU's; {ratios}")
    g = c["graph"]
    graph = (
        f"{g['bytes'] / MIB:.0f} MiB, {'copies and a kernel' if g['kernel'] else 'copies'} replayed after "
        f"pause/resume: replay_right={g['replay_right']}, ptr_kept={g['ptr_kept']}, "
        f"released {g['released_bytes'] / MIB:.1f} MiB; the graph's own pool "
        + ("paused with the tag" if g["pool_tagged"] else "untagged, stays resident")
    )
    graph_ok = g["replay_right"] and g["ptr_kept"] and g["released"]
    gp = c["graph_pool"]
    pool = (
        f"{gp['bytes'] / MIB:.0f} MiB graph ({'copies and a kernel' if gp['kernel'] else 'copies'}) captured in a "
        f"region: pause released {gp['released_bytes'] / MIB:.1f} MiB (mem_get_info gained "
        f"{gp['gained_bytes'] / MIB:.1f} MiB, at least {2 * gp['bytes'] / MIB:.0f} wanted), resume mapped "
        f"{gp['mapped_bytes'] / MIB:.1f} MiB; replay_right={gp['replay_right']}, ptr_kept={gp['ptr_kept']}, "
        "no recapture"
    )
    pool_ok = gp["released"] and gp["mapped_back"] and gp["replay_right"] and gp["ptr_kept"]
    return [
        ("PASS" if ok else "FAIL", "sleep_cycle", cycle),
        bandwidth_line,
        ("PASS" if graph_ok else "FAIL", "sleep_graph", graph),
        ("PASS" if pool_ok else "FAIL", "sleep_graph_pool", pool),
    ]


def judge_colocated(co: dict) -> tuple[str, str, str]:
    if "skip" in co:
        return ("SKIP", "sleep_colocated", co["skip"])
    if "error" in co:
        return ("FAIL", "sleep_colocated", one_line(co["error"], 600))
    ok = co["addresses_kept"] and co["bytes_kept"] and co["status"] == 0
    return (
        "PASS" if ok else "FAIL",
        "sleep_colocated",
        f"colocated_loop.py --unit-mb {co['unit_mb']} --iterations {co['iterations']}: addresses kept "
        f"{co['addresses_kept']}, bytes kept {co['bytes_kept']}, switch {co.get('switch_ms', 0):.0f} ms, "
        f"peak {co.get('peak_mib', 0):.0f} MiB",
    )


def judge_tms(tm: dict) -> tuple[str, str, str]:
    if "skip" in tm:
        return ("SKIP", "sleep_tms", tm["skip"])
    if "error" in tm:
        # torch_memory_saver is a comparison: its failure is recorded, not stepalloc's failure
        return ("SKIP", "sleep_tms", "torch_memory_saver imported but did not complete: " + one_line(tm["error"], 400))
    b, d = tm["backup"], tm["discard"]
    return (
        "PASS",
        "sleep_tms",
        f"torch_memory_saver {tm['version']} ({tm.get('source', 'installed')}) on the same tensors: "
        f"backed up pause {b['pause_s'] * 1e3:.1f} ms, "
        f"resume {b['resume_s'] * 1e3:.1f} ms; discarded pause {d['pause_s'] * 1e3:.1f} ms, resume "
        f"{d['resume_s'] * 1e3:.1f} ms; ptrs_kept={tm['ptrs_kept']}, bytes_kept={tm['bytes_kept']}",
    )


def judge(doc: dict) -> list[tuple[str, str, str]]:
    """The RESULT lines of the parts that ran: (status, name, detail)."""
    res = judge_cycle(doc) if "cycle" in doc else []
    if "colocated" in doc:
        res.append(judge_colocated(doc["colocated"]))
        res += judge_colocated_7b(doc)
    if "tms" in doc:
        res.append(judge_tms(doc["tms"]))
    return res


def host_note() -> str:
    delay = os.environ.get("HOSTCUDA_DELAY_US", "0")
    note = "testdrv's host-memory driver: host-memory figures"
    if delay not in ("", "0"):
        note += f"; HOSTCUDA_DELAY_US={delay}: every piece of queued work, each copy among them, waits that long"
    return note


def text_table(doc: dict) -> str:
    """The human table of sleep.json."""
    c = doc.get("cycle") or {}
    if "stepalloc_backup" not in c:
        why = c.get("skip") or c.get("error", "not run")
        return "\n".join([f"sleep and wake: no figures ({str(why)[-300:]})", *colocated_7b_lines(doc)]) + "\n"
    s = c["sizes"]
    lines = [
        f"sleep and wake (gpu/sleep_check.py) on {c['device']}"
        + (f" ({host_note()})" if doc["host_memory_driver"] else "")
        + f": {s['backup_bytes'] / GIB:.3f} GiB backed up in {s['tensors']} tensors + "
        f"{s['discard_bytes'] / GIB:.3f} GiB discarded, median of cycles 2..{s['cycles']}",
        f"{'':<48} {'bytes':>9} {'pause ms':>9} {'resume ms':>10} {'pause GiB/s':>12} {'resume GiB/s':>13}",
    ]
    rows = [c["stepalloc_backup"], c["copy"], c["stepalloc_discard"]]
    tm = doc.get("tms") or {}
    if "backup" in tm:
        rows += [tm["backup"], tm["discard"]]
    for r in rows:
        name = r["name"].replace("copy_() into kept pinned memory and back", "copy_() out / back, kept pinned buffer")
        lines.append(
            f"{name:<48} {r['bytes'] / MIB:>5.0f} MiB {r['pause_s'] * 1e3:>9.1f} {r['resume_s'] * 1e3:>10.1f}"
            f" {r['pause_gib_s']:>12.2f} {r['resume_gib_s']:>13.2f}"
        )
    bw = doc["bandwidth"]
    lines.append(
        f"stepalloc against copy_(): pause {bw['pause_ratio']:.0%}, resume {bw['resume_ratio']:.0%} "
        f"(target {TARGET:.0%} on a GPU: "
        + ("not judged here)" if not bw["applies"] else ("met)" if bw["target_met"] else "MISSED)"))
    )
    if "skip" in tm or "error" in tm:
        lines.append(f"torch_memory_saver: {one_line(tm.get('skip') or tm.get('error', ''), 300)}")
    g = c["graph"]
    lines.append(
        f"kept: data_ptr {c['ptrs_kept']}, bytes {c['bytes_kept']}; mem_get_info at each pause of cycles 2.. gained "
        f"{c['gained_bytes']['backup_min'] / MIB:.0f} MiB (backed up) and {c['gained_bytes']['discard_min'] / MIB:.0f} "
        f"MiB (discarded) at least; graph replay right {g['replay_right']}, ptr kept {g['ptr_kept']}"
    )
    co = doc.get("colocated") or {}
    if "addresses_kept" in co:
        lines.append(
            f"colocated loop: {co['iterations']} iterations of {co['unit_mb']} MiB units, switch "
            f"{co.get('switch_ms', 0):.0f} ms, peak {co.get('peak_mib', 0):.0f} MiB, addresses kept "
            f"{co['addresses_kept']}, bytes kept {co['bytes_kept']}"
        )
    elif co:
        lines.append(f"colocated loop: {one_line(co.get('error') or co.get('skip', ''), 300)}")
    return "\n".join(lines + colocated_7b_lines(doc)) + "\n"


def colocated_7b_lines(doc: dict) -> list[str]:
    """The table's lines on the 7 B colocated loop and the switch's component costs."""
    lines = []
    c7 = doc.get("colocated_7b") or {}
    if "switch_s" in c7:
        lines.append("colocated loop at 7 B: " + colocated_7b_phrase(c7))
    elif c7:
        lines.append(f"colocated loop at 7 B: {one_line(c7.get('error') or c7.get('skip', ''), 300)}")
    sc = doc.get("switch_costs") or {}
    if "compare" in sc:
        from switch_costs import text as costs_text

        lines.append(costs_text(sc).rstrip())
    elif sc:
        lines.append(f"switch component costs: {one_line(sc.get('error') or sc.get('skip', ''), 300)}")
    return lines


def bandwidth(c: dict) -> dict:
    b, cp = c["stepalloc_backup"], c["copy"]
    pr = b["pause_gib_s"] / cp["pause_gib_s"] if cp["pause_gib_s"] else 0.0
    rr = b["resume_gib_s"] / cp["resume_gib_s"] if cp["resume_gib_s"] else 0.0
    return {
        "pause_ratio": pr,
        "resume_ratio": rr,
        "target": TARGET,
        "target_met": min(pr, rr) >= TARGET,
        "applies": not on_host_driver(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    host = on_host_driver()
    for k, (gpu, small) in DEFAULTS.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=small if host else gpu)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument(
        "--scale-7b", type=int, help="the 7 B colocated loop's sizes divided by this (colocated_7b.py's default)"
    )
    ap.add_argument("--budget", type=float, default=140.0, help="seconds for all parts together")
    ap.add_argument("--stub-runtime", help="testdrv's libcudart.so.13 (default: found beside libcuda.so.1)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.cycles < 2:
        ap.error("--cycles must be at least 2 (the first cycle is warm-up)")
    if min(a.backup_mb, a.discard_mb, a.tensors, a.graph_mb, a.unit_mb, a.iterations) < 1:
        ap.error("sizes, --tensors and --iterations must be at least 1")
    parts = [p for p in a.parts.split(",") if p]
    if set(parts) - set(PARTS):
        ap.error(f"unknown part(s) {','.join(sorted(set(parts) - set(PARTS)))}; accepted: {','.join(PARTS)}")
    start = time.monotonic()
    runtime = Path(a.stub_runtime) if a.stub_runtime else (stub_runtime() if host else None)
    doc: dict = {"host_memory_driver": host, "parts": parts}
    skip = None
    if host and (runtime is None or not runtime.is_file()):
        skip = (
            "STEPALLOC_HOSTCUDA is set but testdrv's stub runtime (runtime/libcudart.so.13 beside libcuda.so.1 "
            "on LD_LIBRARY_PATH) is not there; build it with testdrv/build.sh"
        )
    env = child_env(runtime if host else None)

    def left() -> float:
        return a.budget - (time.monotonic() - start)

    if "cycle" in parts:
        doc["cycle"] = {"skip": skip} if skip else run_child("cycle", a, env, max(10.0, left() * 0.6))
        c = doc["cycle"]
        if "stepalloc_backup" in c:
            doc["bandwidth"] = bandwidth(c)
            doc["correct"] = {
                "ptrs_kept": c["ptrs_kept"],
                "bytes_kept": c["bytes_kept"],
                "memory_released": c["memory_released"],
                "discard_usable": c["discard_usable"],
                "graph_replay_right": c["graph"]["replay_right"],
                "graph_ptr_kept": c["graph"]["ptr_kept"],
                "graph_pool_released": c["graph_pool"]["released"],
                "graph_pool_replay_right": c["graph_pool"]["replay_right"],
            }
    no_device = skip or (doc.get("cycle") or {}).get("skip")
    if "colocated" in parts:
        # The example, the switch's component costs, then the 7 B loop (the longest: it pins
        # the 7 B engine's and trainer's host buffers in its first iteration).
        doc["colocated"] = {"skip": no_device} if no_device else run_colocated(a, env, max(10.0, left() * 0.35))
        doc["switch_costs"] = {"skip": no_device} if no_device else run_switch_costs(a, env, max(10.0, left() * 0.1))
        doc["colocated_7b"] = {"skip": no_device} if no_device else run_colocated_7b(a, env, max(20.0, left() * 0.8))
    if "tms" in parts:
        doc["tms"] = {"skip": no_device} if no_device else run_child("tms", a, env, max(10.0, left() - 5))
    results = judge(doc)
    doc["results"] = [{"status": s, "name": n, "detail": d} for s, n, d in results]
    doc["ok"] = not any(s == "FAIL" for s, _, _ in results)
    doc["seconds"] = time.monotonic() - start
    table = text_table(doc)
    print(table, end="")
    for s, n, d in results:
        print(f"RESULT {s} {n} {d}", flush=True)
    if a.json:
        path = Path(a.json)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        path.with_suffix(".txt").write_text(table)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
