"""The GPU bundle the tests of this folder read, built once per session: the one named by
$STEPALLOC_GPU_BUNDLE if set (scripts/test.sh builds it first), else a fresh one in a temporary
folder (scripts/gpu-bundle.sh)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="session")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("STEPALLOC_GPU_BUNDLE")
    if given:
        path = Path(given)
        assert (path / "MANIFEST.json").is_file(), f"STEPALLOC_GPU_BUNDLE={given} holds no MANIFEST.json"
        return path
    path = tmp_path_factory.mktemp("bundle") / "b"
    subprocess.run([str(ROOT / "scripts" / "gpu-bundle.sh"), str(path)], check=True, cwd=ROOT)
    return path
