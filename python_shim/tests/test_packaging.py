"""`pip install ./python_shim`: the wheel carries the prebuilt library and is tagged for the
platform. Built without build isolation, so it runs offline (needs setuptools >= 70.1)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import SHIM


def _setuptools_new_enough() -> bool:
    try:
        from setuptools.command.bdist_wheel import bdist_wheel  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _setuptools_new_enough(), reason="setuptools >= 70.1 is not installed: wheel not built")
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
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    assert {"stepalloc/lib/libstepalloc.so", "stepalloc/py.typed", "stepalloc/_lib.py"} <= names
