"""PyTorch glue, in fresh processes (PyTorch allows one allocator swap per process).

Needs torch (a CUDA build; no GPU needed): without it these tests skip, saying so. What a
CPU-only machine cannot show: allocating real tensors through stepalloc, and PyTorch's own
refusal to swap an allocator after a real CUDA initialisation (``install()`` checks
``torch.cuda.is_initialized()`` first; that check is tested here by making it report True).
"""

from __future__ import annotations

import pytest

from conftest import check_child, run_python, torch_available

pytestmark = pytest.mark.skipif(
    not torch_available(), reason="torch is not installed: install()/mempool()/patch_torch() not tested"
)

SETTERS = [
    "set_init_fn",
    "set_reset_fn",
    "set_memory_fraction_fn",
    "set_base_alloc_fn",
    "set_record_stream_fn",
    "set_begin_allocate_to_pool",
    "set_end_allocate_to_pool_fn",
    "set_release_pool",
]


def test_install_wires_every_hook_in_a_fresh_process() -> None:
    out = check_child(
        run_python(
            f"""
            import os, pickle, tempfile
            import torch, stepalloc
            assert not torch.cuda.is_initialized()
            import socket, urllib.request
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            h = stepalloc.install(
                conf="backend:sim,sim_capacity_mb:512,trace_entries:64", metrics_port=port, patch_torch=True
            )
            assert h.metrics_address == f"127.0.0.1:{{port}}", h
            with urllib.request.urlopen(f"http://{{h.metrics_address}}/metrics", timeout=10) as r:
                assert b"stepalloc_reserved_bytes" in r.read()
            assert h.library_path == stepalloc.library_path(), h
            assert h.alloc_fn == "stepalloc_torch_malloc" and h.free_fn == "stepalloc_free"
            assert sorted(h.hooks) == sorted({SETTERS!r}), h.hooks
            assert h.torch_patched and h.mode == "process-wide" and stepalloc.is_installed()
            print("backend:", torch._C._cuda_getAllocatorBackend())

            # Idempotent; a different configuration cannot apply any more.
            assert stepalloc.install(conf="backend:sim,sim_capacity_mb:512,trace_entries:64") is h
            assert stepalloc.install() is h
            try:
                stepalloc.install(conf="backend:sim")
                raise SystemExit("a second configuration was accepted")
            except ValueError as e:
                assert "already installed" in str(e)

            # One library object: PyTorch's loader and ctypes share it (mapped once).
            maps = [l.split()[-1] for l in open("/proc/self/maps") if "libstepalloc" in l]
            assert set(maps) == {{h.library_path}}, maps

            # torch.cuda's statistics now answer from stepalloc (they raise under a pluggable
            # allocator otherwise), with the configuration install() set.
            assert torch.cuda.memory_stats is stepalloc.memory_stats
            p = stepalloc.raw_alloc(3 << 20)
            assert torch.cuda.memory_allocated(0) == 3 << 20
            assert torch.cuda.max_memory_allocated(0) >= 3 << 20
            assert torch.cuda.memory_stats(0)["allocation.all.current"] == 1
            assert "Allocated memory" in torch.cuda.memory_summary(0)
            assert torch.cuda.memory_stats(0, include_stepalloc=True)["stepalloc.device_total_bytes"] == 512 << 20
            path = os.path.join(tempfile.mkdtemp(), "s.pickle")
            torch.cuda.memory._dump_snapshot(path)
            snap = pickle.load(open(path, "rb"))
            assert any(b["state"] == "active_allocated" for s in snap["segments"] for b in s["blocks"])
            assert torch.cuda.memory_snapshot() == snap["segments"]
            stepalloc.raw_free(p, 3 << 20)
            torch.cuda.reset_peak_memory_stats(0)
            assert torch.cuda.max_memory_allocated(0) == 0

            # OOM through stepalloc's helpers is torch's OutOfMemoryError (and a MemoryError).
            try:
                stepalloc.raw_alloc(1 << 30)
                raise SystemExit("no OOM")
            except torch.cuda.OutOfMemoryError as e:
                assert isinstance(e, MemoryError) and "out of memory" in str(e).lower()
            stepalloc.unpatch_torch()
            assert torch.cuda.memory_stats is not stepalloc.memory_stats
            print("ok")
            """
        )
    )
    assert "ok" in out
    assert "backend: pluggable" in out, out


def test_install_after_cuda_initialisation_says_how_to_fix() -> None:
    out = check_child(
        run_python(
            """
            import torch, stepalloc
            torch.cuda.is_initialized = lambda: True  # what a real CUDA initialisation makes it say
            try:
                stepalloc.install(conf="backend:sim")
                raise SystemExit("install() accepted an initialised CUDA")
            except RuntimeError as e:
                print("message:", e)
            assert not stepalloc.is_installed()
            assert torch._C._cuda_getAllocatorBackend() == "native", "nothing was swapped"
            # Nothing was configured either: the configuration is still open.
            stepalloc.configure("backend:sim")
            print("ok")
            """
        )
    )
    assert "must run before CUDA is first used" in out
    assert "Fix: call stepalloc.install() right after `import torch`" in out
    assert "stepalloc.mempool()" in out and "ok" in out


def test_install_rejects_a_bad_configuration_before_touching_torch() -> None:
    out = check_child(
        run_python(
            """
            import torch, stepalloc
            try:
                stepalloc.install(conf="max_split_size_mb:abc")
            except ValueError as e:
                print("ValueError:", e)
            assert not stepalloc.is_installed()
            assert torch._C._cuda_getAllocatorBackend() == "native"
            """
        )
    )
    assert "ValueError:" in out and "max_split_size_mb" in out


def test_configure_after_install_is_refused_also_from_racing_threads() -> None:
    out = check_child(
        run_python(
            """
            import threading
            import torch, stepalloc
            conf = "backend:sim,sim_capacity_mb:512,max_split_size_mb:64"
            late = []

            def racer():
                # Keeps configuring until install() is done, then once more.
                while True:
                    done = stepalloc.is_installed()
                    try:
                        stepalloc.configure("backend:sim,sim_capacity_mb:256")
                        if done:
                            late.append("accepted after install")
                    except ValueError as e:
                        if not done and not stepalloc.is_installed():
                            late.append(f"refused before install: {e}")
                    if done:
                        return

            threads = [threading.Thread(target=racer) for _ in range(4)]
            for t in threads:
                t.start()
            h = stepalloc.install(conf=conf)
            for t in threads:
                t.join()
            assert not late, late
            try:
                stepalloc.configure("backend:sim")
                raise SystemExit("configure() after install() was accepted")
            except ValueError as e:
                print("refused:", e)
            assert h.conf == conf
            p = stepalloc.raw_alloc(1 << 20)
            stats = stepalloc.memory_stats(0, include_stepalloc=True)
            assert stats["stepalloc.device_total_bytes"] == 512 << 20, stats["stepalloc.device_total_bytes"]
            stepalloc.raw_free(p)
            print("ok")
            """
        )
    )
    assert "ok" in out and "refused:" in out and "install()" in out


def test_torch_calls_that_do_not_allocate_leave_install_open() -> None:
    out = check_child(
        run_python(
            """
            import torch, stepalloc
            stepalloc.patch_torch()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.reset_accumulated_memory_stats()
            stepalloc.empty_cache()
            with stepalloc.step("train"):
                pass
            h = stepalloc.install(conf="backend:sim,sim_capacity_mb:128")
            p = stepalloc.raw_alloc(1 << 20)
            assert stepalloc.memory_stats(0, include_stepalloc=True)["stepalloc.device_total_bytes"] == 128 << 20
            stepalloc.raw_free(p)
            # After install() a step may create the allocator: the configuration is fixed anyway.
            print("ok")
            """
        )
    )
    assert "ok" in out


def test_install_rejects_a_bad_environment_configuration() -> None:
    out = check_child(
        run_python(
            """
            import torch, stepalloc
            try:
                stepalloc.install()
                raise SystemExit("install() accepted a bad STEPALLOC_CONF")
            except ValueError as e:
                print("ValueError:", e)
            assert not stepalloc.is_installed()
            assert torch._C._cuda_getAllocatorBackend() == "native"
            try:
                stepalloc.mempool()
                raise SystemExit("mempool() accepted a bad STEPALLOC_CONF")
            except ValueError as e:
                print("mempool ValueError:", e)
            """,
            env={"STEPALLOC_CONF": "backend:sim,sim_capacity_mb:lots"},
        )
    )
    assert "ValueError:" in out and "STEPALLOC_CONF" in out and "sim_capacity_mb" in out
    assert "mempool ValueError: STEPALLOC_CONF=" in out


def test_install_fixes_a_good_environment_configuration() -> None:
    out = check_child(
        run_python(
            """
            import torch, stepalloc
            h = stepalloc.install()
            assert h.conf is None
            try:
                stepalloc.configure("backend:sim")  # install() fixed STEPALLOC_CONF's configuration
                raise SystemExit("configure() after install() was accepted")
            except ValueError:
                pass
            p = stepalloc.raw_alloc(1 << 20)
            print(stepalloc.memory_stats(0, include_stepalloc=True)["stepalloc.device_total_bytes"])
            stepalloc.raw_free(p)
            """,
            env={"STEPALLOC_CONF": "backend:sim,sim_capacity_mb:96"},
        )
    )
    assert out.split() == [str(96 << 20)]
