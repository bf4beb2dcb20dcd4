"""What every part of the end-to-end comparison (e2e_compare.py) shares: the configurations
compared, the byte units, the log line and running the stress tool for its JSON report."""

from __future__ import annotations

import json
import subprocess

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

# The configuration that also measures what stepalloc.fit's prediction assumes (e2e_predict.py):
# the SDPA backend of every attention call, and the attention backward's scratch. Its step times
# are judged by no target.
ASSUMPTIONS_IN = "native_expandable"


def log(*a: object) -> None:
    print(*a, flush=True)


def stress_json(cmd: list[str], timeout: float) -> tuple[dict | None, str | None]:
    """Runs a `stepalloc-stress ... --json` command: its report, or None and why it failed."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    if p.returncode != 0:
        return None, f"status {p.returncode}: {p.stderr.strip()[-500:]}"
    return json.loads(p.stdout), None
