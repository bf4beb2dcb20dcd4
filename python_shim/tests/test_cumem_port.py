"""vLLM's sleep-mode allocator tests, ported to run side by side under vLLM 0.34's own
``CuMemAllocator`` (from its wheel, in vLLM's environment: vllm_venv.py) and under
``stepalloc.cumem.CuMemAllocator``, over testdrv's host-memory CUDA driver and stub runtime.

From https://github.com/vllm-project/vllm (Apache-2.0, copyright the vLLM contributors):
- ``tests/basic_correctness/memory/cumem/test_cumem.py`` at 016993098b69fb9ce8ff941ef60aa2e9baeb11b6;
- ``tests/basic_correctness/test_cumem_sleep_sync.py`` at 324c9aa41703423cb71dfe96156fb270d27a48ba
  (sleep drains in-flight kernels before the first unmap, vLLM PR #43020);
- ``tests/basic_correctness/memory/sleep_mode/test_sleep_mode.py`` at
  0c6b103143d605f06ad5c1eca0f3ff90d8a3c561: every test there drives an engine (``LLM(...)``); what
  they ask of the allocator is ported as the allocator calls the engine makes (``sleep_mode_*``).

What changed:
- The import: the allocator is vLLM's or stepalloc's (``CuMemAllocator``, set in the child);
  ``get_mem_allocator_instance()`` is ``CuMemAllocator.get_instance()``;
  ``torch.accelerator.get_memory_info()`` is ``torch.cuda.mem_get_info()``; ``DEVICE_TYPE`` is
  ``"cuda"``. vLLM's ``create_new_process_for_each_test`` is a child interpreter per test.
- Kernels are replaced by copies (testdrv runs memsets, copies and graphs of copies, no
  kernels): values come from host tensors through ``.to("cuda")`` / ``copy_``, sums and
  comparisons are made on ``.cpu()`` copies; ``x @ weight`` (weight = identity) is a copy,
  ``out + 1`` and ``x * weight + const`` are copies of the operand the test checks, a graph's
  ``add_(1)`` copies ones in, ``x.random_()`` copies a random host tensor in.
- The tests are vLLM 0.34's API: vLLM's newer tests call ``CuMemBackend().suspend(level=L)``;
  in 0.34 that is ``suspend(discardable)`` with no discardable storage at level 1 and the
  weights' storage at level 2 (gpu_worker.py), so ``suspend(level)`` here passes that. The
  backend is vLLM's ``CuMemBackend`` under vLLM and ``stepalloc.vllm_backend.StepallocBackend``
  under stepalloc (where vLLM is not installed, the same two calls on the allocator).
- vLLM internals the tests read are read where both have them: ``pointer_to_data``
  (stepalloc.cumem answers it from the library). ``allocator_and_pools`` (vLLM's list of kept
  pools) becomes a count of the tag's allocations. The poisoned remap of
  ``test_level2_discards_ordinary_tensor_with_weights_tag`` patches vLLM's
  ``cumem.create_and_map`` under vLLM; under stepalloc the remap's fresh pages are checked not
  to hold the discarded bytes (testdrv hands out zeroed pages with ``HOSTCUDA_WARM_MB=0``).
- The drain test (test_cumem_sleep_sync.py) patches ``torch.cuda.synchronize`` to see the
  order; here a copy queued on a side stream stands for the in-flight kernel and testdrv counts
  the unmaps of memory it still used (``hostcuda_unmaps_under_work``).
- ``test_cudagraph_pool_sleep``'s routing checks of ``vllm.compilation.cudagraph_pool`` (a
  vLLM config, NCCL's graph allocator) are not ported; its capture into
  ``allocator.cudagraph_pool()`` and the sleep of the graph pool are.
- Each test runs under vLLM's allocator (MemPool mode, as vLLM uses it) and under stepalloc's
  in two modes: as vLLM uses it (no ``stepalloc.install()``) and under ``stepalloc.install()``.
- Without vLLM's environment the stepalloc columns run on the system's torch and the vLLM
  column skips, saying how to make it (CI always has it).

Needs an engine (a model, a GPU, weights from the Hub), not ported: test_cumem.py's
``test_release_kv_cache_memory_preserves_generation``, ``test_sleep_with_only_weights_asleep``
(an engine-level second sleep); every test of test_sleep_mode.py as written (``test_end_to_end``,
``test_deep_sleep``, ``test_deep_sleep_lora``, ``test_deep_sleep_lora_tp2``,
``test_deep_sleep_async``, ``test_deep_sleep_fp8_kvcache_mrv1``,
``test_deep_sleep_fp8_kvcache_mrv1_with_undefined_remap``).

Added (behaviours vLLM's allocator promises that its files do not test): a failed ``wake_up``
can be retried once memory is free and loses nothing; a tag that is not offloaded keeps its
addresses and is usable after wake.

docs/testing.md has the table of results; ``VLLM_FAILS`` and ``STEPALLOC_FAILS`` below list
each test that fails under one of them, with why.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import vllm_venv
from cumem_port import bodies

from conftest import SHIM, check_child, run_python

HERE = Path(__file__).resolve().parent


# --- the tests (run in the parent) ------------------------------------------------------------

BODIES = [f for n, f in vars(bodies).items() if n.startswith("body_") and inspect.isfunction(f)]
# Each body's testdrv settings beyond the defaults (vllm_venv.env).
BODY_ENV: dict[str, dict[str, str]] = {
    # Released pages go back to the host: a page mapped again holds no old bytes.
    "body_level2_discards_ordinary_tensor_with_weights_tag": {"HOSTCUDA_WARM_MB": "0"},
}
# Fails under vLLM 0.34's own allocator, with why, and text its failure shows: run every time,
# xfail only when it fails that way, an error if it passes (then it leaves this list).
VLLM_FAILS: dict[str, tuple[str, str]] = {
    "allocation_after_driver_error": (
        "vLLM 0.34's cumem_allocator extension keeps the first driver error in a global and fails "
        "every later allocation with it (the test came with the fix, after the 0.34 wheel)",
        "CUDA out of memory",
    ),
    "sleep_drains_kernels_before_unmap": (
        "vLLM 0.34's sleep unmaps without synchronizing the device first (test_cumem_sleep_sync.py, "
        "vLLM PR #43020, came after the 0.34 wheel)",
        "unmaps of memory an unfinished copy still used",
    ),
}
# Fails under stepalloc, likewise, per mode.
STEPALLOC_FAILS: dict[tuple[str, str], tuple[str, str]] = {}

IMPORTS = {
    "stepalloc": "from stepalloc.cumem import CuMemAllocator",
    "vllm": "from vllm.device_allocator.cumem import CuMemAllocator",
}
RUNNER = """
import sys
sys.path.insert(0, {here!r})
import torch
if {installed!r}:
    import stepalloc
    stepalloc.install("backend:cuda")
{import_line}
import cumem_port.bodies as port
port.CuMemAllocator, port.IMPL, port.MODE = CuMemAllocator, {impl!r}, {mode!r}
port.{name}()
print("done=1", flush=True)
"""


def run_body(name: str, impl: str, mode: str) -> subprocess.CompletedProcess:
    code = RUNNER.format(
        here=str(HERE), installed=mode == "installed", import_line=IMPORTS[impl], impl=impl, mode=mode, name=name
    )
    extra = BODY_ENV.get(name, {})
    if vllm_venv.ready():
        full = vllm_venv.env()
        full.update(extra)
        return subprocess.run(
            [str(vllm_venv.VENV_PYTHON), "-c", code], env=full, capture_output=True, text=True, timeout=300
        )
    # No vLLM environment: stepalloc on the system's torch (the vLLM column skipped before).
    env = vllm_venv.env()
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(vllm_venv.RUNTIME), str(vllm_venv.HOSTCUDA), str(vllm_venv.HOSTCUDA / "standins")]
    )
    env["PYTHONPATH"] = str(SHIM)
    env.update(extra)
    return run_python(textwrap.dedent(code), env=env, timeout=300)


PARAMS = [
    pytest.param(body.__name__, impl, mode, id=f"{impl}-{mode}-{body.__name__.removeprefix('body_')}")
    for body in BODIES
    for impl, mode in (("vllm", "mempool"), ("stepalloc", "mempool"), ("stepalloc", "installed"))
]


@pytest.mark.parametrize(("name", "impl", "mode"), PARAMS)
def test_cumem(name: str, impl: str, mode: str) -> None:
    if impl == "vllm":
        vllm_venv.require()
    elif not vllm_venv.STUB_RUNTIME.exists():
        pytest.skip("needs testdrv's stubs (testdrv/build.sh)")
    test = name.removeprefix("body_")
    result = run_body(name, impl, mode)
    fails = VLLM_FAILS.get(test) if impl == "vllm" else STEPALLOC_FAILS.get((test, mode))
    if fails is not None:
        why, at = fails
        assert result.returncode != 0, f"{test} passes under {impl} ({mode}) now: take it out of the failure list"
        assert at in result.stderr, f"{test} failed elsewhere than at `{at}`:\n{result.stdout}\n{result.stderr}"
        pytest.xfail(why)
    out = check_child(result)
    assert "done=1" in out, out


def test_every_body_is_run() -> None:
    """A body is found by its name: one misnamed would never run."""
    names = {n for n, f in vars(bodies).items() if inspect.isfunction(f) and n.startswith("body")}
    assert names == {b.__name__ for b in BODIES}
