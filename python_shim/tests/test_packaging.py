"""`pip wheel ./python_shim` in this workspace: the wheel carries the library and is tagged for
the platform. Built without build isolation, so it runs offline; it needs setuptools >= 70.1
and setuptools-rust installed here, and cargo (which finds the workspace's release build up to
date after `cargo build --release -p stepalloc-cabi`). test_pip_build.py builds from nothing,
in fresh environments."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import stepalloc
from conftest import SHIM

# What python_shim/setup.py bundles in stepalloc/lib/hostcuda/.
HOSTCUDA_FILES = ("libcuda.so.1", "runtime/libcudart.so.13", "runtime/libnvidia-ml.so.1")


def _build_tools_missing() -> str | None:
    """Why the wheel cannot be built without build isolation here, or None."""
    try:
        from setuptools.command.bdist_wheel import bdist_wheel  # noqa: F401
    except ImportError:
        return "setuptools >= 70.1 is not installed"
    if importlib.util.find_spec("setuptools_rust") is None:
        return "setuptools-rust is not installed"
    if shutil.which("cargo") is None:
        return "cargo is not installed"
    return None


@pytest.mark.skipif(_build_tools_missing() is not None, reason=f"{_build_tools_missing()}: wheel not built")
def test_wheel_bundles_the_library(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(SHIM)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    wheels = list(tmp_path.glob("stepalloc-*.whl"))
    assert len(wheels) == 1, wheels
    assert wheels[0].name.startswith("stepalloc-0.1.0-py3-none-linux_"), wheels[0].name
    wheel = zipfile.ZipFile(wheels[0])
    names = set(wheel.namelist())
    expected = {
        "stepalloc/lib/libstepalloc.so",
        "stepalloc/py.typed",
        "stepalloc/_lib.py",
        "stepalloc/oom_error.cpp",
        "stepalloc/bin/stepalloc-stress",
        "stepalloc/fit/_binary.py",
    }
    # stepalloc.fit and the model configurations it ships.
    expected |= {"stepalloc/fit/__main__.py", "stepalloc/fit/configs/llava-1.5-7b.json", "stepalloc/fit/configs/qwen2-vl-7b.json"}
    assert expected <= names, names
    # The replay tool: executable once installed, stripped (its debug information is ~40 MB).
    tool = wheel.getinfo("stepalloc/bin/stepalloc-stress")
    assert (tool.external_attr >> 16) & 0o111, oct(tool.external_attr >> 16)
    assert tool.file_size < 12 << 20, tool.file_size
    assert wheel.read("stepalloc/bin/stepalloc-stress")[:4] == b"\x7fELF"
    # The host-memory CUDA stand-in stepalloc.fit records over without a GPU: testdrv's driver
    # and stub runtime, stripped (about 130 KB; with their debug information, 380 KB).
    stand_in = [wheel.getinfo(f"stepalloc/lib/hostcuda/{f}") for f in HOSTCUDA_FILES]
    assert all((i.external_attr >> 16) & 0o111 for i in stand_in)
    assert sum(i.file_size for i in stand_in) < 256 << 10, [i.file_size for i in stand_in]
    assert not any(n.startswith("stepalloc/lib/hostcuda/") and n[len("stepalloc/lib/hostcuda/") :] not in HOSTCUDA_FILES
                   for n in names), names  # fmt: skip
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return
    # Installed: python -m stepalloc.fit finds the stand-in in the installed package (no
    # repository, no STEPALLOC_HOSTCUDA_DIR, no stub on LD_LIBRARY_PATH or preloaded: torch finds
    # no device), re-runs itself over it and records; the installed stepalloc-stress replays.
    # The environment sees the system's torch and transformers; here torch has no nvidia wheels,
    # so testdrv's stand-ins for them stay on LD_LIBRARY_PATH (scripts/test.sh sets it).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheels[0])],
                   check=True, timeout=300)  # fmt: skip
    drop = {"PYTHONPATH", "STEPALLOC_HOSTCUDA_DIR", "STEPALLOC_STRESS", "LD_PRELOAD", "STEPALLOC_FIT_CHILD"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    paths = env.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    keep = [p for p in paths if p and not p.rstrip("/").endswith(("hostcuda", "runtime"))]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(keep)
    where = "from stepalloc.fit import _host; print(_host.hostcuda_dir())"
    found = subprocess.run([str(python), "-c", where], env=env, cwd=tmp_path, capture_output=True, text=True,
                           check=True).stdout.strip()  # fmt: skip
    assert found == str(venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
                        / "stepalloc" / "lib" / "hostcuda"), found  # fmt: skip
    fit = subprocess.run(
        [str(python), "-m", "stepalloc.fit", "--model", "llava-1.5-7b", "--tiny", "--batch", "1", "--iterations", "1",
         "--tokens", "8-16", "--images", "1", "--device", "24", "--json"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    report = json.loads(fit.stdout)
    assert report["recordings"]["sm90"]["allocations"] > 100, report["recordings"]
    assert [c["name"] for c in report["devices"][0]["fit"]["configs"]] == [
        "pytorch", "pytorch_expandable", "split128", "stepalloc"
    ]  # fmt: skip


def _wheel_without_cargo(out: Path, **env: str) -> subprocess.CompletedProcess:
    """`pip wheel` with no cargo or rustc on PATH and no workspace build visible, plus ``env``."""
    path = os.pathsep.join(
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not any(os.path.exists(os.path.join(d, tool)) for tool in ("cargo", "rustc"))
    )
    full_env = {k: v for k, v in os.environ.items() if k not in ("STEPALLOC_LIBRARY", "CARGO")}
    full_env.update({"PATH": path, "CARGO_TARGET_DIR": str(out / "no-target"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(SHIM)],
        env=full_env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(
    _build_tools_missing() not in (None, "cargo is not installed"), reason=f"{_build_tools_missing()}: wheel not built"
)
def test_without_cargo_the_build_fails_saying_how_unless_given_a_library(tmp_path: Path) -> None:
    # No cargo and no prebuilt library: the build fails (it used to install a package without
    # its library) and says what to do.
    failed = _wheel_without_cargo(tmp_path)
    assert failed.returncode != 0, failed.stdout + failed.stderr
    text = failed.stdout + failed.stderr
    assert "cannot build libstepalloc.so: cargo ('cargo') is not on PATH" in text, text
    assert "STEPALLOC_LIBRARY=/path/to/libstepalloc.so" in text, text
    assert not list(tmp_path.glob("*.whl"))

    # STEPALLOC_LIBRARY at build time: that file is bundled as it is, no cargo needed.
    given = stepalloc.library_path()
    built = _wheel_without_cargo(tmp_path, STEPALLOC_LIBRARY=given)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("stepalloc-*.whl")
    assert wheel.name.startswith("stepalloc-0.1.0-py3-none-linux_"), wheel.name
    assert zipfile.ZipFile(wheel).read("stepalloc/lib/libstepalloc.so") == Path(given).read_bytes()

    # A prebuilt library in the target folder: bundled as it is, no cargo needed.
    target = tmp_path / "target"
    (target / "release").mkdir(parents=True)
    shutil.copy2(given, target / "release" / "libstepalloc.so")
    wheel.unlink()
    reused = _wheel_without_cargo(tmp_path, CARGO_TARGET_DIR=str(target))
    assert reused.returncode == 0, reused.stdout + reused.stderr
    (wheel,) = tmp_path.glob("stepalloc-*.whl")
    assert zipfile.ZipFile(wheel).read("stepalloc/lib/libstepalloc.so") == Path(given).read_bytes()

    # The replay tool likewise: no cargo and no prebuilt one, the wheel goes without it (setup.py
    # notes it; pip shows the note with -v), and no copy left by an earlier build sneaks in; a
    # prebuilt one in the target folder is bundled.
    assert "stepalloc/bin/stepalloc-stress" not in zipfile.ZipFile(wheel).namelist()
    (target / "release" / "stepalloc-stress").write_bytes(b"\x7fELF stand-in")
    wheel.unlink()
    with_tool = _wheel_without_cargo(tmp_path, CARGO_TARGET_DIR=str(target))
    assert with_tool.returncode == 0, with_tool.stdout + with_tool.stderr
    (wheel,) = tmp_path.glob("stepalloc-*.whl")
    assert zipfile.ZipFile(wheel).read("stepalloc/bin/stepalloc-stress") == b"\x7fELF stand-in"

    # A STEPALLOC_LIBRARY that names no file fails, naming it.
    bad = _wheel_without_cargo(tmp_path, STEPALLOC_LIBRARY=str(tmp_path / "missing.so"))
    assert bad.returncode != 0
    assert f"STEPALLOC_LIBRARY='{tmp_path / 'missing.so'}' (build environment) does not name a file" in (
        bad.stdout + bad.stderr
    )
