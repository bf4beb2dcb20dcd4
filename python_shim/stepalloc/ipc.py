"""Layer: PyTorch glue. CUDA IPC of tensors under process-wide stepalloc, in PyTorch's own format.

Under a pluggable allocator PyTorch refuses to share CUDA memory (``CUDAPluggableAllocator does
not yet support shareIPcHandle``) and to open what another process shared. ``patch_torch()``
replaces the two entry points ``torch.multiprocessing.reductions`` goes through, so every
``torch.multiprocessing`` queue or pipe that carries a CUDA tensor works:

- ``torch.UntypedStorage._share_cuda_`` (producer) returns exactly the 8-tuple stock PyTorch
  returns: the handle from ``stepalloc_ipc_share`` (a legacy ``cudaIpcMemHandle_t`` for a
  plain segment, the expandable-segment header with POSIX file descriptors for an expandable
  one) and the block's offset, a reference counter in shared memory (a file of
  ``torch.cuda``'s layout: a 64-byte header whose first int counts the file's users, then
  10,000 ``int64`` counters), and an interprocess event recorded on the current stream. A
  receiver running stock PyTorch opens it with its own ``rebuild_cuda_tensor``, unchanged.
- ``torch.UntypedStorage._new_shared_cuda`` (receiver) waits on the producer's event, maps the
  handle with ``stepalloc_ipc_open`` (from stepalloc or from stock PyTorch) and wraps it in a
  storage whose deleter synchronizes the current stream, decrements the producer's counter and
  closes the mapping, as PyTorch's own deleter does.
- ``torch.cuda.ipc_collect()`` also reaps stepalloc's sent blocks.

Lifetime, as PyTorch promises it: a shared storage is held here (so its block stays allocated,
neither reused nor unmapped) until its counter falls to zero; that is checked at each share and
at ``torch.cuda.ipc_collect()`` (PyTorch's own limbo is reaped at the same moments).

Invariants: the patches act only while stepalloc is PyTorch's allocator process-wide (else
PyTorch's own allocator shares its memory itself and the originals run); torch is imported
inside functions only; every shared-memory file this process creates is unlinked once all its
counters are back at zero, or at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import mmap
import os
import secrets
import struct
import threading
from typing import Any

from . import _lib

# torch/csrc/CudaIPCTypes.h: CUDA_IPC_REF_COUNTER_FILE_SIZE counters per file; and
# c10 RefcountedMapAllocator's header (an atomic int of users) before the data, 64 bytes.
COUNTERS_PER_FILE = 10000
COUNTER_HEADER = 64
COUNTER_FILE_BYTES = COUNTER_HEADER + 8 * COUNTERS_PER_FILE
SHM_DIR = "/dev/shm"

RECEIVED_MESSAGE = (
    "Attempted to send CUDA tensor received from another process; this is not currently supported. "
    "Consider cloning before sending."
)

_lock = threading.RLock()


# ----- producer ------------------------------------------------------------------------------


class _CounterFile:
    """A shared-memory file of reference counters, handed out one slot per share."""

    _serial = 0

    def __init__(self) -> None:
        _CounterFile._serial += 1
        self.name = f"/stepalloc_{os.getpid()}_{secrets.token_hex(4)}_{_CounterFile._serial}"
        fd = os.open(SHM_DIR + self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, COUNTER_FILE_BYTES)
            self.map = mmap.mmap(fd, COUNTER_FILE_BYTES)
        finally:
            os.close(fd)
        # This process is a user of the file for as long as it hands out counters, so a
        # receiver that opens and closes it (PyTorch's RefcountedMapAllocator) never unlinks it.
        struct.pack_into("i", self.map, 0, 1)
        self.handed_out = 0
        self.outstanding = 0

    def take(self) -> int:
        slot = self.handed_out
        struct.pack_into("q", self.map, COUNTER_HEADER + 8 * slot, 1)
        self.handed_out += 1
        self.outstanding += 1
        return slot

    def value(self, slot: int) -> int:
        return int(struct.unpack_from("q", self.map, COUNTER_HEADER + 8 * slot)[0])

    def full(self) -> bool:
        return self.handed_out >= COUNTERS_PER_FILE

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR + self.name)
        self.map.close()


class _Sent:
    """A shared storage, held until its receivers are done with it."""

    __slots__ = ("event", "file", "slot", "storage")

    def __init__(self, storage: Any, file: _CounterFile, slot: int, event: Any) -> None:
        self.storage, self.file, self.slot, self.event = storage, file, slot, event


_counter_file: _CounterFile | None = None
_sent: list[_Sent] = []


def _take_counter() -> tuple[_CounterFile, int]:
    global _counter_file
    if _counter_file is None or _counter_file.full():
        _counter_file = _CounterFile()
    return _counter_file, _counter_file.take()


def collect() -> int:
    """Lets go of the shared storages whose receivers all released them; returns how many.

    A storage let go of here is freed (back to stepalloc's cache) if the program dropped it too.
    A counter file is unlinked once it handed out all its counters and got all of them back.
    """
    with _lock:
        done = [s for s in _sent if s.file.value(s.slot) <= 0]
        if not done:
            return 0
        _sent[:] = [s for s in _sent if s.file.value(s.slot) > 0]
        for s in done:
            # The library may let the block's tag pause again (its receivers let go).
            with contextlib.suppress(Exception):
                _lib.lib().stepalloc_ipc_unshare(int(s.storage.data_ptr()))
            s.file.outstanding -= 1
            if s.file.outstanding == 0 and s.file.full():
                s.file.close()
        return len(done)


def held() -> int:
    """How many shared storages are held for receivers now."""
    with _lock:
        return len(_sent)


def _close_all_at_exit() -> None:
    files = {id(s.file): s.file for s in _sent}
    if _counter_file is not None:
        files[id(_counter_file)] = _counter_file
    for f in files.values():
        with contextlib.suppress(OSError, ValueError):
            f.close()


atexit.register(_close_all_at_exit)


def _received_at(ptr: int) -> bool:
    return any(base <= ptr < base + size for base, size in list(_received.values()))


def share_storage(storage: Any) -> tuple[Any, ...]:
    """``_share_cuda_`` of a stepalloc storage: the 8-tuple PyTorch's ``rebuild_cuda_tensor``
    takes (device, handle, size, offset, counter file, counter slot, event handle, True)."""
    import torch

    device = storage.device.index if storage.device.index is not None else torch.cuda.current_device()
    nbytes = int(storage.nbytes())
    ptr = int(storage.data_ptr())
    if ptr == 0 or nbytes == 0:
        return (device, None, nbytes, 0, None, 0, None, None)
    if _received_at(ptr):
        raise RuntimeError(RECEIVED_MESSAGE)
    library = _lib.lib()
    offset = ctypes.c_uint64(0)
    version = torch_handle_version(torch.__version__)
    buf = ctypes.create_string_buffer(256)
    need = int(library.stepalloc_ipc_share(ptr, version, buf, len(buf), ctypes.byref(offset)))
    if need > len(buf):
        buf = ctypes.create_string_buffer(need)
        need = int(library.stepalloc_ipc_share(ptr, version, buf, len(buf), ctypes.byref(offset)))
    if need == 0:
        raise RuntimeError(f"stepalloc cannot share this CUDA tensor with another process: {_lib.last_error()}")
    handle = buf.raw[:need]
    with _lock:
        collect()
        file, slot = _take_counter()
        with torch.cuda.device(device):
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(device))
            event_handle = event.ipc_handle()
        _sent.append(_Sent(storage, file, slot, event))
    return (device, handle, nbytes, int(offset.value), file.name.encode(), slot, event_handle, True)


def torch_handle_version(version: str) -> int:
    """The handle version the installed torch writes and the newest it opens: 3 from torch 2.13
    (the expandable-segment header gained its handle type), 2 before. A receiving stock PyTorch
    refuses a newer version ("received sharable handle from a future version of torch"), and
    the producer's torch is the receiver's in the usual setup (one environment). The library
    writes the handle in this version (``stepalloc_ipc_share``)."""
    try:
        major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return 3
    return 3 if (major, minor) >= (2, 13) else 2


# ----- receiver ------------------------------------------------------------------------------

# Ranges opened here and still referenced, by id of their owner: (address, size).
_received: dict[int, tuple[int, int]] = {}


def _release_counter(name: bytes, slot: int) -> None:
    """Decrements the producer's counter, as PyTorch's deleter does (best effort: the producer
    may have exited and removed the file)."""
    try:
        fd = os.open(SHM_DIR + name.decode(), os.O_RDWR)
    except (OSError, UnicodeDecodeError):
        return
    try:
        with mmap.mmap(fd, 0) as m:
            at = COUNTER_HEADER + 8 * slot
            if slot >= 0 and at + 8 <= len(m):
                struct.pack_into("q", m, at, struct.unpack_from("q", m, at)[0] - 1)
    except (OSError, ValueError):
        pass
    finally:
        os.close(fd)


def _counter_value(name: bytes, slot: int) -> int | None:
    """The producer's reference counter for a share (None when its file cannot be read)."""
    try:
        fd = os.open(SHM_DIR + name.decode(), os.O_RDONLY)
    except (OSError, UnicodeDecodeError):
        return None
    try:
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
            at = COUNTER_HEADER + 8 * slot
            if slot < 0 or at + 8 > len(m):
                return None
            return int(struct.unpack_from("q", m, at)[0])
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


class _Opened:
    """Owns one open of a shared range; torch drops it when the storage built on it is freed."""

    def __init__(self, device: int, base: int, ptr: int, size: int, counter: bytes | None, slot: int) -> None:
        self.device, self.base, self.counter, self.slot = device, base, counter, slot
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 2}
        _received[id(self)] = (ptr, size)

    def __del__(self) -> None:
        _received.pop(id(self), None)
        # A destructor must not raise (it may run at interpreter exit, with torch half gone).
        with contextlib.suppress(Exception):
            import torch

            # PyTorch's deleter: work queued on the storage must be done before the producer
            # may reuse the memory.
            torch.cuda.current_stream(self.device).synchronize()
        if self.counter:
            _release_counter(self.counter, self.slot)
        with contextlib.suppress(Exception):
            _lib.lib().stepalloc_ipc_close(self.device, self.base)


def open_storage(
    device: int,
    handle: bytes | None,
    size: int,
    offset: int,
    counter: bytes | None,
    slot: int,
    event_handle: bytes | None,
    event_sync_required: bool | None,
) -> Any:
    """``_new_shared_cuda`` under stepalloc: the storage of `size` bytes at `offset` in the range
    `handle` names (from stepalloc or stock PyTorch). A storage that does not lie inside what
    the handle maps raises ``StepallocError`` (naming offset, size and the mapping's size) and
    leaves nothing mapped; so does a share its receivers already released (its counter at zero)."""
    import torch

    device, offset, size = int(device), int(offset), int(size)
    if not 0 <= offset < 1 << 64 or not 0 <= size < 1 << 64:
        raise _lib.ConfigError(
            f"CUDA IPC: the received storage ({size} bytes at offset {offset}) has a negative or "
            "out-of-range offset or size",
            _lib.INVALID_ARGUMENT,
        )
    # A producer (stepalloc's or PyTorch's) sets a share's counter to 1 and every receiver's
    # release takes one off: at zero the share was released and the producer may have freed the
    # memory, and an expandable handle's descriptor numbers may name other pages since (a tuple
    # delivered twice). Refused before anything is opened.
    value = _counter_value(counter, int(slot)) if counter and handle else None
    if value is not None and value <= 0:
        raise _lib.StepallocError(
            f"CUDA IPC: this shared storage ({size} bytes at offset {offset}) was already released by its "
            f"receiver(s) (reference counter {value}), so the producer may have freed or reused its memory; "
            "share the tensor again for each receiver",
            _lib.INVALID_ARGUMENT,
        )
    if event_sync_required and event_handle:
        event = torch.cuda.Event.from_ipc_handle(device, event_handle)
        torch.cuda.current_stream(device).wait_event(event)
    if not handle:
        return None
    library = _lib.lib()
    base = ctypes.c_void_p(0)
    _lib.check(int(library.stepalloc_ipc_open(device, handle, len(handle), offset, size, ctypes.byref(base))))
    owner = _Opened(device, int(base.value or 0), int(base.value or 0) + offset, size, counter, int(slot))
    with torch.cuda.device(device):
        tensor = torch.as_tensor(owner, device=f"cuda:{device}")
    return tensor.untyped_storage()


# ----- the patches ---------------------------------------------------------------------------

_originals: dict[str, Any] | None = None


def patch(torch: Any, active: Any) -> None:
    """Installs the IPC patches; `active()` says whether stepalloc is PyTorch's allocator now."""
    global _originals
    with _lock:
        if _originals is not None:
            return
        storage_cls = torch.UntypedStorage
        original_share = storage_cls._share_cuda_
        original_open = storage_cls._new_shared_cuda
        original_collect = torch.cuda.ipc_collect
        saved = {
            "_share_cuda_": storage_cls.__dict__.get("_share_cuda_"),
            "_new_shared_cuda": storage_cls.__dict__.get("_new_shared_cuda"),
            "ipc_collect": original_collect,
        }

        def _share_cuda_(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not active() or args or kwargs:
                return original_share(self, *args, **kwargs)
            return share_storage(self)

        def _new_shared_cuda(cls: Any, *args: Any, **kwargs: Any) -> Any:
            if not active() or kwargs or len(args) != 8:
                return original_open(*args, **kwargs)
            return open_storage(*args)

        def ipc_collect() -> None:
            if active():
                collect()
            original_collect()

        ipc_collect.__doc__ = original_collect.__doc__
        storage_cls._share_cuda_ = _share_cuda_
        storage_cls._new_shared_cuda = classmethod(_new_shared_cuda)
        torch.cuda.ipc_collect = ipc_collect
        _originals = saved


def unpatch(torch: Any) -> None:
    """Restores what ``patch`` replaced."""
    global _originals
    with _lock:
        if _originals is None:
            return
        for name in ("_share_cuda_", "_new_shared_cuda"):
            if _originals[name] is None:
                delattr(torch.UntypedStorage, name)
            else:
                setattr(torch.UntypedStorage, name, _originals[name])
        torch.cuda.ipc_collect = _originals["ipc_collect"]
        _originals = None


__all__ = ["collect", "held", "open_storage", "patch", "share_storage", "unpatch"]
