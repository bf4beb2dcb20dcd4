"""Layer: a vLLM ``CuMemAllocator``-shaped object over ``stepalloc.sleep``, so code written
against vLLM's sleep mode (``vllm/device_allocator/cumem.py``) moves with one import::

    from stepalloc.cumem import CuMemAllocator

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        weights = torch.empty(..., device="cuda")
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = torch.empty(..., device="cuda")
    allocator.sleep(offload_tags=("weights",))   # weights to host, KV cache discarded
    allocator.wake_up(["weights"])               # same addresses, bytes back

Invariants:
- Tags, pause, resume and the backup are the library's (``sleep``); this object keeps only the
  names of the tags its pools used, in first-use order. It has no sleep logic of its own.
- Like vLLM's, it needs no process-wide installation and works after CUDA is initialised: each
  ``use_memory_pool`` enters a ``torch.cuda.MemPool`` whose segments come from stepalloc
  (``stepalloc.mempool()``), inside a region of the tag. When ``stepalloc.install()`` made
  stepalloc the process's allocator, the region alone tags the memory (a pool there would be a
  graph-style private pool, which carries no tag of its own).
- vLLM's ``"default"`` tag is ``cumem.default`` in the library, whose ``"default"`` is the
  untagged memory outside every region (which vLLM's allocator never sees either).
- In MemPool mode PyTorch's cache sits in front: a tensor freed inside a pool leaves its segment
  cached by PyTorch, which stepalloc sees as live, so a ``sleep`` backs it up (or discards it)
  with the tag. vLLM's allocator gives such segments back when ``use_memory_pool`` exits; under
  ``install()`` there is no such cache.
- A ``wake_up`` that finds the device full raises ``torch.cuda.OutOfMemoryError`` (a
  ``RuntimeError``); the tags it could not resume stay paused with their backups, so calling
  it again once memory is free loses nothing. Tags it resumed before the failure stay resumed
  (vLLM unmaps them again; here a retry skips them).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from . import sleep

# vLLM's default tag, and its name in the library (see the module docstring).
DEFAULT_TAG = "default"
LIBRARY_DEFAULT_TAG = "cumem.default"


def _library_tag(tag: str) -> str:
    return LIBRARY_DEFAULT_TAG if tag == DEFAULT_TAG else tag


class CuMemAllocator:
    """The shape of ``vllm.device_allocator.cumem.CuMemAllocator``, over stepalloc."""

    instance: CuMemAllocator | None = None
    default_tag: str = DEFAULT_TAG
    _instance_lock = threading.Lock()

    @staticmethod
    def get_instance() -> CuMemAllocator:
        """The process's one allocator (vLLM's is a singleton too)."""
        with CuMemAllocator._instance_lock:
            if CuMemAllocator.instance is None:
                CuMemAllocator.instance = CuMemAllocator()
            return CuMemAllocator.instance

    def __init__(self) -> None:
        self._tags: dict[str, None] = {}  # vLLM tag names, in first-use order
        self._pools: dict[str, Any] = {}  # one MemPool per tag when not installed process-wide
        self.current_tag: str = DEFAULT_TAG

    @contextlib.contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[None]:
        """Tensors allocated inside carry ``tag`` (None: ``"default"``)."""
        if tag is None:
            tag = DEFAULT_TAG
        if not isinstance(tag, str):
            raise TypeError(f"use_memory_pool: tag must be a str, not {type(tag).__name__}")
        from . import torch as _torch

        installed = _torch.is_installed()
        # A bad tag fails here. Not installed: the region is entered inside the tag's pool.
        region = sleep.region(_library_tag(tag), backup=False, _pool_routed=not installed)
        old, self.current_tag = self.current_tag, tag
        try:
            self._tags.setdefault(tag, None)
            if installed:
                with region:
                    yield
            else:
                import torch

                pool = self._pools.get(tag)
                if pool is None:
                    pool = self._pools[tag] = _torch.mempool()
                with torch.cuda.use_mem_pool(pool), region:
                    yield
        finally:
            self.current_tag = old

    def _known(self) -> list[str]:
        """This object's tags that have memory in the library."""
        known = sleep.tags()
        return [t for t in self._tags if _library_tag(t) in known]

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        """Releases the device memory of every tag this object's pools used, keeping the
        addresses: tags in ``offload_tags`` (None: ``("default",)``) are copied to host memory
        first, the others discarded."""
        if offload_tags is None:
            offload_tags = (DEFAULT_TAG,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        offload = set(offload_tags)
        known = self._known()
        if known:
            # One call for every tag: the offloaded tags' copies run under the others' unmaps.
            sleep._pause_each({_library_tag(tag): tag in offload for tag in known})

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Maps the memory of ``tags`` (None: every tag) again at the same addresses, with the
        offloaded bytes restored; discarded tags come back with undefined contents."""
        wanted = None if tags is None else set(tags)
        targets = [_library_tag(tag) for tag in self._known() if wanted is None or tag in wanted]
        if targets:
            sleep.resume(targets)

    def get_current_usage(self) -> int:
        """Bytes allocated in this object's pools, asleep or awake."""
        known = sleep.tags()
        total = 0
        for tag in self._tags:
            figures = known.get(_library_tag(tag), {})
            total += int(figures.get("live_bytes", 0)) + int(figures.get("paused_bytes", 0))
        return total
