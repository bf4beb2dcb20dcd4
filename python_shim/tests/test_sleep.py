"""Sleep and wake: tagged regions, ``pause`` / ``resume`` with addresses kept, the host backup.

Two layers: the library over the simulated device in this process (tags, reports, statistics,
the documented outcomes of every odd call), and real PyTorch over testdrv in child processes
(bytes and ``data_ptr()`` kept through a backed-up pause, memory back in
``torch.cuda.mem_get_info()`` and in another process's view of a shared device, a CUDA graph
captured before pause replaying after resume, a block freed and ``empty_cache`` while paused,
resume under memory pressure).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import stepalloc
from conftest import MIB, check_child, run_python
from stepalloc import sleep as sleep_mod

GIB = 1 << 30
DEV = 1  # device 1 of the session's simulated devices: other tests use device 0 most


@pytest.fixture(autouse=True)
def _leave_the_session_as_found() -> Iterator[None]:
    """Nothing paused and nothing cached after each test: later tests of this process count
    device mallocs and expect an empty cache."""
    yield
    if stepalloc.paused_tags():
        stepalloc.resume()
    stepalloc.empty_cache()
    stepalloc.release_backup()


def live(tag: str) -> int:
    return int(stepalloc.tags().get(tag, {}).get("live_bytes", 0))


# --- the library over the simulated device --------------------------------------------------


def test_allocations_inside_a_region_carry_its_tag_and_pause_releases_them() -> None:
    with stepalloc.region("sim_kv"):
        a = stepalloc.raw_alloc(64 * MIB, DEV)
        with stepalloc.region("sim_w", backup=True):  # the innermost region wins
            b = stepalloc.raw_alloc(32 * MIB, DEV)
        c = stepalloc.raw_alloc(16 * MIB, DEV)
    d = stepalloc.raw_alloc(8 * MIB, DEV)  # outside every region: "default"
    try:
        t = stepalloc.tags()
        assert t["sim_kv"]["live_bytes"] >= 80 * MIB and t["sim_w"]["live_bytes"] >= 32 * MIB
        assert t["sim_w"]["backup"] is True and t["sim_kv"]["backup"] is False
        reserved = stepalloc.memory_reserved(DEV)
        report = stepalloc.pause("sim_kv")
        assert report.op == "pause" and report.tags == ("sim_kv",) and report.skipped == ()
        assert report.released_bytes >= 80 * MIB
        assert report.discarded_bytes >= 80 * MIB and report.copied_bytes == 0
        assert stepalloc.memory_reserved(DEV) <= reserved - 80 * MIB
        t = stepalloc.tags()
        assert t["sim_kv"]["paused"] and t["sim_kv"]["paused_bytes"] >= 80 * MIB
        assert not t["sim_w"]["paused"]
        stats = stepalloc.memory_stats(DEV, include_stepalloc=True)
        assert stats["stepalloc.tag.sim_kv.paused_bytes"] >= 80 * MIB
        assert stats["stepalloc.tag.sim_kv.pauses"] >= 1
        assert "stepalloc.backup_host_bytes" in stats
        # Pausing it again: a no-op the report names.
        again = stepalloc.pause("sim_kv")
        assert again.tags == () and again.skipped == ("sim_kv",) and again.released_bytes == 0
        back = stepalloc.resume("sim_kv")
        assert back.op == "resume" and back.tags == ("sim_kv",) and back.mapped_bytes >= 80 * MIB
        assert not stepalloc.tags()["sim_kv"]["paused"]
        assert stepalloc.resume("sim_kv").skipped == ("sim_kv",)
        assert stepalloc.memory_stats(DEV, include_stepalloc=True)["stepalloc.tag.sim_kv.resumes"] >= 1
    finally:
        for p in (a, b, c, d):
            stepalloc.raw_free(p, 0, DEV)


def test_a_backed_up_tag_reports_its_copy() -> None:
    with stepalloc.region("sim_backed", backup=True):
        p = stepalloc.raw_alloc(48 * MIB, DEV)
    try:
        r = stepalloc.pause("sim_backed")
        assert r.copied_bytes >= 48 * MIB and r.discarded_bytes == 0
        assert r.seconds > 0 and r.gib_per_s > 0
        assert stepalloc.tags()["sim_backed"]["backup_bytes"] >= 48 * MIB
        assert stepalloc.stepalloc_stats(DEV)["backup_host_bytes"] >= 48 * MIB
        r = stepalloc.resume("sim_backed")
        assert r.copied_bytes >= 48 * MIB
        # The buffers stay for the next pause until given back.
        stepalloc.release_backup()
        # backup=False overrides the tag's policy for one call.
        r = stepalloc.pause("sim_backed", backup=False)
        assert r.copied_bytes == 0 and r.discarded_bytes >= 48 * MIB
        stepalloc.resume("sim_backed")
    finally:
        stepalloc.raw_free(p, 0, DEV)


def test_a_block_freed_while_paused_is_dropped_and_resume_maps_the_rest() -> None:
    with stepalloc.region("sim_drop", backup=True):
        keep = stepalloc.raw_alloc(16 * MIB, DEV)
        gone = stepalloc.raw_alloc(32 * MIB, DEV)
    stepalloc.pause("sim_drop")
    before = stepalloc.tags()["sim_drop"]
    stepalloc.raw_free(gone, 0, DEV)  # no double release, its backup goes too
    after = stepalloc.tags()["sim_drop"]
    assert after["paused_bytes"] <= before["paused_bytes"] - 32 * MIB
    assert after["backup_bytes"] <= before["backup_bytes"] - 32 * MIB
    stepalloc.empty_cache()  # never maps or releases a paused tag's pages
    r = stepalloc.resume("sim_drop")
    assert 16 * MIB <= r.mapped_bytes < 48 * MIB
    stepalloc.raw_free(keep, 0, DEV)
    assert live("sim_drop") == 0


def test_allocating_in_a_paused_tags_region_is_a_paused_error() -> None:
    with stepalloc.region("sim_blocked"):
        p = stepalloc.raw_alloc(4 * MIB, DEV)
    stepalloc.pause("sim_blocked")
    try:
        with stepalloc.region("sim_blocked"), pytest.raises(stepalloc.PausedError, match="sim_blocked"):
            stepalloc.raw_alloc(4 * MIB, DEV)
        # Outside the region the thread allocates as usual.
        q = stepalloc.raw_alloc(4 * MIB, DEV)
        stepalloc.raw_free(q, 0, DEV)
    finally:
        stepalloc.resume("sim_blocked")
        stepalloc.raw_free(p, 0, DEV)


def test_resume_that_cannot_get_the_memory_fails_naming_the_tag_and_can_be_retried() -> None:
    with stepalloc.region("sim_pressure"):
        p = stepalloc.raw_alloc(512 * MIB, DEV)
    stepalloc.pause("sim_pressure")
    hog = stepalloc.raw_alloc(700 * MIB, DEV)  # the released memory, taken by someone else
    try:
        with pytest.raises(MemoryError, match="sim_pressure") as info:
            stepalloc.resume("sim_pressure")
        assert "short" in str(info.value) or "need" in str(info.value), info.value
        assert stepalloc.tags()["sim_pressure"]["paused"]  # still paused, nothing lost
    finally:
        stepalloc.raw_free(hog, 0, DEV)
    stepalloc.empty_cache()
    r = stepalloc.resume("sim_pressure")
    assert r.mapped_bytes >= 512 * MIB
    stepalloc.raw_free(p, 0, DEV)


def test_odd_calls_have_their_documented_outcome() -> None:
    with pytest.raises(ValueError, match="never_seen_tag"):
        stepalloc.pause("never_seen_tag")
    with pytest.raises(ValueError, match="default"):
        stepalloc.pause("default")  # memory outside every region is never paused
    with pytest.raises(ValueError, match="default"):
        stepalloc.resume("default")
    for bad in ["", "has space", "x" * 65, "slash/tag"]:
        with pytest.raises(ValueError), stepalloc.region(bad):
            pass
    with pytest.raises(ValueError, match="NUL"):
        stepalloc.region("a\x00b")
    with pytest.raises(TypeError):
        stepalloc.region(7)  # type: ignore[arg-type]
    # An exit without an enter (not reachable through the context manager).
    assert sleep_mod._c().stepalloc_region_exit() == 3  # INVALID_ARGUMENT


def test_regions_are_per_thread() -> None:
    def other() -> None:
        p = stepalloc.raw_alloc(8 * MIB, DEV)  # no region on this thread: "default"
        stepalloc.raw_free(p, 0, DEV)

    with stepalloc.region("sim_thread"):
        before = live("sim_thread")
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert live("sim_thread") == before
        q = stepalloc.raw_alloc(8 * MIB, DEV)
        assert live("sim_thread") >= before + 8 * MIB
        stepalloc.raw_free(q, 0, DEV)


def test_sleep_report_reads_the_librarys_json() -> None:
    text = json.dumps(
        {
            "op": "pause",
            "tags": ["a", "b"],
            "skipped": ["c"],
            "released_bytes": 3 * GIB,
            "mapped_bytes": 0,
            "copied_bytes": GIB,
            "discarded_bytes": 2 * GIB,
            "seconds": 0.5,
            "gib_per_s": 2.0,
        }
    )
    r = stepalloc.SleepReport.from_json(text)
    assert r.tags == ("a", "b") and r.skipped == ("c",) and r.copied_bytes == GIB and r.gib_per_s == 2.0
    assert "pause a, b" in str(r) and "skipped c" in str(r)


def test_prometheus_text_carries_the_tags() -> None:
    with stepalloc.region("sim_metrics"):
        p = stepalloc.raw_alloc(2 * MIB, DEV)
    try:
        text = stepalloc.metrics_text()
        assert 'tag="sim_metrics"' in text, text[:2000]
    finally:
        stepalloc.raw_free(p, 0, DEV)


# --- real PyTorch over testdrv ----------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
HOSTCUDA = ROOT / "target" / "hostcuda"
RUNTIME = HOSTCUDA / "runtime"
STUB_RUNTIME = RUNTIME / "libcudart.so.13"


def _torch_ok() -> bool:
    from conftest import torch_available

    return STUB_RUNTIME.exists() and torch_available()


needs_torch = pytest.mark.skipif(not _torch_ok(), reason="needs torch and testdrv's stubs (testdrv/build.sh)")


def torch_env(capacity_mb: int = 1024, shared: Path | None = None) -> dict[str, str]:
    library_path = [str(RUNTIME), str(HOSTCUDA), str(HOSTCUDA / "standins"), os.environ.get("LD_LIBRARY_PATH", "")]
    env = {
        "LD_PRELOAD": str(STUB_RUNTIME),
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in library_path if p),
        "HOSTCUDA_DEVICES": "1",
        "HOSTCUDA_CAPACITY_MB": str(capacity_mb),
        "PYTORCH_CUDA_ALLOC_CONF": "",
    }
    if shared is not None:
        env["HOSTCUDA_SHARED"] = str(shared)
    return env


PRELUDE = """
import sys, torch, stepalloc
MIB = 1 << 20
def say(*a):
    print(*a, flush=True)
"""


def run_torch(code: str, **kw: object) -> dict[str, str]:
    out = check_child(run_python(PRELUDE + textwrap.dedent(code), env=torch_env(**kw), timeout=240))  # type: ignore[arg-type]
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


CONFS = ["backend:cuda," + stepalloc.RECOMMENDED, "backend:cuda"]


@needs_torch
@pytest.mark.parametrize("conf", CONFS, ids=["recommended", "plain"])
def test_backed_up_tensors_keep_bytes_and_addresses_and_discarded_memory_is_free(conf: str) -> None:
    v = run_torch(
        f"""
        stepalloc.install({conf!r})
        g = torch.Generator().manual_seed(3)
        sizes = [1, 511, 4097, MIB + 3, 3 * MIB, 7 * MIB + 1, 40 * MIB]
        hosts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
        with stepalloc.region("weights", backup=True):
            ws = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
        for w, h in zip(ws, hosts):
            w.copy_(h)
        with stepalloc.region("kv_cache"):
            kv = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
            tmp = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        del tmp  # cached free pages of the tag go too
        ptrs = [w.data_ptr() for w in ws] + [kv.data_ptr()]
        free0 = torch.cuda.mem_get_info()[0]
        r = stepalloc.pause()
        free1 = torch.cuda.mem_get_info()[0]
        say("gained=" + str(free1 - free0))
        say("copied=" + str(r.copied_bytes))
        say("discarded=" + str(r.discarded_bytes))
        say("tags=" + ",".join(sorted(r.tags)))
        r = stepalloc.resume()
        say("restored=" + str(r.copied_bytes))
        say("same_ptrs=" + str(ptrs == [w.data_ptr() for w in ws] + [kv.data_ptr()]))
        say("same_bytes=" + str(all(torch.equal(w.cpu(), h) for w, h in zip(ws, hosts))))
        kv.copy_(torch.full((256 * MIB,), 5, dtype=torch.uint8))  # the discarded tag is usable again
        say("kv_ok=" + str(bool((kv.cpu()[:: MIB] == 5).all())))
        stats = stepalloc.memory_stats(include_stepalloc=True)
        say("pauses=" + str(stats["stepalloc.tag.weights.pauses"]))
        """
    )
    need = sum([1, 511, 4097, MIB + 3, 3 * MIB, 7 * MIB + 1, 40 * MIB]) + 320 * MIB
    assert int(v["gained"]) >= need, v
    assert int(v["copied"]) >= need - 320 * MIB and int(v["restored"]) == int(v["copied"])
    assert int(v["discarded"]) >= 256 * MIB
    assert v["tags"] == "kv_cache,weights"
    assert v["same_ptrs"] == "True" and v["same_bytes"] == "True" and v["kv_ok"] == "True"
    assert v["pauses"] == "1"


@needs_torch
def test_a_graph_captured_before_pause_replays_after_resume() -> None:
    v = run_torch(
        """
        stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED)
        n = 8 * MIB
        with stepalloc.region("engine", backup=True):
            static_in = torch.zeros(n, dtype=torch.uint8, device="cuda")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = static_in.clone()  # allocated in the graph's pool, copied on replay
        out_ptr = static_out.data_ptr()
        stepalloc.pause("engine")
        stepalloc.resume("engine")
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        static_in.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        say("same_ptr=" + str(static_out.data_ptr() == out_ptr))
        say("replayed=" + str(torch.equal(static_out.cpu(), src)))
        # Pausing during a capture is refused, naming the capture.
        s = torch.cuda.Stream()
        g2 = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g2, stream=s):
                stepalloc.pause("engine")
        except ValueError as e:
            say("refused=" + str("captur" in str(e)))
        """
    )
    assert v["same_ptr"] == "True" and v["replayed"] == "True", v
    assert v["refused"] == "True", v


@needs_torch
def test_free_and_empty_cache_while_paused_and_resume_under_pressure() -> None:
    v = run_torch(
        """
        stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED)
        with stepalloc.region("kv", backup=True):
            keep = torch.full((128 * MIB,), 9, dtype=torch.uint8).cuda()
            drop = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        stepalloc.pause("kv")
        del drop  # freed while paused: dropped, no double release
        torch.cuda.empty_cache()  # leaves the paused tag alone
        say("paused_after_free=" + str(stepalloc.tags()["kv"]["paused_bytes"]))
        # Someone else takes the memory: resume cannot get it back and says so.
        hog = torch.empty(torch.cuda.mem_get_info()[0] - 64 * MIB, dtype=torch.uint8, device="cuda")
        try:
            stepalloc.resume("kv")
        except torch.cuda.OutOfMemoryError as e:
            say("oom_names_tag=" + str("kv" in str(e)))
        say("still_paused=" + str(stepalloc.tags()["kv"]["paused"]))
        del hog
        torch.cuda.empty_cache()
        r = stepalloc.resume("kv")
        say("mapped=" + str(r.mapped_bytes))
        say("kept=" + str(bool((keep.cpu()[:: MIB] == 9).all())))
        """
    )
    assert int(v["paused_after_free"]) < 256 * MIB, v
    assert v["oom_names_tag"] == "True" and v["still_paused"] == "True", v
    assert 128 * MIB <= int(v["mapped"]) < 384 * MIB and v["kept"] == "True", v


def _spawn(code: str, env: dict[str, str]) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if k != "STEPALLOC_CONF" and not k.startswith("HOSTCUDA_")}
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python_shim"), full.get("PYTHONPATH", "")])
    full.update(env)
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env=full,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _expect(p: subprocess.Popen, key: str) -> str:
    line = p.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith(key + "="):
        p.kill()
        out, err = p.communicate(timeout=30)
        pytest.fail(f"expected {key}=..., got {line!r}\n{out}\n{err[-4000:]}")
    return line.split("=", 1)[1].strip()


def _send(p: subprocess.Popen) -> None:
    p.stdin.write("go\n")  # type: ignore[union-attr]
    p.stdin.flush()  # type: ignore[union-attr]


@needs_torch
def test_another_process_sees_paused_memory_free_and_resume_waits_for_it(tmp_path: Path) -> None:
    # A trainer with stepalloc and an engine with PyTorch's own allocator on one 1 GiB device.
    env = torch_env(capacity_mb=1024, shared=tmp_path / "device")
    trainer = _spawn(
        """
        stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED)
        with stepalloc.region("train", backup=True):
            params = torch.full((512 * MIB,), 3, dtype=torch.uint8).cuda()
        say("ready=1")
        sys.stdin.readline()
        stepalloc.pause("train")
        say("paused=1")
        sys.stdin.readline()
        try:
            stepalloc.resume("train")
            say("resume=ok")
        except torch.cuda.OutOfMemoryError as e:
            say("resume=oom " + str("train" in str(e)))
        sys.stdin.readline()
        stepalloc.resume("train")
        say("retry=" + str(bool((params.cpu()[:: MIB] == 3).all())))
        """,
        env,
    )
    _expect(trainer, "ready")
    engine = _spawn(
        """
        free0 = torch.cuda.mem_get_info()[0]
        say("free0=" + str(free0))
        sys.stdin.readline()
        free1 = torch.cuda.mem_get_info()[0]
        say("free1=" + str(free1))
        kv = torch.empty(700 * MIB, dtype=torch.uint8, device="cuda")
        say("engine_holds=1")
        sys.stdin.readline()
        del kv
        torch.cuda.empty_cache()
        say("engine_released=1")
        """,
        env,
    )
    free0 = int(_expect(engine, "free0"))
    assert free0 <= 512 * MIB, free0
    _send(trainer)
    _expect(trainer, "paused")
    _send(engine)
    free1 = int(_expect(engine, "free1"))
    assert free1 >= free0 + 512 * MIB, (free0, free1)  # seen free when pause returned
    _expect(engine, "engine_holds")
    _send(trainer)
    assert _expect(trainer, "resume") == "oom True"
    _send(engine)
    _expect(engine, "engine_released")
    _send(trainer)
    assert _expect(trainer, "retry") == "True"
    for p in (engine, trainer):
        _out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-4000:]


@needs_torch
def test_process_exit_while_paused_is_clean() -> None:
    r = run_python(
        PRELUDE
        + textwrap.dedent(
            """
            stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED)
            with stepalloc.region("w", backup=True):
                x = torch.ones(4 * MIB, dtype=torch.uint8).cuda()
            stepalloc.pause()
            say("paused=1")
            """
        ),
        env=torch_env(),
    )
    assert r.returncode == 0 and "paused=1" in r.stdout, r.stderr[-4000:]
    assert "panic" not in r.stderr.lower(), r.stderr[-4000:]


@needs_torch
def test_the_colocated_loop_example_runs_and_fits() -> None:
    example = ROOT / "python_shim" / "examples" / "colocated_loop.py"
    r = run_python(
        f"import runpy, sys\nsys.argv = [{str(example)!r}, '--iterations', '3', '--unit-mb', '64']\n"
        f"runpy.run_path({str(example)!r}, run_name='__main__')",
        env=torch_env(capacity_mb=1024),
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "fits: yes" in r.stdout and "addresses kept: yes" in r.stdout, r.stdout
