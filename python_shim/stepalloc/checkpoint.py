"""Layer: PyTorch glue. torch.compile's CUDA-graph trees (``mode="reduce-overhead"``) under
process-wide stepalloc: ``get_checkpoint_state`` and ``set_checkpoint_pool_state`` stand in for
``torch._C._cuda_getCheckpointState`` / ``_cuda_setCheckpointPoolState`` (``patch_torch``
installs them), which PyTorch's pluggable-allocator class refuses.

The library records a private pool's state and restores it (``stepalloc_pool_checkpoint`` /
``stepalloc_pool_restore``); this module does the storage part, with what PyTorch exposes to
Python, so that PyTorch's own bookkeeping of the pluggable allocator (its table of what it
handed out, which its deleter frees through) stays true:

- blocks allocated since the checkpoint are freed through PyTorch
  (``_free_And_Remove_DeleterFn``: the stale storage keeps its address but no longer frees it);
- the restore allocates the recorded blocks freed since, and each is then taken through
  PyTorch's allocator, routed to the pool, which hands it the restored block (the library's
  adoption): a storage of ``storages_to_add_deleters_to`` at that address gets an owning data
  pointer (``torch.empty`` then ``UntypedStorage._swap_data_ptr_``), any other block a raw
  allocation that ``torch._C._cuda_cudaCachingAllocator_raw_delete`` frees later.

Invariants: everything that can be refused is checked before anything changes; a restore frees
only blocks whose storage the caller passed as stale (PyTorch frees any, and the owner's later
free then fails: this refuses first, naming the block); torch is imported inside functions.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any, NamedTuple

from . import _lib

DRY_RUN, ADOPT = 1, 2  # stepalloc_pool_restore's flags


class Block(NamedTuple):
    addr: int
    size: int
    requested: int
    stream: int


class CheckpointState:
    """A private pool's state (PyTorch's ``_cuda_CUDAAllocator_AllocatorState``): plain data,
    the library's encoding of the pool's segments and allocated blocks."""

    __slots__ = ("device", "pool", "words")

    def __init__(self, device: int, pool: tuple[int, int], words: tuple[int, ...]) -> None:
        self.device, self.pool, self.words = device, pool, words

    def allocated(self) -> list[Block]:
        """The blocks allocated when it was recorded (the encoding: magic, pool id, segment count,
        two words per segment, block count, four words per block)."""
        w = self.words
        at = 4 + 2 * w[3]
        return [Block(*w[i : i + 4]) for i in range(at + 1, len(w), 4)]

    def __repr__(self) -> str:
        return f"CheckpointState(device={self.device}, pool={self.pool}, blocks={len(self.allocated())})"


def get_checkpoint_state(device: int, pool_id: Any) -> CheckpointState:
    """``torch._C._cuda_getCheckpointState(device, pool_id)``."""
    device, pool = int(device), (int(pool_id[0]), int(pool_id[1]))
    cap = 256
    while True:
        buf = (ctypes.c_uint64 * cap)()
        n = int(_lib.lib().stepalloc_pool_checkpoint(device, pool[0], pool[1], buf, cap))
        if n == 0:
            raise _lib.error_for(int(_lib.lib().stepalloc_last_status()))
        if n <= cap:
            return CheckpointState(device, pool, tuple(buf[:n]))
        cap = n


def _restore(
    device: int, state: CheckpointState, flags: int, freed_cap: int, allocated_cap: int
) -> tuple[list[Block], list[Block]]:
    words = (ctypes.c_uint64 * len(state.words))(*state.words)
    freed = (ctypes.c_uint64 * (4 * max(freed_cap, 1)))()
    allocated = (ctypes.c_uint64 * (4 * max(allocated_cap, 1)))()
    counts = (ctypes.c_size_t * 2)()
    _lib.check(
        int(
            _lib.lib().stepalloc_pool_restore(
                device, words, len(state.words), flags, freed, freed_cap, allocated, allocated_cap, counts
            )
        )
    )

    def blocks(buf: Any, n: int) -> list[Block]:
        return [Block(*buf[4 * i : 4 * i + 4]) for i in range(n)]

    return blocks(freed, min(counts[0], freed_cap)), blocks(allocated, min(counts[1], allocated_cap))


def _plan(device: int, state: CheckpointState) -> tuple[list[Block], list[Block]]:
    """What a restore would free and allocate (a dry run, retried until the lists fit)."""
    cap = 64
    while True:
        words = (ctypes.c_uint64 * len(state.words))(*state.words)
        counts = (ctypes.c_size_t * 2)()
        _lib.check(
            int(_lib.lib().stepalloc_pool_restore(device, words, len(state.words), DRY_RUN, None, 0, None, 0, counts))
        )
        if counts[0] <= cap and counts[1] <= cap:
            return _restore(device, state, DRY_RUN, cap, cap)
        cap = max(counts[0], counts[1])


def _unique(pointers: Iterable[int]) -> list[int]:
    seen: dict[int, None] = {}
    for p in pointers:
        seen.setdefault(int(p), None)
    return list(seen)


def set_checkpoint_pool_state(
    device: int, state: Any, stale_storages: Iterable[int], storages_to_add_deleters_to: Iterable[int] = ()
) -> None:
    """``torch._C._cuda_setCheckpointPoolState(device, state, stale_storages,
    storages_to_add_deleters_to)``: the pool back in ``state``. ``stale_storages``: StorageImpl
    pointers of live storages whose blocks the restore frees (they stop freeing them);
    ``storages_to_add_deleters_to``: StorageImpl pointers of storages that do not own their
    memory (graph trees' outputs rebuilt after a replay) and own it from now on when the restore
    allocates their block."""
    import torch

    if not isinstance(state, CheckpointState):
        raise TypeError(f"expected a state from torch._C._cuda_getCheckpointState, not {type(state).__name__}")
    device = int(device)
    if device != state.device:
        raise ValueError(f"the checkpoint is of device {state.device}, not {device}")
    c = torch._C
    freed, allocated = _plan(device, state)
    recorded = {b.addr for b in state.allocated()}
    allocated_addrs = {b.addr for b in allocated}
    # PyTorch's restore frees every allocated block of the pool and allocates the recorded ones
    # again: the blocks allocated now are the ones it frees, plus those it keeps.
    now_allocated = {b.addr for b in freed} | (recorded - allocated_addrs)
    stale = [(impl, torch.UntypedStorage._new_with_weak_ptr(impl)) for impl in _unique(stale_storages)]
    stale_by_addr = {}
    for impl, storage in stale:
        addr = int(storage.data_ptr())
        if addr not in now_allocated:
            raise RuntimeError(f"stale storage at {addr:#x} is not an allocated block of pool {state.pool}")
        if not c._has_Standard_Deleter(impl):
            raise RuntimeError("Unexpected deleter function on storage, could not swap function")
        stale_by_addr[addr] = impl
    definitely_freed = [b for b in freed if b.addr not in recorded]
    if len(stale) < len(definitely_freed):
        raise RuntimeError("Any stale tensors which are being manually freed must be passed to set checkpoint")
    for b in freed:
        if b.addr not in stale_by_addr:
            raise RuntimeError(
                f"stepalloc: block {b.addr:#x} ({b.size} bytes) of pool {state.pool} was allocated after the "
                "checkpoint and is still owned; restoring would free it under its owner. Pass its storage in "
                "stale_storages, or free it first."
            )
    # A storage given a deleter owns its block when the restore allocates it. One over a block
    # that stays allocated (its owner unchanged) is left as it is: PyTorch would make it a
    # second owner of the block, and the later of the two frees would fail.
    targets: dict[int, Any] = {}
    for impl in _unique(storages_to_add_deleters_to):
        storage = torch.UntypedStorage._new_with_weak_ptr(impl)
        targets[int(storage.data_ptr())] = (impl, storage)
    for b in allocated:
        if b.addr in targets:
            impl, storage = targets[b.addr]
            if c._has_Standard_Deleter(impl):
                raise RuntimeError(" Not expecting deleter function")
            if storage.nbytes() > b.size:
                raise RuntimeError(f"storage of {storage.nbytes()} bytes at {b.addr:#x} exceeds its block of {b.size}")

    # Nothing is refused from here on. Stale storages stop owning their blocks, which go back.
    for impl in stale_by_addr.values():
        c._free_And_Remove_DeleterFn(impl)
    _, allocated = _restore(device, state, ADOPT, 0, len(allocated) + len(stale_by_addr))
    pool = state.pool
    with torch.cuda.device(device):
        c._cuda_beginAllocateCurrentThreadToPool(device, pool)
        try:
            for b in allocated:
                if b.addr in targets:
                    _, storage = targets[b.addr]
                    owner = torch.empty((storage.nbytes(),), dtype=torch.uint8, device=f"cuda:{device}")
                    got = int(owner.data_ptr())
                    if got == b.addr:
                        storage._swap_data_ptr_(owner.untyped_storage())
                else:
                    got = int(c._cuda_cudaCachingAllocator_raw_alloc(b.requested, b.stream))
                if got != b.addr:
                    raise RuntimeError(
                        f"stepalloc: restoring pool {pool} took {got:#x} for the block at {b.addr:#x} (another "
                        "thread allocated from the pool meanwhile)"
                    )
        finally:
            c._cuda_endAllocateToPool(device, pool)
            c._cuda_releasePool(device, pool)
