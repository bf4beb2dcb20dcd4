"""Sixth adversarial pass: "will it fit?" as a hostile or careless user drives it.

- ``stepalloc-stress fit --pytorch-conf`` against PyTorch 2.15's own parser (the wheel over
  testdrv, ``torch.cuda.memory._set_allocator_settings``): a fixed list of corner cases and 400
  strings drawn from PyTorch's keys, values and separators; whatever PyTorch refuses is refused,
  whatever it accepts is accepted or refused as not modelled (never silently read otherwise);
- ``python -m stepalloc.fit`` refuses bad replay inputs (device sizes, ``--outside-mb``, a
  ``PYTORCH_CUDA_ALLOC_CONF`` PyTorch or the model refuses, a seed out of range) with exit status
  2 before recording;
- inputs that would make the recorder itself use tens of GiB of host memory (tokens, batch, image
  size) and hostile configurations (absurd or negative sizes and depths, nesting, a wrong
  type, an unknown model type, a folder without ``config.json``) are refused, named;
- ``record(fn)``: a function that raises leaves no patch behind; odd return values; CPU
  allocations; a thread started inside is recorded; a side stream is recorded as a stream; a
  function that allocates without end is stopped at the recorder's bound.

docs/testing.md (the adversarial pass) records what each attempt found.
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_sleep import needs_torch, torch_env

from conftest import SHIM, check_child, run_python

from stepalloc.fit._binary import StressBinaryNotFound, stress_binary

ROOT = SHIM.parent
MIB = 1 << 20


def stress() -> Path:
    try:
        return stress_binary()
    except StressBinaryNotFound:
        pytest.skip("needs the stress tool (cargo build --release -p stepalloc-stress)")


# ---- --pytorch-conf against PyTorch's own parser --------------------------------------------

KEYS = [
    "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold", "roundup_power2_divisions",
    "expandable_segments", "pinned_use_background_threads", "large_segment_size_mb", "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb", "backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
    "pinned_num_register_threads", "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse",
    "per_process_memory_fraction", "pinned_free_catch_all", "throw_on_cudamalloc_oom", "expandable_segments_reserve",
    "expandable_segments_reserve_by_class", "bogus", "EXPANDABLE_SEGMENTS",
]
VALUES = [
    "True", "False", "true", "128", "20", "19", "11", "-1", "0", "1", "3", "4", "256", "0.5", "1.5", "abc", "256abc",
    "0x1p-1", "nan", "1e-320", ".5", "native", "cudaMallocAsync", "", " 1 28", "\u00a0True",
]
FIXED = [
    "", ",,,", "expandable_segments", "expandable_segments:", ":True", "expandable_segments:True]",
    "max_split_size_mb:128:256", "max_split_size_mb:-1", "max_split_size_mb:128abc", "max_split_size_mb:- 5",
    "max_split_size_mb:18446744073709551615", "max_split_size_mb:18446744073709551616", "max_split_size_mb,128",
    "garbage_collection_threshold:0.5abc", "garbage_collection_threshold:0x0.8p0", "garbage_collection_threshold:1e-320",
    "roundup_power2_divisions:0", "roundup_power2_divisions:[]", "roundup_power2_divisions:[256:1,",
    "roundup_power2_divisions:[256,1]", "roundup_power2_divisions:[256abc:2]", "roundup_power2_divisions:[,]",
    "per_process_memory_fraction:0", "per_process_memory_fraction:-0", "per_process_memory_fraction:1e-310",
    "expandable_segments:\u00a0True", ",expandable_segments:True", "max_split_size_mb:128,,",
    "max_non_split_rounding_mb:1", "pinned_num_register_threads:3", "pinned_num_register_threads:256",
    "pinned_reserve_segment_size_mb:0", "pinned_max_cached_size_mb:abc", "throw_on_cudamalloc_oom:False",
    "expandable_segments_reserve:[1,2]", "expandable_segments_reserve_by_class:[a:0.5,b:1G]",
    "expandable_segments_reserve_by_class:[a:b:c]", "large_segment_size_mb:-5,expandable_segments:True",
    "backend:native,backend:native", "expandable_segments:True,expandable_segments:False",
    "max_split_size_mb:20,large_segment_size_mb:64", "large_segment_size_mb:64,large_segment_size_mb:20,max_split_size_mb:30",
    "expandable_segments_reserve_by_class:11]", "expandable_segments_reserve_by_class:abc",
]


# Values PyTorch takes for each key, so that many drawn strings are accepted (and read).
GOOD = {
    "max_split_size_mb": ["20", "128", "-1", "300x"], "max_non_split_rounding_mb": ["20", "64"],
    "garbage_collection_threshold": ["0.5", ".9", "0x1p-2"], "roundup_power2_divisions": ["4", "[256:2,>:4]", "[>:8]"],
    "expandable_segments": ["True", "False"], "large_segment_size_mb": ["16", "64"],
    "per_process_memory_fraction": ["0.5", "1", "0.25abc"], "pinned_num_register_threads": ["8", "128"],
    "backend": ["native"], "throw_on_cudamalloc_oom": ["False"], "pinned_max_cached_size_mb": ["0", "512"],
}


def drawn(n: int, seed: int = 6) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(KEYS)
            if rng.random() < 0.75:
                key = rng.choice(list(GOOD))
                parts.append(f"{key}:{rng.choice(GOOD[key])}")
                continue
            if rng.random() < 0.2:
                items = [f"{rng.choice(['256', '>', '1', '3', 'abc', '512'])}{rng.choice([':', ',', ''])}{rng.choice(['1', '2', '0', '3'])}"
                         for _ in range(rng.randint(0, 2))]
                value = "[" + ",".join(items) + rng.choice(["]", "", "],", "]]"])
            else:
                value = rng.choice(VALUES)
            parts.append(key + rng.choices([":", ",", "", "]"], [8, 1, 1, 1])[0] + value)
        text = rng.choices([",", ",,", " , ", ":"], [12, 1, 1, 1])[0].join(parts)
        out.append(rng.choices(["", ",", " "], [12, 1, 1])[0] + text + rng.choices(["", ",", "]", ":"], [12, 1, 1, 1])[0])
    return out


PYTORCH_READS = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
torch.cuda.init()
verdicts = {}
for s in json.load(open(sys.argv[1])):
    try:
        torch.cuda.memory._set_allocator_settings(s)
        verdicts[s] = "accepted"
    except Exception as e:
        verdicts[s] = "refused: " + str(e).splitlines()[0][:160]
    # The one setting that outlives a call and changes how the next is read (the least split size).
    torch.cuda.memory._set_allocator_settings("large_segment_size_mb:20")
json.dump(verdicts, sys.stdout)
"""


@needs_torch
def test_pytorch_conf_is_refused_where_pytorch_refuses_it_and_read_where_it_reads_it(tmp_path: Path) -> None:
    binary = stress()
    cases = FIXED + drawn(400)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "step.jsonl").write_text('{"op":"alloc","device":0,"addr":1,"size":1048576,"stream":0}\n')
    script = tmp_path / "reads.py"
    script.write_text(PYTORCH_READS)
    env = dict(os.environ, **torch_env())
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "cases.json")], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    pytorch = json.loads(done.stdout)
    wrong = []
    for s in cases:
        ours = subprocess.run([str(binary), "fit", str(tmp_path / "step.jsonl"), "--capacity-gb", "1", "--json",
                               "--pytorch-conf", s], capture_output=True, text=True, timeout=60, check=False)
        if pytorch[s] == "accepted":
            if ours.returncode != 0 and "not modelled" not in ours.stderr:
                wrong.append((s, "PyTorch accepts it, fit refuses it", ours.stderr.strip()[:200]))
        elif ours.returncode != 2:
            wrong.append((s, "PyTorch refuses it, fit reads it", pytorch[s]))
    accepted = sum(v == "accepted" for v in pytorch.values())
    assert accepted > len(cases) // 4, f"only {accepted} of {len(cases)} strings accepted by PyTorch: draw better ones"
    assert not wrong, f"{len(wrong)} of {len(cases)} strings read otherwise than PyTorch 2.15 ({accepted} accepted by it): {wrong[:12]}"
