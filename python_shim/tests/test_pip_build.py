"""`pip install ./python_shim` builds libstepalloc.so itself, in a fresh virtual environment,
from a copy of the workspace that holds no prebuilt library; `pip wheel ./python_shim` then
gives a platform wheel that installs and works in a second fresh environment with no cargo
or rustc on its PATH.

One cargo build serves both steps (the wheel reuses the copy's target/). It compiles the C
ABI crate and its dependencies from nothing, without debug info (CARGO_PROFILE_RELEASE_DEBUG=0)
to keep it short. pip fetches setuptools and setuptools-rust into its isolated build
environment, so the test skips when pip cannot reach its package index, and when cargo is
missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import SHIM

WORKSPACE = SHIM.parent
BUILD_TIMEOUT_S = 1800  # a release build from nothing on a busy 2-core machine
# What the package must do where it is installed: find its own copy of the library, load it,
# configure the simulated device, allocate and free.
CHECK = """
import stepalloc, sys
path = stepalloc.library_path()
assert path.startswith(sys.prefix), f"library {path} is not the installed copy under {sys.prefix}"
assert callable(stepalloc.install)
stepalloc.configure("backend:sim")
p = stepalloc.raw_alloc(1 << 20)
assert p != 0
assert stepalloc.memory_allocated() == 1 << 20, stepalloc.memory_allocated()
stepalloc.raw_free(p, 1 << 20)
assert stepalloc.memory_allocated() == 0
import importlib.util, pathlib, subprocess
spec = importlib.util.spec_from_file_location("_binary", pathlib.Path(stepalloc.__file__).parent / "fit" / "_binary.py")
binary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(binary)
tool = binary.stress_binary()
assert str(tool).startswith(sys.prefix), f"stepalloc-stress {tool} is not the installed copy under {sys.prefix}"
help = subprocess.run([str(tool), "fit", "--help"], capture_output=True, text=True, check=True).stdout
assert "--capacity-gb" in help, help
print("ok", stepalloc.version(), path)
"""


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that would point at a library or a build
    of this workspace, plus ``extra``."""
    drop = {"STEPALLOC_LIBRARY", "STEPALLOC_CONF", "CARGO_TARGET_DIR", "PYTHONPATH", "VIRTUAL_ENV"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> str:
    result = subprocess.run(args, env=env, cwd=cwd, check=False, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _index_reachable(tmp: Path) -> bool:
    """Whether pip can fetch the build requirements (the isolated build needs them)."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), "setuptools-rust"],
        env=_clean_env(),
        check=False,
        capture_output=True,
        timeout=120,
    )
    return result.returncode == 0


def _copy_workspace(dest: Path) -> None:
    """The workspace's sources without its build outputs (target/, python_shim/build/, ...)."""
    ignore = shutil.ignore_patterns("target", ".git", "build", "*.egg-info", "__pycache__", ".whl", "*.so")
    shutil.copytree(WORKSPACE, dest, ignore=ignore)


def _venv(path: Path, env: dict[str, str]) -> Path:
    _run([sys.executable, "-m", "venv", str(path)], env, path.parent, timeout=300)
    return path / "bin" / "python"


def _path_without_rust() -> str:
    """$PATH less every folder that holds cargo or rustc."""
    keep = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not any(os.path.exists(os.path.join(d, tool)) for tool in ("cargo", "rustc"))
    ]
    return os.pathsep.join(keep)


@pytest.mark.skipif(shutil.which("cargo") is None, reason="cargo is not installed: nothing can build the library")
def test_pip_install_builds_the_library_and_the_wheel_needs_no_rust(tmp_path: Path) -> None:
    if not _index_reachable(tmp_path / "probe"):
        pytest.skip("pip cannot reach its package index (offline): the isolated build needs setuptools-rust")
    src = tmp_path / "src"
    _copy_workspace(src)
    assert not (src / "target").exists()
    build_env = _clean_env(CARGO_PROFILE_RELEASE_DEBUG="0")

    # 1. One command on a machine with Rust: builds the crate and installs the package.
    python1 = _venv(tmp_path / "venv1", build_env)
    _run([str(python1), "-m", "pip", "install", str(src / "python_shim")], build_env, tmp_path, BUILD_TIMEOUT_S)
    out = _run([str(python1), "-c", CHECK], _clean_env(), tmp_path)
    assert out.startswith("ok "), out
    assert (src / "target" / "release" / "libstepalloc.so").is_file(), "cargo did not build into the copy's target/"

    # 2. The wheel: platform-tagged, holds the library (the build above is reused).
    wheels = tmp_path / "wheels"
    _run(
        [str(python1), "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(src / "python_shim")],
        build_env,
        tmp_path,
        BUILD_TIMEOUT_S,
    )
    (wheel,) = wheels.glob("stepalloc-*.whl")
    assert wheel.name.startswith("stepalloc-0.1.0-py3-none-linux_"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "stepalloc/lib/libstepalloc.so",
        "stepalloc/oom_error.cpp",
        "stepalloc/py.typed",
        "stepalloc/bin/stepalloc-stress",
        "stepalloc/fit/_binary.py",
        "stepalloc/lib/hostcuda/libcuda.so.1",
        "stepalloc/lib/hostcuda/runtime/libcudart.so.13",
    } <= names, names
    # vLLM finds the sleep-mode backend through this entry point (stepalloc/vllm_backend.py).
    (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[vllm.general_plugins]" in text and "stepalloc = stepalloc.vllm_backend:register" in text, text

    # 3. A machine without Rust: a second fresh environment, no cargo or rustc on PATH, no index.
    no_rust = _clean_env(PATH=_path_without_rust())
    assert shutil.which("cargo", path=no_rust["PATH"]) is None
    assert shutil.which("rustc", path=no_rust["PATH"]) is None
    python2 = _venv(tmp_path / "venv2", no_rust)
    _run([str(python2), "-m", "pip", "install", "--no-index", "--no-deps", str(wheel)], no_rust, tmp_path)
    out = _run([str(python2), "-c", CHECK], no_rust, tmp_path)
    assert out.startswith("ok "), out
    assert str(tmp_path / "venv2") in out, out
