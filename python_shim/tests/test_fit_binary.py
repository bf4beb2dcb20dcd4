"""``stepalloc/fit/_binary.py``: which ``stepalloc-stress`` the fit front end runs —
``$STEPALLOC_STRESS``, else the packaged ``stepalloc/bin/stepalloc-stress``, else the
repository's ``target/release/stepalloc-stress`` — and a clear error naming what to do when
none is found. The module is imported by its path (the ``stepalloc.fit`` package is the
recorder's), from the checkout or from a copy laid out as an installed package."""

from __future__ import annotations

import importlib.util
import shutil
import stat
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from conftest import SHIM

SOURCE = SHIM / "stepalloc" / "fit" / "_binary.py"


def load(path: Path = SOURCE) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_binary_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def executable(path: Path, text: str = "#!/bin/sh\necho stress\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def installed(tmp: Path, with_binary: bool) -> ModuleType:
    """The module in a copy laid out as site-packages/stepalloc/{fit,bin}."""
    package = tmp / "site-packages" / "stepalloc"
    (package / "fit").mkdir(parents=True)
    shutil.copy(SOURCE, package / "fit" / "_binary.py")
    if with_binary:
        executable(package / "bin" / "stepalloc-stress")
    return load(package / "fit" / "_binary.py")


def test_the_environment_variable_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = executable(tmp_path / "my-stress")
    monkeypatch.setenv("STEPALLOC_STRESS", str(mine))
    module = installed(tmp_path, with_binary=True)
    assert module.stress_binary() == mine.resolve()


def test_a_wrong_override_is_an_error_not_a_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = installed(tmp_path, with_binary=True)
    monkeypatch.setenv("STEPALLOC_STRESS", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"STEPALLOC_STRESS='.*missing' does not exist: point it at"):
        module.stress_binary()
    plain = tmp_path / "plain"
    plain.write_text("not executable")
    monkeypatch.setenv("STEPALLOC_STRESS", str(plain))
    with pytest.raises(module.StressBinaryNotFound, match="is not executable"):
        module.stress_binary()


def test_the_packaged_copy_then_the_repository_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPALLOC_STRESS", raising=False)
    module = installed(tmp_path, with_binary=True)
    assert module.stress_binary() == tmp_path / "site-packages" / "stepalloc" / "bin" / "stepalloc-stress"
    # A checkout's release build, found through CARGO_TARGET_DIR like the library's.
    target = tmp_path / "target"
    built = executable(target / "release" / "stepalloc-stress")
    monkeypatch.setenv("CARGO_TARGET_DIR", str(target))
    assert load().stress_binary() == built


def test_none_found_says_where_it_looked_and_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPALLOC_STRESS", raising=False)
    monkeypatch.setenv("CARGO_TARGET_DIR", str(tmp_path / "empty-target"))
    module = installed(tmp_path, with_binary=False)
    with pytest.raises(FileNotFoundError) as e:
        module.stress_binary()
    text = str(e.value)
    assert "no stepalloc-stress found" in text
    assert str(tmp_path / "site-packages" / "stepalloc" / "bin" / "stepalloc-stress") in text
    assert str(tmp_path / "empty-target" / "release" / "stepalloc-stress") in text
    assert "cargo build --release -p stepalloc-stress" in text and "STEPALLOC_STRESS=" in text


@pytest.mark.skipif(
    not (SHIM.parent / "target" / "release" / "stepalloc-stress").is_file(), reason="no release build of the tool"
)
def test_in_the_checkout_it_finds_the_release_build_and_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPALLOC_STRESS", raising=False)
    monkeypatch.delenv("CARGO_TARGET_DIR", raising=False)
    found = load().stress_binary()
    packaged = SHIM / "stepalloc" / "bin" / "stepalloc-stress"
    assert found in (packaged, SHIM.parent / "target" / "release" / "stepalloc-stress")
    out = subprocess.run([str(found), "fit", "--help"], capture_output=True, text=True, check=True)
    assert "--capacity-gb" in out.stdout and "--pytorch-conf" in out.stdout
