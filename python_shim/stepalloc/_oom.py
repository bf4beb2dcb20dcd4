"""Layer: makes stepalloc's out-of-memory in process-wide mode a ``torch.OutOfMemoryError``.

PyTorch raises ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``) only for a C++
``c10::OutOfMemoryError``; libstepalloc.so is built without torch, so on its own it throws a
``std::runtime_error`` (a plain ``RuntimeError`` in Python) and ``except
torch.cuda.OutOfMemoryError:`` would miss it. Here ``oom_error.cpp`` is compiled once against the
installed torch's headers and libc10 (the include paths of ``torch.utils.cpp_extension``, the
ecosystem's way to build against torch) and registered with the library, which then throws
through it. The built file is cached per torch version, source and compiler
(``$STEPALLOC_CACHE_DIR``, else ``$XDG_CACHE_HOME/stepalloc``, else ``~/.cache/stepalloc``).
Without a C++ compiler or torch's headers, a warning says so and the ``RuntimeError`` stays,
with the same message, starting ``CUDA out of memory.``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

from . import _lib

SOURCE = Path(__file__).with_name("oom_error.cpp")
SYMBOL = "stepalloc_throw_oom"

_registered: ctypes.CDLL | None = None


def _cache_dir() -> Path:
    if os.environ.get("STEPALLOC_CACHE_DIR"):
        return Path(os.environ["STEPALLOC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stepalloc"


def _build(torch: Any) -> Path:
    """Compiles oom_error.cpp (or finds the cached build); raises RuntimeError on failure."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + f"{torch.__version__}|{torch_lib}|{abi}|{compiler}".encode()).hexdigest()[:16]
    out = _cache_dir() / f"oom_error-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        cmd = [
            compiler,
            "-shared",
            "-fPIC",
            "-O1",
            "-std=c++17",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *includes,
            str(SOURCE),
            "-o",
            str(built),
            f"-L{torch_lib}",
            "-lc10",
            f"-Wl,-rpath,{torch_lib}",
        ]
        result = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} ... failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, out)  # atomic: concurrent processes never load a half-written file
    return out


def enable(torch: Any) -> bool:
    """Registers the c10::OutOfMemoryError thrower with the library; returns whether it did.

    Idempotent. A failure to build is a warning, never an exception: allocation still works.
    """
    global _registered
    if _registered is not None:
        return True
    try:
        path = _build(torch)
        handle = ctypes.CDLL(str(path))
        thrower = ctypes.cast(getattr(handle, SYMBOL), ctypes.c_void_p)
    except Exception as e:  # noqa: BLE001 - torch's build helpers may fail in any way; see the docstring
        warnings.warn(
            f"stepalloc: out-of-memory will raise RuntimeError, not torch.OutOfMemoryError, because "
            f"building the c10::OutOfMemoryError thrower failed: {e}",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    set_fn = _lib.lib().stepalloc_set_oom_thrower
    set_fn.argtypes = [ctypes.c_void_p]
    set_fn.restype = None
    set_fn(thrower)
    _registered = handle  # kept loaded for the life of the process
    return True
