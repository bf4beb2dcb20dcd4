"""Layer: PyTorch glue. The CUDA graph captures underway in this process, so that a pause or a
resume refuses to run during one instead of breaking it.

A pause synchronizes the device before its first unmap, and a resume maps pages and copies:
CUDA refuses a device-wide synchronize while any stream of the device captures (in every capture
mode) and, in PyTorch's default ``global`` mode, an unmap or a synchronize from any thread
invalidates the capture. Under ``stepalloc.install()`` the library sees each capture begin and
end (PyTorch tells its allocator) and refuses the call itself. Where PyTorch's own allocator
serves the process (``stepalloc.cumem`` as vLLM uses it, ``stepalloc.mempool()``) the library is
not told, so ``torch.cuda.CUDAGraph.capture_begin`` and ``capture_end_pre`` /``capture_end``
(what ``torch.cuda.graph`` and ``make_graphed_callables`` call) are wrapped to note each capture,
and ``pause`` / ``resume`` run under this module's lock (``none_underway``): a capture that
another thread begins meanwhile waits for them, and one underway refuses them with a
``ValueError`` naming it, before anything changes.

Invariants:
- Each capture is noted once, by its graph object, and forgotten at its end, also when the
  capture failed (``torch.cuda.graph`` ends every capture it began through ``capture_end_pre``
  or ``capture_end``, whichever raises).
- Captures begun outside ``torch.cuda.CUDAGraph`` (C++ or raw CUDA calls) are not seen.
- The wrappers go in once (``ensure``), when a region, a stepalloc pool or ``stepalloc.cumem``
  is first used with torch imported, and at the first pause; they only note and forward.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

from . import _lib

_lock = threading.RLock()
# id(graph) -> (device, thread name) of each capture underway.
_underway: dict[int, tuple[int, str]] = {}
_wrapped = False


def ensure() -> None:
    """Puts the wrappers on ``torch.cuda.CUDAGraph`` (once), if torch is imported."""
    global _wrapped
    if _wrapped or "torch" not in sys.modules:
        return
    import torch

    with _lock:
        if _wrapped:
            return
        graph = getattr(torch.cuda, "CUDAGraph", None)
        if graph is None or not hasattr(graph, "capture_begin"):
            _wrapped = True
            return
        graph.capture_begin = _begin(graph.capture_begin)
        for name in ("capture_end_pre", "capture_end"):
            if hasattr(graph, name):
                setattr(graph, name, _end(getattr(graph, name)))
        _wrapped = True


def _begin(original: Any) -> Any:
    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        # Under the lock: a pause or resume of another thread finishes first.
        with _lock:
            _underway[id(self)] = (torch.cuda.current_device(), threading.current_thread().name)
            try:
                return original(self, *args, **kwargs)
            except BaseException:
                _underway.pop(id(self), None)
                raise

    capture_begin.__wrapped__ = original  # type: ignore[attr-defined]
    return capture_begin


def _end(original: Any) -> Any:
    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            with _lock:
                _underway.pop(id(self), None)

    capture_end.__wrapped__ = original  # type: ignore[attr-defined]
    return capture_end


def underway() -> list[tuple[int, str]]:
    """(device, thread name) of each capture underway."""
    with _lock:
        return list(_underway.values())


@contextlib.contextmanager
def none_underway(what: str) -> Iterator[None]:
    """Runs the block (a pause or a resume, ``what`` naming it) with no capture underway and
    none beginning; raises ``stepalloc.ConfigError`` (a ``ValueError``) when one is underway."""
    ensure()
    with _lock:
        if _underway:
            device, thread = next(iter(_underway.values()))
            raise _lib.ConfigError(
                f"{what} during a CUDA graph capture (device {device}, thread {thread!r}): its device "
                "synchronize and its unmaps or maps would invalidate the capture; call it after the capture ends",
                _lib.INVALID_ARGUMENT,
            )
        yield
