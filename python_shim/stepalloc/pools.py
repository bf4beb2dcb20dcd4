"""Layer: PyTorch glue. ``MemPool``: ``torch.cuda.MemPool`` under process-wide stepalloc.

PyTorch's own ``MemPool`` asks the allocator to create the pool (``createOrIncrefPool``), which
its pluggable-allocator class refuses; ``patch_torch()`` (after ``install()``) puts this class
in its place in ``torch.cuda`` and ``torch.cuda.memory``. A pool is one of stepalloc's private
pools (the ones CUDA graphs allocate to): ``torch.cuda.use_mem_pool``, graph capture into a pool
and ``torch.cuda.memory_snapshot(pool.id)`` reach it through PyTorch's own pool hooks.

Invariants:
- A pool's id comes from PyTorch's own counter (``torch._C._graph_pool_handle``), so it never
  equals a graph pool's or another MemPool's id.
- ``MemPool(allocator=...)`` needs the functions behind the allocator: ``patch_torch()`` wraps
  ``torch._C._cuda_customAllocator`` (what ``CUDAPluggableAllocator`` calls) to note them in
  ``_SEGMENT_FUNCTIONS``; an allocator made before that, or by C++, is refused with a message.
  The noted allocators stay alive for the life of the process (their functions free segments).
"""

from __future__ import annotations

import threading
from typing import Any

from . import _lib, follow

# id(torch._C._cuda_CUDAAllocator) -> (that object, alloc function address, free function address)
_SEGMENT_FUNCTIONS: dict[int, tuple[Any, int, int]] = {}
_registry_lock = threading.Lock()


def record_custom_allocator(original: Any) -> Any:
    """A wrapper of ``torch._C._cuda_customAllocator`` that notes the two function addresses of
    every allocator it makes, for ``MemPool(allocator=...)``."""

    def stepalloc_custom_allocator(alloc_fn: int, free_fn: int) -> Any:
        made = original(alloc_fn, free_fn)
        with _registry_lock:
            _SEGMENT_FUNCTIONS[id(made)] = (made, int(alloc_fn), int(free_fn))
        return made

    stepalloc_custom_allocator.__wrapped__ = original  # type: ignore[attr-defined]
    return stepalloc_custom_allocator


def _segment_functions(allocator: Any) -> tuple[int, int] | None:
    """The (alloc, free) addresses behind ``allocator``; None when it is stepalloc itself (the
    pool is then served from stepalloc's own heap)."""
    raw = allocator.allocator() if hasattr(allocator, "allocator") and callable(allocator.allocator) else allocator
    with _registry_lock:
        entry = _SEGMENT_FUNCTIONS.get(id(raw))
    if entry is None or entry[0] is not raw:
        raise _lib.StepallocError(
            "stepalloc: MemPool(allocator=...) was given an allocator whose functions stepalloc cannot "
            "see (one made before stepalloc.install(patch_torch=True), or by C++). Instead: create the "
            "torch.cuda.memory.CUDAPluggableAllocator after stepalloc.install(patch_torch=True), or leave "
            "allocator out to allocate the pool's segments from stepalloc.",
            _lib.INVALID_ARGUMENT,
        )
    _, alloc_fn, free_fn = entry
    own = {_lib.symbol_address(name) for name in ("stepalloc_malloc", "stepalloc_torch_malloc")}
    return None if alloc_fn in own else (alloc_fn, free_fn)


class MemPool:
    """``torch.cuda.MemPool`` under process-wide stepalloc, with PyTorch's arguments and methods.

    Args:
        allocator: another allocator for the pool's segments (a
            ``torch.cuda.memory.CUDAPluggableAllocator`` or its ``.allocator()``), as vLLM's
            sleep mode passes one: stepalloc caches the pool's blocks and asks it for whole
            segments, and gives them back through its free function (``empty_cache`` once the
            pool is released, or the out-of-memory path). None: segments from stepalloc.
        use_on_oom: a general allocation that finds no memory may take a free block of this pool.
        no_split: each block takes a whole segment, never split from a larger one (as
            PyTorch's: a 4 MiB tensor holds a whole 20 MiB segment, and the next one another).

    The pool serves the device current when it is made; ``use_mem_pool(pool, device=d)`` for
    another device raises ``StepallocError`` naming both. ``use_mem_pool`` of a pool this thread
    is inside already nests: the inner route ends first and the outer one routes again.
    """

    def __init__(self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False) -> None:
        import torch

        self._released = True  # nothing to release until the pool exists
        functions = None if allocator is None else _segment_functions(allocator)
        self._device = int(torch.cuda.current_device())
        self._id = tuple(int(x) for x in torch._C._graph_pool_handle())
        self._allocator = allocator
        lib = _lib.lib()
        _lib.check(int(lib.stepalloc_pool_create(self._device, *self._id)))
        self._released = False
        follow.follow_pool(self._id, self._device)  # backward() inside use_mem_pool allocates here too
        try:
            if functions is not None:
                _lib.check(int(lib.stepalloc_pool_set_segment_allocator(self._device, *self._id, *functions)))
            if use_on_oom:
                _lib.check(int(lib.stepalloc_pool_set_use_on_oom(self._device, *self._id, 1)))
            if no_split:
                _lib.check(int(lib.stepalloc_pool_set_no_split(self._device, *self._id, 1)))
        except BaseException:
            self._release()
            raise

    @property
    def id(self) -> tuple[int, int]:
        """The pool's id, as ``torch.cuda.MemPool.id``: ``(0, n)``."""
        return self._id

    @property
    def allocator(self) -> Any:
        """The allocator given for the pool's segments (None: stepalloc's own)."""
        return self._allocator

    def use_count(self) -> int:
        """References to the pool: this object, each ``use_mem_pool`` underway, each CUDA graph
        that captured into it and is not reset."""
        count = int(_lib.lib().stepalloc_pool_use_count(self._device, *self._id))
        if count < 0:
            raise _lib.error_for(int(_lib.lib().stepalloc_last_status()))
        return count

    def snapshot(self, include_traces: bool = True) -> list[dict[str, Any]]:
        """The pool's segments, as ``torch.cuda.memory_snapshot(pool.id)``."""
        import torch

        return torch.cuda.memory_snapshot(self._id, include_traces=include_traces)

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            import torch

            # PyTorch's releasePool hook: the same path a graph's pool takes.
            torch._C._cuda_releasePool(self._device, self._id)
        except Exception:  # noqa: BLE001 - at interpreter exit torch may be gone already
            pass

    def __del__(self) -> None:
        if hasattr(self, "_released"):
            self._release()

    def __repr__(self) -> str:
        return f"stepalloc.MemPool(id={self._id}, device={self._device})"
