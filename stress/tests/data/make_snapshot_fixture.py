"""Writes snapshot_small.pickle and snapshot_small.json: a small PyTorch memory snapshot in
the exact structure `torch.cuda.memory._dump_snapshot` writes (a dict of plain dicts, lists,
tuples, strings and ints, pickled with protocol 4), for the replay tests on machines without
torch or without a GPU.

The trace (device 0, stream 0; MiB = 1048576):
  segment_alloc 20 MiB;  alloc A 4 MiB;  alloc B 3 MiB;  free A;  alloc C 6 MiB;  free B;
  free of X (allocated before recording began);  segment_alloc 2 MiB;  alloc D 1000 B.
Each free is a free_requested followed by a free_completed. Hand-computed under PyTorch's rules
(the `pytorch` preset): floor (peak live requested) 9 MiB (B + C), peak allocated 9 MiB,
peak reserved 22 MiB (one 20 MiB large segment, one 2 MiB small segment).
"""

import json
import pickle
import sys
from pathlib import Path

MIB = 1 << 20
SEG = 0x7F0000000000
SMALL = 0x7F0002000000
A, B, C, X, D = SEG, SEG + 4 * MIB, SEG + 7 * MIB, 0x7F00F0000000, SMALL

frame = {"filename": "train.py", "line": 42, "name": "forward"}


def entry(action, addr, size, t):
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "stream": 0,
        "time_us": 1_000_000 + t,
        "frames": [frame],
        "compile_context": "N/A",
        "user_metadata": "",
    }


trace = []
t = 0
for action, addr, size in [
    ("segment_alloc", SEG, 20 * MIB),
    ("alloc", A, 4 * MIB),
    ("alloc", B, 3 * MIB),
    ("free_requested", A, 4 * MIB),
    ("free_completed", A, 4 * MIB),
    ("alloc", C, 6 * MIB),
    ("free_requested", B, 3 * MIB),
    ("free_completed", B, 3 * MIB),
    ("free_requested", X, 512),
    ("free_completed", X, 512),
    ("segment_alloc", SMALL, 2 * MIB),
    ("alloc", D, 1000),
]:
    trace.append(entry(action, addr, size, t))
    t += 10


def block(addr, size, requested, state):
    return {"address": addr, "size": size, "requested_size": requested, "state": state, "frames": [frame]}


segments = [
    {
        "device": 0,
        "address": SEG,
        "total_size": 20 * MIB,
        "allocated_size": 6 * MIB,
        "active_size": 6 * MIB,
        "requested_size": 6 * MIB,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [frame],
        "blocks": [
            block(SEG, 7 * MIB, 0, "inactive"),
            block(C, 6 * MIB, 6 * MIB, "active_allocated"),
            block(C + 6 * MIB, 7 * MIB, 0, "inactive"),
        ],
    },
    {
        "device": 0,
        "address": SMALL,
        "total_size": 2 * MIB,
        "allocated_size": 1024,
        "active_size": 1024,
        "requested_size": 1000,
        "stream": 0,
        "segment_type": "small",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [frame],
        "blocks": [block(D, 1024, 1000, "active_allocated"), block(D + 1024, 2 * MIB - 1024, 0, "inactive")],
    },
]

snapshot = {
    "segments": segments,
    "device_traces": [trace],
    "allocator_settings": {
        "PYTORCH_CUDA_ALLOC_CONF": "",
        "max_split_size": -1,
        "garbage_collection_threshold": 0.0,
        "expandable_segments": False,
        "pinned_num_register_threads": 1,
        "release_lock_on_malloc": False,
        "pinned_use_host_register": False,
        "roundup_power2_divisions": [1] * 64,
    },
    "external_annotations": [],
}

out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
with open(out / "snapshot_small.pickle", "wb") as f:
    pickle.dump(snapshot, f, protocol=4)
with open(out / "snapshot_small.json", "w") as f:
    json.dump(snapshot, f)
