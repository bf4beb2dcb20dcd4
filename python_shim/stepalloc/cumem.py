"""Layer: vLLM 0.34's ``CuMemAllocator`` (``vllm/device_allocator/cumem.py``) over
``stepalloc.sleep``, so code written against vLLM's sleep mode moves with one import::

    from stepalloc.cumem import CuMemAllocator

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        weights = torch.empty(..., device="cuda")
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = torch.empty(..., device="cuda")
    allocator.sleep(offload_tags=("weights",))   # weights to host, everything else discarded
    allocator.wake_up(["weights"])               # weights back; kv_cache may wait (deferrable)

The surface and its meaning are vLLM 0.34's: ``sleep(offload_tags, discardable)``,
``discard(tags)``, ``wake_up(tags)`` (only ``DEFERRABLE_TAGS`` can be left asleep),
``use_memory_pool(tag)``, ``cudagraph_pool()``, ``release_pools()``, ``close()``,
``get_current_usage()`` (asleep bytes included) and ``pointer_to_data`` (address ->
``AllocationData``: handle ``(device, size, address, 0)``, tag, ``is_asleep``, and
``cpu_backup_tensor``: the host address of the backup while asleep with one, else None).

Invariants:
- Tags, pause, resume and the backup are the library's (``sleep``): this object keeps the
  vLLM tag names its pools used (first-use order), the ids of the ``torch.cuda.MemPool`` each
  entry made, and the graph pool. Everything it reports is read from the library.
- Like vLLM's, it needs no process-wide installation and works after CUDA is initialised: each
  ``use_memory_pool`` entry makes a new ``torch.cuda.MemPool`` whose segments come from stepalloc
  (``stepalloc.mempool()``), entered with a region of the tag. The pool is not kept after the
  entry: PyTorch's pool destructor gives its free segments back at once, and a segment freed
  later goes back with the next ``torch.cuda.empty_cache()`` (which ``sleep`` and ``wake_up``
  run first, as vLLM's do), so memory freed while asleep is never mapped again and nothing
  grows over cycles. Re-entering a tag gives back the segments its earlier entries left free.
  When ``stepalloc.install()`` made stepalloc the process's allocator, the region alone tags
  the memory.
- vLLM's ``"default"`` tag is ``cumem.default`` in the library, whose ``"default"`` is the
  untagged memory outside every region (which vLLM's allocator never sees either).
- A pause synchronizes the device before its first unmap; a ``sleep`` of several tags is one
  library call (the offloaded tags' copies run under the others' unmaps). An allocation asleep
  already keeps its policy (its tag is skipped).
- A ``wake_up`` that finds the device full raises ``torch.cuda.OutOfMemoryError`` (a
  ``RuntimeError``); the tags it could not resume stay asleep with their backups, so calling
  it again once memory is free loses nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
from collections.abc import Collection, Iterator
from typing import Any

from . import sleep

# vLLM's default tag, and its name in the library (see the module docstring).
DEFAULT_TAG = "default"
LIBRARY_DEFAULT_TAG = "cumem.default"
# Selective wake may defer only these; any wake restores every other tag (vLLM 0.34).
DEFERRABLE_TAGS: tuple[str, ...] = ("weights", "kv_cache")
# The tag of CUDA-graph memory captured into ``cudagraph_pool()``.
CUDAGRAPH_TAG = "cudagraph"
EXPANDABLE_SEGMENTS = "expandable_segments"

logger = logging.getLogger(__name__)


def _library_tag(tag: str) -> str:
    return LIBRARY_DEFAULT_TAG if tag == DEFAULT_TAG else tag


@dataclasses.dataclass
class AllocationData:
    """One allocation as vLLM's ``pointer_to_data`` describes it (a snapshot, not live)."""

    handle: tuple[int, int, int, int]  # device, size, address, 0 (no driver handle here)
    tag: str
    cpu_backup_tensor: int | None = None  # host address of the backup while asleep with one
    is_asleep: bool = False


@contextlib.contextmanager
def _without_expandable_segments() -> Iterator[None]:
    """PyTorch's expandable segments do not mix with a pool of a pluggable allocator
    (pytorch #147851): off inside, as vLLM does, rewriting the whole settings string (PyTorch
    resets every option the string leaves out) and restoring it after."""
    import torch

    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    set_ = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    conf = get() if get is not None else ""
    fields = [f.strip() for f in conf.split(",") if f.strip()]
    on = any(
        f.partition(":")[0].strip() == EXPANDABLE_SEGMENTS and f.partition(":")[2].strip().lower() in ("true", "1")
        for f in fields
    )
    if not on or set_ is None:
        yield
        return
    off = [f if f.partition(":")[0].strip() != EXPANDABLE_SEGMENTS else f"{EXPANDABLE_SEGMENTS}:False" for f in fields]
    set_(",".join(off))
    try:
        yield
    finally:
        set_(conf)


class CuMemAllocator:
    """vLLM 0.34's ``vllm.device_allocator.cumem.CuMemAllocator``, over stepalloc."""

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
        self._pool_ids: dict[str, list[tuple[int, int]]] = {}  # MemPool ids each tag's entries made
        self._graph_pool: Any = None  # the MemPool (or, installed, the pool id) of cudagraph_pool()
        self.current_tag: str = DEFAULT_TAG

    # ----- allocating ---------------------------------------------------------------------

    @contextlib.contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[None]:
        """Tensors allocated inside carry ``tag`` (None: ``"default"``). Each entry allocates
        from a new pool; entering a tag again gives back what its earlier entries left free."""
        if tag is None:
            tag = DEFAULT_TAG
        if not isinstance(tag, str):
            raise TypeError(f"use_memory_pool: tag must be a str, not {type(tag).__name__}")
        from . import torch as _torch

        installed = _torch.is_installed()
        # A bad tag fails here. Not installed: the region is entered inside the entry's pool.
        region = sleep.region(_library_tag(tag), backup=False, _pool_routed=not installed)
        old, self.current_tag = self.current_tag, tag
        try:
            if tag != old:
                self._trim(tag)
            self._tags.setdefault(tag, None)
            if installed:
                with region:
                    yield
                return
            import torch

            with _without_expandable_segments():
                pool = _torch.mempool()
                self._pool_ids.setdefault(tag, []).append(pool.id)
                with torch.cuda.use_mem_pool(pool), region:
                    yield
            # The pool goes with this frame: PyTorch's destructor gives its free segments back.
            del pool
        finally:
            self.current_tag = old

    @contextlib.contextmanager
    def cudagraph_pool(self) -> Iterator[tuple[int, int]]:
        """Yields the id of the pool to capture CUDA graphs into (``torch.cuda.graph(g,
        pool=...)``); what a capture allocates there carries the tag ``"cudagraph"`` and sleeps
        with it. The pool is kept until ``release_pools()``. Under ``install()`` every
        allocation of the thread inside carries the tag, captured or not."""
        from . import torch as _torch

        installed = _torch.is_installed()
        if self._graph_pool is None:
            if installed:
                import torch

                self._graph_pool = torch.cuda.graph_pool_handle()
            else:
                self._graph_pool = _torch.mempool()
        pool_id = self._graph_pool if installed else self._graph_pool.id
        old, self.current_tag = self.current_tag, CUDAGRAPH_TAG
        try:
            self._tags.setdefault(CUDAGRAPH_TAG, None)
            # capture_begin routes the capture's allocations to the pool; the region tags them.
            with sleep.region(CUDAGRAPH_TAG, backup=False, _pool_routed=not installed):
                yield pool_id
        finally:
            self.current_tag = old

    def _trim(self, tag: str) -> None:
        """Gives back the free segments the earlier pools of ``tag`` hold (they are never
        allocated from again): those pools are gone, so ``empty_cache`` releases them."""
        ids = self._pool_ids.get(tag)
        if not ids:
            return
        import torch

        segments = torch.cuda.memory_snapshot()
        mine = {tuple(s["segment_pool_id"]) for s in segments} & set(ids)
        self._pool_ids[tag] = [i for i in ids if i in mine]  # pools with no segment left are gone
        if any(tuple(s["segment_pool_id"]) in mine and s["allocated_size"] == 0 for s in segments):
            torch.cuda.empty_cache()

    def release_pools(self) -> None:
        """Drops the pools this object keeps (the graph pool), so that none outlives the
        interpreter's teardown of the allocator it uses; their free segments go back. Safe to
        call more than once; the allocations keep working, asleep or awake."""
        self._graph_pool = None
        gc.collect()

    def close(self) -> None:
        """vLLM's alias of ``release_pools``."""
        self.release_pools()

    # ----- sleep and wake -----------------------------------------------------------------

    def _known(self) -> list[str]:
        """This object's tags that have memory in the library."""
        known = sleep.tags()
        return [t for t in self._tags if _library_tag(t) in known]

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None, discardable: Collection[int] = ()) -> None:
        """Releases the device memory of every allocation of this object's pools, keeping the
        addresses: allocations of ``offload_tags`` (None: ``("default",)``) are copied to host
        memory first, the others discarded; so are ``weights`` allocations holding only tensors
        that start at ``discardable`` addresses (storage the caller rewrites after waking). An
        allocation asleep already keeps its policy."""
        if offload_tags is None:
            offload_tags = (DEFAULT_TAG,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        offload = set(offload_tags)
        known = self._known()
        if known:
            self._warn_policy_kept(known, offload, "sleep")
            discard = self._discardable_allocations(discardable) if discardable else []
            # One call for every tag: the offloaded tags' copies run under the others' unmaps.
            sleep._pause_each({_library_tag(tag): tag in offload for tag in known}, discard)
        gc.collect()
        self._empty_cache()

    def discard(self, tags: tuple[str, ...] | str) -> None:
        """Releases the device memory of the awake allocations of ``tags`` without a backup
        (contents undefined after the wake); asleep ones keep their policy."""
        if isinstance(tags, str):
            tags = (tags,)
        known = [t for t in self._known() if t in tags]
        if known:
            self._warn_policy_kept(known, set(), "discard")
            sleep._pause_each({_library_tag(tag): False for tag in known})

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Maps the memory of the asleep allocations again at the same addresses, offloaded
        bytes restored, discarded ones undefined: of every tag when ``tags`` is None, else of
        ``tags`` and of every tag that cannot be deferred (all but ``weights`` and
        ``kv_cache``)."""
        gc.collect()
        self._empty_cache()
        paused = set(sleep.paused_tags())
        targets = [
            _library_tag(t)
            for t in self._tags
            if _library_tag(t) in paused and (tags is None or t in tags or t not in DEFERRABLE_TAGS)
        ]
        if targets:
            sleep.resume(targets)

    # ----- what is allocated --------------------------------------------------------------

    @property
    def pointer_to_data(self) -> dict[int, AllocationData]:
        """Every allocation of this object's pools, asleep or awake: address ->
        ``AllocationData`` (read from the library now; a new dict each time)."""
        from . import snapshot

        vllm_tag = {_library_tag(t): t for t in self._tags}
        out: dict[int, AllocationData] = {}
        for seg in snapshot.memory_snapshot()["segments"]:
            tag = vllm_tag.get(seg.get("tag") or "")
            if tag is None:
                continue
            asleep = bool(seg.get("paused"))
            for block in seg["blocks"]:
                if block["state"] != "active_allocated":
                    continue
                addr, size = int(block["address"]), int(block["size"])
                backup = sleep.backup_pointer(addr, size) if asleep and sleep.has_backup_pointer() else 0
                out[addr] = AllocationData((int(seg["device"]), size, addr, 0), tag, backup or None, asleep)
        return out

    def get_current_usage(self) -> int:
        """Bytes allocated in this object's pools, asleep or awake."""
        return sum(data.handle[1] for data in self.pointer_to_data.values())

    # ----- helpers ------------------------------------------------------------------------

    def _discardable_allocations(self, tensors: Collection[int]) -> list[int]:
        """The ``weights`` allocations whose live tensors all start at ``tensors`` addresses.
        Installed, an allocation is a tensor's storage; in MemPool mode it is a PyTorch segment
        of a ``weights`` pool, discardable when each of its blocks is free or starts there."""
        from . import torch as _torch

        wanted = {int(t) for t in tensors}
        if _torch.is_installed():
            return sorted(wanted)
        import torch

        pools = set(self._pool_ids.get("weights", ()))
        return [
            int(seg["address"])
            for seg in torch.cuda.memory_snapshot()
            if tuple(seg["segment_pool_id"]) in pools
            and all(b["state"] == "inactive" or int(b["address"]) in wanted for b in seg["blocks"])
        ]

    def _warn_policy_kept(self, known: list[str], offload: set[str], what: str) -> None:
        """vLLM warns when a call would change the policy of allocations asleep already."""
        figures = sleep.tags()
        for tag in known:
            state = figures.get(_library_tag(tag), {})
            if state.get("paused") and bool(state.get("backup_bytes")) != (tag in offload):
                logger.warning(
                    "CuMemAllocator: %s cannot change the policy of already-asleep allocations "
                    "(tag %r); the existing policy was kept.",
                    what,
                    tag,
                )

    @staticmethod
    def _empty_cache() -> None:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
