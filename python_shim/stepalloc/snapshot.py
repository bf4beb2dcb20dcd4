"""Layer: memory snapshots in the layout of ``torch.cuda.memory._snapshot()``.

Invariants:
- The structure comes from the library (``stepalloc_snapshot_json``): ``segments`` (each with
  ``blocks`` and their ``state``), ``device_traces`` (one list per device; actions ``alloc``,
  ``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``),
  ``external_annotations`` (step markers, ``stage`` START/END) and ``allocator_settings``.
- ``dump_snapshot`` writes ``pickle.dump(snapshot)``, exactly what
  ``torch.cuda.memory._dump_snapshot`` writes, so https://pytorch.org/memory_viz opens it.
- Device traces are empty unless the allocator records them (``trace_entries:N`` in the
  configuration), as torch's are empty without ``_record_memory_history``.
"""

from __future__ import annotations

import json
import os
import pickle
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

    The file is written whole to a temporary name and then renamed, so a reader never sees a
    half-written snapshot.
    """
    snapshot = memory_snapshot()
    target = os.fspath(path)
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        pickle.dump(snapshot, f)
    os.replace(tmp, target)
    return target


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
