#!/usr/bin/env python3
"""Checks what gpu/run_all.sh left in its output folder on a machine without a GPU (CI, over
testdrv's host-memory driver): summary.json says OK, every check passed or skipped with a
reason, the driver-level checks ran, and the end-to-end dry run ran every configuration and
its snapshot replay. Usage: check_gpu_run.py OUT. Exit status 0 good, 1 otherwise."""

import json
import sys
from pathlib import Path


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
        "e2e",
    ):
        if names.get(name) != "PASS":
            problems.append(f"check {name}: {names.get(name, 'absent')}, expected PASS")
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
