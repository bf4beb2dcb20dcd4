#!/usr/bin/env python3
"""The same trace replayed on the simulated device and on the CUDA backend (over the
host-memory driver of testdrv/, or a real GPU) must give the same peaks under every compared
configuration: the heap above the backend is the same code, and the CUDA backend's
virtual-memory calls must do what the simulated device's do.

Usage: cuda_matches_sim.py STRESS_BINARY TRACE  (LD_LIBRARY_PATH must find libcuda)."""
import json
import subprocess
import sys


# PyTorch's rules with the size-class lookup rather than `exact_fit` (the `pytorch` preset):
# exact fit breaks ties by address, and the two backends place segments at different addresses,
# so only an address-independent choice can give identical figures across backends.
CONFIGS = ["pytorch_rules=exact_fit:False", "pytorch_expandable", "stepalloc"]


def peaks(binary: str, trace: str, backend: str) -> dict:
    out = subprocess.run(
        [binary, "replay", trace, "--json", "--backend", backend, "--compare", *CONFIGS],
        check=True, capture_output=True, text=True,
    ).stdout
    runs = json.loads(out)["runs"]
    return {r["name"]: (r["peak_reserved"], r["peak_allocated"], r["ooms"]) for r in runs}


def main() -> int:
    binary, trace = sys.argv[1], sys.argv[2]
    sim, cuda = peaks(binary, trace, "sim"), peaks(binary, trace, "cuda")
    for name, figures in sim.items():
        print(f"{name}: sim {figures}, cuda {cuda.get(name)}")
    if sim != cuda:
        print("FAIL: the CUDA backend's peaks differ from the simulated device's")
        return 1
    print(f"cuda matches sim on {trace}: {len(sim)} configurations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
