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


# ---- python -m stepalloc.fit: bad inputs before recording --------------------------------------


def cli(*args: str, env: dict[str, str] | None = None, memory_gib: int = 8) -> subprocess.CompletedProcess:
    """``python -m stepalloc.fit`` over testdrv's stand-in, its address space bounded so that a
    recorder that ignored a bound fails here instead of filling the machine."""
    full = dict(os.environ, PYTHONPATH=str(SHIM))
    full.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    full.update(env or {})

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_gib << 30, memory_gib << 30))

    return subprocess.run([sys.executable, "-m", "stepalloc.fit", *args], cwd=SHIM, env=full, capture_output=True,
                          text=True, timeout=300, check=False, preexec_fn=bounded)


TINY = ["--model", "llava", "--tiny", "--batch", "1", "--iterations", "1", "--tokens", "8-16", "--images", "0-1"]


def test_bad_replay_inputs_are_refused_before_anything_is_recorded() -> None:
    stress()
    cases = [
        (["--device", "100000"], {}, "16384 GB"),
        (["--device", "0.0000001"], {}, "1 MiB"),
        (["--outside-mb", "-5"], {}, "--outside-mb -5"),
        (["--outside-mb", "100.5"], {}, "--outside-mb"),
        (["--device", "24", "--outside-mb", "30000"], {}, "whole device"),
        (["--pytorch-conf", ",expandable_segments:True"], {}, "Unrecognized key ','"),
        ([], {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, "from the environment; --pytorch-conf '' leaves it out"),
        ([], {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:10"}, "PYTORCH_CUDA_ALLOC_CONF"),
        (["--seed", "-1"], {}, "--seed -1"),
        (["--seed", str(1 << 70)], {}, "2**63-1"),
    ]
    for args, env, want in cases:
        done = cli(*TINY, *args, env=env)
        assert done.returncode == 2, (args, env, done.stderr[-500:])
        assert want in done.stderr and "recorded for" not in done.stdout + done.stderr, (args, env, done.stderr[-500:])


def test_inputs_that_would_fill_the_hosts_memory_are_refused_naming_the_bound(tmp_path: Path) -> None:
    for args in (
        ["--tokens", "1000000000-1000000000"],
        ["--batch", "100000000"],
        ["--rollout", "100000000"],
        ["--model", "qwen2-vl", "--images", "1-1", "--image-size", "1000000"],
    ):
        done = cli(*TINY, *args, "--record-only")
        assert done.returncode == 2, (args, done.stderr[-800:])
        assert "takes at most 16,777,216" in done.stderr, (args, done.stderr[-800:])


def test_hostile_configurations_are_refused_naming_the_file_and_the_key(tmp_path: Path) -> None:
    from stepalloc.fit import _configs

    llava = _configs.load("llava-1.5-7b")
    llava.pop("_path")

    def with_text(**text: object) -> dict:
        c = json.loads(json.dumps(llava))
        c["text_config"].update(text)
        return c

    cases = [
        (with_text(num_hidden_layers=1_000_000_000), "'num_hidden_layers' is 1000000000"),
        (with_text(num_hidden_layers=-3), "'num_hidden_layers' is -3"),
        (with_text(num_hidden_layers=4096.5), "'num_hidden_layers' is 4096.5"),
        (with_text(num_hidden_layers=True), "'num_hidden_layers' is True"),
        (with_text(hidden_size=0), "'hidden_size' is 0"),
        (with_text(num_attention_heads=0), "'num_attention_heads' is 0"),
        (with_text(vocab_size=1 << 40), "'vocab_size'"),
        (dict(llava, text_config="llama"), "'text_config' must be a JSON object"),
        (dict(llava, text_config=dict(llava["text_config"], num_hidden_layers=100, num_local_experts=1000)), "expert blocks"),
    ]
    deep: dict = {"model_type": "llama"}
    node = deep
    for _ in range(40):
        node["sub"] = {}
        node = node["sub"]
    cases.append((deep, "nested deeper than 16"))
    for i, (config, want) in enumerate(cases):
        path = tmp_path / f"c{i}" / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(config))
        with pytest.raises(_configs.ConfigError, match=None) as caught:
            _configs.load(path.parent)
        assert want in str(caught.value) and str(path) in str(caught.value), (want, str(caught.value))
    (tmp_path / "nested.json").write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(_configs.ConfigError, match="nested too deeply"):
        _configs.load(tmp_path / "nested.json")
    (tmp_path / "big.json").write_text('{"model_type": "llama", "x": "' + "y" * (5 << 20) + '"}')
    with pytest.raises(_configs.ConfigError, match="a model configuration is a few KiB"):
        _configs.load(tmp_path / "big.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(_configs.ConfigError, match="no config.json at"):
        _configs.load(tmp_path / "empty")


@needs_torch
def test_configurations_transformers_cannot_build_exit_2_naming_the_file(tmp_path: Path) -> None:
    from stepalloc.fit import _configs

    llava = _configs.load("llava-1.5-7b")
    llava.pop("_path")
    for name, config, want in (
        ("unknown", {"model_type": "no-such-model"}, "transformers cannot read it"),
        ("encoder", {"model_type": "vit"}, "not a configuration the recipes can use"),
        ("activation", dict(llava, projector_hidden_act="no-such-function"), "cannot build LlavaForConditionalGeneration"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        done = cli("--model", str(tmp_path / name), "--tiny", "--batch", "1", "--iterations", "1", "--tokens", "8-16",
                   "--images", "0-0", "--record-only")
        assert done.returncode == 2 and want in done.stderr and str(tmp_path / name) in done.stderr, (name, done.stderr[-800:])
        assert "Traceback" not in done.stderr, (name, done.stderr[-800:])


# ---- record(fn) ------------------------------------------------------------------------------

RECORD = r"""
import concurrent.futures, threading, warnings
warnings.simplefilter("ignore")
import torch, torch.nn.functional as F
import stepalloc.fit as fit
from stepalloc.fit import _trace
MIB = 1 << 20
out = {}
originals = (F.scaled_dot_product_attention, torch.tensor, torch.UntypedStorage.resize_, threading.Thread.start)

def restored():
    return originals == (F.scaled_dot_product_attention, torch.tensor, torch.UntypedStorage.resize_, threading.Thread.start) \
        and fit._api._current is None and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None

def sizes(rec):
    return sorted(a.size for a in rec.trace.allocations())

def raises():
    torch.randn(1024, device="cuda")
    raise KeyError("the user's own error")
try:
    fit.record(raises)
except KeyError:
    out["raises"] = restored()
out["odd_returns"] = [len(sizes(fit.record(f))) for f in (
    lambda: (i for i in range(3)), lambda: torch.randn(8, device="cuda"), lambda: {"a": [torch.randn(8, device="cuda")]},
    lambda: 42, lambda: None)]
out["cpu_only"] = sizes(fit.record(lambda: torch.randn(1000, 1000)))

def threads():
    held = {}
    def work(k):
        held[k] = torch.empty(MIB * (k + 1), dtype=torch.uint8, device="cuda")
    t = threading.Thread(target=work, args=(3,)); t.start(); t.join()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(work, (0, 1)))
    return held
rec = fit.record(threads)
out["threads"] = [s for s in sizes(rec) if s >= MIB]
out["thread_start_restored"] = restored()

def streams():
    side = torch.cuda.Stream()
    a = torch.empty(MIB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        b = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")
    return a, b
rec = fit.record(streams, trace=TRACE)
out["streams"] = sorted((a.size, a.stream) for a in rec.trace.allocations())
out["stream_in_file"] = sorted((d["size"], d["stream"]) for d in _trace.read_jsonl(TRACE) if d["op"] == "alloc")

_trace.MAX_ALLOCATIONS = 5000
def endless():
    keep = []
    while True:
        keep.append(torch.empty(512, device="cuda"))
try:
    fit.record(endless)
    out["endless"] = "returned"
except _trace.RecordingTooLarge as e:
    out["endless"] = ("stopped", "5,000 allocations" in str(e), restored())
_trace.MAX_ALLOCATIONS = 8_000_000
def nested():
    fit.record(lambda: None)
try:
    fit.record(nested)
except RuntimeError as e:
    out["nested"] = ("already in progress" in str(e), restored())
out["after_all"] = len(sizes(fit.record(lambda: torch.empty(MIB, device="cuda"))))
print("result=" + repr(out))
"""


@needs_torch
def test_record_of_hostile_functions(tmp_path: Path) -> None:
    code = "TRACE = " + repr(str(tmp_path / "streams.jsonl")) + "\n" + RECORD
    done = check_child(run_python(code, env=torch_env(), timeout=300))
    import ast

    got = ast.literal_eval(next(line for line in done.splitlines() if line.startswith("result=")).split("=", 1)[1])
    assert got == {
        "raises": True,
        "odd_returns": [0, 1, 1, 0, 0],
        "cpu_only": [],
        "threads": [MIB, 2 * MIB, 4 * MIB],
        "thread_start_restored": True,
        "streams": [(MIB, 0), (2 * MIB, 1)],
        "stream_in_file": [(MIB, 0), (2 * MIB, 1)],
        "endless": ("stopped", True, True),
        "nested": (True, True),
        "after_all": 1,
    }, got


def test_the_largest_batch_search_stays_bounded_when_memory_does_not_grow() -> None:
    from stepalloc.fit import _replay

    tried: list[int] = []

    def always(batch: int) -> dict[str, bool]:
        tried.append(batch)
        return {"pytorch": True, "stepalloc": True}

    search = _replay.largest_batch(always)
    assert search.capped and search.largest == {"pytorch": 256, "stepalloc": 256} and len(tried) == 9
    odd = _replay.largest_batch(lambda b: {"pytorch": b in (1, 4, 5)})  # not monotonic: the first failure bounds it
    assert odd.largest == {"pytorch": 1} and sorted(odd.tried) == [1, 2]
