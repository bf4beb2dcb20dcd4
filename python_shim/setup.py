"""Build step of the stepalloc Python package: build ``libstepalloc.so`` (the ``stepalloc-cabi``
crate of the cargo workspace this folder lives in, release profile) and put it in the package
as ``stepalloc/lib/libstepalloc.so``, the first place ``stepalloc/_lib.py`` looks after
``$STEPALLOC_LIBRARY``; and build the ``stepalloc-stress`` tool (crate ``stepalloc-stress``,
stripped) into ``stepalloc/bin/stepalloc-stress``, which ``stepalloc.fit`` runs to replay a
recorded step (``stepalloc/fit/_binary.py`` finds it).

Why setuptools-rust with ``Binding.NoBinding``: the library is a plain C-ABI cdylib that the
package loads with ctypes (and PyTorch with dlopen), not a Python extension module. NoBinding
builds the cdylib as it is, with no Python ABI and no feature added, and as a setuptools plugin
it leaves the rest of this package as it was (package data, the wheel tag, the overrides
below). maturin has no binding kind for a ctypes-loaded cdylib (pyo3, cffi, uniffi, bin) and
expects the crate's manifest beside pyproject.toml, not in a workspace above it.

Where the library comes from, in order:
1. ``$STEPALLOC_LIBRARY`` set at build time: that file is bundled and nothing is compiled (a
   library built elsewhere, for a machine without Rust).
2. cargo (``$CARGO``, else ``cargo`` on PATH) builds it, in the workspace's ``target/``
   (``$CARGO_TARGET_DIR`` replaces it). Cargo reuses what is up to date there, so after
   ``cargo build --release -p stepalloc-cabi`` little or nothing is compiled again.
3. Without cargo, a prebuilt ``target/release/libstepalloc.so`` (``$CARGO_TARGET_DIR`` likewise)
   is bundled as it is, with a note: nothing checks that it matches the sources.
4. Otherwise the build fails, saying how to get a library.

The tool, likewise: ``$STEPALLOC_STRESS`` set at build time, else cargo builds it (also when
the library was given), else a prebuilt ``target/release/stepalloc-stress``. Without any of
them the package is still built, with a note: the library works, and ``stepalloc.fit`` asks
for ``$STEPALLOC_STRESS`` when it runs.

And the host-memory CUDA stand-in that lets ``python -m stepalloc.fit`` record on a machine
without a GPU or a driver (``stepalloc/fit/_host.py``): testdrv's driver and stub runtime
(``testdrv/build.sh``: ``libcuda.so.1``, ``runtime/libcudart.so.13``, ``runtime/libnvidia-ml.so.1``,
about 100 KB stripped) in ``stepalloc/lib/hostcuda/``, a folder nothing searches but
``stepalloc.fit`` (which preloads it in a child process only when torch finds no device: a GPU
machine never loads it). ``$STEPALLOC_HOSTCUDA_DIR`` set at build time names a prebuilt folder;
else the C compiler (``$CC``, else ``cc``) builds it; without one the package goes without it,
with a note.

A wheel is tagged ``py3-none-<platform>``: it holds a native library but no module tied to a
CPython ABI. Build from this folder inside the repository (``pip install ./python_shim``,
``pip wheel ./python_shim``): the crate lives outside it, so an sdist would not carry it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools_rust import Binding, RustExtension, Strip, build_rust

HERE = Path(__file__).resolve().parent
WORKSPACE = HERE.parent
LIBRARY = "libstepalloc.so"
# The extension's dotted name places the library in stepalloc/lib/; its file name is fixed
# below (LIBRARY), not the CPython extension name setuptools would give it.
EXTENSION = "stepalloc.lib.libstepalloc"
STRESS = "stepalloc-stress"
# An executable's dotted name places it in stepalloc/bin/ under its own (kebab-case) name.
STRESS_TARGET = {STRESS: f"stepalloc.bin.{STRESS}"}
# The host-memory CUDA stand-in, beside the library: the files stepalloc/fit/_host.py needs.
HOSTCUDA = "hostcuda"
HOSTCUDA_FILES = ("libcuda.so.1", "runtime/libcudart.so.13", "runtime/libnvidia-ml.so.1")


def given(variable: str) -> Path | None:
    """The file ``$variable`` names when set at build time (it must name a file)."""
    explicit = os.environ.get(variable)
    if not explicit:
        return None
    p = Path(explicit).expanduser()
    if not p.is_file():
        raise SystemExit(f"stepalloc: {variable}={explicit!r} (build environment) does not name a file")
    return p


def given_library() -> Path | None:
    """``$STEPALLOC_LIBRARY`` when set at build time."""
    return given("STEPALLOC_LIBRARY")


def given_stress() -> Path | None:
    """``$STEPALLOC_STRESS`` when set at build time."""
    return given("STEPALLOC_STRESS")


def given_hostcuda() -> Path | None:
    """``$STEPALLOC_HOSTCUDA_DIR`` when set at build time (it must hold the stand-in's files)."""
    explicit = os.environ.get("STEPALLOC_HOSTCUDA_DIR")
    if not explicit:
        return None
    folder = Path(explicit).expanduser()
    missing = [f for f in HOSTCUDA_FILES if not (folder / f).is_file()]
    if missing:
        raise SystemExit(
            f"stepalloc: STEPALLOC_HOSTCUDA_DIR={explicit!r} (build environment) lacks {', '.join(missing)}; "
            "testdrv/build.sh FOLDER makes them"
        )
    return folder


def copy_stripped(source: Path, dest: Path) -> None:
    """Copies a shared library without its debug information (``strip``, where there is one)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    strip = shutil.which("strip")
    command = [strip or "strip", "--strip-unneeded", "-o", str(dest), str(source)]
    if strip is None or subprocess.run(command, check=False).returncode != 0:
        shutil.copy2(source, dest)


def prebuilt(name: str) -> Path:
    """Where a ``cargo build --release`` of this workspace leaves ``name``."""
    target = Path(os.environ["CARGO_TARGET_DIR"]) if os.environ.get("CARGO_TARGET_DIR") else WORKSPACE / "target"
    return target / "release" / name


def prebuilt_library() -> Path:
    """Where a ``cargo build --release -p stepalloc-cabi`` of this workspace leaves the library."""
    return prebuilt(LIBRARY)


class BuildLibrary(build_rust):
    """setuptools-rust's build_rust, with the library's own file name and the cases above in
    which no cargo runs for a part (given, or prebuilt without cargo)."""

    def run(self) -> None:
        no_cargo = shutil.which(self.cargo) is None
        library = given_library()
        if library is None and no_cargo:
            library = prebuilt_library()
            if not library.is_file():
                raise SystemExit(
                    f"stepalloc: cannot build {LIBRARY}: cargo ({self.cargo!r}) is not on PATH and there is no "
                    f"prebuilt library at {library}. Install Rust (rustup, or your system's cargo), or build "
                    f"the library elsewhere and set STEPALLOC_LIBRARY=/path/to/{LIBRARY} for this install, or "
                    "install a wheel made with `pip wheel ./python_shim` on a machine with Rust."
                )
            print(f"stepalloc: cargo not found; bundling the prebuilt {library} as it is", file=sys.stderr)
        stress = given_stress()
        if stress is None and no_cargo:
            stress = prebuilt(STRESS)
            if stress.is_file():
                print(f"stepalloc: cargo not found; bundling the prebuilt {stress} as it is", file=sys.stderr)
            else:
                print(
                    f"stepalloc: cargo not found and no prebuilt {stress}: the package has no {STRESS}; "
                    f"stepalloc.fit will need STEPALLOC_STRESS=/path/to/{STRESS} when it runs",
                    file=sys.stderr,
                )
                stress = None
        # What cargo builds: the parts neither given nor prebuilt (none without cargo).
        to_build = [
            ext
            for ext in self.extensions
            if not no_cargo and (library if not ext._uses_exec_binding() else given_stress()) is None
        ]
        for ext in self.extensions:
            if ext in to_build:
                continue
            source = stress if ext._uses_exec_binding() else library
            dest = self.bundled_path(ext)
            if source is None:
                dest.unlink(missing_ok=True)  # an earlier build's copy must not ship unnoticed
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)
            print(f"stepalloc: bundled {source} as {dest}", file=sys.stderr)
        if to_build:
            everything = self.extensions
            self.extensions = to_build  # cargo builds these; install_extension copies them
            try:
                super().run()
            finally:
                self.extensions = everything
        library_ext = next(ext for ext in self.extensions if not ext._uses_exec_binding())
        self.bundle_hostcuda(self.bundled_path(library_ext).parent / HOSTCUDA)

    def bundle_hostcuda(self, dest: Path) -> None:
        """The host-memory CUDA stand-in in ``dest`` (given, or built from testdrv/ with cc)."""
        shutil.rmtree(dest, ignore_errors=True)  # an earlier build's copy must not ship unnoticed
        source = given_hostcuda()
        with tempfile.TemporaryDirectory() as tmp:
            if source is None:
                cc = os.environ.get("CC") or "cc"
                if shutil.which(cc) is None:
                    print(
                        f"stepalloc: no C compiler ({cc!r}): the package has no host-memory CUDA stand-in; "
                        "python -m stepalloc.fit then needs a GPU, or STEPALLOC_HOSTCUDA_DIR when it runs",
                        file=sys.stderr,
                    )
                    return
                subprocess.run(["bash", str(WORKSPACE / "testdrv" / "build.sh"), tmp], check=True)
                source = Path(tmp)
            for rel in HOSTCUDA_FILES:
                copy_stripped(source / rel, dest / rel)
        print(f"stepalloc: bundled the host-memory CUDA stand-in from {source} as {dest}", file=sys.stderr)

    def bundled_path(self, ext: RustExtension) -> Path:
        """Where install_extension would put what cargo builds for ``ext``."""
        if not ext._uses_exec_binding():
            return Path(self.get_dylib_ext_path(ext, ext.name))
        build_ext = self.get_finalized_command("build_ext")
        build_ext.inplace = self.inplace
        return Path(build_ext.get_ext_fullpath(STRESS_TARGET[STRESS])).parent / STRESS

    def get_dylib_ext_path(self, ext: RustExtension, target_fname: str) -> str:
        # build_ext's path for the extension (build_lib, or the source folder in place) gives
        # the folder; the file keeps the name _lib.py and PyTorch's loader look for.
        build_ext = self.get_finalized_command("build_ext")
        return str(Path(build_ext.get_ext_fullpath(target_fname)).parent / LIBRARY)


class PlatformWheel(bdist_wheel):
    """A wheel holding a native library is platform-specific but not tied to a CPython ABI."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        if not self.root_is_pure:
            python, abi = "py3", "none"
        return python, abi, plat


setup(
    rust_extensions=[
        RustExtension(
            EXTENSION,
            path=str(WORKSPACE / "cabi" / "Cargo.toml"),
            binding=Binding.NoBinding,
            debug=False,  # the release profile, also under `pip install -e`
        ),
        # The replay tool, stripped (about 5 MB; with its debug information it is 40 MB).
        RustExtension(
            STRESS_TARGET,
            path=str(WORKSPACE / "stress" / "Cargo.toml"),
            binding=Binding.Exec,
            debug=False,
            strip=Strip.All,
        ),
    ],
    cmdclass={"build_rust": BuildLibrary, "bdist_wheel": PlatformWheel},
)
