"""stepalloc.fit's recipes on tiny LLaVA and Qwen2-VL (two layers, narrow; every token id and the
data-dependent code paths of the full models), run unchanged under fake tensors, and the command
line end to end (the replay when the stress tool has its ``fit`` subcommand).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fit_child import child_env, needs_torch, run_fit

from conftest import SHIM, run_python
from stepalloc.fit import _replay, _trace

RECIPES = """
from stepalloc.fit import Recipe, record_recipe
R = {}
for name, kw in {
    "llava_full_rollout": dict(model="llava-1.5-7b", rollout=3),
    "qwen_lora": dict(model="qwen2-vl-7b", finetune="lora", image_size=112),
}.items():
    rec = record_recipe(Recipe(tiny=True, batch=2, images=(1, 2), tokens=(8, 24), iterations=2, **kw))
    allocs = rec.trace.allocations()
    R[name] = dict(rec.summary(), modules=sorted({a.module.split(".")[0] for a in allocs if a.module}),
                   lora=sum(1 for a in allocs if "lora_" in a.module and a.torch_op == "parameter"),
                   phases=[p for kind, p in rec.trace.events if kind == "begin"])

# transformers' mask path as a real run takes it: an unpadded causal batch without images gives
# SDPA no mask (is_causal); under fake tensors left as they are, transformers believes it is
# tracing and builds a 4-D mask.
import contextlib
from stepalloc.fit import _recorder
unpadded = Recipe(model="llava-1.5-7b", tiny=True, images=(0, 0), tokens=(64, 64), iterations=1)
R["mask_real_path"] = dict(record_recipe(unpadded).attention_used)
_recorder.transformers_as_real_run = contextlib.nullcontext
R["mask_tracing_path"] = dict(record_recipe(unpadded).attention_used)
RESULT = R
"""


@pytest.fixture(scope="module")
def recipes() -> dict:
    return run_fit(RECIPES)


@needs_torch
def test_tiny_llava_runs_unchanged_with_rollouts(recipes) -> None:
    r = recipes["llava_full_rollout"]
    assert r["phases"] == ["rollout", "train", "rollout", "train"]
    # get_placeholder_mask's check and the generation loop's stopping checks were served.
    assert r["served_data_dependent"] > 0
    assert "model" in r["modules"] and "optimizer" in r["modules"]
    # H100: cuDNN attention where it qualifies, the rest by the next backend in order.
    assert sum(r["attention"].values()) > 0 and r["attention_order"][0] == "cudnn"


@needs_torch
def test_tiny_qwen2_vl_lora_runs_unchanged(recipes) -> None:
    r = recipes["qwen_lora"]
    assert r["phases"] == ["train", "train"]
    # get_rope_index (argwhere, tolist, torch.tensor of fakes) and the vision tower's grid.
    assert r["served_data_dependent"] > 10
    assert r["lora"] > 0


@needs_torch
def test_transformers_mask_path_is_the_real_runs(recipes) -> None:
    assert recipes["mask_real_path"] == {"cudnn": 4}  # 2 layers, forward and recomputation
    assert recipes["mask_tracing_path"] == {"cudnn+mask": 4}


@needs_torch
def test_command_line_records_and_replays(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    args = ["-m", "stepalloc.fit", "--model", "llava-1.5-7b", "--tiny", "--tokens", "8-16", "--images", "0-1",
            "--iterations", "1", "--trace", str(trace), "--json"]
    try:
        has_fit = subprocess.run([str(_replay._stress_binary()), "fit", "--help"], capture_output=True, timeout=30).returncode == 0
    except _replay.ReplayError:
        has_fit = False
    if not has_fit:
        args.append("--record-only")
    code = f"import runpy, sys; sys.argv = ['stepalloc.fit'] + {args[2:]!r}; runpy.run_module('stepalloc.fit', run_name='__main__')"
    out = run_python(code, env=child_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout[out.stdout.index("{"):])
    lines = _trace.read_jsonl(trace)
    peak, allocations = _trace.peak_live(lines)
    assert report["recordings"]["sm90"]["allocations"] == allocations > 0
    assert report["recordings"]["sm90"]["peak_live_bytes"] == peak
    assert all("module" in d or d["op"] != "alloc" or d.get("torch_op") for d in lines)
    if has_fit:
        configs = {c["name"] for c in report["devices"][0]["fit"]["configs"]}
        assert {"pytorch", "stepalloc"} <= configs


def test_command_line_without_a_device_says_what_to_do(tmp_path) -> None:
    # No stand-in to be found and no device: a clear error, exit 2.
    env = {"STEPALLOC_HOSTCUDA_DIR": str(tmp_path), "STEPALLOC_FIT_CHILD": "1", "LD_PRELOAD": "", "LD_LIBRARY_PATH": ""}
    out = subprocess.run([sys.executable, "-m", "stepalloc.fit", "--model", "llava-1.5-7b", "--tiny"], cwd=SHIM,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "device context" in out.stderr and "testdrv/build.sh" in out.stderr
