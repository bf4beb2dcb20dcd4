#!/usr/bin/env python3
"""pip install ARGS..., but without the CUDA wheels torch depends on (~3 GB).

The tests run PyTorch's CUDA paths over testdrv's stub runtime and driver, and stand-ins for
the vendor libraries (testdrv/standins.py), so the `nvidia-*` wheels, triton and the
`cuda-*` meta packages are never used. pip cannot leave out some dependencies, so: resolve
with `--dry-run --report`, then install everything the resolution chose except those, with
`--no-deps`. Everything else resolves exactly as `pip install ARGS...` would.
"""
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SKIP = re.compile(r"^(nvidia-.*|triton|cuda-toolkit|cuda-bindings|cuda-pathfinder)$")
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([*PIP, "install", "--quiet", "--dry-run", "--report", str(report), *sys.argv[1:]], check=True)
        chosen = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
    keep = [f"{name}=={version}" for name, version in chosen if not SKIP.match(name.lower())]
    left_out = sorted(name for name, _ in chosen if SKIP.match(name.lower()))
    print(f"pip-light: installing {len(keep)} packages, leaving out {len(left_out)}: {' '.join(left_out)}")
    if keep:
        subprocess.run([*PIP, "install", "--quiet", "--no-deps", *keep], check=True)


if __name__ == "__main__":
    main()
