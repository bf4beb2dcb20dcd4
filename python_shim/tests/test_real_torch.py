"""Real PyTorch's CUDA allocation paths, with stepalloc inside, on the host-memory driver.

Each test runs a child Python with testdrv's stub CUDA runtime preloaded (testdrv/README.md,
"Real PyTorch over it"): ``torch.empty(..., device="cuda")``, copies, streams, events, CUDA
graph capture and replay, and PyTorch's own caching allocator run on host memory, and
stepalloc's ``backend:cuda`` shares the same driver (one device memory budget, one capture
state). Kernels do not run, so the scenarios move data with copies only.

Skipped when the stubs are not built (``testdrv/build.sh``) or torch is not installed.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from conftest import check_child, run_python, torch_available

ROOT = Path(__file__).resolve().parents[2]
HOSTCUDA = ROOT / "target" / "hostcuda"
RUNTIME = HOSTCUDA / "runtime"
STUB_RUNTIME = RUNTIME / "libcudart.so.13"

pytestmark = pytest.mark.skipif(
    not STUB_RUNTIME.exists() or not torch_available(),
    reason="needs torch and testdrv's stubs (testdrv/build.sh)",
)

# 1 GiB devices; PyTorch and stepalloc see the same two.
CAPACITY_MB = 1024


def run_torch(code: str, delay_us: int = 0, extra_env: dict[str, str] | None = None) -> str:
    """Runs ``code`` with torch over the stub runtime; returns its stdout (fails on error)."""
    library_path = [str(RUNTIME), str(HOSTCUDA), str(HOSTCUDA / "standins"), os.environ.get("LD_LIBRARY_PATH", "")]
    env = {
        "LD_PRELOAD": str(STUB_RUNTIME),
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in library_path if p),
        "HOSTCUDA_DEVICES": "2",
        "HOSTCUDA_CAPACITY_MB": str(CAPACITY_MB),
        "HOSTCUDA_DELAY_US": str(delay_us),
        "PYTORCH_CUDA_ALLOC_CONF": "",
    }
    env.update(extra_env or {})
    prelude = "import torch, stepalloc\nMIB = 1 << 20\n"
    return check_child(run_python(prelude + textwrap.dedent(code), env=env, timeout=180))


# For a child's script: ``u8(n)``, a tensor of n bytes on the current device, and
# ``pool_of(ptr)``, the pool id of the segment that holds ``ptr`` (from torch's snapshot).
POOL_HELPERS = """
def u8(n):
    return torch.empty(n, dtype=torch.uint8, device="cuda")
def pool_of(ptr):
    for s in torch.cuda.memory_snapshot():
        if s["address"] <= ptr < s["address"] + s["total_size"]:
            return tuple(s["segment_pool_id"])
"""


def values(out: str) -> dict[str, str]:
    """The child's ``key=value`` lines."""
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_tensors_of_many_sizes_round_trip_through_stepalloc() -> None:
    out = run_torch(
        """
        stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED)
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2
        g = torch.Generator().manual_seed(7)
        sizes = [1, 511, 512, 513, 4097, MIB - 1, 3 * MIB + 5, 25 * MIB, 100 * MIB]
        live = []
        for n in sizes:
            host = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
            dev = torch.empty(n, dtype=torch.uint8, device="cuda")
            dev.copy_(host)
            live.append((host, dev))
        ptrs = [d.data_ptr() for _, d in live]
        assert len(set(ptrs)) == len(ptrs)
        for host, dev in live:
            assert torch.equal(dev.cpu(), host), dev.numel()
        stats = stepalloc.memory_stats(0)
        print("allocated", stats["allocated_bytes.all.current"], "requested", sum(sizes))
        assert stats["requested_bytes.all.current"] == sum(sizes)
        # Device-to-device copies on a side stream, then back.
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            copies = [d.clone() for _, d in live]
        side.synchronize()
        for (host, _), c in zip(live, copies):
            assert torch.equal(c.cpu(), host)
        del live, copies, dev, c, _
        print("after=" + str(stepalloc.memory_stats(0)["allocated_bytes.all.current"]))
        """
    )
    assert values(out)["after"] == "0"


def test_install_under_torchrun_puts_the_ranks_tensors_on_its_device() -> None:
    # Rank 1 of a node whose two GPUs every rank sees: LOCAL_RANK picks the device, without
    # the script calling torch.cuda.set_device.
    out = run_torch(
        """
        h = stepalloc.install("backend:cuda")
        assert h.device == 1, h
        x = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
        print("tensor_device=" + str(x.device))
        print("current=" + str(torch.cuda.current_device()))
        print("on_1=" + str(stepalloc.memory_stats(1)["allocated_bytes.all.current"]))
        print("on_0=" + str(stepalloc.memory_stats(0)["allocated_bytes.all.current"]))
        print("default=" + str(stepalloc.memory_allocated()))
        print(stepalloc.memory_summary().splitlines()[1])
        """,
        extra_env={"RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0"},
    )
    v = values(out)
    assert v["tensor_device"] == "cuda:1" and v["current"] == "1", out
    assert int(v["on_1"]) == int(v["default"]) >= 4 << 20 and v["on_0"] == "0", out
    assert "stepalloc memory summary, rank 1 (local rank 1, node 0), device ID 1" in out


def test_empty_cache_and_memory_fraction_reach_stepalloc() -> None:
    out = run_torch(
        """
        stepalloc.install("backend:cuda")
        x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        del x
        print("cached=" + str(stepalloc.memory_stats(0)["reserved_bytes.all.current"]))
        torch.cuda.empty_cache()
        print("emptied=" + str(stepalloc.memory_stats(0)["reserved_bytes.all.current"]))
        torch.cuda.set_per_process_memory_fraction(0.1)  # about 102 MiB of 1 GiB
        try:
            torch.empty(200 * MIB, dtype=torch.uint8, device="cuda")
            print("fraction=ignored")
        except torch.cuda.OutOfMemoryError as e:
            print("fraction=enforced")
            assert str(e).startswith("CUDA out of memory."), e
        y = torch.empty(50 * MIB, dtype=torch.uint8, device="cuda")
        print("small=ok")
        """
    )
    v = values(out)
    assert int(v["cached"]) >= 64 << 20
    assert v["emptied"] == "0"
    assert v["fraction"] == "enforced"
    assert v["small"] == "ok"


@pytest.mark.parametrize("conf", ["backend:cuda", "backend:cuda,expandable_segments:True,page_reuse:True"])
def test_record_stream_keeps_a_block_until_the_other_stream_is_done(conf: str) -> None:
    # Work queued on a stream completes 300 ms after it was queued.
    out = run_torch(
        f"""
        stepalloc.install({conf!r})
        side = torch.cuda.Stream()
        host = torch.ones(4 * MIB, dtype=torch.uint8).pin_memory()
        x = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
        old = x.data_ptr()
        with torch.cuda.stream(side):
            x.copy_(host, non_blocking=True)  # pending on `side` for 300 ms
        x.record_stream(side)
        del x
        y = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
        print("reused_while_pending=" + str(y.data_ptr() == old))
        del y
        side.synchronize()
        z = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
        print("reused_after=" + str(z.data_ptr() == old))
        """,
        delay_us=300_000,
    )
    v = values(out)
    assert v["reused_while_pending"] == "False"
    assert v["reused_after"] == "True"


def test_out_of_memory_is_torch_out_of_memory_error_and_the_process_goes_on() -> None:
    out = run_torch(
        """
        stepalloc.install("backend:cuda")
        keep = torch.empty(300 * MIB, dtype=torch.uint8, device="cuda")
        cached = torch.empty(600 * MIB, dtype=torch.uint8, device="cuda")
        del cached  # stays reserved in stepalloc's cache
        print("reserved_before=" + str(stepalloc.memory_stats(0)["reserved_bytes.all.current"]))
        # Needs the cached 600 MiB segment given back to the device first.
        big = torch.empty(700 * MIB, dtype=torch.uint8, device="cuda")
        print("released_to_serve=ok")
        del big
        try:
            torch.empty(2048 * MIB, dtype=torch.uint8, device="cuda")
            print("oom=none")
        except torch.cuda.OutOfMemoryError as e:
            print("oom=" + type(e).__name__)
            print("message_ok=" + str(str(e).startswith("CUDA out of memory.")))
        # Training-style allocation goes on afterwards.
        for step in range(20):
            acts = [torch.empty((step + 1) * MIB, dtype=torch.uint8, device="cuda") for _ in range(8)]
            acts[0].copy_(torch.full(((step + 1) * MIB,), step % 256, dtype=torch.uint8))
            assert int(acts[0].cpu()[-1]) == step % 256
            del acts
        print("after=ok")
        """
    )
    v = values(out)
    assert int(v["reserved_before"]) >= 900 << 20
    assert v["released_to_serve"] == "ok"
    assert v["oom"] == "OutOfMemoryError"
    assert v["message_ok"] == "True"
    assert v["after"] == "ok"


def test_mempool_mode_serves_pytorch_segments_and_gets_them_back() -> None:
    out = run_torch(
        """
        stepalloc.configure("backend:cuda")
        pool = stepalloc.mempool()
        with torch.cuda.use_mem_pool(pool):
            t = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
        t.copy_(torch.arange(8 * MIB, dtype=torch.int64).to(torch.uint8))
        assert torch.equal(t.cpu(), torch.arange(8 * MIB, dtype=torch.int64).to(torch.uint8))
        print("held=" + str(stepalloc.memory_stats(0)["allocated_bytes.all.current"]))
        del t, pool
        torch.cuda.empty_cache()
        print("after=" + str(stepalloc.memory_stats(0)["reserved_bytes.all.current"]))
        pool = stepalloc.mempool()
        with torch.cuda.use_mem_pool(pool):
            try:
                torch.empty(4096 * MIB, dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError:
                print("oom=typed")
        """
    )
    v = values(out)
    assert int(v["held"]) >= 8 << 20
    assert v["after"] == "0"
    assert v["oom"] == "typed"


def test_cuda_graph_capture_replay_and_reset_return_the_pool() -> None:
    out = run_torch(
        """
        stepalloc.install("backend:cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")
        g.replay()
        print("captured=" + str(stepalloc.memory_stats(0)["reserved_bytes.all.current"]))
        del static
        g.reset()
        torch.cuda.empty_cache()
        print("after_reset=" + str(stepalloc.memory_stats(0)["reserved_bytes.all.current"]))
        """
    )
    v = values(out)
    assert int(v["captured"]) >= 16 << 20
    assert v["after_reset"] == "0"


def test_capture_begin_with_pending_record_stream_events() -> None:
    # torch.cuda.graph() empties the cache first, which hides the case: call capture_begin()
    # right after freeing a record_stream'd tensor whose event is still pending.
    out = run_torch(
        """
        stepalloc.install("backend:cuda")
        side = torch.cuda.Stream()
        capture = torch.cuda.Stream()
        host = torch.ones(MIB, dtype=torch.uint8).pin_memory()
        x = torch.empty(MIB, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(side):
            x.copy_(host, non_blocking=True)
        x.record_stream(side)
        del x
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(capture):
            g.capture_begin()
            y = torch.empty(MIB, dtype=torch.uint8, device="cuda")
            g.capture_end()
        g.replay()
        torch.cuda.synchronize()
        print("capture=ok")
        """,
        delay_us=300_000,
    )
    assert values(out)["capture"] == "ok"


def test_many_threads_allocate_copy_and_free() -> None:
    out = run_torch(
        """
        import threading, random
        stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED)
        errors = []
        def work(seed):
            try:
                rng = random.Random(seed)
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    live = []
                    for i in range(150):
                        if live and rng.random() < 0.45:
                            host, dev = live.pop(rng.randrange(len(live)))
                            if not torch.equal(dev.cpu(), host):
                                errors.append(f"thread {seed}: data changed")
                        else:
                            n = rng.choice([256, 4096, 70000, MIB, 3 * MIB])
                            host = torch.full((n,), (seed * 31 + i) % 256, dtype=torch.uint8)
                            dev = torch.empty(n, dtype=torch.uint8, device="cuda")
                            dev.copy_(host)
                            live.append((host, dev))
                    del live
                stream.synchronize()
            except Exception as e:
                errors.append(f"thread {seed}: {e!r}")
        threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        assert not errors, errors
        print("allocated=" + str(stepalloc.memory_stats(0)["allocated_bytes.all.current"]))
        """
    )
    assert values(out)["allocated"] == "0"


def test_record_memory_history_and_dump_snapshot_under_stepalloc(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    out = run_torch(
        f"""
        import pickle
        stepalloc.install("backend:cuda", patch_torch=True)  # no trace ring configured
        torch.cuda.memory._record_memory_history(max_entries=100000)
        keep = [torch.empty(n * MIB, dtype=torch.uint8, device="cuda") for n in (1, 2, 3)]
        for step in range(4):
            scratch = [torch.empty((step + 1) * 700_000, dtype=torch.uint8, device="cuda") for _ in range(5)]
            del scratch
        print("allocated=" + str(torch.cuda.memory_allocated()))
        print("peak_reserved=" + str(torch.cuda.max_memory_reserved()))
        torch.cuda.memory._dump_snapshot({str(path)!r})
        with open({str(path)!r}, "rb") as f:
            snap = pickle.load(f)
        print("keys=" + ",".join(sorted(snap)))
        print("events=" + str(len(snap["device_traces"][0])))
        sizes = sorted(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
        print("blocks=" + ",".join(str(s) for s in sizes))
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.memory._dump_snapshot({str(path) + ".off"!r})
        with open({str(path) + ".off"!r}, "rb") as f:
            print("events_after_stop=" + str(len(pickle.load(f)["device_traces"][0])))
        """
    )
    v = values(out)
    assert int(v["allocated"]) >= 6 << 20
    assert {"segments", "device_traces"} <= set(v["keys"].split(","))
    assert int(v["events"]) >= 3 + 4 * 5 * 2
    assert v["blocks"] == f"{1 << 20},{2 << 20},{3 << 20}"
    assert v["events_after_stop"] == "0"
    # The dumped snapshot replays to the recorded peak.
    stress = ROOT / "target" / "debug" / "stepalloc-stress"
    if not stress.exists():
        pytest.skip("stepalloc-stress is not built (cargo build -p stepalloc-stress)")
    import subprocess

    # The recorded run's own configuration (backend:cuda's defaults: PyTorch's rules with the
    # size-class lookup), replayed on the simulated device.
    report = subprocess.run(
        [str(stress), "replay", str(path), "--json", "--compare", "recorded=exact_fit:False"],
        capture_output=True,
        text=True,
        check=True,
    )
    (run,) = json.loads(report.stdout)["runs"]
    assert run["peak_reserved"] == int(v["peak_reserved"]), run


# The same allocation script under PyTorch's own allocator (default, expandable segments) and
# under stepalloc: a fine-tuning-like loop whose activation sizes vary from step to step.
ALLOCATION_SCRIPT = """
import random
rng = random.Random(3)
weights = [torch.empty(24 * MIB, dtype=torch.uint8, device="cuda") for _ in range(8)]
for step in range(30):
    seq = rng.choice([1, 2, 3, 5, 8])
    acts = [torch.empty(seq * 1_300_000 + 4096 * i, dtype=torch.uint8, device="cuda") for i in range(12)]
    grads = [torch.empty(w.numel(), dtype=torch.uint8, device="cuda") for w in weights[:4]]
    del acts
    scratch = torch.empty(seq * 2_700_000, dtype=torch.uint8, device="cuda")
    del grads, scratch
"""


def peak_reserved(setup: str, read: str, alloc_conf: str = "") -> int:
    out = run_torch(
        setup + ALLOCATION_SCRIPT + "print('peak=' + str(" + read + "))",
        extra_env={"PYTORCH_CUDA_ALLOC_CONF": alloc_conf},
    )
    return int(values(out)["peak"])


def test_stepalloc_reserves_no_more_than_pytorchs_own_allocator_on_the_same_script() -> None:
    native = "torch.cuda.max_memory_reserved()"
    default = peak_reserved("", native)
    expandable = peak_reserved("", native, "expandable_segments:True")
    ours = peak_reserved(
        'stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED)\n',
        'stepalloc.memory_stats(0)["reserved_bytes.all.peak"]',
    )
    print(f"peak reserved: PyTorch default {default}, expandable {expandable}, stepalloc {ours}")
    # The live peak is 8 x 24 MiB + 4 x 24 MiB + the largest activations: ~ 330 MiB.
    assert default > 300 << 20
    assert ours <= default
    assert ours <= expandable


# Small blocks of distinct sizes in one 2 MiB segment and large ones in one 20 MiB segment,
# freed and reallocated so that free pieces are split, shrunk, grown and merged (no two free
# blocks of one size, whose order PyTorch and stepalloc's `exact_fit` may break differently).
STATISTICS_SCRIPT = """
import json
KIB = 1 << 10
live = {}
sizes = [3 * KIB, 700, 40 * KIB, 5 * KIB, 130 * KIB, 9 * KIB, 2 * MIB + 3, 3 * MIB + 5, 1536 * KIB, 4 * MIB + 7]
for i, size in enumerate(sizes):
    live[i] = torch.empty(size, dtype=torch.uint8, device="cuda")
for i in (1, 3, 7, 8):
    del live[i]
for i, size in zip(range(10, 16), [600, 4 * KIB, 2 * MIB + 100, 1200 * KIB, 200, 2 * MIB]):
    live[i] = torch.empty(size, dtype=torch.uint8, device="cuda")
for i in (0, 2, 10, 6, 12):
    del live[i]
keys = ("allocation", "allocated_bytes", "active", "active_bytes", "inactive_split",
        "inactive_split_bytes", "segment", "reserved_bytes", "requested_bytes")
stats = READ
print("stats=" + json.dumps({k: v for k, v in stats.items() if k.split(".")[0] in keys}))
"""


def test_statistics_equal_pytorchs_own_allocator_on_the_same_sequence() -> None:
    """Every pool statistic (current, peak and the lifetime allocated / freed totals, per pool)
    equals what PyTorch's own allocator reports after the same allocations and frees. The
    inactive-split figures change once per operation by its net effect, as PyTorch's do."""

    def stats(setup: str, read: str) -> dict[str, int]:
        out = run_torch(setup + STATISTICS_SCRIPT.replace("READ", read))
        return json.loads(values(out)["stats"])

    native = stats("", "torch.cuda.memory_stats()")
    ours = stats('stepalloc.install("backend:cuda,exact_fit:True")\n', "stepalloc.memory_stats(0)")
    assert len(native) == 9 * 3 * 4, sorted(native)
    assert native["inactive_split.all.allocated"] > 0 and native["inactive_split.all.freed"] > 0
    differing = {k: (native[k], ours.get(k)) for k in native if native[k] != ours.get(k)}
    assert not differing, f"(PyTorch, stepalloc): {differing}"


def test_drift_check_names_what_the_installed_torch_needs_and_a_stub_lacks(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    drift = ROOT / "testdrv" / "torch_drift.py"
    ok = subprocess.run([sys.executable, str(drift), str(HOSTCUDA)], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    # A runtime without cudaStreamGetPriority (as when a new torch starts importing a function).
    (tmp_path / "runtime").mkdir()
    shutil.copy(HOSTCUDA / "libcuda.so.1", tmp_path / "libcuda.so.1")
    shutil.copy(RUNTIME / "libnvidia-ml.so.1", tmp_path / "runtime" / "libnvidia-ml.so.1")
    source = (ROOT / "testdrv" / "hostcudart.c").read_text()
    source = source.replace("cudaError_t cudaStreamGetPriority(", "static cudaError_t cudaStreamGetPriority(")
    (tmp_path / "hostcudart.c").write_text(source)
    subprocess.run(
        [
            "cc",
            "-shared",
            "-fPIC",
            "-w",
            f"-Wl,--version-script={ROOT / 'testdrv' / 'cudart.map'}",
            "-o",
            str(tmp_path / "runtime" / "libcudart.so.13"),
            str(tmp_path / "hostcudart.c"),
            f"-L{tmp_path}",
            "-l:libcuda.so.1",
            "-ldl",
        ],
        check=True,
    )
    bad = subprocess.run([sys.executable, str(drift), str(tmp_path)], capture_output=True, text=True, check=False)
    assert bad.returncode == 1
    assert "runtime: cudaStreamGetPriority" in bad.stderr


def test_without_a_compiler_out_of_memory_is_still_a_runtime_error_with_the_same_text(tmp_path: Path) -> None:
    out = run_torch(
        """
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stepalloc.install("backend:cuda")
        print("warned=" + str(any("RuntimeError, not torch.OutOfMemoryError" in str(w.message) for w in caught)))
        try:
            torch.empty(4096 * MIB, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            print("type=OutOfMemoryError")
        except RuntimeError as e:
            print("type=RuntimeError")
            print("text_ok=" + str(str(e).startswith("CUDA out of memory.")))
        """,
        extra_env={"CXX": "no-such-compiler", "STEPALLOC_CACHE_DIR": str(tmp_path)},
    )
    v = values(out)
    assert v["warned"] == "True"
    assert v["type"] == "RuntimeError"
    assert v["text_ok"] == "True"
