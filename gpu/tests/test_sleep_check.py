"""The GPU kit's sleep/wake step (gpu/sleep_check.py) from the bundle, over testdrv's host-memory
driver with small sizes: bytes restored, data_ptr kept, memory given back, the graph's replay
right, the colocated loop run, figures present and positive; what the bundle must carry for it;
its summary section (gpu/summarize.py) and its check (scripts/check_gpu_run.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
HOSTCUDA = ROOT / "target" / "hostcuda"
sys.path.insert(0, str(ROOT / "scripts"))

import check_gpu_run  # noqa: E402

# Every correctness check of the step, passed.
ALL_CORRECT = {
    "ptrs_kept": True,
    "bytes_kept": True,
    "memory_released": True,
    "discard_usable": True,
    "graph_replay_right": True,
    "graph_ptr_kept": True,
    "graph_pool_released": True,
    "graph_pool_replay_right": True,
}

SMALL = ["--backup-mb", "12", "--tensors", "9", "--discard-mb", "6", "--cycles", "3", "--graph-mb", "2"]
SMALL += ["--unit-mb", "4", "--iterations", "2"]


def sleep_check(bundle: Path, out: Path, *args: str, library_path: str | None = None) -> subprocess.CompletedProcess:
    """The step as a kit run over testdrv runs it (scripts/test.sh), on a 1 GiB device; the
    driver's folder first on LD_LIBRARY_PATH, or ``library_path`` alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTCUDA_") and k != "STEPALLOC_CONF"}
    env.pop("LD_PRELOAD", None)
    if library_path is None:
        library_path = os.pathsep.join(p for p in (str(HOSTCUDA), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    env.update(
        {
            "STEPALLOC_HOSTCUDA": "1",
            "HOSTCUDA_DEVICES": "1",
            "HOSTCUDA_CAPACITY_MB": "1024",
            "LD_LIBRARY_PATH": library_path,
            "STEPALLOC_LIBRARY": str(bundle / "lib" / "libstepalloc.so"),
        }
    )
    return subprocess.run(
        [sys.executable, str(bundle / "gpu" / "sleep_check.py"), "--json", str(out / "sleep.json"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
        check=False,
    )


def results(stdout: str) -> dict[str, str]:
    return {line.split()[2]: line.split()[1] for line in stdout.splitlines() if line.startswith("RESULT ")}


def torch_over_testdrv() -> bool:
    return (HOSTCUDA / "runtime" / "libcudart.so.13").is_file() and importlib.util.find_spec("torch") is not None


def test_the_bundle_carries_what_the_step_needs(bundle: Path) -> None:
    listed = {e["path"] for e in json.loads((bundle / "MANIFEST.json").read_text())["files"]}
    for rel in ["gpu/sleep_check.py", "gpu/sleep_worker.py", "python/examples/colocated_loop.py", "python/stepalloc/sleep.py"]:
        assert rel in listed and (bundle / rel).is_file(), rel
    assert "gpu/sleep_check.py" in (bundle / "gpu" / "run_all.sh").read_text()


def test_the_bundled_torch_memory_saver_wheel_unpacks_to_an_importable_package(bundle: Path) -> None:
    """Where no torch_memory_saver is installed for the interpreter that has torch, the step
    imports the bundle's wheel (scripts/gpu-bundle.sh fetches it; offline, it may be absent)."""
    wheels = list((bundle / "wheels").glob("torch_memory_saver-*.whl"))
    if not wheels:
        pytest.skip("the bundle has no torch_memory_saver wheel (fetched when the bundle was built)")
    before = list(sys.path)
    # As when run as a script: its folder first, for its sibling testdrv_env.py.
    sys.path.insert(0, str(bundle / "gpu"))
    try:
        spec = importlib.util.spec_from_file_location("bundled_sleep_worker", bundle / "gpu" / "sleep_worker.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.unpack_bundled_wheel() == wheels[0].name
        folder = Path(sys.path[0])
        assert (folder / "torch_memory_saver" / "__init__.py").is_file()
        assert list(folder.rglob("*.so")), "the wheel's extension was unpacked"
    finally:
        sys.path[:] = before


@pytest.mark.skipif(not torch_over_testdrv(), reason="needs torch and testdrv's stub runtime (testdrv/build.sh)")
def test_the_step_over_the_host_memory_driver(bundle: Path, tmp_path: Path) -> None:
    r = sleep_check(bundle, tmp_path, *SMALL)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    status = results(r.stdout)
    assert status["sleep_cycle"] == status["sleep_graph"] == status["sleep_colocated"] == "PASS", r.stdout
    assert status["sleep_graph_pool"] == "PASS", r.stdout
    assert status["sleep_bandwidth"] == "SKIP"  # the 80% target is a GPU's
    doc = json.loads((tmp_path / "sleep.json").read_text())
    assert doc["host_memory_driver"] is True and doc["ok"] is True
    assert doc["correct"] == ALL_CORRECT
    c = doc["cycle"]
    assert c["sizes"] == {"backup_bytes": 12 << 20, "tensors": 9, "discard_bytes": 6 << 20, "cycles": 3}
    for name in ("stepalloc_backup", "stepalloc_discard", "copy"):
        row = c[name]
        assert len(row["pause_all_s"]) == len(row["resume_all_s"]) == 3, name
        assert min(row["pause_s"], row["resume_s"], row["pause_gib_s"], row["resume_gib_s"]) > 0, (name, row)
    # The library's own report: every pause copied the backed-up bytes and resume brought them back.
    assert all(x["pause"]["copied_bytes"] >= 12 << 20 for x in c["library_reports"])
    assert all(x["resume"]["copied_bytes"] == x["pause"]["copied_bytes"] for x in c["library_reports"])
    assert c["gained_bytes"]["backup_min"] >= 12 << 20 and c["gained_bytes"]["discard_min"] >= 6 << 20
    g = c["graph"]
    assert g["kernel"] is False and g["released_bytes"] >= 2 * (2 << 20)
    # A capture begun inside a region puts the graph's pool under the tag (src/heap/graphs.rs):
    # the graph's own output counts in the tag and pauses with it, nothing lands in "default".
    assert g["pool_tagged"] is True and g["capture_growth"]["tag"] >= 2 << 20, g
    assert g["capture_growth"]["default"] < 2 << 20, g
    bw = doc["bandwidth"]
    assert bw["pause_ratio"] > 0 and bw["resume_ratio"] > 0 and bw["applies"] is False
    co = doc["colocated"]
    assert co["status"] == 0 and co["addresses_kept"] and co["bytes_kept"] and co["switch_ms"] > 0
    if importlib.util.find_spec("torch_memory_saver") is not None:
        assert status["sleep_tms"] == "PASS", r.stdout
        assert doc["tms"]["bytes_kept"] is True and doc["tms"]["ptrs_kept"] is True
        assert doc["tms"]["backup"]["pause_s"] > 0
    else:
        assert status["sleep_tms"] == "SKIP" and "does not import" in doc["tms"]["skip"]
    table = (tmp_path / "sleep.txt").read_text()
    assert "stepalloc pause/resume, backed up" in table and "copy_() out / back" in table
    assert check_gpu_run.sleep_problems(doc) == []


def test_without_the_stub_runtime_the_step_skips_and_says_why(bundle: Path, tmp_path: Path) -> None:
    r = sleep_check(bundle, tmp_path, *SMALL, library_path=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    status = results(r.stdout)
    skipped = ("sleep_cycle", "sleep_colocated", "sleep_switch_costs", "sleep_colocated_7b", "sleep_tms")
    assert status == dict.fromkeys(skipped, "SKIP"), r.stdout
    assert "testdrv/build.sh" in r.stdout


def test_bad_arguments_are_refused(bundle: Path, tmp_path: Path) -> None:
    r = sleep_check(bundle, tmp_path, "--cycles", "1")
    assert r.returncode == 2 and "--cycles must be at least 2" in r.stderr
    r = sleep_check(bundle, tmp_path, "--parts", "cycle,bogus")
    assert r.returncode == 2 and "unknown part(s) bogus" in r.stderr


def test_the_summary_has_a_sleep_section_and_the_check_reads_it(tmp_path: Path) -> None:
    (tmp_path / "validate").mkdir()
    (tmp_path / "checks").mkdir()
    (tmp_path / "validate" / "summary").write_text("RESULT PASS symbols all found\n")
    (tmp_path / "checks" / "results").write_text("RESULT PASS sleep_cycle ok\n")
    row = {"pause_s": 0.1, "resume_s": 0.2, "pause_gib_s": 10.0, "resume_gib_s": 5.0}
    sleep = {
        "correct": ALL_CORRECT,
        "cycle": {"stepalloc_backup": row, "stepalloc_discard": row, "copy": row},
        "bandwidth": {"pause_ratio": 0.9, "resume_ratio": 0.85, "target_met": True},
    }
    (tmp_path / "checks" / "sleep.json").write_text(json.dumps(sleep))
    (tmp_path / "checks" / "sleep.txt").write_text("SLEEP TABLE\n")
    r = subprocess.run(
        [sys.executable, str(ROOT / "gpu" / "summarize.py"), str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert "SLEEP TABLE" in r.stdout
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["sleep"] == sleep
    assert check_gpu_run.sleep_problems(doc["sleep"]) == []
    sleep["correct"]["graph_replay_right"] = False
    del sleep["correct"]["bytes_kept"]
    sleep["cycle"]["copy"] = dict(row, resume_gib_s=0.0)
    assert check_gpu_run.sleep_problems(sleep) == [
        "sleep: graph_replay_right is False",
        "sleep: no bytes_kept field",
        "sleep: copy figures missing or not positive: [0.1, 0.2, 10.0, 0.0]",
    ]
    assert check_gpu_run.sleep_problems(None) == ["summary.json: no sleep section (checks/sleep.json missing)"]
    (tmp_path / "checks" / "sleep.txt").unlink()
    r = subprocess.run(
        [sys.executable, str(ROOT / "gpu" / "summarize.py"), str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert "sleep and wake: no result (see checks/sleep_check.log)" in r.stdout
