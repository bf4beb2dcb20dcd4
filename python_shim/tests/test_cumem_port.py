"""vLLM's ``tests/basic_correctness/test_cumem.py``, ported to run against
``stepalloc.cumem.CuMemAllocator`` (and against vLLM's own ``CuMemAllocator`` where vLLM is
installed), over testdrv's host-memory CUDA driver and stub runtime.

From: https://github.com/vllm-project/vllm, tests/basic_correctness/test_cumem.py (read at
commit 3eec60f9dbac42c63338028b32ff268e716a7624), Apache-2.0, copyright the vLLM contributors.

What changed:
- The import: ``from stepalloc.cumem import CuMemAllocator`` (or vLLM's, for the original
  column). ``current_platform.mem_get_info()`` is ``torch.cuda.mem_get_info()``, ``DEVICE`` is
  ``"cuda"``, ``GiB_bytes`` is not needed.
- vLLM's ``create_new_process_for_each_test("fork")`` is a child interpreter per test
  (``run_python``): the test bodies below run there, with testdrv's libraries.
- Kernels are replaced by copies (testdrv runs no kernels, it runs memsets and copies, and
  graphs that replay copies): tensors get their values from host tensors through ``.cuda()`` /
  ``copy_``, sums and comparisons are done on ``.cpu()`` copies; in the graph test
  ``x @ weight`` (weight = identity) is ``x.clone()``, ``out + 1`` is a copy of the weight's
  rows (so the replayed output checks the offloaded weight came back), ``x.random_()`` is a
  copy from a random host tensor.
- Each test runs in two modes: as vLLM uses it (no ``stepalloc.install()``; each pool is a
  ``torch.cuda.MemPool`` from stepalloc, the rest is PyTorch's allocator) and under
  ``stepalloc.install()`` (stepalloc is the process's allocator).
- Not ported, they need a real vLLM engine and model (``LLM(...)``, a GPU, weights from the
  Hub): ``test_end_to_end``, ``test_deep_sleep``, ``test_deep_sleep_async``,
  ``test_deep_sleep_fp8_kvcache``. What they check of the allocator (a graph captured before
  sleep replays after wake, ``wake_up(tags=[...])`` one tag at a time) is covered here.
- Added (behaviours vLLM's allocator promises that its file does not test): a failed
  ``wake_up`` can be retried once memory is free and loses nothing; a tag that is not
  offloaded keeps its addresses and is usable after wake; ``wake_up(tags)`` one tag at a time;
  ``get_current_usage``.
"""

from __future__ import annotations

import inspect
import os
import textwrap
from pathlib import Path

import pytest

from conftest import check_child, run_python

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HOSTCUDA = ROOT / "target" / "hostcuda"
RUNTIME = HOSTCUDA / "runtime"
STUB_RUNTIME = RUNTIME / "libcudart.so.13"
DEVICE = "cuda"
# Set in the child, by the one changed import.
CuMemAllocator = None  # type: ignore[assignment]


def _torch_ok() -> bool:
    from conftest import torch_available

    return STUB_RUNTIME.exists() and torch_available()


def _vllm_ok() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


IMPORTS = {
    "stepalloc": "from stepalloc.cumem import CuMemAllocator",
    "vllm": "from vllm.device_allocator.cumem import CuMemAllocator",
}


def _env() -> dict[str, str]:
    library_path = [str(RUNTIME), str(HOSTCUDA), str(HOSTCUDA / "standins"), os.environ.get("LD_LIBRARY_PATH", "")]
    return {
        "LD_PRELOAD": str(STUB_RUNTIME),
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in library_path if p),
        "HOSTCUDA_DEVICES": "1",
        "HOSTCUDA_CAPACITY_MB": "1024",
        "PYTORCH_CUDA_ALLOC_CONF": "",
        "STEPALLOC_CONF": "backend:cuda",
    }


def run_ported(body: object, impl: str, mode: str) -> dict[str, str]:
    """Runs test body ``body`` (a function of this module) in a fresh interpreter with
    ``CuMemAllocator`` from ``impl``; ``mode`` "installed" calls ``stepalloc.install()`` first."""
    if impl == "vllm" and not _vllm_ok():
        pytest.skip("vLLM is not installed here (it needs a CUDA build and a real driver for its cumem extension)")
    if impl == "vllm" and mode == "installed":
        pytest.skip("vLLM's allocator under stepalloc.install() is not a combination anyone runs")
    if not _torch_ok():
        pytest.skip("needs torch and testdrv's stubs (testdrv/build.sh)")
    name = body.__name__  # type: ignore[attr-defined]
    code = f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        import torch
        if {mode == "installed"!r}:
            import stepalloc
            stepalloc.install("backend:cuda")
        {IMPORTS[impl]}
        import test_cumem_port as port
        port.CuMemAllocator = CuMemAllocator
        port.{name}()
        print("done=1", flush=True)
        """
    out = check_child(run_python(textwrap.dedent(code), env=_env(), timeout=240))
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert values.get("done") == "1", out
    return values


def say(key: str, value: object) -> None:
    print(f"{key}={value}", flush=True)


# --- the test bodies (run in the child) -------------------------------------------------------


def body_python_error() -> None:
    """Test if Python error occurs when there's low-level
    error happening from the C++ side."""
    import torch

    allocator = CuMemAllocator.get_instance()
    total_bytes = torch.cuda.mem_get_info()[1]
    alloc_bytes = int(total_bytes * 0.7)
    tensors = []
    with allocator.use_memory_pool():
        # allocate 70% of the total memory
        x = torch.empty(alloc_bytes, dtype=torch.uint8, device=DEVICE)
        tensors.append(x)
    # release the memory
    allocator.sleep()

    # allocate more memory than the total memory
    y = torch.empty(alloc_bytes, dtype=torch.uint8, device=DEVICE)
    tensors.append(y)
    try:
        # when the allocator is woken up, it should raise an error
        # because we don't have enough memory
        allocator.wake_up()
    except RuntimeError:
        say("raised", 1)
    else:
        raise AssertionError("wake_up with the memory taken did not raise RuntimeError")


def body_basic_cumem() -> None:
    import torch

    # some tensors from default memory pool
    shape = (1024, 1024)
    x = torch.zeros(shape).to(DEVICE)

    # some tensors from custom memory pool
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool():
        # custom memory pool
        y = torch.ones(shape).to(DEVICE)  # y.zero_(); y += 1
        z = torch.full(shape, 2.0).to(DEVICE)  # z.zero_(); z += 2

    # they can be used together
    output = x.cpu() + y.cpu() + z.cpu()
    assert torch.allclose(output, torch.ones_like(output) * 3)
    free_bytes = torch.cuda.mem_get_info()[0]
    allocator.sleep()
    free_bytes_after_sleep = torch.cuda.mem_get_info()[0]
    assert free_bytes_after_sleep > free_bytes, (free_bytes, free_bytes_after_sleep)
    allocator.wake_up()

    # they can be used together
    output = x.cpu() + y.cpu() + z.cpu()
    assert torch.allclose(output, torch.ones_like(output) * 3)
    say("gained", free_bytes_after_sleep - free_bytes)


def body_cumem_with_cudagraph() -> None:
    import torch

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool():
        weight = torch.eye(1024).to(DEVICE)
    with allocator.use_memory_pool(tag="discard"):
        cache = torch.empty(1024, 1024, device=DEVICE)

    def model(x):
        out = x.clone()  # x @ weight, weight = identity
        cache[: out.size(0)].copy_(out)
        return weight[: out.size(0)].clone()  # stands for out + 1: reads the restored weight

    x = torch.empty(128, 1024, device="cuda")

    # warmup
    model(x)

    # capture cudagraph
    model_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(model_graph):
        y = model(x)

    free_bytes = torch.cuda.mem_get_info()[0]
    allocator.sleep()
    free_bytes_after_sleep = torch.cuda.mem_get_info()[0]
    assert free_bytes_after_sleep > free_bytes, (free_bytes, free_bytes_after_sleep)
    allocator.wake_up()

    # after waking up, the content in the weight tensor
    # should be restored, but the content in the cache tensor
    # should be discarded

    # this operation is also compatible with cudagraph

    x.copy_(torch.randn(128, 1024))  # x.random_()
    model_graph.replay()
    torch.cuda.synchronize()

    # cache content is as expected
    assert torch.allclose(x.cpu(), cache[: x.size(0)].cpu())

    # output content is as expected
    assert torch.allclose(y.cpu(), torch.eye(1024)[:128])


def body_wake_up_retried_after_memory_is_free_loses_nothing() -> None:
    import torch

    allocator = CuMemAllocator.get_instance()
    total_bytes = torch.cuda.mem_get_info()[1]
    alloc_bytes = int(total_bytes * 0.6)
    pattern = torch.randint(0, 256, (alloc_bytes,), dtype=torch.uint8)
    with allocator.use_memory_pool(tag="weights"):
        w = pattern.to(DEVICE)
    ptr = w.data_ptr()
    usage = allocator.get_current_usage()
    assert usage >= alloc_bytes, usage
    allocator.sleep(offload_tags="weights")
    assert allocator.get_current_usage() == usage
    hog = torch.empty(alloc_bytes, dtype=torch.uint8, device=DEVICE)
    try:
        allocator.wake_up()
    except RuntimeError as e:
        say("first_error", type(e).__name__)
    else:
        raise AssertionError("wake_up with the memory taken did not raise RuntimeError")
    del hog
    torch.cuda.empty_cache()
    allocator.wake_up()
    assert w.data_ptr() == ptr
    assert torch.equal(w.cpu(), pattern), "bytes lost across a failed and a retried wake_up"
    say("retried", 1)


def body_tag_not_offloaded_keeps_addresses_and_tags_wake_one_at_a_time() -> None:
    import torch

    allocator = CuMemAllocator.get_instance()
    n = 64 << 20
    with allocator.use_memory_pool(tag="weights"):
        w = torch.full((n,), 7, dtype=torch.uint8).to(DEVICE)
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = torch.empty(2 * n, dtype=torch.uint8, device=DEVICE)
    ptrs = (w.data_ptr(), kv.data_ptr())
    free0 = torch.cuda.mem_get_info()[0]
    allocator.sleep(offload_tags=("weights",))
    free1 = torch.cuda.mem_get_info()[0]
    assert free1 - free0 >= 3 * n, (free0, free1)
    allocator.wake_up(tags=["weights"])
    free2 = torch.cuda.mem_get_info()[0]
    assert free1 - free2 >= n and free2 - free0 >= 2 * n, (free0, free1, free2)  # the KV cache still asleep
    assert bool((w.cpu() == 7).all())
    allocator.wake_up(tags=["kv_cache"])
    assert (w.data_ptr(), kv.data_ptr()) == ptrs
    kv.copy_(torch.full((2 * n,), 3, dtype=torch.uint8))  # the discarded tag is usable again
    assert bool((kv.cpu() == 3).all()) and bool((w.cpu() == 7).all())
    say("kept", 1)


# --- the tests (run in the parent) ------------------------------------------------------------

IMPLS = ["vllm", "stepalloc"]
MODES = ["mempool", "installed"]
BODIES = [
    body_python_error,
    body_basic_cumem,
    body_cumem_with_cudagraph,
    body_wake_up_retried_after_memory_is_free_loses_nothing,
    body_tag_not_offloaded_keeps_addresses_and_tags_wake_one_at_a_time,
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("body", BODIES, ids=[b.__name__.removeprefix("body_") for b in BODIES])
def test_cumem(body: object, impl: str, mode: str) -> None:
    run_ported(body, impl, mode)


def test_every_body_is_run() -> None:
    """A body added to this file and forgotten in BODIES would never run."""
    names = {n for n, f in globals().items() if n.startswith("body_") and inspect.isfunction(f)}
    assert names == {b.__name__ for b in BODIES}
