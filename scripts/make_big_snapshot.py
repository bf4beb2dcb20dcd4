"""Writes a PyTorch memory snapshot pickle of about N trace entries (default 10^6) for timing
`stepalloc-stress advise` and `replay` on the snapshot format: the events of a stepalloc JSON-lines
trace (`stepalloc-stress gen-trace --format jsonl`) as `_dump_snapshot` lays them out (alloc,
free_requested, free_completed; each entry with Python frames shared between entries, as torch's
symbolizer shares them), protocol 4.

    stepalloc-stress gen-trace --iterations 2 --out /tmp/agent.jsonl
    python3 scripts/make_big_snapshot.py /tmp/agent.jsonl /tmp/big.pickle [N]
"""

import json
import pickle
import sys

src, dst = sys.argv[1], sys.argv[2]
limit = int(sys.argv[3]) if len(sys.argv) > 3 else 1_000_000

# A few call stacks, innermost first, as torch records them (torch's own frames, then the user's).
torch_frame = {
    "filename": "/usr/lib/python3/site-packages/torch/nn/modules/module.py",
    "line": 1750,
    "name": "_call_impl",
}
stacks = [
    [
        torch_frame,
        {"filename": "model.py", "line": 10 + 7 * k, "name": f"layer{k}"},
        {"filename": "train.py", "line": 99, "name": "main"},
    ]
    for k in range(8)
]
trace = []
live = {}


def entry(action: str, e: dict, frames: list) -> dict:
    return {
        "action": action,
        "addr": e["addr"],
        "size": e["size"],
        "stream": e.get("stream", 0),
        "time_us": e["t_us"],
        "frames": frames,
        "compile_context": "N/A",
        "user_metadata": "",
    }


with open(src) as f:
    for line in f:
        if len(trace) >= limit:
            break
        e = json.loads(line)
        op = e.get("op")
        if op == "alloc":
            frames = stacks[(e["size"] >> 20) % len(stacks)]
            live[e["addr"]] = frames
            trace.append(entry("alloc", e, frames))
        elif op == "free":
            frames = live.pop(e["addr"], stacks[0])
            for action in ("free_requested", "free_completed"):
                trace.append(entry(action, e, frames))
settings = {
    "PYTORCH_CUDA_ALLOC_CONF": "",
    "max_split_size": -1,
    "garbage_collection_threshold": 0.0,
    "expandable_segments": False,
    "roundup_power2_divisions": [0] * 64,
}
snapshot = {"segments": [], "device_traces": [trace], "allocator_settings": settings, "external_annotations": []}
with open(dst, "wb") as f:
    pickle.dump(snapshot, f, protocol=4)
print(f"wrote {len(trace)} entries to {dst}")
