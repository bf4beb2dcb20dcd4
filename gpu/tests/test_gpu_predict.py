"""The prediction beside the measurement (gpu/e2e_predict.py): a recording cut to the steps a
configuration ran, replayed at the device's memory with exact peaks worked out by hand, the
report's rows and targets, the SDPA backend count, and what scripts/check_gpu_run.py requires of
a dry run's prediction. The recording of the real loop runs in scripts/test.sh (the bundle's
tiny sizes) and the whole path in its dry run of gpu/run_all.sh.
"""

from __future__ import annotations

import copy
import gzip
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
MIB, GIB = 1 << 20, 1 << 30
sys.path.insert(0, str(ROOT / "gpu"))
sys.path.insert(0, str(ROOT / "scripts"))

import check_gpu_run  # noqa: E402
import e2e_compare  # noqa: E402
import e2e_predict  # noqa: E402
import e2e_report  # noqa: E402


def stress() -> str:
    found = e2e_compare.find_stress(None) or next(
        (str(p) for p in [ROOT / "target" / "debug" / "stepalloc-stress"] if p.is_file()), None
    )
    if found is None:
        pytest.skip("no stepalloc-stress build")
    return found


# Three steps of one large allocation each (30, 50, 70 MiB: each above 10 MiB, so PyTorch gives
# it a segment of its own size rounded to 2 MiB), each freed in its step. PyTorch's default
# keeps every freed segment cached and none is big enough for the next request: reserved
# 30 + 50 = 80 MiB after two steps, 150 MiB after three. With expandable segments one segment
# grows, 20 MiB at a time for large requests, to hold the largest: 60 MiB, then 80 MiB.
STEPS = [("rollout", 30), ("train", 50), ("rollout", 70)]


def write_recording(folder: Path, name: str = "tiny7b-full-sm90") -> dict:
    lines = []
    for i, (phase, mib) in enumerate(STEPS, start=1):
        lines += [
            {"op": "step_begin", "phase": phase},
            {
                "op": "alloc",
                "device": 0,
                "addr": i,
                "size": mib * MIB,
                "stream": 0,
                "module": "m",
                "torch_op": "aten::mm",
            },
            {"op": "free", "device": 0, "addr": i},
            {"op": "step_end"},
        ]
    with gzip.open(folder / f"{name}.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    facts = {"steps": 3, "allocations": 3, "peak_live_bytes": 70 * MIB, "recorded": "2026-12-06", "torch": "2.15.0",
             "transformers": "5.25.0", "attention": {"cudnn": 4, "cudnn+mask": 2}}  # fmt: skip
    (folder / f"{name}.json").write_text(json.dumps(facts))
    return facts


def test_the_first_steps_of_a_recording_are_what_a_run_that_stopped_there_did(tmp_path: Path) -> None:
    write_recording(tmp_path)
    src, dst = tmp_path / "tiny7b-full-sm90.jsonl.gz", tmp_path / "cut.jsonl"
    assert e2e_predict.first_steps(src, 2, dst) == 2
    ops = [json.loads(line)["op"] for line in dst.read_text().splitlines()]
    assert ops == ["step_begin", "alloc", "free", "step_end"] * 2
    assert e2e_predict.first_steps(src, 9, dst) == 3  # no more than it holds


def measured(iterations: int, peak_mib: float | None, oom: bool = False) -> dict:
    r = {"iterations": [{"i": i} for i in range(iterations)], "train": {"variant": "full"}, "capability": [9, 0],
         "total_bytes": 80 * GIB, "torch": "2.15.0", "transformers": "5.25.0"}  # fmt: skip
    if peak_mib is not None:
        r["peak_reserved"] = int(peak_mib * MIB)
    if oom:
        r["oom"] = {"iteration": iterations, "batch": 2}
    return r


def test_each_configuration_is_predicted_over_the_steps_it_ran(tmp_path: Path) -> None:
    write_recording(tmp_path)
    results = {
        "native": measured(1, 78),  # one iteration: two steps
        "native_expandable": measured(1, 50, oom=True),  # out of memory in its second: three steps
        "stepalloc": {"config": "stepalloc", "skipped": "the time budget is spent"},
    }
    pred = e2e_predict.predict(results, "tiny7b", "cuda", stress(), tmp_path)
    assert pred["trace"] == "tiny7b-full-sm90.jsonl.gz" and pred["capacity_bytes"] == 80 * GIB
    assert set(pred["configs"]) == {"native", "native_expandable"}  # stepalloc did not run
    n, x = pred["configs"]["native"], pred["configs"]["native_expandable"]
    assert (n["column"], n["steps"], n["predicted_peak_reserved"]) == ("pytorch", 2, 80 * MIB)
    assert (x["column"], x["steps"], x["predicted_peak_reserved"]) == ("pytorch_expandable", 3, 80 * MIB)
    assert n["ratio"] == 80 / 78 and x["measured_fits"] is False and x["predicted_fits"] is True
    assert pred["replays"]["3"]["columns"]["pytorch"]["peak_reserved"] == 150 * MIB
    assert pred["replays"]["3"]["floor_bytes"] == 70 * MIB
    status = {t["target"]: (t["status"], t["detail"]) for t in e2e_report.prediction_targets(pred)}
    assert status == {
        "prediction within 3% of measured peak reserved (native)": ("MET", "predicted/measured 1.026"),
        "prediction within 3% of measured peak reserved (native_expandable)": ("MISSED", "predicted/measured 1.600"),
    }


def test_a_missing_recording_is_a_reason_not_a_failure(tmp_path: Path) -> None:
    write_recording(tmp_path)
    results = {"native": dict(measured(2, 80), train={"variant": "lora"})}
    pred = e2e_predict.predict(results, "tiny7b", "cuda", stress(), tmp_path)
    assert "configs" not in pred
    assert pred["skipped"] == (
        f"no recording tiny7b-lora-sm90 in {tmp_path} (recorded: tiny7b-full-sm90); make it where torch and "
        f"transformers are installed: gpu/e2e_predict.py record --size tiny7b --variant lora --capability 9.0 "
        f"--out {tmp_path}"
    )
    assert e2e_report.prediction_targets(pred) == []
    other = {"native": dict(measured(2, 80), capability=[8, 0])}
    assert (
        "no recording tiny7b-full-sm80" in e2e_predict.predict(other, "tiny7b", "cuda", stress(), tmp_path)["skipped"]
    )


def test_the_report_sets_prediction_and_assumptions_beside_the_measurement(tmp_path: Path) -> None:
    write_recording(tmp_path)
    res = {"native": measured(1, 78), "native_expandable": measured(1, 60)}
    res["native"]["outside"] = {"memgetinfo_bytes": 530 * MIB, "smi_bytes": 546 * MIB}
    res["native"]["device_totals"] = {"memgetinfo_bytes": 81_090 * MIB, "smi_bytes": 81_559 * MIB}
    res["native_expandable"]["attention"] = {"cudnn": 4, "flash+mask": 2}
    res["native_expandable"]["attention_probe"] = [
        {"case": "language model, causal", "b": 2, "h": 32, "hk": 32, "s": 2048, "d": 128, "picked": "cudnn",
         "backends": {"cudnn": {"measured_bytes": 40 * MIB, "modelled_bytes": 33 * MIB},
                      "flash": {"error": "No available kernel."}}},
    ]  # fmt: skip
    doc = {"device": "cuda", "configs": res}
    doc["prediction"] = e2e_predict.predict(res, "tiny7b", "cuda", stress(), tmp_path)
    text = "\n".join(e2e_report.report_lines(doc))
    row = next(line for line in text.splitlines() if line.strip().startswith("native "))
    assert row.split() == ["native", "pytorch", "2", "78.00", "MiB", "80.00", "MiB", "1.026"]
    row = next(line for line in text.splitlines() if line.strip().startswith("native_expandable"))
    assert row.split() == ["native_expandable", "pytorch_expandable", "2", "60.00", "MiB", "60.00", "MiB", "1.000"]
    assert "recorded 2026-12-06 with torch 2.15.0, transformers 5.25.0 (measured with torch 2.15.0" in text
    assert "replayed at 80.00 GiB (cudaMemGetInfo total), 512 MiB outside PyTorch (assumed)" in text
    assert "assumed 512 MiB; measured native 530 MiB (cudaMemGetInfo used - reserved), 546 MiB (nvidia-smi)" in text
    assert "cudaMemGetInfo total 81,090 MiB, nvidia-smi total 81,559 MiB" in text
    assert "recorded {'cudnn': 4, 'cudnn+mask': 2}; this device (native_expandable's loop, 1 iterations): " \
           "{'cudnn': 4, 'flash+mask': 2}" in text  # fmt: skip
    assert ("language model, causal (B 2, H 32/32, S 2048, D 128): picks cudnn; backward scratch: cudnn 40 MiB "
            "measured / 33 MiB modelled, flash: No available kernel.") in text  # fmt: skip
    doc["prediction"] = {"skipped": "no recording x"}
    assert "  no prediction: no recording x" in e2e_report.report_lines(doc)


def test_the_attention_cases_are_the_sizes_calls() -> None:
    cases = {c["case"]: c for c in e2e_predict.attention_cases("7b")}
    lm, padded, vision = cases["language model, causal"], cases["language model, padded (mask)"], cases["vision tower"]
    assert (lm["b"], lm["h"], lm["hk"], lm["s"], lm["d"], lm["causal"]) == (2, 32, 32, 2048, 128, True)
    assert padded["mask"] and not padded["causal"]
    assert (vision["b"], vision["h"], vision["s"], vision["d"]) == (3, 16, 577, 64)
    # The 1.4 B size's language model has grouped K/V heads (16 query heads, 4 K/V).
    full = e2e_predict.attention_cases("full")[0]
    assert (full["h"], full["hk"], full["d"]) == (16, 4, 128)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_attention_calls_are_counted_by_the_backend_they_ran_on() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 8, 16)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    counts: Counter = Counter()
    with e2e_predict.count_attention(torch, counts):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        with sdpa_kernel([SDPBackend.MATH]):
            F.scaled_dot_product_attention(q, q, q)
    # On the CPU PyTorch runs its flash kernel for CPU where it can, else the math composition.
    assert counts == Counter({"flash": 1, "flash+mask": 1, "math": 1})
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"  # restored


def test_check_gpu_run_requires_a_prediction_for_every_configuration(tmp_path: Path) -> None:
    write_recording(tmp_path)
    res = {"native": measured(1, None), "native_expandable": measured(1, None)}
    res["native_expandable"]["attention"] = {"flash": 4, "flash+mask": 2}
    res["native_expandable"]["attention_probe"] = [
        {"case": c, "picked": "flash"}
        for c in ("language model, causal", "language model, padded (mask)", "vision tower")
    ]
    e2e = {"configs": res, "prediction": e2e_predict.predict(res, "tiny7b", "cpu", stress(), tmp_path)}
    # The floor is checked against the replay of the whole recording: add it as a run of 3 steps.
    e2e["prediction"]["replays"]["3"] = {"floor_bytes": 70 * MIB}
    assert check_gpu_run.prediction_problems(e2e, "e2e") == []
    bad = copy.deepcopy(e2e)
    bad["configs"]["native_expandable"]["attention"] = {"flash": 5, "flash+mask": 1}
    assert check_gpu_run.prediction_problems(bad, "e2e") == [
        "e2e: attention calls counted {'flash': 5, 'flash+mask': 1}, recorded {'cudnn': 4, 'cudnn+mask': 2}"
    ]
    bad = copy.deepcopy(e2e)
    del bad["prediction"]["configs"]["native"]
    assert check_gpu_run.prediction_problems(bad, "e2e") == [
        "e2e: predicted ['native_expandable'], ran ['native', 'native_expandable']"
    ]
    bad = copy.deepcopy(e2e)
    bad["prediction"]["replays"]["3"]["floor_bytes"] = 69 * MIB
    assert "is not the recording's peak live bytes" in check_gpu_run.prediction_problems(bad, "e2e")[0]
    assert check_gpu_run.prediction_problems({"configs": {}}, "e2e_7b") == ["e2e_7b: no prediction: absent"]
