#!/usr/bin/env python3
"""Checks what gpu/run_all.sh left in its output folder on a machine without a GPU (CI, over
testdrv's host-memory driver): summary.json says OK, every check passed or skipped with a
reason, the driver-level checks ran, the sleep/wake step ran with its correctness fields true
(data_ptr and bytes kept, memory given back, the graph's replay right) and its figures there,
and the end-to-end dry run ran every configuration and its snapshot replay.
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


def main() -> int:
    out = Path(sys.argv[1])
    problems = []
    for name in ("summary.json", "summary.txt", "e2e/e2e.json", "e2e/e2e.txt", "validate/summary.txt"):
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
    e2e = doc["e2e"]
    ran = [n for n, r in e2e["configs"].items() if "failed" not in r and r.get("iterations")]
    if sorted(ran) != sorted(["native_record", "native", "native_expandable", "stepalloc", "stepalloc_mempool"]):
        problems.append(f"e2e: only {ran} ran")
    if "runs" not in e2e["replay"] or set(e2e["replay"]["runs"]) != {"pytorch", "stepalloc"}:
        problems.append(f"e2e: the snapshot replay gave {e2e['replay']}")
    print(
        "\n".join(problems)
        or f"GPU run kit: {doc['counts']['PASS']} checks passed, "
        f"{doc['counts']['SKIP']} skipped, the dry run ran {len(ran)} configurations and the replay"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
