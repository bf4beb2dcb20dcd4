#!/usr/bin/env python3
"""Checks that testdrv's stub runtime, driver and NVML cover what the installed torch needs.

Fails, listing each missing name, when:
- torch's libraries import a CUDA runtime function (`cuda*@libcudart.so.N`) that
  target/hostcuda/runtime/libcudart.so.N does not export, or name a runtime soname the stub is not;
- c10 resolves a driver function (through cudaGetDriverEntryPointByVersion, by name) that
  target/hostcuda/libcuda.so.1 exports neither as NAME nor as NAME_v2;
- torch names an NVML function (dlsym by name) that target/hostcuda/runtime/libnvidia-ml.so.1 lacks.
torch's imports change between releases (85 runtime functions in 2.5, 92 in 2.9, 113 in 2.15),
so bumping the torch that CI pins without updating the stubs stops here, with the list.

Usage: testdrv/torch_drift.py [HOSTCUDA_DIR]   (default target/hostcuda; needs readelf)
"""
from __future__ import annotations

import importlib.util
import mmap
import re
import subprocess
import sys
from pathlib import Path


def run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def names_in(lib: Path, prefix: bytes) -> set[str]:
    """The printable strings of `lib` (as `strings` finds them) that are identifiers starting
    with `prefix` and a capital: the names torch looks up with dlsym or the driver entry-point
    query."""
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        found = set()
        for m in re.finditer(prefix + rb"[A-Z]\w+", data):
            before = data[m.start() - 1] if m.start() else 0
            after = data[m.end()] if m.end() < len(data) else 0
            if not (0x20 <= before <= 0x7E or 0x20 <= after <= 0x7E):
                found.add(m.group().decode())
        return found


def exports(lib: Path) -> set[str]:
    names = set()
    for line in run("readelf", "-W", "--dyn-syms", str(lib)).splitlines():
        cols = line.split()
        if len(cols) >= 8 and cols[6] != "UND" and cols[3] in ("FUNC", "OBJECT"):
            names.add(cols[7].split("@")[0])
    return names


def main() -> int:
    stub_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "target/hostcuda")
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        print("torch_drift: torch is not installed", file=sys.stderr)
        return 2
    torch_dir = Path(list(spec.submodule_search_locations)[0])
    libs = sorted((torch_dir / "lib").glob("*.so")) + sorted(torch_dir.glob("_C*.so"))
    problems: list[str] = []

    runtime: dict[str, set[str]] = {}  # soname -> functions
    for lib in libs:
        for line in run("readelf", "-W", "--dyn-syms", str(lib)).splitlines():
            m = re.search(r"\sUND\s+(\w+)@(libcudart\.so\.\d+)", line)
            if m:
                runtime.setdefault(m.group(2), set()).add(m.group(1))
    for soname, needed in sorted(runtime.items()):
        stub = stub_dir / "runtime" / soname
        if not stub.exists():
            problems.append(f"torch imports {len(needed)} functions from {soname}; the stub runtime is not {soname} "
                            f"(testdrv/build.sh builds {', '.join(p.name for p in (stub_dir / 'runtime').glob('libcudart.so.*'))})")
            continue
        for name in sorted(needed - exports(stub)):
            problems.append(f"runtime: {name} (imported by torch from {soname}; add it to testdrv/hostcudart.c)")

    driver = exports(stub_dir / "libcuda.so.1")
    c10 = torch_dir / "lib" / "libc10_cuda.so"
    driver_names = names_in(c10, b"cu")
    for name in sorted(driver_names):
        if name not in driver and f"{name}_v2" not in driver:
            problems.append(f"driver: {name} (c10 resolves it by name; add it to the driver, testdrv/hostcuda*.c)")

    nvml = exports(stub_dir / "runtime" / "libnvidia-ml.so.1")
    wanted_nvml: set[str] = set()
    for lib in (c10, torch_dir / "lib" / "libtorch_cuda.so"):
        if lib.exists():
            wanted_nvml |= names_in(lib, b"nvml")
    # torch.cuda's device count asks NVML through ctypes.
    init_py = (torch_dir / "cuda" / "__init__.py").read_text()
    wanted_nvml |= set(re.findall(r"\b(nvml[A-Z]\w+)\(", init_py))
    for name in sorted(wanted_nvml - nvml):
        problems.append(f"nvml: {name} (torch looks it up by name; add it to testdrv/hostnvml.c)")

    total = sum(len(v) for v in runtime.values())
    if problems:
        print(f"torch {torch_dir} needs what testdrv's stubs lack ({len(problems)}):", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(f"torch_drift: the stubs cover torch: {total} runtime functions, "
          f"{len(driver_names)} driver names, "
          f"{len(wanted_nvml)} NVML names")
    return 0


if __name__ == "__main__":
    sys.exit(main())
