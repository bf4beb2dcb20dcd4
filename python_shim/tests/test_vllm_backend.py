"""The ``stepalloc`` sleep-mode backend through vLLM 0.34's own plugin loader, factory and
allocator slot (from its wheel, in vLLM's environment: vllm_venv.py), over testdrv.

The package's entry point is what a ``pip install`` of it would declare: a
``stepalloc-*.dist-info`` with ``entry_points.txt`` written from python_shim/pyproject.toml onto
the child's import path, so ``vllm.plugins.load_general_plugins()`` finds it as it finds an
installed package's. vLLM's config module does not import here (it needs pydantic and
transformers, which this environment leaves out), so where the backend's allocator selection
reads the current config (``vllm.config.vllm.get_current_vllm_config_or_none``), a stand-in
module answers with the ``model_config.sleep_mode_backend`` a test chooses.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import vllm_venv

from conftest import SHIM

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the test machines run 3.11
    tomllib = None


def _dist_info(tmp_path: Path) -> Path:
    """A dist-info of the package with the entry points pyproject.toml declares."""
    if tomllib is None:
        pytest.skip("needs tomllib (Python >= 3.11) to read pyproject.toml")
    project = tomllib.loads((SHIM / "pyproject.toml").read_text())["project"]
    info = tmp_path / f"stepalloc-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: stepalloc\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return tmp_path


PRELUDE = """
import sys, types
import torch
MIB = 1 << 20
def say(*a):
    print(*a, flush=True)

def choose(backend):
    # vLLM's config module stands in (see the module docstring): the current config chooses.
    module = types.ModuleType("vllm.config.vllm")
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(sleep_mode_backend=backend))
    module.get_current_vllm_config_or_none = lambda: config
    sys.modules["vllm.config.vllm"] = module

from vllm.plugins import load_general_plugins
from vllm.device_allocator.sleep_mode_backend import SleepModeBackend, SleepModeBackendFactory
from vllm.device_allocator import get_mem_allocator_instance
"""


def run(code: str, tmp_path: Path) -> dict[str, str]:
    vllm_venv.require()
    out = vllm_venv.run(PRELUDE + textwrap.dedent(code), extra_path=[_dist_info(tmp_path)])
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_the_plugin_registers_the_backend_and_its_flags_are_what_is_tested(tmp_path: Path) -> None:
    out = run(
        """
        load_general_plugins()
        cls = SleepModeBackendFactory.get_backend_class("stepalloc")
        from stepalloc.vllm_backend import StepallocBackend
        assert cls is StepallocBackend and issubclass(cls, SleepModeBackend)
        backend = SleepModeBackendFactory.create_backend(types.SimpleNamespace(sleep_mode_backend="stepalloc"))
        assert isinstance(backend, StepallocBackend) and backend.state() == "RUNNING"
        flags = {f: getattr(cls, f)() for f in ("is_supported", "preserves_communicators",
                 "preserves_compiled_artifacts", "preserves_graphs_with_communicators", "supports_durable_storage")}
        say("flags=" + ",".join(f"{k}:{v}" for k, v in flags.items()))
        # vLLM may load its plugins more than once per process: harmless.
        import vllm.plugins
        vllm.plugins.plugins_loaded = False
        load_general_plugins()
        say("cumem=%s" % (SleepModeBackendFactory.get_backend_class("cumem").__name__))
        """,
        tmp_path,
    )
    assert out["flags"] == (
        "is_supported:True,preserves_communicators:True,preserves_compiled_artifacts:False,"
        "preserves_graphs_with_communicators:False,supports_durable_storage:False"
    ), out
    assert out["cumem"] == "CuMemBackend", out


def test_chosen_by_name_vllms_pools_allocate_through_stepalloc_and_the_backend_sleeps_them(tmp_path: Path) -> None:
    out = run(
        """
        load_general_plugins()
        choose("stepalloc")
        allocator = get_mem_allocator_instance()  # what vLLM's worker allocates its pools through
        pattern = torch.randint(0, 256, (32 * MIB,), dtype=torch.uint8)
        with allocator.use_memory_pool(tag="weights"):
            weights = pattern.to("cuda")
        with allocator.use_memory_pool(tag="runtime"):
            state = torch.arange(1 << 20).to("cuda")
        with allocator.use_memory_pool(tag="kv_cache"):
            kv = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        buffer = torch.full((4 * MIB,), 9, dtype=torch.uint8).to("cuda")  # outside the pools (NCCL's)
        import stepalloc.sleep
        tags = stepalloc.sleep.tags()
        assert {"weights", "runtime", "kv_cache"} <= set(tags), tags
        backend = SleepModeBackendFactory.create_backend(types.SimpleNamespace(sleep_mode_backend="stepalloc"))
        free0 = torch.cuda.mem_get_info()[0]
        backend.suspend()
        say("state=" + backend.state())
        say("freed_mib=%d" % ((torch.cuda.mem_get_info()[0] - free0) // MIB))
        say("buffer_kept=%d" % int(bool((buffer.cpu() == 9).all())))
        backend.resume(tags=["kv_cache"])  # runtime wakes too: it cannot be deferred
        say("runtime_back=%d" % int(torch.equal(state.cpu(), torch.arange(1 << 20))))
        say("weights_asleep=%d" % int(stepalloc.sleep.tags()["weights"]["paused"]))
        backend.resume(tags=["weights"])
        say("state=" + backend.state())
        say("weights_back=%d" % int(torch.equal(weights.cpu(), pattern)))
        backend.discard(("kv_cache",))
        say("after_discard=" + backend.state())
        say("kv_asleep=%d" % int(stepalloc.sleep.tags()["kv_cache"]["paused"]))
        backend.resume()
        kv.copy_(torch.full((64 * MIB,), 5, dtype=torch.uint8))
        say("kv_usable=%d" % int(bool((kv.cpu() == 5).all())))
        say("allocator=" + type(allocator._target()).__module__)
        """,
        tmp_path,
    )
    assert out["allocator"] == "stepalloc.cumem", out
    assert int(out["freed_mib"]) >= 32 + 4 + 64, out
    assert out["buffer_kept"] == "1", out  # communicators' memory untouched
    assert (out["runtime_back"], out["weights_asleep"], out["weights_back"]) == ("1", "1", "1"), out
    assert (out["after_discard"], out["kv_asleep"], out["kv_usable"]) == ("SUSPENDED", "1", "1"), out


def test_another_backend_chosen_vllms_own_allocator_serves_the_pools(tmp_path: Path) -> None:
    out = run(
        """
        load_general_plugins()
        choose("cumem")
        allocator = get_mem_allocator_instance()
        with allocator.use_memory_pool(tag="weights"):
            w = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
        import stepalloc.sleep
        say("allocator=" + type(allocator._target()).__module__)
        say("vllm_allocations=%d" % len(allocator.pointer_to_data))
        say("stepalloc_loaded=%d" % int("stepalloc.cumem" in sys.modules))
        # The stepalloc backend used anyway (chosen after the pools were made) refuses, naming why.
        from stepalloc.vllm_backend import StepallocBackend
        try:
            StepallocBackend().suspend()
        except RuntimeError as e:
            say("refused=" + str(e).split(":")[1].split("(")[0].strip())
        """,
        tmp_path,
    )
    assert out["allocator"] == "vllm.device_allocator.cumem", out
    assert out["vllm_allocations"] == "1", out
    assert out["stepalloc_loaded"] == "0", out
    assert out["refused"] == "vLLM's own CuMemAllocator holds the worker's pools", out
