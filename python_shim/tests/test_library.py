"""Locating and loading libstepalloc.so, configuration errors, the lazy-import promise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import stepalloc
from conftest import MIB, check_child, run_python
from stepalloc import _lib


def test_library_path_is_absolute_and_loaded_once() -> None:
    path = stepalloc.library_path()
    assert os.path.isabs(path) and path.endswith("libstepalloc.so")
    assert _lib.lib() is _lib.lib()
    assert _lib.lib()._name == path  # the exact path PyTorch's loader will be given
    assert stepalloc.version()


def test_explicit_library_that_does_not_exist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STEPALLOC_LIBRARY", str(tmp_path / "nope.so"))
    with pytest.raises(stepalloc.LibraryNotFoundError, match="does not name a file"):
        stepalloc.find_library()


def test_explicit_library_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    real = stepalloc.library_path()
    monkeypatch.setenv("STEPALLOC_LIBRARY", real)
    assert stepalloc.find_library() == real


def test_missing_library_message_says_where_and_how(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("STEPALLOC_LIBRARY", raising=False)
    monkeypatch.setenv("CARGO_TARGET_DIR", str(tmp_path))
    with pytest.raises(stepalloc.LibraryNotFoundError) as e:
        stepalloc.find_library()
    text = str(e.value)
    assert str(tmp_path / "release" / "libstepalloc.so") in text
    assert "cargo build --release -p stepalloc-cabi" in text and "STEPALLOC_LIBRARY" in text


def test_unknown_key_raises_value_error_with_library_message() -> None:
    with pytest.raises(ValueError) as e:
        stepalloc.configure("backend:sim,no_such_key:1")
    assert "no_such_key" in str(e.value) and "unknown key" in str(e.value)
    assert str(e.value) == _lib.last_error()  # the library's own message, unchanged
    assert e.value.status == _lib.CONFIG


def test_bad_value_names_the_key_and_the_form() -> None:
    with pytest.raises(ValueError, match="max_split_size_mb") as e:
        stepalloc.configure("max_split_size_mb:lots")
    assert "lots" in str(e.value)


def test_configure_after_first_use_is_refused() -> None:
    # conftest created the allocator; a valid string is now refused, and the state is unchanged.
    with pytest.raises(ValueError, match="already initialised"):
        stepalloc.configure("backend:sim")
    assert stepalloc.device_count() == 2


def test_configure_wants_a_string() -> None:
    with pytest.raises(TypeError):
        stepalloc.configure(b"backend:sim")  # type: ignore[arg-type]


def test_config_help_lists_keys() -> None:
    text = stepalloc.config_help()
    for key in ("max_split_size_mb", "backend", "phase_trim", "trace_entries"):
        assert key in text


def test_import_loads_nothing_heavy() -> None:
    out = check_child(
        run_python(
            """
            import sys, stepalloc
            from stepalloc import _lib
            heavy = [m for m in ("torch", "transformers", "lightning", "pytorch_lightning", "prometheus_client")
                     if m in sys.modules]
            print("heavy:", heavy, "loaded:", _lib._lib is not None)
            """
        )
    )
    assert "heavy: [] loaded: False" in out


def test_raw_alloc_oom_is_memory_error() -> None:
    before = stepalloc.memory_stats(0)["num_ooms"]
    with pytest.raises(MemoryError) as e:
        stepalloc.raw_alloc(4096 * MIB, device=0)  # the simulated device has 1 GiB
    assert "out of memory" in str(e.value).lower()
    assert stepalloc.memory_stats(0)["num_ooms"] == before + 1


@pytest.mark.parametrize(
    "torch_init",
    [
        'raise ValueError("libcublasLt.so.12: cannot open shared object file")',
        'raise OSError("libc10_cuda.so: undefined symbol")',
        "",  # imports, but has no torch.cuda
    ],
)
def test_oom_with_a_torch_that_does_not_import_is_stepallocs_own(tmp_path: Path, torch_init: str) -> None:
    # An installed torch that failed to import turned an out-of-memory into that import's
    # error (ValueError), then into "ImportError: torch can only be initialized once".
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(torch_init + "\n")
    out = check_child(
        run_python(
            f"""
            import sys
            sys.path.insert(0, {str(tmp_path)!r})
            import stepalloc

            stepalloc.configure("backend:sim,sim_capacity_mb:64")
            for attempt in range(3):
                try:
                    stepalloc.raw_alloc(1 << 30)
                except MemoryError as e:
                    assert type(e).__name__ == "OutOfMemoryError" and type(e).__module__ == "stepalloc", type(e)
                    assert "out of memory" in str(e).lower(), e
                else:
                    raise AssertionError("1 GiB fit on a 64 MiB device")
            print("ok")
            """
        )
    )
    assert out.strip() == "ok"


def test_raw_free_of_unknown_pointer_raises() -> None:
    with pytest.raises(ValueError):
        stepalloc.raw_free(0xDEAD0000, 512, device=0)


def test_recommended_configuration_is_the_cores_and_works() -> None:
    # The same string as the core's `config::RECOMMENDED` (the source is the reference).
    core = (Path(__file__).resolve().parents[2] / "src" / "config.rs").read_text()
    assert f'pub const RECOMMENDED: &str = "{stepalloc.RECOMMENDED}";' in core
    out = check_child(
        run_python(
            f"""
            import stepalloc
            stepalloc.configure("backend:sim,sim_capacity_mb:64,{stepalloc.RECOMMENDED}")
            # Nine 6 MiB blocks, every other one freed, then 24 MiB: free pages move into place.
            blocks = [stepalloc.raw_alloc(6 << 20) for _ in range(9)]
            for p in blocks[::2]:
                stepalloc.raw_free(p)
            stepalloc.raw_alloc(24 << 20)
            stats = stepalloc.memory_stats(include_stepalloc=True)
            print(stats["stepalloc.moved_bytes"] > 0, stats["num_ooms"])
            """
        )
    )
    assert out.split() == ["True", "0"]


def test_out_of_range_integers_never_reach_ctypes() -> None:
    # ctypes would wrap these silently: 2**64 + 1000 bytes became a 1000-byte block, device
    # 2**32 became device 0.
    before = stepalloc.memory_stats(0)["allocation.all.current"]
    for size in (2**64 + 1000, 2**64):
        with pytest.raises(OverflowError, match="size"):
            stepalloc.raw_alloc(size)
    for device in (2**32, 2**31, -1):
        with pytest.raises((OverflowError, ValueError), match="device"):
            stepalloc.raw_alloc(10, device=device)
    with pytest.raises(OverflowError, match="stream"):
        stepalloc.raw_alloc(10, stream=2**64)
    with pytest.raises(ValueError, match="size"):
        stepalloc.raw_alloc(-1)
    with pytest.raises(TypeError, match="size"):
        stepalloc.raw_alloc(10.5)  # type: ignore[arg-type]
    assert stepalloc.memory_stats(0)["allocation.all.current"] == before
    for call in (stepalloc.memory_stats, stepalloc.reset_peak_memory_stats, stepalloc.memory_summary):
        with pytest.raises(OverflowError, match="device"):
            call(2**32)
    with pytest.raises(OverflowError, match="device"):
        stepalloc.memory_stats("cuda:4294967296")
    with pytest.raises(OverflowError, match="ptr"):
        stepalloc.raw_free(2**64 + 4096)
    with pytest.raises(OverflowError, match="size"):
        stepalloc.raw_free(4096, size=2**64 + 512)


def test_strings_with_nul_are_refused_not_truncated() -> None:
    with pytest.raises(ValueError, match="NUL") as e:
        stepalloc.configure("backend:sim\x00garbage")
    assert "configuration" in str(e.value)


def test_calls_that_do_not_allocate_leave_the_configuration_open() -> None:
    out = check_child(
        run_python(
            """
            import stepalloc
            from stepalloc import _lib
            stepalloc.reset_peak_memory_stats()
            stepalloc.reset_accumulated_memory_stats(1)
            with stepalloc.step("rollout"):
                pass
            stepalloc.step_begin("train")
            stepalloc.step_end()
            stepalloc.empty_cache()
            try:
                stepalloc.serve_metrics(1)
            except RuntimeError as e:
                print("serve_metrics:", e)
            assert stepalloc.memory_stats()["allocation.all.current"] == 0
            # Nothing was allocated: the configuration is still open.
            stepalloc.configure("backend:sim,sim_devices:3,sim_capacity_mb:64")
            assert stepalloc.device_count() == 3
            stepalloc.reset_peak_memory_stats(2)
            stepalloc.configure("backend:sim,sim_devices:2,sim_capacity_mb:64")
            assert stepalloc.device_count() == 2
            p = stepalloc.raw_alloc(1 << 20)
            try:
                stepalloc.reset_peak_memory_stats(2)
                raise SystemExit("device 2 of 2 accepted")
            except ValueError as e:
                print("device 2:", e)
            with stepalloc.step("rollout"):
                pass
            assert stepalloc.stepalloc_stats(0)["steps.rollout"] == 1
            stepalloc.raw_free(p)
            print("ok")
            """
        )
    )
    assert "ok" in out
    assert "serve_metrics: " in out and "install()" in out
    assert "device 2: " in out and "2 devices" in out


def test_bad_environment_configuration_names_its_source() -> None:
    out = check_child(
        run_python(
            """
            import stepalloc
            try:
                stepalloc.device_count()
            except ValueError as e:
                print("ValueError:", e)
            """,
            env={"STEPALLOC_CONF": "backend:sim,sim_capacity_mb:-5"},
        )
    )
    assert "ValueError:" in out and "sim_capacity_mb" in out and "STEPALLOC_CONF" in out
