"""Layer: memory snapshots in the layout of ``torch.cuda.memory._snapshot()``.

Invariants:
- The structure comes from the library (``stepalloc_snapshot_json``): ``segments`` (each with
  ``blocks`` and their ``state``), ``device_traces`` (one list per device; actions ``alloc``,
  ``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``),
  ``external_annotations`` (step markers, ``stage`` START/END) and ``allocator_settings``.
- ``dump_snapshot`` writes ``pickle.dump(snapshot)``, exactly what
  ``torch.cuda.memory._dump_snapshot`` writes, so https://pytorch.org/memory_viz opens it, and
  like it writes to what the path names: a symlink's target, a FIFO, a device. Only a path that
  is a regular file (with one link) or nothing yet is written whole under a temporary name and
  renamed over it; nothing else is ever replaced. Errors name the caller's path.
- Device traces are empty unless the allocator records them (``trace_entries:N`` in the
  configuration), as torch's are empty without ``_record_memory_history``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import stat
import threading
from typing import Any

from . import _lib


def memory_snapshot() -> dict[str, Any]:
    """The allocator's state as ``torch.cuda.memory._snapshot()`` returns it (a dict)."""
    text = _lib.read_text(_lib.lib().stepalloc_snapshot_json)
    if not text:
        _lib.check(int(_lib.lib().stepalloc_last_status()) or _lib.UNAVAILABLE)
    return json.loads(text)


def dump_snapshot(path: str | os.PathLike[str] = "stepalloc_snapshot.pickle") -> str:
    """Writes the snapshot pickle that PyTorch's memory viewer opens; returns the path.

    Like ``torch.cuda.memory._dump_snapshot`` it writes to what ``path`` names (a symlink's
    target, a FIFO, ``/dev/stdout``). A regular file, or a path that names nothing yet, is
    written whole under a temporary name beside it and then renamed over it, so a reader never
    sees a half-written snapshot and a failed write (a full disk) leaves the old file as it was.
    Raises ``OSError`` naming ``path``.
    """
    data = pickle.dumps(memory_snapshot())
    target = os.fspath(path)
    try:
        if not (_replaceable(target) and _write_and_rename(target, data)):
            with open(target, "wb") as f:
                f.write(data)
    except OSError as e:
        if e.errno is None:
            raise
        # The temporary name is ours, not the caller's: the error names the path given.
        raise OSError(e.errno, f"dump_snapshot: {e.strerror}", target) from None
    return target


def _replaceable(target: str) -> bool:
    """Whether ``target`` may be replaced by a rename: it names nothing yet, or a regular file
    with no other link (a rename would turn a symlink, FIFO or device into a regular file, and
    cut a hard link off)."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _write_and_rename(target: str, data: bytes) -> bool:
    """Writes ``data`` to a new file beside ``target`` and renames it over ``target``; returns
    False, having written nothing, when the directory does not let it create one (the file
    itself may still be writable: then it is written in place)."""
    tmp = f"{target}.tmp{os.getpid()}.{threading.get_ident()}"
    try:
        f = open(tmp, "xb")  # noqa: SIM115 - closed below; "x": never opens what is already there
    except PermissionError:
        return False
    try:
        with f:
            f.write(data)
            with contextlib.suppress(FileNotFoundError):
                os.chmod(f.fileno(), stat.S_IMODE(os.stat(target).st_mode))  # the old file's mode
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return True


def trace_jsonl() -> str:
    """The recorded trace in stepalloc's JSON-lines format (what ``stepalloc-stress`` replays);
    empty unless ``trace_entries:N`` is configured."""
    return _lib.read_text(_lib.lib().stepalloc_trace_jsonl)


def dump_trace(path: str | os.PathLike[str]) -> str:
    """Writes ``trace_jsonl()`` to ``path``; returns the path."""
    target = os.fspath(path)
    with open(target, "w", encoding="utf-8") as f:
        f.write(trace_jsonl())
    return target
