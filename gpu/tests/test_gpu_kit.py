"""Tests of the GPU run kit: the bundle (scripts/gpu-bundle.sh, scripts/gpu_manifest.py), the
summary (gpu/summarize.py) and the input checks of gpu/run_all.sh and gpu/e2e_compare.py.

The bundle is built once per session (the fixture ``bundle``, conftest.py). The whole run from
the bundle over the host-memory driver is scripts/test.sh's, not these tests'; the sleep/wake
step alone runs in test_sleep_check.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
MIB = 1 << 20
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_manifest  # noqa: E402

NEEDED = [
    "lib/libstepalloc.so",
    "bin/stepalloc-stress",
    "bin/abi_test",
    "bin/torch_caller",
    "testbin/stepalloc-lib-tests",
    "testbin/random_cuda",
    "python/stepalloc/__init__.py",
    "python/stepalloc/torch.py",
    "gpu/run_all.sh",
    "gpu/validate.sh",
    "gpu/e2e_compare.py",
    "gpu/e2e_common.py",
    "gpu/e2e_model.py",
    "gpu/e2e_report.py",
    "gpu/e2e_worker.py",
    "gpu/e2e_predict.py",
    "python/stepalloc/fit/_kernels.py",
    "python/stepalloc/fit/configs/llava-1.5-7b.json",
    # stepalloc.fit's recordings of the dry run's loops (a GPU bundle also has 7b- and full-)
    "fit/tiny7b-full-sm90.jsonl.gz",
    "fit/tiny7b-full-sm90.json",
    "fit/tiny-full-sm90.jsonl.gz",
    "fit/tiny-full-sm90.json",
    "gpu/summarize.py",
    "gpu/torch_check.py",
    "gpu/ipc_check.py",
    "gpu/sleep_check.py",
    "gpu/sleep_worker.py",
    "gpu/testdrv_env.py",
    "python/examples/colocated_loop.py",
    "scripts/gpu_manifest.py",
    "scripts/cuda_matches_sim.py",
    "traces/model_vlm_agent.jsonl",
    "MANIFEST.json",
]


@pytest.fixture()
def copy(bundle: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst, symlinks=True)
    return dst


def manifest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_manifest.py"), *args], capture_output=True, text=True, check=False
    )


def test_bundle_holds_what_the_gpu_run_needs(bundle: Path) -> None:
    for rel in NEEDED:
        assert (bundle / rel).is_file(), f"{rel} missing from the bundle"
    # The whole Python package, its data files too (oom_error.cpp makes out-of-memory raise
    # torch.OutOfMemoryError).
    package = ROOT / "python_shim" / "stepalloc"
    for f in package.iterdir():
        if f.is_file() and f.suffix != ".pyc":
            assert (bundle / "python" / "stepalloc" / f.name).is_file(), f"{f.name} missing from the bundle"
    for rel in ["lib/libstepalloc.so", "bin/stepalloc-stress", "testbin/stepalloc-lib-tests", "gpu/run_all.sh"]:
        assert os.access(bundle / rel, os.X_OK) or rel.endswith(".so"), f"{rel} is not executable"
    m = json.loads((bundle / "MANIFEST.json").read_text())
    assert m["total_bytes"] <= 40 * MIB == m["limit_bytes"]
    assert m["total_bytes"] == sum(
        p.stat().st_size for p in bundle.rglob("*") if p.is_file() and p.name != "MANIFEST.json"
    )
    assert m["runtime_ok"] is True
    # What the library needs from glibc is stated, and within Ubuntu 24.04's 2.39.
    lib = next(e for e in m["files"] if e["path"] == "lib/libstepalloc.so")
    assert "GLIBC" in lib["needs"] and gpu_manifest.too_new(lib["needs"]) == []
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    assert m["source"]["commit"] == head
    r = manifest("check", str(bundle))
    assert r.returncode == 0, r.stderr
    # The test binaries are the ones that exercise the CUDA backend.
    listed = subprocess.run(
        [str(bundle / "testbin" / "stepalloc-lib-tests"), "--list", "backend::cuda"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "gpu_allocator_on_cuda" in listed


def test_manifest_check_finds_changed_missing_and_unlisted_files(copy: Path) -> None:
    with open(copy / "gpu" / "run_all.sh", "a") as f:
        f.write("# changed\n")
    (copy / "traces" / "model_vlm_agent.jsonl").unlink()
    (copy / "extra.txt").write_text("x")
    r = manifest("check", str(copy))
    assert r.returncode == 1
    assert "gpu/run_all.sh differs from MANIFEST.json" in r.stderr
    assert "traces/model_vlm_agent.jsonl is listed in MANIFEST.json but missing" in r.stderr
    assert "extra.txt is in the bundle but not in MANIFEST.json" in r.stderr


def test_a_bundle_over_its_limit_is_refused(copy: Path) -> None:
    r = manifest("write", str(copy), "--limit-mib", "1")
    assert r.returncode == 1
    assert "over its limit of 1 MiB" in r.stderr
    r = manifest("check", str(copy), "--limit-mib", "0")
    assert r.returncode == 2 and "--limit-mib 0.0 out of range" in r.stderr


def test_a_binary_needing_a_newer_glibc_is_refused() -> None:
    assert gpu_manifest.too_new({"GLIBC": "2.39", "GLIBCXX": "3.4.33"}) == []
    assert gpu_manifest.too_new({"GLIBC": "2.40"}) == ["GLIBC_2.40 (the GPU machine has GLIBC_2.39)"]
    assert gpu_manifest.too_new({"CXXABI": "1.3.16"}) == ["CXXABI_1.3.16 (the GPU machine has CXXABI_1.3.15)"]


def test_manifest_of_a_missing_folder_is_an_error(tmp_path: Path) -> None:
    r = manifest("check", str(tmp_path / "nope"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = manifest("check", str(tmp_path))
    assert r.returncode == 1 and "MANIFEST.json not found" in r.stderr


def test_run_all_refuses_a_folder_that_is_not_a_bundle(tmp_path: Path) -> None:
    r = subprocess.run(
        [str(ROOT / "gpu" / "run_all.sh"), str(tmp_path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2 and "is not a GPU bundle" in r.stderr


def test_e2e_rejects_bad_input(tmp_path: Path) -> None:
    def e2e(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(ROOT / "gpu" / "e2e_compare.py"), "--out", str(tmp_path), *args],
            capture_output=True,
            text=True,
            check=False,
        )

    r = e2e("--configs", "native", "bogus")
    assert r.returncode == 2 and "unknown configuration(s) bogus; accepted: native_record, native" in r.stderr
    r = e2e("--budget", "5")
    assert r.returncode == 2 and "--budget 5.0: out of range [10, 3600] seconds" in r.stderr
    r = e2e("--dry-run", "--device", "cuda")
    assert r.returncode == 2 and "--dry-run runs on the CPU" in r.stderr


def write_run(out: Path, validate: str, e2e: dict | None) -> None:
    (out / "validate").mkdir(parents=True)
    (out / "checks").mkdir()
    (out / "validate" / "summary").write_text(validate)
    (out / "checks" / "results").write_text("RESULT PASS bundle_manifest ok\nRESULT SKIP random_cuda no driver\n")
    if e2e is not None:
        (out / "e2e").mkdir()
        (out / "e2e" / "e2e.json").write_text(json.dumps(e2e))
        (out / "e2e" / "e2e.txt").write_text("TABLE\n")


def summarize(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "gpu" / "summarize.py"), str(out)], capture_output=True, text=True, check=False
    )


def test_summary_counts_every_check_and_fails_on_a_failure(tmp_path: Path) -> None:
    write_run(tmp_path, "RESULT PASS symbols all found\nANSWER q: yes\nRESULT FAIL torch_check broke\n", {"failed": []})
    r = summarize(tmp_path)
    assert r.returncode == 1
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["counts"] == {"PASS": 2, "FAIL": 1, "SKIP": 1} and doc["ok"] is False
    assert doc["answers"] == ["q: yes"]
    text = (tmp_path / "summary.txt").read_text()
    assert "FAIL torch_check broke" in text and "TABLE" in text and text.rstrip().endswith(f"in {tmp_path})")


def test_summary_is_ok_when_everything_ran(tmp_path: Path) -> None:
    write_run(tmp_path, "RESULT PASS symbols all found\n", {"failed": []})
    assert summarize(tmp_path).returncode == 0
    assert json.loads((tmp_path / "summary.json").read_text())["ok"] is True


def test_summary_without_a_comparison_is_not_ok(tmp_path: Path) -> None:
    write_run(tmp_path, "RESULT PASS symbols all found\n", None)
    r = summarize(tmp_path)
    assert r.returncode == 1 and "end-to-end comparison: no result" in r.stdout


sys.path.insert(0, str(ROOT / "gpu"))
import e2e_compare  # noqa: E402

GIB = 1 << 30


@pytest.mark.parametrize(
    ("largest", "probes", "expected", "tried"),
    [
        (3, 5, (0, 4, True), [4]),  # not even the base batch fits
        (4, 5, (4, 5, True), [4, 8, 6, 5]),
        (9, 6, (9, 10, True), [4, 8, 16, 12, 10, 9]),
        (9, 4, (8, 12, False), [4, 8, 16, 12]),  # out of probes: 8 fits, 12 does not
        (100, 3, (16, None, False), [4, 8, 16]),  # nothing failed yet
    ],
)
def test_headroom_search_doubles_then_bisects(largest: int, probes: int, expected: tuple, tried: list) -> None:
    calls: list[int] = []

    def fits(batch: int) -> bool:
        calls.append(batch)
        return batch <= largest

    assert e2e_compare.search(fits, 4, probes, lambda: True) == expected
    assert calls == tried


def test_headroom_search_stops_when_time_runs_out() -> None:
    assert e2e_compare.search(lambda b: True, 4, 10, lambda: False) == (0, None, False)


def gpu_result(name: str, reserved: float, step: float, batch: int) -> dict:
    return {
        "config": name,
        "device": "cuda",
        "device_name": "NVIDIA H200",
        "params": 1_412_000_000,
        "torch": "2.11.0",
        "transformers": "5.17.0",
        "notes": [],
        "iterations": [{"step_s": step}],
        "peak_reserved": int(reserved * GIB),
        "peak_allocated": int(20 * GIB),
        "reserved_over_allocated": reserved / 20,
        "peak_device_used": int((reserved + 0.5) * GIB),
        "median_step_s": step,
        "device_allocs_per_step": 1.5,
        "headroom": {"cap_bytes": 36 * GIB, "largest_batch": batch, "scale": batch / 4, "exact": True},
    }


def test_gpu_report_tables_and_targets() -> None:
    """The report of a GPU run (which CI never produces): every row, the replay table, the targets."""
    res = {
        "native_record": gpu_result("native_record", 24.0, 1.30, 0),
        "native": gpu_result("native", 24.0, 1.00, 6),
        "native_expandable": gpu_result("native_expandable", 21.5, 1.01, 7),
        "stepalloc": gpu_result("stepalloc", 20.0, 1.015, 8),
        "stepalloc_mempool": {"config": "stepalloc_mempool", "failed": "timed out after 60 s"},
    }
    res["stepalloc"]["maps_per_step"], res["stepalloc"]["creates_per_step"] = 3.0, 0.5
    del res["native_record"]["headroom"]
    replay = {
        "runs": {
            "pytorch": {"peak_reserved": int(25 * GIB), "floor": int(19 * GIB)},
            "stepalloc": {"peak_reserved": int(20.2 * GIB)},
        },
        "source": {"native": {"peak_reserved": int(24 * GIB)}},
    }
    doc = {
        "date": "2026-12-03 01:00 UTC",
        "device_name": "NVIDIA H200",
        "size": "full",
        "order": list(res),
        "headroom_factor": 1.5,
        "configs": res,
        "replay": replay,
        "targets": e2e_compare.evaluate(res),
    }
    status = {t["target"]: t["status"] for t in doc["targets"]}
    assert status == {
        "peak reserved >= 15% below native": "MET",  # 20.0 <= 0.85 x 24.0
        "peak reserved not above native expandable": "MET",
        "median step time within 2% of native": "MET",
        "MemPool mode's peak within 2% of process-wide stepalloc": "n/a",  # its run failed
        "headroom above both native configurations": "MET",
    }
    text = e2e_compare.text_report(doc)
    assert "2026-12-03 01:00 UTC, device: NVIDIA H200" in text
    assert "1.41 B params" in text
    row = next(line for line in text.splitlines() if line.startswith("peak reserved"))
    assert row.split()[2:] == ["24.00", "GiB", "21.50", "GiB", "20.00", "GiB", "FAILED"]
    assert "3.5" in next(line for line in text.splitlines() if line.startswith("maps + creates"))
    assert "8 (2.00x)" in text and "36.00 GiB = native peak x 1.5" in text
    native_row = next(line for line in text.splitlines() if line.startswith("native (pytorch)"))
    assert native_row.split()[2:] == ["24.00", "GiB", "25.00", "GiB", "1.042"]
    assert "segment events give native a peak reserved of 24.00 GiB" in text
    assert "FAILED (stepalloc_mempool): timed out after 60 s" in text
    res["native"]["error"] = "headroom search: RuntimeError: CUDA error"
    assert "ERROR (native): headroom search: RuntimeError: CUDA error" in e2e_compare.text_report(doc)
    # A slower stepalloc and a peak above expandable are missed targets.
    res["stepalloc"].update(median_step_s=1.05, peak_reserved=int(22 * GIB))
    status = {t["target"]: t["status"] for t in e2e_compare.evaluate(res)}
    assert status["median step time within 2% of native"] == "MISSED"
    assert status["peak reserved not above native expandable"] == "MISSED"
    assert status["peak reserved >= 15% below native"] == "MISSED"
    # MemPool mode against process-wide stepalloc (22 GiB now): within 2% or not.
    res["stepalloc_mempool"] = dict(res["stepalloc"], config="stepalloc_mempool", peak_reserved=int(22.4 * GIB))
    status = {t["target"]: t["status"] for t in e2e_compare.evaluate(res)}
    assert status["MemPool mode's peak within 2% of process-wide stepalloc"] == "MET"
    res["stepalloc_mempool"]["peak_reserved"] = int(22.5 * GIB)
    status = {t["target"]: t["status"] for t in e2e_compare.evaluate(res)}
    assert status["MemPool mode's peak within 2% of process-wide stepalloc"] == "MISSED"


def test_e2e_one_after_another_as_on_a_gpu(tmp_path: Path) -> None:
    """The orchestration a GPU run takes (one configuration at a time, the cap from
    native_record, its replay in the background), on the CPU with the tiny model."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "gpu" / "e2e_compare.py"), "--out", str(tmp_path), "--dry-run", "--jobs", "1",
         "--configs", "native_record", "stepalloc", "--budget", "300"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert doc["failed"] == [] and doc["device"] == "cpu" and doc["size"] == "tiny"
    for name in ("native_record", "stepalloc"):
        its = doc["configs"][name]["iterations"]
        assert len(its) == 3 and all(i["step_s"] > 0 for i in its)
        assert "SKIP allocator set-up" in (tmp_path / f"{name}.log").read_text()
    # Same seed, same shapes in every configuration.
    shapes = [[(i["images"], i["prompt"], i["new"]) for i in doc["configs"][n]["iterations"]] for n in doc["configs"]]
    assert shapes[0] == shapes[1]
    runs = doc["replay"]["runs"]
    assert set(runs) == {"pytorch", "stepalloc"} and runs["pytorch"]["floor"] > 0
    assert doc["replay"]["snapshot_kept"] == "native_snapshot.pickle.gz"
    assert "replay of the native run's snapshot" in (tmp_path / "e2e.txt").read_text()


def test_bundle_refuses_a_folder_it_would_wrongly_empty(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    r = subprocess.run(
        [str(ROOT / "scripts" / "gpu-bundle.sh"), str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert r.returncode == 2 and "is not empty and holds no earlier bundle" in r.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"
