"""On a CUDA GPU only: real tensors through stepalloc, in fresh processes.

These skip on machines without a GPU (CI); run them on a GPU machine with
``python -m pytest python_shim/tests/test_gpu.py -q``. They also answer a question the design
leaves open: whether PyTorch's pluggable allocator stays usable after stepalloc's entry point
threw an out-of-memory exception.
"""

from __future__ import annotations

import pytest

from conftest import check_child, run_python, torch_available


def _gpu() -> bool:
    if not torch_available():
        return False
    import torch

    return bool(torch.cuda.is_available())


pytestmark = pytest.mark.skipif(not _gpu(), reason="no CUDA GPU: real-tensor tests not run")


def test_process_wide_mode_with_real_tensors() -> None:
    out = check_child(
        run_python(
            """
            import torch, stepalloc
            stepalloc.install("backend:cuda,trace_entries:10000", patch_torch=True)
            x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
            assert stepalloc.memory_allocated(0) >= 3 << 20
            assert torch.cuda.memory_allocated() == stepalloc.memory_allocated(0)
            with stepalloc.step("rollout"):
                ys = [torch.randn(1024, 1024, device="cuda") for _ in range(8)]
                total = sum(float(y.sum()) for y in ys)
                del ys
            assert stepalloc.stepalloc_stats(0)["steps.rollout"] == 1

            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                z = torch.ones(1 << 20, device="cuda")
            z.record_stream(torch.cuda.current_stream())  # the record_stream hook
            del z
            torch.cuda.synchronize()
            before = stepalloc.memory_reserved(0)
            torch.cuda.empty_cache()  # the reset hook
            assert stepalloc.memory_reserved(0) <= before

            total_memory = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(0.5)  # the memory-fraction hook
            try:
                torch.empty(int(total_memory * 0.8), dtype=torch.uint8, device="cuda")
                raise SystemExit("no out-of-memory error past the memory fraction")
            except RuntimeError as e:
                assert str(e).startswith("CUDA out of memory."), str(e)[:200]
            # The allocator is still usable after the exception crossed PyTorch.
            assert float(torch.ones(10, device="cuda").sum()) == 10.0
            assert stepalloc.memory_stats(0)["num_ooms"] >= 1

            g = torch.cuda.CUDAGraph()  # the graph-pool hooks
            static = torch.zeros(1024, device="cuda")
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                out = static * 2 + 1
            g.replay()
            torch.cuda.synchronize()
            assert float(out.sum()) == 1024.0
            del g, out
            snap = stepalloc.memory_snapshot()
            assert snap["segments"] and snap["device_traces"][0]
            print("ok")
            """,
            timeout=300,
        )
    )
    assert "ok" in out


def test_mempool_mode_serves_segments() -> None:
    out = check_child(
        run_python(
            """
            import torch, stepalloc
            stepalloc.configure("backend:cuda")
            torch.cuda.init()  # MemPool mode works after CUDA is initialised
            pool = stepalloc.mempool()
            with torch.cuda.use_mem_pool(pool):
                x = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
            assert stepalloc.memory_reserved(0) >= 5 << 20, stepalloc.memory_stats(0)
            assert float(x.fill_(1).sum()) == 5 << 20
            print("ok")
            """,
            timeout=300,
        )
    )
    assert "ok" in out
