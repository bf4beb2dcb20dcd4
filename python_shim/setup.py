"""Build step of the stepalloc Python package: copy a prebuilt ``libstepalloc.so`` into the
package (``stepalloc/lib/``) so the installed package carries its library.

The Rust library is not built here; build it first with
``cargo build --release -p stepalloc-cabi``. Where the library comes from, in order:
``$STEPALLOC_LIBRARY``, ``../target/release``, ``../target/debug`` (relative to this file, i.e.
the cargo workspace this folder lives in; ``$CARGO_TARGET_DIR`` replaces ``../target``).
Without one the package installs pure-Python and finds the library at run time
(``STEPALLOC_LIBRARY``), with a warning now and a clear error then.
A wheel that bundles the library is tagged for this platform (py3-none-<platform>), not
as a pure-Python wheel.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
LIBRARY = "libstepalloc.so"


def prebuilt_library() -> Path | None:
    explicit = os.environ.get("STEPALLOC_LIBRARY")
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise SystemExit(f"STEPALLOC_LIBRARY={explicit!r} does not name a file")
        return p
    target = Path(os.environ["CARGO_TARGET_DIR"]) if os.environ.get("CARGO_TARGET_DIR") else HERE.parent / "target"
    for profile in ("release", "debug"):
        p = target / profile / LIBRARY
        if p.is_file():
            return p
    return None


class BuildPyWithLibrary(build_py):
    """build_py that also copies the prebuilt library into the built package."""

    def run(self) -> None:
        super().run()
        lib = prebuilt_library()
        dest = Path(self.build_lib) / "stepalloc" / "lib"
        if lib is None:
            print(
                f"warning: {LIBRARY} not found (build it with `cargo build --release -p stepalloc-cabi`, or set "
                "STEPALLOC_LIBRARY); installing without it: set STEPALLOC_LIBRARY at run time",
                file=sys.stderr,
            )
            return
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, dest / LIBRARY)
        print(f"stepalloc: bundled {lib} as stepalloc/lib/{LIBRARY}", file=sys.stderr)


class BinaryDistribution(Distribution):
    """With the library bundled the package is platform-specific: files go to platlib."""

    def has_ext_modules(self) -> bool:
        return prebuilt_library() is not None


class PlatformWheel(bdist_wheel):
    """A wheel holding a native library is platform-specific but not tied to a CPython ABI."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        if not self.root_is_pure:
            python, abi = "py3", "none"
        return python, abi, plat


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel})
