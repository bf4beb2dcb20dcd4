"""torch_memory_saver's own test suite (``test/test_examples.py`` and ``test/examples/``, from
fzyzcjy/torch_memory_saver at 4a43c97, the tree of the 0.0.10 wheel), ported into ``tms_port/``
and run side by side under the original (the installed torch_memory_saver 0.0.10 wheel) and under
stepalloc's saver (``torch_memory_saver`` aliased to ``stepalloc.memory_saver``), over testdrv.

What changed from ``test_examples.py``: each example runs in a child Python started here
(``run_python``) rather than a ``multiprocessing`` spawn; the child prints a marker after the
example returned and leaves with ``os._exit(0)``, because the 0.0.10 wheel's torch hook mode
exits with status 1 at interpreter teardown (``tms_torch_free``, see test_memory_saver.py);
the preload hook mode of the original gets its library through ``LD_PRELOAD`` ahead of testdrv's
runtime, as ``configure_subprocess`` would set it; testdrv keeps no warm memory
(``HOSTCUDA_WARM_MB=0``), so memory released and created again does not hold its old bytes. The environment variables the original
harness sets per test (``TMS_INIT_ENABLE``, ...) are set here the same way. The examples with
CUDA graphs (``cuda_graph``, ``rl_example``) use graphs of copies, which testdrv replays. Also
run: what of ``test/test_configure_subprocess.py`` and ``test/test_utils.py`` tests the library's
behaviour (``tms_port/utils_and_configure.py``). Not ported (a GPU-only check, or process RSS):
``cuda_vmm_granularity``, ``cpu_backup.run_rss``, ``run_preload_backend_from_env``, XPU ones.
docs/testing.md has the table of results.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from test_sleep import needs_torch, torch_env

from conftest import SHIM, run_python

TESTS = SHIM / "tests"

INIT_ENABLE = {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}
BOTH = ("preload", "torch")

# (test id, module, function, hook modes, environment, devices)
CASES = [
    ("simple", "simple", "run", ("preload", "torch"), {}, 1),
    ("cpu_backup", "cpu_backup", "run", ("preload", "torch"), {}, 1),
    ("cpu_backup_multi_device_mmap_restore", "cpu_backup", "run_multi_device_mmap_restore", ("preload", "torch"), {}, 2),
    ("cpu_backup_backend_from_env", "cpu_backup", "run_backend_from_env", ("preload", "torch"), {"TMS_INIT_CPU_BACKUP_BACKEND": "mmap"}, 1),
    ("cpu_backup_retain_from_env", "cpu_backup", "run_retain_from_env", ("preload", "torch"), {"TMS_RETAIN_CPU_BACKUP": "1"}, 1),
    ("disk_backup", "disk_backup", "run", ("preload", "torch"), {}, 1),
    ("multi_device", "multi_device", "run", ("preload", "torch"), {}, 2),
    ("multi_device_torch_mode", "multi_device_torch_mode", "run", ("torch",), {}, 2),
    ("nested_region", "nested_region", "run", ("preload",), {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}, 1),
    ("cuda_graph", "cuda_graph", "run", ("preload", "torch"), {}, 1),
    ("rl_example", "rl_example", "run", ("preload", "torch"), {}, 1),
    ("training_engine", "training_engine", "run", ("preload",), INIT_ENABLE, 1),
    # test/test_configure_subprocess.py and test/test_utils.py (what of them is the library's behaviour)
    ("configure_subprocess", "utils_and_configure", "run_configure_subprocess", ("preload",), {}, 1),
    ("cpu_backup_backend_requires_enable", "utils_and_configure", "run_backend_requires_enable", BOTH, {}, 1),
]

# Fails under stepalloc, with why, and the assertion it must fail at (docs/testing.md lists
# them too): run every time, xfail only when it fails there, an error if it passes.
STEPALLOC_FAILS: dict[str, tuple[str, str]] = {}

PARAMS = [
    pytest.param(impl, case_id, module, fn, mode, env, devices, id=f"{impl}-{case_id}-{mode}")
    for impl in ("original", "stepalloc")
    for case_id, module, fn, modes, env, devices in CASES
    for mode in modes
]

RUNNER = """
import os, sys
sys.path.insert(0, {tests!r})
if {stepalloc!r}:
    from stepalloc.memory_saver import alias_torch_memory_saver
    alias_torch_memory_saver()
import torch_memory_saver
print("impl=" + torch_memory_saver.__name__, flush=True)
import importlib
mod = importlib.import_module("tms_port.{module}")
try:
    mod.{fn}(hook_mode={mode!r})
except BaseException:
    import traceback
    traceback.print_exc()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(1)
print("ok=port", flush=True)
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)  # the 0.0.10 wheel's torch mode fails at interpreter teardown
"""


def _original_available() -> bool:
    return importlib.util.find_spec("torch_memory_saver") is not None


def _preload_library() -> str:
    spec = importlib.util.find_spec("torch_memory_saver")
    assert spec is not None and spec.origin is not None
    site = os.path.dirname(os.path.dirname(spec.origin))
    # The build for PyTorch's CUDA 13 runtime (the wheel picks it the same way).
    path = os.path.join(site, "torch_memory_saver_hook_mode_preload_cu13.abi3.so")
    assert os.path.exists(path), f"no preload library of torch_memory_saver in {site}"
    return path


def run_case(impl: str, module: str, fn: str, mode: str, env: dict[str, str], devices: int):
    full_env = torch_env(capacity_mb=4096)
    full_env["HOSTCUDA_DEVICES"] = str(devices)
    # Released memory goes back to the host at once, so a page created again does not hold its
    # old bytes (testdrv's warm memory hands them back uncleared; the examples assert that a
    # tensor without backup lost its bytes, as on a GPU).
    full_env["HOSTCUDA_WARM_MB"] = "0"
    full_env.update(env)
    if impl == "original" and mode == "preload":
        full_env["LD_PRELOAD"] = _preload_library() + ":" + full_env["LD_PRELOAD"]
    code = RUNNER.format(tests=str(TESTS), stepalloc=impl == "stepalloc", module=module, fn=fn, mode=mode)
    return run_python(code, env=full_env, timeout=600)


@needs_torch
@pytest.mark.parametrize(("impl", "case_id", "module", "fn", "mode", "env", "devices"), PARAMS)
def test_torch_memory_saver_example(
    impl: str, case_id: str, module: str, fn: str, mode: str, env: dict[str, str], devices: int
) -> None:
    if impl == "original" and not _original_available():
        pytest.skip("torch_memory_saver not installed")
    r = run_case(impl, module, fn, mode, env, devices)
    expected = "torch_memory_saver" if impl == "original" else "stepalloc.memory_saver"
    assert f"impl={expected}\n" in r.stdout, r.stdout + r.stderr
    if impl == "stepalloc" and case_id in STEPALLOC_FAILS:
        why, at = STEPALLOC_FAILS[case_id]
        assert r.returncode != 0, f"{case_id} {mode} passes under stepalloc now: out of STEPALLOC_FAILS with it"
        where = f"{case_id} {mode} failed elsewhere than at `{at}`"
        assert at in r.stderr, f"{where}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        pytest.xfail(why)
    assert r.returncode == 0 and "ok=port" in r.stdout, f"{impl} {case_id} {mode}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
