"""Where the ``stepalloc-stress`` tool is: ``stepalloc.fit`` records a step in Python and runs
``stepalloc-stress fit TRACE ... --json`` to replay it (the contract: the repository's
notes, FIT-CONTRACT.md).

Looked for in this order, the first that is a file wins:

1. ``$STEPALLOC_STRESS``: a path to the binary (set, it must name an executable file, or the
   lookup fails: a wrong override is not silently replaced by another binary);
2. the copy the package carries, ``stepalloc/bin/stepalloc-stress`` (``python_shim/setup.py``
   builds it into the wheel);
3. in a checkout of the repository, its release build ``target/release/stepalloc-stress``
   (``$CARGO_TARGET_DIR`` replaces ``target``), else its debug build (what ``scripts/test.sh``
   builds; slower, fine for small traces).

Nothing is run and nothing is imported but the standard library.
"""

from __future__ import annotations

import os
import pathlib

NAME = "stepalloc-stress"
# stepalloc/fit/_binary.py -> stepalloc/
_PACKAGE = pathlib.Path(__file__).resolve().parent.parent
# python_shim/stepalloc/ -> the repository (when the package runs from a checkout)
_REPOSITORY = _PACKAGE.parent.parent


class StressBinaryNotFound(FileNotFoundError):
    """No ``stepalloc-stress`` was found; the message says where it looked and what to do."""


def _executable(path: pathlib.Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _candidates() -> list[pathlib.Path]:
    """The packaged copy, then the repository's release build, then its debug build."""
    target = os.environ.get("CARGO_TARGET_DIR")
    build = pathlib.Path(target) if target else _REPOSITORY / "target"
    if not build.is_absolute():
        build = _REPOSITORY / build
    return [_PACKAGE / "bin" / NAME, build / "release" / NAME, build / "debug" / NAME]


def stress_binary() -> pathlib.Path:
    """The ``stepalloc-stress`` executable to run, as an absolute path.

    Raises ``StressBinaryNotFound`` (a ``FileNotFoundError``) naming every place looked at and
    how to get one.
    """
    explicit = os.environ.get("STEPALLOC_STRESS")
    if explicit:
        path = pathlib.Path(explicit).expanduser()
        if _executable(path):
            return path.resolve()
        what = "is not executable" if path.is_file() else "does not exist"
        raise StressBinaryNotFound(
            f"STEPALLOC_STRESS={explicit!r} {what}: point it at a stepalloc-stress binary "
            "(cargo build --release -p stepalloc-stress makes target/release/stepalloc-stress), or unset it to use "
            "the one the package carries"
        )
    tried = _candidates()
    for path in tried:
        if _executable(path):
            return path
    places = ", ".join(str(p) for p in tried)
    raise StressBinaryNotFound(
        f"no {NAME} found (looked at $STEPALLOC_STRESS, unset, and {places}). This stepalloc package was built "
        "without it: reinstall it from a wheel built with Rust (pip install ./python_shim on a machine with cargo), "
        "or build it (cargo build --release -p stepalloc-stress in the stepalloc repository) and set "
        "STEPALLOC_STRESS=/path/to/stepalloc-stress"
    )
