"""The GPU kit at the seed's scale, on the CPU: the 7 B comparison's code path (gpu/e2e_model.py's
``7b`` size and its tiny counterpart ``tiny7b``: the training variant picked for the device,
per-sample images and prompt lengths, left padding, LoRA, the report's answer), the switch's
component costs (gpu/switch_costs.py: the cost model's constants read from the Rust files) and
the 7 B colocated loop (gpu/colocated_7b.py through gpu/sleep_check.py over testdrv), the
stage order of gpu/run_all.sh, and what scripts/check_gpu_run.py requires of them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
HOSTCUDA = ROOT / "target" / "hostcuda"
GIB = 1 << 30
sys.path.insert(0, str(ROOT / "gpu"))
sys.path.insert(0, str(ROOT / "scripts"))

import check_gpu_run  # noqa: E402
import e2e_model  # noqa: E402
import e2e_report  # noqa: E402
import switch_costs  # noqa: E402

H100, H200 = int(79.1 * GIB), int(139.8 * GIB)  # what torch.cuda.mem_get_info reports as total


def torch_ok() -> bool:
    return importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


# --- the training variant -------------------------------------------------------------------------


def test_full_fine_tuning_fits_an_h100_and_an_h200_and_lora_a_smaller_device() -> None:
    size = e2e_model.SIZES["7b"]
    params = 7_063_427_072  # LLaVA-1.5-7B's shape, counted on the meta device below
    for total in (H100, H200):
        v = e2e_model.pick_variant(size, params, total)
        assert v["variant"] == "full", v
        assert v["state_bytes"] == 8 * params and "so it fits" in v["why"]
    assert "52.6 GiB) is 67% of the device" in e2e_model.pick_variant(size, params, H100)["why"]
    for total in (48 * 10**9, 40 * GIB, 24 * GIB):
        v = e2e_model.pick_variant(size, params, total)
        assert v["variant"] == "lora" and "LoRA (rank 16) on the frozen base" in v["why"], v
    # The boundary: at most FULL_SHARE of the device.
    assert e2e_model.FULL_SHARE == 0.75
    exact = 8 * params * 4 // 3 + 1
    assert e2e_model.pick_variant(size, params, exact)["variant"] == "full"
    assert e2e_model.pick_variant(size, params, exact - 1024)["variant"] == "lora"
    # Asked for, or fixed by the size (the 1.4 B runs on record are full fine-tuning).
    assert e2e_model.pick_variant(size, params, H200, "lora")["variant"] == "lora"
    assert e2e_model.pick_variant(e2e_model.SIZES["full"], params, 24 * GIB)["variant"] == "full"
    assert e2e_model.pick_variant(size, params, 0)["variant"] == "lora"  # no device size known


def test_the_tiny_sizes_have_their_big_sizes_structure() -> None:
    s7, t7 = e2e_model.SIZES["7b"], e2e_model.SIZES["tiny7b"]
    assert e2e_model.DRY == {"full": "tiny", "tiny": "tiny", "7b": "tiny7b", "tiny7b": "tiny7b"}
    for f in ("per_sample", "headroom", "train", "fused_adamw", "max_positions", "batch", "max_images"):
        assert getattr(s7, f) == getattr(t7, f), f
    assert s7.kv_heads == s7.heads and t7.kv_heads == t7.heads  # Llama-2-7B: no grouped KV
    assert (s7.hidden, s7.layers, s7.inter, s7.image, s7.patch, s7.v_layers) == (4096, 32, 11008, 336, 14, 24)
    # The longest episode fits the positions: 3 images of 576 tokens, 1024 prompt, 32 new.
    assert s7.max_images * e2e_model.image_tokens(s7) + s7.prompt[1] + s7.new_tokens[1] <= s7.max_positions


@pytest.mark.skipif(not torch_ok(), reason="needs torch and transformers")
def test_the_7b_model_has_llava_1_5_7b_parameters() -> None:
    import torch

    model = e2e_model.build_model(torch, e2e_model.SIZES["7b"], "meta")
    params = [p for p in model.parameters()]
    assert sum(p.numel() for p in params) == 7_063_427_072
    assert {p.dtype for p in params} == {torch.bfloat16}


# --- shapes ----------------------------------------------------------------------------------------


def test_per_sample_shapes_vary_within_the_ranges_and_the_full_size_keeps_its_draws() -> None:
    import random

    s7 = e2e_model.SIZES["7b"]
    plan = e2e_model.iteration_plan(s7, 1, 20)
    assert all(len(p["images"]) == len(p["prompt"]) == s7.batch for p in plan)
    assert all(0 <= k <= s7.max_images for p in plan for k in p["images"])
    assert all(s7.prompt[0] <= n <= s7.prompt[1] for p in plan for n in p["prompt"])
    assert any(len(set(p["images"])) > 1 for p in plan) and any(len(set(p["prompt"])) > 1 for p in plan)
    # The 1.4 B size: one draw per iteration, in the order of the runs on record.
    full = e2e_model.SIZES["full"]
    rng = random.Random(1)
    old = [
        (rng.randint(0, full.max_images), rng.randint(*full.prompt), rng.randint(*full.new_tokens)) for _ in range(8)
    ]
    new = e2e_model.iteration_plan(full, 1, 8)
    assert [(p["images"], p["prompt"], p["new"]) for p in new] == [([i] * 4, [n] * 4, t) for i, n, t in old]
    assert e2e_model.largest(s7) == {"images": [3, 3], "prompt": [1024, 1024], "new": 32}
    assert e2e_model.per_sample([1, 2], 5) == [1, 2, 1, 2, 1]


@pytest.mark.skipif(not torch_ok(), reason="needs torch and transformers")
def test_inputs_are_left_padded_with_a_mask_only_when_lengths_differ() -> None:
    import contextlib

    import torch

    size = e2e_model.SIZES["tiny7b"]
    model = e2e_model.build_model(torch, size, "cpu")
    loop = e2e_model.Loop(torch, model, size, "cpu", lambda _p: contextlib.nullcontext())
    t = e2e_model.image_tokens(size)
    ids, mask, pixels = loop.inputs({"images": [0, 2], "prompt": [5, 9], "new": 2}, 2)
    assert ids.shape == (2, 2 * t + 9) and pixels.shape[0] == 2
    assert mask is not None and mask[0].tolist() == [0] * (2 * t + 4) + [1] * 5 and mask[1].all()
    assert int((ids == size.vocab - 1).sum()) == 2 * t and int((ids[0] == 0).sum()) == 2 * t + 4
    ids, mask, pixels = loop.inputs({"images": [1, 1], "prompt": [7, 7], "new": 2}, 3)  # cycled to 3
    assert ids.shape == (3, t + 7) and mask is None and pixels.shape[0] == 3
    assert loop.inputs({"images": [0, 0], "prompt": [4, 4], "new": 2}, 2)[2] is None


@pytest.mark.skipif(not torch_ok(), reason="needs torch and transformers")
def test_lora_trains_the_adapters_and_the_projector_and_leaves_the_base() -> None:
    import contextlib

    import torch

    size = e2e_model.SIZES["tiny7b"]
    torch.manual_seed(0)
    model = e2e_model.build_model(torch, size, "cpu")
    total = sum(p.numel() for p in model.parameters())
    loop = e2e_model.Loop(torch, model, size, "cpu", lambda _p: contextlib.nullcontext(), "lora")
    named = dict(model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert loop.trainable == sum(named[n].numel() for n in trainable) < total
    assert trainable and all(n.endswith((".a", ".b")) or "multi_modal_projector" in n for n in trainable)
    assert sum(1 for n in trainable if n.endswith(".b")) == 7 * size.layers  # every projection of every layer
    base = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad}
    r = loop.iteration({"images": [2, 0], "prompt": [12, 20], "new": 3}, 2)
    assert math.isfinite(r["loss"]) and r["step_s"] > 0
    assert all(torch.equal(base[n], named[n]) for n in base)
    assert any(named[n].abs().sum() > 0 for n in trainable if n.endswith(".b"))  # B starts at zero
    with pytest.raises(ValueError, match="expected full or lora"):
        e2e_model.Loop(torch, model, size, "cpu", lambda _p: contextlib.nullcontext(), "qlora")


def test_the_7b_dry_run_with_lora_forced(tmp_path: Path) -> None:
    if not torch_ok():
        pytest.skip("needs torch and transformers")
    r = subprocess.run(
        [sys.executable, str(ROOT / "gpu" / "e2e_compare.py"), "--out", str(tmp_path), "--dry-run", "--size", "7b",
         "--train", "lora", "--configs", "native", "stepalloc", "--budget", "300"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "CPU dry run: size tiny7b, the structure of 7b at a tiny scale" in r.stdout
    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert doc["size"] == "tiny7b" and doc["failed"] == [] and doc["answer"] == "n/a: CPU dry run"
    assert doc["train"]["variant"] == "lora" and doc["train"]["why"].startswith("asked for")
    assert doc["replay"] == {"skipped": "native_record not run"}
    for name in ("native", "stepalloc"):
        its = doc["configs"][name]["iterations"]
        assert len(its) == 3 and all(len(i["images"]) == 2 for i in its)
    text = (tmp_path / "e2e.txt").read_text()
    assert "training: LoRA on the frozen base" in text and "fits the whole device" in text


# --- the report ------------------------------------------------------------------------------------


def result(name: str, batch: int | None, oom: bool = False, exact: bool = True) -> dict:
    r: dict = {"config": name, "iterations": [{"step_s": 2.0}], "median_step_s": 2.0, "peak_reserved": 60 * GIB}
    if oom:
        r["oom"] = {"iteration": 0, "batch": 2, "error": "CUDA out of memory"}
        r["iterations"] = []
    if batch is not None:
        r["headroom"] = {"largest_batch": batch, "scale": batch / 2, "exact": exact, "cap_bytes": H100}
    return r


def test_the_report_answers_whether_it_fits_under_stepalloc_where_pytorch_runs_out() -> None:
    answer = e2e_report.answer
    res = {"native": result("native", 6), "stepalloc": result("stepalloc", 9), "native_expandable": result("x", 8)}
    assert answer(res) == (
        "yes: batch 7-9 fits under stepalloc and runs out of memory under PyTorch "
        "(largest batch: stepalloc 9, PyTorch 6, expandable segments 8)"
    )
    res["stepalloc"] = result("stepalloc", 7, exact=False)
    assert answer(res).startswith("yes: batch 7 fits") and "stepalloc 7 or more" in answer(res)
    res["stepalloc"] = result("stepalloc", 6)
    assert answer(res).startswith("no difference at this size")
    res["native"] = result("native", 0, oom=True)
    assert answer(res) == "yes: the base batch (2) runs out of memory under PyTorch and fits under stepalloc"
    res["stepalloc"] = result("stepalloc", 0, oom=True)
    assert answer(res) == "no: the base batch (2) runs out of memory under stepalloc"
    assert answer({"native": {"failed": "timed out"}}).startswith("not measured")
    res = {"native": result("native", None), "stepalloc": result("stepalloc", None)}
    assert "not measured (no headroom search)" in answer(res)
    # The table: the base batch row, the device headroom line, the answer.
    res = {"native": result("native", 0, oom=True), "stepalloc": result("stepalloc", 4)}
    res["native_expandable"] = {"config": "native_expandable", "skipped": "the time budget is spent"}
    doc = {
        "date": "2026-12-06 04:00 UTC", "device_name": "NVIDIA H100 80GB HBM3", "size": "7b",
        "order": ["native", "stepalloc", "native_expandable"], "headroom_factor": 1.5, "configs": res,
        "replay": {"skipped": "x"},
        "targets": [], "train": {"variant": "full", "why": "it fits", "trainable_params": 7_063_427_072},
    }  # fmt: skip
    text = e2e_report.text_report(doc)
    assert "training: full fine-tuning (7063.4 M trainable): it fits" in text
    row = next(line for line in text.splitlines() if line.startswith("base batch"))
    assert row.split()[2:] == ["OOM", "at", "it.", "0", "SKIPPED", "fits"]  # the columns in CONFIGS' order
    assert "fits the whole device (79.10 GiB), from base batch 2" in text
    assert "SKIPPED" in next(line for line in text.splitlines() if line.startswith("peak reserved"))
    assert "SKIPPED (native_expandable): the time budget is spent" in text
    assert "fits under stepalloc where PyTorch runs out of memory? yes: the base batch (2)" in text


# --- the switch's component costs ------------------------------------------------------------------


def test_the_cost_model_constants_are_read_from_the_rust_files(tmp_path: Path) -> None:
    model, source = switch_costs.load_model(ROOT)
    assert all("built-in" not in s for s in source.values()), source  # every constant found
    assert source["vm_create_map_s"] == "stress/src/workload/colocated/cost.rs VM_CREATE_MAP_S"
    assert source["map_s"] == "src/backend/sim.rs COST_MAP_NS"
    assert model["link_gbps_pcie4"] > 0 and model["map_s"] < 1e-3 and model["sim_copy_gib_s"] > 1
    assert switch_costs.rust_constant("const X: u64 = 25 << 30;", "X") == float(25 << 30)
    assert switch_costs.rust_constant("pub const Y: f64 = 10e-6;", "Y") == 10e-6
    assert switch_costs.rust_constant("const Z: u64 = 10_000;", "Z") == 10000.0
    assert switch_costs.rust_constant("const Z: u64 = other();", "Z") is None
    # A bundle's copies (model/), or the built-in values where nothing is there.
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "cost.rs").write_text("pub const PCIE4_X16_GBPS: f64 = 24.0;\n")
    model, source = switch_costs.load_model(tmp_path)
    assert model["link_gbps_pcie4"] == 24.0 and source["link_gbps_pcie4"] == "model/cost.rs PCIE4_X16_GBPS"
    assert source["map_s"] == "built-in (no sim.rs COST_MAP_NS)" and model["map_s"] == 10e-6


def host_driver_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTCUDA_") and k != "LD_PRELOAD"}
    env.update({"STEPALLOC_HOSTCUDA": "1", "HOSTCUDA_DEVICES": "1", "HOSTCUDA_CAPACITY_MB": "1024"})
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(HOSTCUDA), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    env.update(extra)
    return env


@pytest.mark.skipif(not (HOSTCUDA / "libcuda.so.1").exists(), reason="needs testdrv's driver (testdrv/build.sh)")
def test_switch_costs_over_the_host_memory_driver(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "gpu" / "switch_costs.py"), "--pages", "8", "--big-pages", "2", "--copy-mb", "8",
         "--json", str(tmp_path / "c.json")],
        capture_output=True, text=True, env=host_driver_env(), timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["granularity"] == 2 << 20 and doc["pages"]["pages"] == 8 and doc["big_pages"]["page_bytes"] == 16 << 20
    for k in ("create", "map", "set_access", "unmap", "release"):
        assert doc["pages"][k]["n"] == 8 and doc["pages"][k]["median_us"] > 0, k
    assert doc["copy"]["dtoh_gbps"] > 0 and doc["copy"]["htod_gbps"] > 0 and doc["copy"]["sync_copy_4k_s"] > 0
    rows = {c["what"]: c for c in doc["compare"]}
    assert len(rows) == 13 and rows["create + map (vLLM, per allocation)"]["model_s"] == doc["model"]["vm_create_map_s"]
    assert all(c["ratio"] > 0 for c in doc["compare"])
    assert "unmap + release (vLLM, per allocation)" in r.stdout and "cost.rs VM_UNMAP_RELEASE_S" in r.stdout
    r = subprocess.run(
        [sys.executable, str(ROOT / "gpu" / "switch_costs.py"), "--pages", "0"],
        capture_output=True, text=True, env=host_driver_env(), check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "--pages 1..65536" in r.stderr


@pytest.mark.skipif(
    not ((HOSTCUDA / "runtime" / "libcudart.so.13").is_file() and torch_ok()),
    reason="needs torch and testdrv's stub runtime (testdrv/build.sh)",
)
def test_the_7b_colocated_loop_from_the_bundle_over_the_host_memory_driver(bundle: Path, tmp_path: Path) -> None:
    env = host_driver_env(STEPALLOC_LIBRARY=str(bundle / "lib" / "libstepalloc.so"))
    r = subprocess.run(
        [sys.executable, str(bundle / "gpu" / "sleep_check.py"), "--parts", "colocated", "--unit-mb", "4",
         "--iterations", "2", "--scale-7b", "1024", "--json", str(tmp_path / "sleep.json")],
        capture_output=True, text=True, env=env, timeout=400, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    status = {line.split()[2]: line.split()[1] for line in r.stdout.splitlines() if line.startswith("RESULT ")}
    assert status == {"sleep_colocated": "PASS", "sleep_switch_costs": "PASS", "sleep_colocated_7b": "PASS"}, r.stdout
    doc = json.loads((tmp_path / "sleep.json").read_text())
    c7 = doc["colocated_7b"]
    assert c7["addresses_kept"] is True and c7["bytes_kept"] is True and c7["scale"] == 1024
    sz = c7["sizes"]
    # The 7 B model's 686 parameter tensors, 16 to a tensor over testdrv; 16 GiB of KV / 1024.
    assert c7["group"] == 16 and sz["weight_tensors"] == -(-686 // 16) and sz["kv_bytes"] == 16 << 20
    assert c7["engine_switch_s"] > 0 and c7["engine_over_floor"] > 0 and c7["link_gbps"] > 0
    assert c7["train"]["variant"] == "full" and sz["trainer_backed_up_bytes"] == 3 * sz["weights_bytes"]
    its = c7["iterations"]
    assert len(its) == 3 and all(i["switch_s"] > 0 and i["floor_s"] > 0 for i in its)
    # Steady iterations copy the weights out and in and the trainer's state in and out.
    moved = sz["weights_bytes"] + sz["trainer_backed_up_bytes"]
    assert all(i["copied_out_bytes"] == i["copied_in_bytes"] == moved for i in its[1:]), its
    steady = sorted(i["over_floor"] for i in its[1:])
    assert c7["over_floor"] == pytest.approx(sum(steady) / 2) and c7["over_floor"] > 0  # the median of two
    assert doc["switch_costs"]["model_source"]["map_s"] == "model/sim.rs COST_MAP_NS"  # the bundle's copy
    table = (tmp_path / "sleep.txt").read_text()
    assert "colocated loop at 7 B: 7 B engine" in table and "switch component costs on the device" in table
    assert check_gpu_run.colocated_problems(doc) == []
    c7["bytes_kept"] = False
    doc["switch_costs"]["compare"][0]["measured_s"] = 0.0
    assert check_gpu_run.colocated_problems(doc) == [
        "sleep: the 7 B colocated loop kept addresses True, bytes False ()",
        "sleep: switch component costs missing or not positive: 13 rows, "
        + str([0.0] + [c.get("measured_s", c.get("measured_gbps")) for c in doc["switch_costs"]["compare"][1:]]),
    ]


# --- the kit ---------------------------------------------------------------------------------------


def test_run_all_runs_the_7b_figures_first() -> None:
    text = (ROOT / "gpu" / "run_all.sh").read_text()
    body = text[text.index("set -u") :]
    order = [
        body.index("comparison e2e_7b e2e_7b"),
        body.index('"$BUNDLE/gpu/sleep_check.py"'),
        body.index('"$BUNDLE/gpu/validate.sh"'),
        body.index('"$BUNDLE/scripts/cuda_matches_sim.py"'),
        body.index('"$BUNDLE/gpu/ipc_check.py"'),
        body.index("comparison e2e e2e"),
        body.index('"$BUNDLE/gpu/summarize.py"'),
    ]
    assert order == sorted(order)
    assert (
        "STEPALLOC_E2E7B_BUDGET:-240" in text
        and "STEPALLOC_RUN_BUDGET:-$([ $HOST_DRIVER = 1 ] && echo 900 || echo 470)" in text
    )


def test_run_all_refuses_a_budget_that_is_not_whole_seconds(bundle: Path, tmp_path: Path) -> None:
    r = subprocess.run(
        [str(bundle / "gpu" / "run_all.sh"), str(bundle), str(tmp_path)],
        capture_output=True, text=True, env=dict(os.environ, STEPALLOC_E2E7B_BUDGET="2m"), check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "STEPALLOC_E2E7B_BUDGET=2m must be whole seconds" in r.stderr


def test_check_gpu_run_requires_the_7b_dry_run() -> None:
    assert check_gpu_run.e2e_7b_problems(None) == ["summary.json: no e2e_7b section (e2e_7b/e2e.json missing)"]
    its = [{"images": [0, 2]}, {"images": [1, 1]}]
    names = ["native", "native_expandable", "stepalloc", "stepalloc_mempool"]
    doc = {"size": "tiny7b", "train": {"variant": "full"}, "configs": {n: {"iterations": its} for n in names}}
    assert check_gpu_run.e2e_7b_problems(doc) == []
    doc["configs"]["stepalloc_mempool"] = {"failed": "timed out"}
    doc["train"] = None
    doc["size"] = "7b"
    for r in doc["configs"].values():
        for i in r.get("iterations", []):
            i["images"] = [1, 1]
    assert check_gpu_run.e2e_7b_problems(doc) == [
        "e2e_7b: size 7b, expected tiny7b in a dry run",
        "e2e_7b: only ['native', 'native_expandable', 'stepalloc'] ran",
        "e2e_7b: no training variant picked: None",
        "e2e_7b: no iteration with a different number of images per sample: " + str([[1, 1]] * 6),
    ]


def test_the_headroom_search_on_the_whole_device_sets_no_memory_fraction() -> None:
    """e2e_worker.headroom, which only a GPU run reaches, with a stand-in torch and loop: with no
    cap (the 7 B size) it searches the whole device; with a cap it sets the fraction and resets it."""
    import types

    import e2e_worker

    calls: list = []
    cuda = types.SimpleNamespace(
        mem_get_info=lambda: (10 * GIB, 80 * GIB),
        set_per_process_memory_fraction=lambda f: calls.append(("fraction", f)),
        empty_cache=lambda: calls.append("empty_cache"),
    )
    fake_torch = types.SimpleNamespace(cuda=cuda)

    class Loop:
        opt = types.SimpleNamespace(zero_grad=lambda set_to_none: None)

        def iteration(self, shape: dict, batch: int) -> dict:
            calls.append(("batch", batch, tuple(shape["images"])))
            if batch > 5:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return {}

    size = e2e_model.SIZES["7b"]
    h = e2e_worker.headroom(fake_torch, Loop(), size, 0, 5, float("inf"), 0.0)
    assert not [c for c in calls if isinstance(c, tuple) and c[0] == "fraction"]
    assert [c[1] for c in calls if isinstance(c, tuple) and c[0] == "batch"] == [2, 4, 8, 6, 5]
    assert all(c[2] == (3, 3) for c in calls if isinstance(c, tuple) and c[0] == "batch")  # the largest shape
    assert h["cap"] == "device" and h["cap_bytes"] == 80 * GIB and h["fraction"] == 1.0
    assert (h["largest_batch"], h["first_failing_batch"], h["exact"]) == (5, 6, True) and h["scale"] == 2.5
    calls.clear()
    h = e2e_worker.headroom(fake_torch, Loop(), size, 40 * GIB, 5, float("inf"), 0.0)
    fractions = [c[1] for c in calls if isinstance(c, tuple) and c[0] == "fraction"]
    assert fractions == [0.5, 1.0] and h["cap"] == "native peak" and h["cap_bytes"] == 40 * GIB
    # Another error than out-of-memory is not a probe's answer.
    Loop.iteration = lambda self, shape, batch: (_ for _ in ()).throw(RuntimeError("illegal memory access"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        e2e_worker.headroom(fake_torch, Loop(), size, 0, 5, float("inf"), 0.0)
