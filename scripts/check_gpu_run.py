#!/usr/bin/env python3
"""Checks what gpu/run_all.sh left in its output folder on a machine without a GPU (CI, over
testdrv's host-memory driver): summary.json says OK, every check passed or skipped with a
reason, the driver-level checks ran, the sleep/wake step ran with its correctness fields true
(data_ptr and bytes kept, memory given back, the graph's replay right) and its figures there,
the switch's component costs measured and the 7 B colocated loop run with addresses and bytes
kept, the 7 B comparison's dry run (tiny7b) ran its four configurations with a training variant
picked, the 1.4 B dry run ran every configuration and its snapshot replay, and both printed the
prediction made on the CPU for every configuration and measured its assumptions (as far as a
CPU can: the SDPA calls and the attention probe's picks).
Usage: check_gpu_run.py OUT. Exit status 0 good, 1 otherwise."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def sleep_problems(sleep: dict | None) -> list[str]:
    """What is wrong with summary.json's sleep section (gpu/sleep_check.py's sleep.json)."""
    if not sleep:
        return ["summary.json: no sleep section (checks/sleep.json missing)"]
    problems = [f"sleep: {k} is {v}" for k, v in sorted(sleep.get("correct", {}).items()) if v is not True]
    needed = ("ptrs_kept", "bytes_kept", "memory_released", "graph_replay_right", "graph_ptr_kept")
    problems += [f"sleep: no {k} field" for k in needed if k not in sleep.get("correct", {})]
    cycle = sleep.get("cycle") or {}
    for row in ("stepalloc_backup", "stepalloc_discard", "copy"):
        figures = [cycle.get(row, {}).get(k, 0) for k in ("pause_s", "resume_s", "pause_gib_s", "resume_gib_s")]
        if not all(isinstance(f, (int, float)) and f > 0 for f in figures):
            problems.append(f"sleep: {row} figures missing or not positive: {figures}")
    if not {"pause_ratio", "resume_ratio", "target_met"} <= set(sleep.get("bandwidth", {})):
        problems.append(f"sleep: bandwidth fields missing: {sleep.get('bandwidth')}")
    return problems


def colocated_problems(sleep: dict | None) -> list[str]:
    """What is wrong with the sleep section's 7 B colocated loop and switch component costs."""
    sleep = sleep or {}
    problems = []
    c7 = sleep.get("colocated_7b") or {}
    if c7.get("addresses_kept") is not True or c7.get("bytes_kept") is not True:
        why = str(c7.get("error") or c7.get("skip") or "")[-300:]
        problems.append(
            f"sleep: the 7 B colocated loop kept addresses {c7.get('addresses_kept')}, "
            f"bytes {c7.get('bytes_kept')} ({why})"
        )
    elif not all(c7.get(k, 0) > 0 for k in ("switch_s", "floor_s", "over_floor")) or c7.get("scale", 0) < 1:
        problems.append(f"sleep: the 7 B colocated loop's figures missing or not positive: {c7.get('switch_s')}")
    costs = (sleep.get("switch_costs") or {}).get("compare") or []
    measured = [r.get("measured_s", r.get("measured_gbps", 0)) for r in costs]
    if len(costs) < 9 or not all(isinstance(m, (int, float)) and m > 0 for m in measured):
        problems.append(f"sleep: switch component costs missing or not positive: {len(costs)} rows, {measured}")
    return problems


def e2e_7b_problems(e2e: dict | None) -> list[str]:
    """What is wrong with the 7 B comparison's dry run (tiny7b: the 7 B code path at a tiny size)."""
    if not e2e:
        return ["summary.json: no e2e_7b section (e2e_7b/e2e.json missing)"]
    problems = []
    if e2e.get("size") != "tiny7b":
        problems.append(f"e2e_7b: size {e2e.get('size')}, expected tiny7b in a dry run")
    ran = sorted(n for n, r in e2e["configs"].items() if "failed" not in r and r.get("iterations"))
    if ran != sorted(["native", "native_expandable", "stepalloc", "stepalloc_mempool"]):
        problems.append(f"e2e_7b: only {ran} ran")
    if (e2e.get("train") or {}).get("variant") not in ("full", "lora"):
        problems.append(f"e2e_7b: no training variant picked: {e2e.get('train')}")
    shapes = [i["images"] for r in e2e["configs"].values() for i in r.get("iterations", [])]
    if not any(len(set(s)) > 1 for s in shapes):
        problems.append(f"e2e_7b: no iteration with a different number of images per sample: {shapes}")
    return problems


def prediction_problems(e2e: dict, label: str) -> list[str]:
    """What is wrong with a dry run's prediction (gpu/e2e_predict.py): the loop's recording (the
    bundle's fit/) replayed for every configuration that ran, over the steps it ran, its floor
    the recording's own peak of live bytes; the attention calls counted in native_expandable's
    loop as many, with and without a mask, as the recording made; the attention probe's cases."""
    pred = e2e.get("prediction") or {}
    if "configs" not in pred:
        return [f"{label}: no prediction: {pred.get('skipped', 'absent')}"]
    problems = []
    ran = {n: r for n, r in e2e["configs"].items() if r.get("iterations")}
    if sorted(pred["configs"]) != sorted(ran):
        problems.append(f"{label}: predicted {sorted(pred['configs'])}, ran {sorted(ran)}")
    for n, c in pred["configs"].items():
        steps = 2 * len(ran.get(n, {}).get("iterations", []))
        if c["steps"] != steps or not (c.get("predicted_peak_reserved") or 0) > 0:
            peak = c.get("predicted_peak_reserved")
            problems.append(f"{label}: {n} predicted over {c['steps']} steps (ran {steps}), peak {peak}")
    recording = pred["recording"]
    whole = pred["replays"].get(str(recording["steps"]), {})
    if whole.get("floor_bytes") != recording["peak_live_bytes"]:
        problems.append(
            f"{label}: the replay's floor {whole.get('floor_bytes')} is not the recording's peak live bytes "
            f"{recording['peak_live_bytes']}"
        )

    def calls(counts: dict) -> tuple[int, int]:
        return (sum(v for k, v in counts.items() if not k.endswith("+mask")),
                sum(v for k, v in counts.items() if k.endswith("+mask")))  # fmt: skip

    counted = (ran.get("native_expandable") or {}).get("attention")
    if counted is None or calls(counted) != calls(recording["attention"]):
        problems.append(f"{label}: attention calls counted {counted}, recorded {recording['attention']}")
    probe = (ran.get("native_expandable") or {}).get("attention_probe") or []
    if [row.get("case") for row in probe if row.get("picked")] != [
        "language model, causal", "language model, padded (mask)", "vision tower"
    ]:  # fmt: skip
        problems.append(f"{label}: attention probe {probe}")
    return problems


def main() -> int:
    out = Path(sys.argv[1])
    problems = []
    for name in (
        "summary.json",
        "summary.txt",
        "e2e/e2e.json",
        "e2e/e2e.txt",
        "e2e_7b/e2e.json",
        "validate/summary.txt",
    ):
        if not (out / name).is_file():
            problems.append(f"{out / name} is missing")
    if problems:
        print("\n".join(problems))
        return 1
    doc = json.loads((out / "summary.json").read_text())
    if not doc["ok"]:
        problems.append(f"summary.json: not ok, {doc['counts']}")
    names = {c["name"]: c["status"] for c in doc["checks"]}
    # cuda_smoke.py reports its checks by their own names (device_count, threads_on_real_streams).
    for name in (
        "bundle_manifest",
        "symbols",
        "device_count",
        "threads_on_real_streams",
        "c_abi_threads_cuda",
        "bundle_gpu_tests",
        "cuda_matches_sim",
        "random_cuda",
        "sleep_cycle",
        "sleep_graph",
        "sleep_colocated",
        "sleep_switch_costs",
        "sleep_colocated_7b",
        "e2e_7b",
        "e2e",
    ):
        if names.get(name) != "PASS":
            problems.append(f"check {name}: {names.get(name, 'absent')}, expected PASS")
    # Reported, not judged over testdrv (the bandwidth target is a GPU's; torch_memory_saver
    # is skipped where its wheel does not import).
    for name in ("sleep_bandwidth", "sleep_tms"):
        if names.get(name) not in ("PASS", "SKIP"):
            problems.append(f"check {name}: {names.get(name, 'absent')}, expected PASS or SKIP")
    problems += sleep_problems(doc.get("sleep"))
    problems += colocated_problems(doc.get("sleep"))
    problems += e2e_7b_problems(doc.get("e2e_7b"))
    problems += prediction_problems(doc.get("e2e_7b") or {"configs": {}}, "e2e_7b")
    e2e = doc["e2e"]
    problems += prediction_problems(e2e, "e2e")
    ran = [n for n, r in e2e["configs"].items() if "failed" not in r and r.get("iterations")]
    if sorted(ran) != sorted(["native_record", "native", "native_expandable", "stepalloc", "stepalloc_mempool"]):
        problems.append(f"e2e: only {ran} ran")
    if "runs" not in e2e["replay"] or set(e2e["replay"]["runs"]) != {"pytorch", "stepalloc"}:
        problems.append(f"e2e: the snapshot replay gave {e2e['replay']}")
    print(
        "\n".join(problems)
        or f"GPU run kit: {doc['counts']['PASS']} checks passed, "
        f"{doc['counts']['SKIP']} skipped, the dry runs ran {len(ran)} configurations and the replay (1.4 B's "
        f"structure) and 4 (7 B's), each with the prediction and its assumptions"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
