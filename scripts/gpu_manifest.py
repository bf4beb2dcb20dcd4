#!/usr/bin/env python3
"""Writes MANIFEST.json for a GPU bundle (scripts/gpu-bundle.sh) and checks it.

The manifest lists every file of the bundle with its size and sha256, the git commit it was
built from, and for each ELF file the symbol versions it needs from the C and C++ runtimes
(read with `objdump -T`), compared with what the GPU machine has: an Ubuntu 24.04 class system,
glibc 2.39 and the libstdc++ of GCC 14 (GLIBCXX_3.4.33, CXXABI_1.3.15). A file needing a newer
version would fail to load there, so the bundle is refused.

Usage: gpu_manifest.py write BUNDLE [--limit-mib N]   (writes BUNDLE/MANIFEST.json)
       gpu_manifest.py check BUNDLE [--limit-mib N]   (verifies sizes, hashes and limits)
Exit status: 0 good, 1 a check failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

MANIFEST = "MANIFEST.json"
MIB = 1 << 20
# What the GPU machine provides (Ubuntu 24.04: glibc 2.39, libstdc++ from GCC 14).
TARGET = {"GLIBC": (2, 39), "GLIBCXX": (3, 4, 33), "CXXABI": (1, 3, 15)}
TARGET_TEXT = "Ubuntu 24.04 class: glibc 2.39, libstdc++ GLIBCXX_3.4.33 / CXXABI_1.3.15 (GCC 14)"
VERSION_RE = re.compile(r"\b(GLIBC|GLIBCXX|CXXABI)_([0-9]+(?:\.[0-9]+)*)\b")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def symbol_versions(path: Path) -> dict[str, str]:
    """The newest version of each runtime (GLIBC, GLIBCXX, CXXABI) the file's dynamic symbols need."""
    out = subprocess.run(["objdump", "-T", str(path)], check=True, capture_output=True, text=True).stdout
    newest: dict[str, tuple[int, ...]] = {}
    for lib, ver in VERSION_RE.findall(out):
        v = tuple(int(x) for x in ver.split("."))
        if v > newest.get(lib, ()):
            newest[lib] = v
    return {lib: ".".join(map(str, v)) for lib, v in sorted(newest.items())}


def too_new(versions: dict[str, str]) -> list[str]:
    bad = []
    for lib, ver in versions.items():
        if tuple(int(x) for x in ver.split(".")) > TARGET[lib]:
            bad.append(f"{lib}_{ver} (the GPU machine has {lib}_{'.'.join(map(str, TARGET[lib]))})")
    return bad


def git_commit(repo: Path) -> dict[str, object]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def files_of(bundle: Path) -> list[Path]:
    return sorted(p for p in bundle.rglob("*") if p.is_file() and p.name != MANIFEST and "__pycache__" not in p.parts)


def write(bundle: Path, limit_mib: float, repo: Path) -> int:
    entries = []
    total = 0
    problems = []
    needs: dict[str, tuple[int, ...]] = {}
    for p in files_of(bundle):
        rel = p.relative_to(bundle).as_posix()
        size = p.stat().st_size
        total += size
        e: dict[str, object] = {"path": rel, "bytes": size, "sha256": sha256(p), "executable": os.access(p, os.X_OK)}
        if is_elf(p):
            v = symbol_versions(p)
            e["needs"] = v
            for lib, ver in v.items():
                t = tuple(int(x) for x in ver.split("."))
                if t > needs.get(lib, ()):
                    needs[lib] = t
            problems += [f"{rel} needs {b}" for b in too_new(v)]
        entries.append(e)
    manifest = {
        "what": "stepalloc GPU bundle: run gpu/run_all.sh BUNDLE OUT on the GPU machine (no Rust needed)",
        "source": git_commit(repo),
        "total_bytes": total,
        "limit_bytes": int(limit_mib * MIB),
        "runtime_needs": {lib: ".".join(map(str, v)) for lib, v in sorted(needs.items())},
        "target_runtime": TARGET_TEXT,
        "runtime_ok": not problems,
        "files": entries,
    }
    (bundle / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(
        f"{bundle / MANIFEST}: {len(entries)} files, {total / MIB:.1f} MiB (limit {limit_mib:g} MiB); "
        f"needs {', '.join(f'{k}_{v}' for k, v in manifest['runtime_needs'].items())}; target {TARGET_TEXT}"
    )
    return report(problems, total, limit_mib)


def report(problems: list[str], total: int, limit_mib: float) -> int:
    if total > limit_mib * MIB:
        problems.append(f"the bundle holds {total / MIB:.1f} MiB, over its limit of {limit_mib:g} MiB")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


def check(bundle: Path, limit_mib: float) -> int:
    path = bundle / MANIFEST
    if not path.is_file():
        print(f"error: {path} not found (build the bundle with scripts/gpu-bundle.sh)", file=sys.stderr)
        return 1
    m = json.loads(path.read_text())
    problems = []
    listed = {e["path"]: e for e in m["files"]}
    present = {p.relative_to(bundle).as_posix() for p in files_of(bundle)}
    for rel in sorted(present - set(listed)):
        problems.append(f"{rel} is in the bundle but not in {MANIFEST}")
    total = 0
    for rel, e in sorted(listed.items()):
        p = bundle / rel
        if not p.is_file():
            problems.append(f"{rel} is listed in {MANIFEST} but missing")
            continue
        total += p.stat().st_size
        if p.stat().st_size != e["bytes"] or sha256(p) != e["sha256"]:
            problems.append(f"{rel} differs from {MANIFEST} (size or sha256)")
        if "needs" in e:
            problems += [f"{rel} needs {b}" for b in too_new(e["needs"])]
    if total != m["total_bytes"]:
        problems.append(f"total {total} bytes, {MANIFEST} says {m['total_bytes']}")
    status = report(problems, total, limit_mib)
    if status == 0:
        print(
            f"{path}: {len(listed)} files, {total / MIB:.1f} MiB, hashes match, runtime needs "
            f"{m['runtime_needs']} within {TARGET_TEXT}"
        )
    return status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["write", "check"])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--limit-mib", type=float, default=40.0)
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    a = ap.parse_args()
    if not a.bundle.is_dir():
        print(f"error: bundle folder {a.bundle} does not exist", file=sys.stderr)
        return 2
    if not 0 < a.limit_mib <= 1 << 20:
        print(f"error: --limit-mib {a.limit_mib} out of range (0, 1048576]", file=sys.stderr)
        return 2
    return write(a.bundle, a.limit_mib, a.repo) if a.action == "write" else check(a.bundle, a.limit_mib)


if __name__ == "__main__":
    sys.exit(main())
