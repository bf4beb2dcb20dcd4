"""Layer: the one ctypes handle on ``libstepalloc.so`` and the errors its status codes map to.

Invariants:
- The library is located once per process (``library_path()``) and loaded once (``lib()``).
  PyTorch's ``CUDAPluggableAllocator`` is given exactly the same absolute path, so ``dlopen``
  returns the same loaded object and ctypes and PyTorch share one allocator state.
- Every control call goes through ``_check``: a non-zero status becomes a Python exception that
  carries the library's own message (``stepalloc_last_error``, a thread-local in the library,
  read on the same thread right after the failing call).
- Nothing here imports torch at module import time.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path
from typing import Callable

LIBRARY_NAME = "libstepalloc.so"
ENV_LIBRARY = "STEPALLOC_LIBRARY"

# Status codes of the C ABI (stable numbers, see cabi/include/stepalloc.h).
OK = 0
OUT_OF_MEMORY = 1
UNKNOWN_POINTER = 2
INVALID_ARGUMENT = 3
CONFIG = 4
DRIVER = 5
UNAVAILABLE = 6
PANIC = 7

STATUS_NAMES = {
    OK: "OK",
    OUT_OF_MEMORY: "OUT_OF_MEMORY",
    UNKNOWN_POINTER: "UNKNOWN_POINTER",
    INVALID_ARGUMENT: "INVALID_ARGUMENT",
    CONFIG: "CONFIG",
    DRIVER: "DRIVER",
    UNAVAILABLE: "UNAVAILABLE",
    PANIC: "PANIC",
}


class StepallocError(RuntimeError):
    """A call into libstepalloc failed. ``status`` is the library's status code."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ConfigError(StepallocError, ValueError):
    """A configuration string or an argument was rejected (also a ``ValueError``)."""


class LibraryNotFoundError(ImportError):
    """``libstepalloc.so`` could not be found or loaded."""


_lock = threading.Lock()
_path: str | None = None
_lib: ctypes.CDLL | None = None


def _candidates() -> list[tuple[str, Path]]:
    """Where the library may be, in the order they are tried, with a label for messages."""
    here = Path(__file__).resolve().parent
    out: list[tuple[str, Path]] = [("packaged copy", here / "lib" / LIBRARY_NAME)]
    # python_shim/stepalloc/_lib.py -> the repository root is two levels up.
    repo = here.parent.parent
    target = Path(os.environ["CARGO_TARGET_DIR"]) if os.environ.get("CARGO_TARGET_DIR") else repo / "target"
    out.append(("cargo release build", target / "release" / LIBRARY_NAME))
    out.append(("cargo debug build", target / "debug" / LIBRARY_NAME))
    return out


def find_library() -> str:
    """Returns the absolute path of ``libstepalloc.so`` without loading it.

    Order: ``$STEPALLOC_LIBRARY`` (if set it must exist), the copy packaged inside the installed
    package, then the cargo target folder of the repository (release, then debug).
    Raises ``LibraryNotFoundError`` saying where it looked and how to fix it.
    """
    explicit = os.environ.get(ENV_LIBRARY)
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_file():
            raise LibraryNotFoundError(f"{ENV_LIBRARY}={explicit!r} does not name a file")
        return str(p.resolve())
    tried = []
    for label, p in _candidates():
        if p.is_file():
            return str(p.resolve())
        tried.append(f"  {label}: {p}")
    raise LibraryNotFoundError(
        f"{LIBRARY_NAME} not found. Looked in:\n  ${ENV_LIBRARY}: (unset)\n"
        + "\n".join(tried)
        + "\nBuild it with `cargo build --release -p stepalloc-cabi` in the stepalloc repository and "
        "reinstall the package (`pip install ./python_shim` copies it in), or set "
        f"{ENV_LIBRARY}=/path/to/{LIBRARY_NAME}."
    )


def library_path() -> str:
    """The absolute path of the library this process uses (located once, then fixed)."""
    global _path
    with _lock:
        if _path is None:
            _path = find_library()
        return _path


def _declare(cdll: ctypes.CDLL) -> None:
    """Declares argument and result types of the control functions used through ctypes."""
    c_int, c_char_p, c_size_t, c_void_p, c_double = (
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_double,
    )
    text = [c_char_p, c_size_t]
    table: dict[str, tuple[list, object]] = {
        "stepalloc_configure": ([c_char_p], c_int),
        "stepalloc_step_begin": ([c_char_p], c_int),
        "stepalloc_step_end": ([], c_int),
        "stepalloc_metrics_serve": ([c_char_p], c_int),
        "stepalloc_reset_peak_stats": ([c_int], c_int),
        "stepalloc_reset_accumulated_stats": ([c_int], c_int),
        "stepalloc_device_count": ([], c_int),
        "stepalloc_last_status": ([], c_int),
        "stepalloc_stats_json": ([c_int, c_char_p, c_size_t], c_size_t),
        "stepalloc_snapshot_json": (text, c_size_t),
        "stepalloc_trace_jsonl": (text, c_size_t),
        "stepalloc_metrics_text": (text, c_size_t),
        "stepalloc_last_error": (text, c_size_t),
        "stepalloc_config_help": (text, c_size_t),
        "stepalloc_version": ([], c_char_p),
        "stepalloc_malloc": ([c_size_t, c_int, c_void_p], c_void_p),
        "stepalloc_free": ([c_void_p, c_size_t, c_int, c_void_p], None),
        "stepalloc_empty_cache": ([], None),
        "stepalloc_set_memory_fraction": ([c_double, c_int], None),
        "stepalloc_set_mempool_mode": ([c_int], c_int),
    }
    for name, (argtypes, restype) in table.items():
        fn = getattr(cdll, name)  # AttributeError names a missing symbol: an outdated library.
        fn.argtypes = argtypes
        fn.restype = restype


def lib() -> ctypes.CDLL:
    """The loaded library (loaded on first call, shared by everything in this process)."""
    global _lib
    path = library_path()
    with _lock:
        if _lib is None:
            try:
                cdll = ctypes.CDLL(path)
            except OSError as e:
                raise LibraryNotFoundError(f"could not load {path}: {e}") from e
            try:
                _declare(cdll)
            except AttributeError as e:
                raise LibraryNotFoundError(
                    f"{path} lacks a stepalloc symbol ({e}); it is older than this package, rebuild it"
                ) from e
            _lib = cdll
        return _lib


def read_text(fn: Callable[..., int], *leading: object) -> str:
    """Calls a ``size_t f([leading...,] char *buf, size_t cap)`` text function of the library.

    The first call sizes the buffer; the text can grow between the two calls (allocations on
    other threads), so the call repeats until the text fits.
    """
    need = int(fn(*leading, None, 0))
    while True:
        buf = ctypes.create_string_buffer(need + 1)
        full = int(fn(*leading, buf, need + 1))
        if full <= need:
            return buf.value.decode("utf-8", errors="replace")
        need = full


def last_error() -> str:
    """The library's message for the last failed call on this thread."""
    return read_text(lib().stepalloc_last_error)


def error_for(status: int, message: str | None = None) -> Exception:
    """The Python exception for a status code, with the library's message."""
    text = message if message is not None else last_error()
    text = text or f"stepalloc call failed with status {STATUS_NAMES.get(status, status)}"
    if status in (CONFIG, INVALID_ARGUMENT, UNKNOWN_POINTER):
        return ConfigError(text, status)
    if status == OUT_OF_MEMORY:
        return out_of_memory_error(text)
    return StepallocError(text, status)


def check(status: int) -> None:
    """Raises the exception for a non-zero status (see ``error_for``)."""
    if status != OK:
        raise error_for(status)


_oom_class: type | None = None


def out_of_memory_error(message: str) -> Exception:
    """An out-of-memory exception: ``torch.cuda.OutOfMemoryError`` when torch is importable
    (a subclass that is also a ``MemoryError``), else a plain ``MemoryError``."""
    global _oom_class
    if _oom_class is None:
        base: tuple[type, ...] = (MemoryError,)
        if "torch" in sys.modules or _torch_importable():
            import torch

            base = (torch.cuda.OutOfMemoryError, MemoryError)
        _oom_class = type("OutOfMemoryError", base, {"__module__": "stepalloc"})
    return _oom_class(message)


def _torch_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def version() -> str:
    """The library's version string."""
    v = lib().stepalloc_version()
    return v.decode() if v else ""


def config_help() -> str:
    """Every configuration key with its default, form and meaning (from the library)."""
    return read_text(lib().stepalloc_config_help)


def configure(conf: str) -> None:
    """Sets the process-wide configuration (``PYTORCH_CUDA_ALLOC_CONF`` syntax).

    Only before the first allocation; afterwards the configuration is fixed and this raises
    ``ValueError``. A bad key or value raises ``ValueError`` with the library's message.
    """
    if not isinstance(conf, str):
        raise TypeError(f"conf must be a str, not {type(conf).__name__}")
    check(lib().stepalloc_configure(conf.encode()))


def device_count() -> int:
    """Number of devices the allocator drives (initialises the allocator)."""
    n = int(lib().stepalloc_device_count())
    if n < 0:
        check(int(lib().stepalloc_last_status()) or UNAVAILABLE)
    return n


def raw_alloc(size: int, device: int = 0, stream: int = 0) -> int:
    """Allocates ``size`` bytes on ``device`` for ``stream`` (a ``cudaStream_t`` as an int,
    0 = default stream) and returns the device address.

    Raises ``torch.cuda.OutOfMemoryError`` (also a ``MemoryError``) when the device is full,
    with the library's report. Pair with ``raw_free``.
    """
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    ptr = lib().stepalloc_malloc(size, device, stream or None)
    if ptr:
        return int(ptr)
    status = int(lib().stepalloc_last_status())
    if status == OK:
        return 0  # a zero-byte request may be served with a null pointer
    raise error_for(status)


def raw_free(ptr: int, size: int = 0, device: int = 0, stream: int = 0) -> None:
    """Frees an address from ``raw_alloc`` (``size``: the size asked for, or 0 if unknown)."""
    lib().stepalloc_free(ptr or None, size, device, stream or None)
    status = int(lib().stepalloc_last_status())
    if status != OK:
        raise error_for(status)


def symbol_address(name: str) -> int:
    """The address of an exported function, for PyTorch's ``set_*_fn`` hooks."""
    addr = ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value
    if not addr:
        raise LibraryNotFoundError(f"{library_path()} does not export {name}")
    return int(addr)
