"""``python -m stepalloc.fit.host SCRIPT [ARGS...]``: runs a script that calls
``stepalloc.fit.record`` over stepalloc's host-memory CUDA stand-in, for a machine without a GPU
(``_host.py`` says why and where the stand-in comes from)."""

from __future__ import annotations

import sys

from ._host import NoDeviceError, run_child


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: python -m stepalloc.fit.host SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    try:
        return run_child(sys.argv[1:])
    except NoDeviceError as exc:
        print(f"stepalloc.fit: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
