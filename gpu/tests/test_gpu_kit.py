"""Tests of the GPU run kit: the bundle (scripts/gpu-bundle.sh, scripts/gpu_manifest.py), the
summary (gpu/summarize.py) and the input checks of gpu/run_all.sh and gpu/e2e_compare.py.

The bundle is built once per session: the one named by $STEPALLOC_GPU_BUNDLE if set
(scripts/test.sh builds it first), else a fresh one in a temporary folder. The whole run from
the bundle over the host-memory driver is scripts/test.sh's, not these tests'.
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
    "gpu/summarize.py",
    "gpu/torch_check.py",
    "scripts/gpu_manifest.py",
    "scripts/cuda_matches_sim.py",
    "traces/model_vlm_agent.jsonl",
    "MANIFEST.json",
]


@pytest.fixture(scope="session")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("STEPALLOC_GPU_BUNDLE")
    if given:
        path = Path(given)
        assert (path / "MANIFEST.json").is_file(), f"STEPALLOC_GPU_BUNDLE={given} holds no MANIFEST.json"
        return path
    path = tmp_path_factory.mktemp("bundle") / "b"
    subprocess.run([str(ROOT / "scripts" / "gpu-bundle.sh"), str(path)], check=True, cwd=ROOT)
    return path


@pytest.fixture()
def copy(bundle: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst, symlinks=True)
    return dst


def manifest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_manifest.py"), *args], capture_output=True, text=True)


def test_bundle_holds_what_the_gpu_run_needs(bundle: Path) -> None:
    for rel in NEEDED:
        assert (bundle / rel).is_file(), f"{rel} missing from the bundle"
    for rel in ["lib/libstepalloc.so", "bin/stepalloc-stress", "testbin/stepalloc-lib-tests", "gpu/run_all.sh"]:
        assert os.access(bundle / rel, os.X_OK) or rel.endswith(".so"), f"{rel} is not executable"
    m = json.loads((bundle / "MANIFEST.json").read_text())
    assert m["total_bytes"] <= 40 * MIB == m["limit_bytes"]
    assert m["total_bytes"] == sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    assert m["runtime_ok"] is True
    # What the library needs from glibc is stated, and within Ubuntu 24.04's 2.39.
    lib = next(e for e in m["files"] if e["path"] == "lib/libstepalloc.so")
    assert "GLIBC" in lib["needs"] and gpu_manifest.too_new(lib["needs"]) == []
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert m["source"]["commit"] == head
    r = manifest("check", str(bundle))
    assert r.returncode == 0, r.stderr
    # The test binaries are the ones that exercise the CUDA backend.
    listed = subprocess.run([str(bundle / "testbin" / "stepalloc-lib-tests"), "--list", "backend::cuda"],
                            capture_output=True, text=True, check=True).stdout
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
    r = subprocess.run([str(ROOT / "gpu" / "run_all.sh"), str(tmp_path), str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 2 and "is not a GPU bundle" in r.stderr


def test_e2e_rejects_bad_input(tmp_path: Path) -> None:
    def e2e(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "gpu" / "e2e_compare.py"), "--out", str(tmp_path), *args],
                              capture_output=True, text=True)

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
    return subprocess.run([sys.executable, str(ROOT / "gpu" / "summarize.py"), str(out)], capture_output=True, text=True)


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
