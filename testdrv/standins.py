#!/usr/bin/env python3
"""Writes empty stand-ins for the CUDA vendor libraries the installed torch links against.

torch from PyPI depends on ~3 GB of `nvidia-*` wheels (cuBLAS, cuDNN, NCCL, cuFFT, ...). The
tests that run real PyTorch over the host-memory driver (testdrv/README.md) use none of them,
but torch's libraries name them in `NEEDED` and are bound at load, so each must exist and
define every symbol torch imports from it, under the same symbol version. This script reads
torch's own import tables (`readelf`), and for each needed library that cannot be found
(not in torch/lib, not in the nvidia wheels, not on the system, not one of testdrv's), builds
`DIR/<soname>`: every imported function returns 1 (a failure status in each of these
libraries), a function named like an error-string getter returns a static message, and an
imported object is a zeroed one of the right size. With DIR on LD_LIBRARY_PATH, torch installed
with `pip install --no-deps` loads as a CPU-only torch (the runtime stand-in finds no
device); its vendor libraries fail on first use. Preloading testdrv's stub runtime
(libcudart.so.13, same soname) makes CUDA available on the host-memory driver.

Extension libraries built against torch (vLLM's `_C*.so`) may import vendor functions torch
itself never imports, with no `NEEDED` entry (torch loads the vendor libraries globally):
`--extra LIB...` adds each such import that nothing defines to the stand-in whose library name
is its longest prefix (`cublasHgemm` -> libcublas), and fails naming any that fits none.

Usage: testdrv/standins.py DIR [--extra LIB...]   (needs readelf and cc; prints what it wrote)
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

# Never stood in for: the driver (testdrv's, or the machine's) is opened lazily, never linked
# by the libraries loaded at `import torch`. The runtime gets a stand-in like the others
# (then torch imports as a CPU-only torch: cudaGetDeviceCount fails); preloading testdrv's
# stub runtime (same soname) replaces it for the tests that run PyTorch's CUDA paths.
OWN = {"libcuda.so.1", "libnvidia-ml.so.1"}
# Return values other than 1: the runtime stand-in reports no device (cudaErrorNoDevice), as a
# machine without a GPU does, so torch answers is_available() False without a warning.
RETURNS = {"cudaGetDeviceCount": 100}
MESSAGE = "unavailable: a stand-in library (testdrv/standins.py) with no implementation"


def torch_lib_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("standins: torch is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def readelf(*args: str) -> str:
    return subprocess.run(["readelf", "-W", *args], check=True, capture_output=True, text=True).stdout


def needed_and_rpath(lib: Path) -> tuple[list[str], list[Path]]:
    out = readelf("-d", str(lib))
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    paths: list[Path] = []
    for m in re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[([^\]]+)\]", out):
        paths += [Path(p.replace("$ORIGIN", str(lib.parent))) for p in m.split(":")]
    return needed, paths


def system_libraries() -> dict[str, str]:
    """soname -> path of the system's shared libraries (ldconfig's cache, x86-64 first)."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    found: dict[str, str] = {}
    for line in out.splitlines()[1:]:
        if "=>" in line:
            found.setdefault(line.split()[0], line.split("=>")[1].strip())
    return found


def defined(lib: Path) -> set[str]:
    names = set()
    for line in readelf("--dyn-syms", str(lib)).splitlines():
        cols = line.split()
        if len(cols) >= 8 and cols[6] != "UND" and cols[3] in ("FUNC", "OBJECT", "IFUNC"):
            names.add(cols[7].split("@")[0])
    return names


def version_files(lib: Path) -> dict[str, str]:
    """Version name -> the library file that defines it (from .gnu.version_r)."""
    files: dict[str, str] = {}
    current = None
    for line in readelf("-V", str(lib)).splitlines():
        m = re.search(r"File: (\S+)", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"Name: (\S+)", line)
        if m and current:
            files[m.group(1)] = current
    return files


def imports(lib: Path) -> list[tuple[str, str | None, str]]:
    """(symbol, version or None, type) of each strong undefined symbol."""
    result = []
    for line in readelf("--dyn-syms", str(lib)).splitlines():
        cols = line.split()
        if len(cols) >= 8 and cols[6] == "UND" and cols[4] != "WEAK":
            name, _, version = cols[7].partition("@")
            result.append((name, version.split()[0] if version else None, cols[3]))
    return result


def c_source(functions: set[str], objects: set[str]) -> str:
    lines = [f"/* Generated by testdrv/standins.py: {MESSAGE}. */", ""]
    lines.append(f'static const char message[] = "{MESSAGE}";')
    for name in sorted(functions):
        if re.search(r"(ErrorString|StatusString|StatusName|ErrorName|GetLastError)$", name):
            lines.append(f"const char *{name}(void) {{ return message; }}")
        else:
            lines.append(f"int {name}(void) {{ return {RETURNS.get(name, 1)}; }}")
    for name in sorted(objects):
        lines.append(f"char {name}[256];")
    return "\n".join(lines) + "\n"


def add_extra_imports(
    extra: list[Path], wanted: dict[str, dict[str, dict[str, str]]], available: set[str]
) -> None:
    """Adds to ``wanted`` the imports of the ``extra`` libraries that nothing defines, each to the
    stand-in whose library name (``libcublasLt.so.13`` -> ``cublasLt``) is its longest prefix."""
    names = {soname: soname[3:].split(".so")[0] for soname in wanted}
    for lib in extra:
        for name, version, kind in imports(lib):
            # Versioned imports name their library (NEEDED); the driver (cu + capital) is never
            # stood in for (OWN); Py* is the interpreter's.
            if version or name in available or name.startswith(("_", "Py")) or re.match(r"cu[A-Z]", name):
                continue
            fits = [so for so, prefix in names.items() if name.lower().startswith(prefix.lower())]
            if not fits:
                sys.exit(f"standins: {lib.name} imports {name}, which no library defines and no stand-in fits")
            soname = max(fits, key=lambda so: len(names[so]))
            versions = wanted[soname]
            version = sorted(versions)[0] if versions else None
            if version is None:
                sys.exit(f"standins: {name} ({lib.name}) would go to {soname}, which has no symbol version")
            versions[version][name] = kind


def main() -> None:
    args = sys.argv[1:]
    extra: list[Path] = []
    if "--extra" in args:
        at = args.index("--extra")
        extra = [Path(p) for p in args[at + 1 :]]
        args = args[:at]
    if len(args) != 1:
        sys.exit(__doc__)
    out_dir = Path(args[0]).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib_dir = torch_lib_dir() / "lib"
    ours = {p.name for p in lib_dir.glob("*.so*")}
    system = system_libraries()

    # soname -> version name -> {symbol: type}
    wanted: dict[str, dict[str, dict[str, str]]] = {}
    # Unversioned imports (NCCL, cuSPARSELt, cuFile export no versions) cannot name their
    # library: those that no available library defines go into every unversioned stand-in.
    unversioned: dict[str, str] = {}
    available: set[str] = set()
    for lib in lib_dir.glob("*.so*"):
        available |= defined(lib)
    for lib in sorted(lib_dir.glob("*.so")):
        needed, rpath = needed_and_rpath(lib)
        missing = [
            n for n in needed
            if n not in ours and n not in OWN and n not in system and not any((d / n).exists() for d in rpath)
        ]
        if not missing:
            continue
        for n in needed:
            if n in system:
                available |= defined(Path(system[n]))
        files = version_files(lib)
        for name, version, kind in imports(lib):
            soname = files.get(version) if version else None
            if soname in missing:
                wanted.setdefault(soname, {}).setdefault(version, {})[name] = kind
            elif version is None:
                unversioned[name] = kind
        for soname in missing:
            wanted.setdefault(soname, {})

    unversioned = {n: k for n, k in unversioned.items() if n not in available}
    if extra:
        for lib in extra:
            needed, _ = needed_and_rpath(lib)
            for n in needed:
                if n in system:
                    available |= defined(Path(system[n]))
        add_extra_imports(extra, wanted, available | set(unversioned))
    for soname, versions in sorted(wanted.items()):
        functions = {n for v in versions.values() for n, k in v.items() if k != "OBJECT"}
        objects = {n for v in versions.values() for n, k in v.items() if k == "OBJECT"}
        if not versions:
            functions = {n for n, k in unversioned.items() if k != "OBJECT"}
            objects = {n for n, k in unversioned.items() if k == "OBJECT"}
        src = out_dir / f"{soname}.c"
        src.write_text(c_source(functions, objects))
        script = out_dir / f"{soname}.map"
        if versions:
            script.write_text("".join(f"{v} {{ global: {' '.join(n + ';' for n in sorted(s))} }};\n" for v, s in sorted(versions.items())))
        else:
            script.write_text("{ global: *; };\n")
        cc = os.environ.get("CC", "cc")
        subprocess.run(
            [cc, "-shared", "-fPIC", "-O0", f"-Wl,-soname,{soname}", f"-Wl,--version-script={script}",
             "-o", str(out_dir / soname), str(src)],
            check=True,
        )
        print(f"{out_dir / soname}: {len(functions)} functions, {len(objects)} objects")


if __name__ == "__main__":
    main()
