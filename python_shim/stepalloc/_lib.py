"""Layer: the one ctypes handle on ``libstepalloc.so`` and the errors its status codes map to.

Invariants:
- The library is located once per process (``library_path()``) and loaded once (``lib()``).
  PyTorch's ``CUDAPluggableAllocator`` is given exactly the same absolute path, so ``dlopen``
  returns the same loaded object and ctypes and PyTorch share one allocator state.
- Every control call goes through ``_check``: a non-zero status becomes a Python exception that
  carries the library's own message (``stepalloc_last_error``, a thread-local in the library,
  read on the same thread right after the failing call).
- Nothing here imports torch at module import time.
- No integer or string reaches ctypes unchecked: ctypes wraps an out-of-range integer silently
  (``2**64 + 1000`` bytes becomes 1000) and C cuts a string at its first NUL, so
  ``c_int_arg``/``c_size_arg``/``c_pointer_arg`` and ``c_string`` refuse those first.
- The configuration is fixed once ``install()`` ran (``fix_configuration``) or the allocator
  exists (``initialised()``); ``configure`` refuses it then, under ``_config_lock``, which
  ``install()`` holds from its own ``configure`` to the swap.
"""

from __future__ import annotations

import ctypes
import operator
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

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
PAUSED = 8  # the operation needs a tag that is paused (stepalloc.pause)

STATUS_NAMES = {
    OK: "OK",
    OUT_OF_MEMORY: "OUT_OF_MEMORY",
    UNKNOWN_POINTER: "UNKNOWN_POINTER",
    INVALID_ARGUMENT: "INVALID_ARGUMENT",
    CONFIG: "CONFIG",
    DRIVER: "DRIVER",
    UNAVAILABLE: "UNAVAILABLE",
    PANIC: "PANIC",
    PAUSED: "PAUSED",
}


class StepallocError(RuntimeError):
    """A call into libstepalloc failed. ``status`` is the library's status code."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ConfigError(StepallocError, ValueError):
    """A configuration string or an argument was rejected (also a ``ValueError``)."""


class UnsupportedError(StepallocError):
    """A PyTorch memory entry point that stepalloc's process-wide allocator cannot serve; the
    message says why and what to do instead (``stepalloc.parity`` lists them). Also a
    ``RuntimeError``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, INVALID_ARGUMENT)


def unsupported_message(name: str, note: str, instead: str) -> str:
    """The text of the ``UnsupportedError`` that entry point ``name`` raises."""
    return f"stepalloc: {name} is not available under stepalloc's process-wide allocator ({note}). Instead: {instead}."


class PausedError(StepallocError):
    """The operation needs memory of a tag that is paused (``stepalloc.pause``): allocating
    inside a paused tag's region, sharing a paused tensor. ``stepalloc.resume(tag)`` first."""


class LibraryNotFoundError(ImportError):
    """``libstepalloc.so`` could not be found or loaded."""


_lock = threading.Lock()
_path: str | None = None
_lib: ctypes.CDLL | None = None

# The configuration's state as seen from Python (see the invariants at the top).
_config_lock = threading.RLock()
_fixed_by: str | None = None  # what fixed the configuration ("install()"), None while open
_pending_conf: str | None = None  # the text ``configure`` last gave the library

# The ranges of the C types the library takes (LP64: int is 32 bits, size_t 64).
INT_MAX = 2 ** (8 * ctypes.sizeof(ctypes.c_int) - 1) - 1
SIZE_MAX = 2 ** (8 * ctypes.sizeof(ctypes.c_size_t)) - 1
POINTER_MAX = 2 ** (8 * ctypes.sizeof(ctypes.c_void_p)) - 1


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
        + "\nIn the stepalloc repository, reinstall the package with `pip install ./python_shim` (it "
        "builds the library with cargo) or build it with `cargo build --release -p stepalloc-cabi`; or set "
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
        "stepalloc_check_phase": ([c_char_p, c_size_t], c_int),
        "stepalloc_metrics_serve": ([c_char_p], c_int),
        "stepalloc_reset_peak_stats": ([c_int], c_int),
        "stepalloc_reset_accumulated_stats": ([c_int], c_int),
        "stepalloc_device_count": ([], c_int),
        "stepalloc_is_initialised": ([], c_int),
        "stepalloc_config_device_count": ([c_char_p], c_int),
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
        "stepalloc_memory_fraction": ([c_int], c_double),
        "stepalloc_set_expandable_segments": ([c_int], c_int),
        "stepalloc_attach_oom_observer": ([c_void_p], c_int),
        "stepalloc_set_caching_enabled": ([c_int], c_int),
        "stepalloc_caching_enabled": ([], c_int),
        "stepalloc_set_mempool_mode": ([c_int], c_int),
        "stepalloc_record_history": ([ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)], c_int),
        # User memory pools (pools.py): device, pool id.
        "stepalloc_pool_create": ([c_int, ctypes.c_uint64, ctypes.c_uint64], c_int),
        "stepalloc_pool_use_count": ([c_int, ctypes.c_uint64, ctypes.c_uint64], c_int),
        "stepalloc_pool_set_segment_allocator": ([c_int, ctypes.c_uint64, ctypes.c_uint64, c_void_p, c_void_p], c_int),
        "stepalloc_pool_set_use_on_oom": ([c_int, ctypes.c_uint64, ctypes.c_uint64, c_int], c_int),
        "stepalloc_pool_set_no_split": ([c_int, ctypes.c_uint64, ctypes.c_uint64, c_int], c_int),
        # Pool checkpoints (parity.py, CUDA-graph trees): device, pool id, words, capacity;
        # restore(device, state, words, flags, freed, cap, allocated, cap, counts).
        "stepalloc_pool_checkpoint": (
            [c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64), c_size_t],
            c_size_t,
        ),
        # NCCL buffer registration (nccl.py): device, pool id, ctx, register, deregister.
        "stepalloc_pool_register_segments": (
            [c_int, ctypes.c_uint64, ctypes.c_uint64, c_void_p, c_void_p, c_void_p],
            c_int,
        ),
        "stepalloc_pool_restore": (
            [
                c_int,
                ctypes.POINTER(ctypes.c_uint64),
                c_size_t,
                c_int,
                ctypes.POINTER(ctypes.c_uint64),
                c_size_t,
                ctypes.POINTER(ctypes.c_uint64),
                c_size_t,
                ctypes.POINTER(c_size_t),
            ],
            c_int,
        ),
        # CUDA IPC (ipc.py): share(ptr, handle version, buf, cap, &offset);
        # open(device, handle, len, offset, size, &base).
        "stepalloc_ipc_share": ([c_void_p, c_int, c_char_p, c_size_t, ctypes.POINTER(ctypes.c_uint64)], c_size_t),
        "stepalloc_ipc_open": (
            [c_int, c_char_p, c_size_t, ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(c_void_p)],
            c_int,
        ),
        "stepalloc_ipc_close": ([c_int, c_void_p], c_int),
        "stepalloc_ipc_unshare": ([c_void_p], c_int),
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
    if status == PAUSED:
        return PausedError(text, status)
    return StepallocError(text, status)


def check(status: int) -> None:
    """Raises the exception for a non-zero status (see ``error_for``)."""
    if status != OK:
        raise error_for(status)


_oom_class: type | None = None


def out_of_memory_error(message: str) -> Exception:
    """An out-of-memory exception: ``torch.cuda.OutOfMemoryError`` when torch imports (a
    subclass that is also a ``MemoryError``), else stepalloc's own ``OutOfMemoryError``, a
    plain ``MemoryError``. The class is chosen once: a torch that failed to import is not
    imported again (a second attempt fails differently, "torch can only be initialized once")."""
    global _oom_class
    if _oom_class is None:
        torch_oom = _torch_out_of_memory_error()
        base: tuple[type, ...] = (torch_oom, MemoryError) if torch_oom is not None else (MemoryError,)
        _oom_class = type("OutOfMemoryError", base, {"__module__": "stepalloc"})
    return _oom_class(message)


def _torch_out_of_memory_error() -> type | None:
    """``torch.cuda.OutOfMemoryError``, or None when torch is not installed or does not import.

    An installed torch can fail to import in many ways (a CUDA library missing: ``ValueError``
    or ``OSError``; a half-initialised earlier import: ``ImportError``; a stub without ``cuda``:
    ``AttributeError``); every one of them means no torch here, never an error in place of the
    out-of-memory being reported.
    """
    try:
        if "torch" not in sys.modules and not _torch_importable():
            return None
        import torch

        cls = torch.cuda.OutOfMemoryError
    except Exception:  # noqa: BLE001 - any failure to import torch: see above
        return None
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None


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


def _checked_int(value: Any, what: str, low: int, high: int, c_type: str) -> int:
    """``value`` as a Python int in ``low..high``: ``TypeError`` for a non-integer (a bool
    included), ``ValueError`` below ``low``, ``OverflowError`` above ``high``."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, not bool")
    try:
        number = operator.index(value)  # ints and integer-like types (numpy), never floats
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}") from None
    if number < low:
        raise ValueError(f"{what} {number} is out of range: accepted {low}..{high} ({c_type})")
    if number > high:
        raise OverflowError(f"{what} {number} is out of range: accepted {low}..{high} ({c_type})")
    return number


def c_int_arg(value: object, what: str) -> int:
    """A non-negative C ``int`` argument (device numbers)."""
    return _checked_int(value, what, 0, INT_MAX, "a C int")


def c_size_arg(value: object, what: str) -> int:
    """A C ``size_t`` argument (sizes in bytes)."""
    return _checked_int(value, what, 0, SIZE_MAX, "a C size_t")


def c_pointer_arg(value: object, what: str) -> int:
    """A pointer-sized argument (device addresses, ``cudaStream_t`` handles as ints)."""
    return _checked_int(value, what, 0, POINTER_MAX, "a pointer")


def c_string(value: object, what: str) -> bytes:
    """``value`` as the UTF-8 bytes of a C string. A NUL inside would end the string there and
    the rest would be dropped silently, so it is refused (``ValueError``)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    at = value.find("\x00")
    if at >= 0:
        raise ConfigError(
            f"{what} {value!r} contains a NUL character (at index {at}); the library reads C strings, "
            f"which end at the first NUL, so it would see only {value[:at]!r}",
            INVALID_ARGUMENT,
        )
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} {value!r} is not valid Unicode text ({e})", INVALID_ARGUMENT) from None


def initialised() -> bool:
    """Whether the library's allocator exists (creates nothing). Before it does, nothing has
    been allocated, every statistic is zero and the configuration can still change."""
    return bool(lib().stepalloc_is_initialised())


def configuration_fixed() -> bool:
    """Whether the configuration can no longer change: ``install()`` ran or the allocator exists.
    Calls that need the allocator may then create it without fixing anything new."""
    return _fixed_by is not None or initialised()


def fix_configuration(by: str) -> None:
    """Marks the configuration fixed by ``by`` (``install()``): ``configure`` refuses from now on."""
    global _fixed_by
    with _config_lock:
        _fixed_by = by


def pending_configuration() -> tuple[str, str]:
    """The configuration the allocator will be created with, and where it comes from: the text
    given to ``configure``, else ``STEPALLOC_CONF``, else the defaults (as the library chooses)."""
    with _config_lock:
        if _pending_conf is not None:
            return _pending_conf, "configure()"
    env = os.environ.get("STEPALLOC_CONF")
    if env is not None:
        return env, f"STEPALLOC_CONF={env!r}"
    return "", "the default configuration"


def adopt_environment() -> None:
    """Gives ``STEPALLOC_CONF`` to the library now, when it is set and nothing else chose the
    configuration yet. The library would read it only when the allocator is created, at the
    first allocation, and a bad string would fail there; this fails at once, naming the
    variable. The text is the same, so the configuration is the same."""
    with _config_lock:
        env = os.environ.get("STEPALLOC_CONF")
        if env is None or _pending_conf is not None or _fixed_by is not None or initialised():
            return
        configure(env, source=f"STEPALLOC_CONF={env!r}")


def configure(conf: str, source: str | None = None) -> None:
    """Sets the process-wide configuration (``PYTORCH_CUDA_ALLOC_CONF`` syntax).

    Only before ``install()`` and before the first allocation; afterwards the configuration is
    fixed and this raises ``ValueError``. A bad key or value raises ``ValueError`` with the
    library's message (prefixed with ``source``, where the text came from, when given).
    """
    global _pending_conf
    data = c_string(conf, "configuration string")
    with _config_lock:
        if _fixed_by is not None:
            raise ConfigError(
                f"stepalloc's configuration is fixed since {_fixed_by}; configure({conf!r}) cannot apply "
                "(pass the configuration to install(conf=...) or set STEPALLOC_CONF before it)",
                INVALID_ARGUMENT,
            )
        status = int(lib().stepalloc_configure(data))
        if status != OK:
            error = error_for(status)
            if source is not None and isinstance(error, StepallocError):
                raise type(error)(f"{source}: {error}", error.status) from None
            raise error
        _pending_conf = conf


def device_count() -> int:
    """Number of devices the allocator drives. Before it exists (nothing allocated yet), the
    number it will drive under the pending configuration (see ``pending_configuration``),
    without creating it: ``sim_devices`` on the simulated device, else the CUDA driver's count."""
    if initialised():
        n = int(lib().stepalloc_device_count())
        if n < 0:
            check(int(lib().stepalloc_last_status()) or UNAVAILABLE)
        return n
    conf, source = pending_configuration()
    n = int(lib().stepalloc_config_device_count(c_string(conf, source)))
    if n < 0:
        status = int(lib().stepalloc_last_status()) or UNAVAILABLE
        raise error_for(status, f"{source}: {last_error()}")
    return n


def raw_alloc(size: int, device: int = 0, stream: int = 0) -> int:
    """Allocates ``size`` bytes on ``device`` for ``stream`` (a ``cudaStream_t`` as an int,
    0 = default stream) and returns the device address.

    Raises ``torch.cuda.OutOfMemoryError`` (also a ``MemoryError``) when the device is full,
    with the library's report; ``ValueError`` / ``OverflowError`` for an argument outside its C
    type (``size``: 0..2**64-1, ``device``: 0..2**31-1). Pair with ``raw_free``.
    """
    size = c_size_arg(size, "raw_alloc: size")
    device = c_int_arg(device, "raw_alloc: device")
    stream = c_pointer_arg(stream, "raw_alloc: stream")
    ptr = lib().stepalloc_malloc(size, device, stream or None)
    if ptr:
        return int(ptr)
    status = int(lib().stepalloc_last_status())
    if status == OK:
        return 0  # a zero-byte request may be served with a null pointer
    raise error_for(status)


def raw_free(ptr: int, size: int = 0, device: int = 0, stream: int = 0) -> None:
    """Frees an address from ``raw_alloc`` (``size``: the size asked for, or 0 if unknown)."""
    ptr = c_pointer_arg(ptr, "raw_free: ptr")
    size = c_size_arg(size, "raw_free: size")
    device = c_int_arg(device, "raw_free: device")
    stream = c_pointer_arg(stream, "raw_free: stream")
    if ptr == 0:
        return
    if not initialised():
        # Nothing was allocated yet, so the pointer cannot be ours; asking the library would
        # create the allocator and fix the configuration.
        raise ConfigError(
            f"raw_free: {ptr:#x} was not allocated by stepalloc (nothing is allocated yet)", UNKNOWN_POINTER
        )
    lib().stepalloc_free(ptr, size, device, stream or None)
    status = int(lib().stepalloc_last_status())
    if status != OK:
        raise error_for(status)


def symbol_address(name: str) -> int:
    """The address of an exported function, for PyTorch's ``set_*_fn`` hooks."""
    addr = ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value
    if not addr:
        raise LibraryNotFoundError(f"{library_path()} does not export {name}")
    return int(addr)
