"""What every part of the end-to-end comparison (e2e_compare.py) shares: the configurations
compared, the byte units and the log line."""

from __future__ import annotations

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
