"""Layer: PyTorch glue. ``ProcessGroupNCCL.register_mem_pool`` / ``deregister_mem_pool`` under
process-wide stepalloc (``patch_torch`` installs them): PyTorch's own take the pool's segments
from its allocator's snapshot and new ones from its trace hooks, which its pluggable-allocator
class refuses. Here the library registers the pool's segments with the process group's NCCL
communicator (``ProcessGroupNCCL._comm_ptr()``) through NCCL's own ``ncclCommRegister`` /
``ncclCommDeregister``, which it calls as segments come and go (``stepalloc_pool_register_segments``):
the ones the pool holds at once, each new one when it is created, each released one before its
memory goes back, and the rest at ``deregister_mem_pool``.

Also (``route_backend``, from ``install()``): torch 2.15's default "nccl" backend, nccl2's
``ProcessGroupNCCL2``, creates its communicator's memory hook by asking the allocator for a
snapshot, which PyTorch's pluggable-allocator class refuses, inside a constructor: the process
aborts (``terminate called ... CUDAPluggableAllocator does not yet support snapshot``) at
``init_process_group("nccl")``. Under process-wide stepalloc "nccl" is PyTorch's stock
``ProcessGroupNCCL`` (its "nccl-legacy", what ``TORCH_DIST_USE_NCCL2=0`` selects), which works.

Invariants: the NCCL functions are the ones the process already loaded (PyTorch's); a pool is
registered with a communicator at most once; ``symm=True`` (symmetric windows, a collective
registration) is refused with an ``UnsupportedError`` naming ``symm=False``.
"""

from __future__ import annotations

import ctypes
from typing import Any

from . import _lib

# PyTorch's message for a process group whose communicator does not exist yet.
UNINITIALIZED = (
    "NCCL communicator has not been initialized before mem pool creation. You can pass `device_id` to "
    "init_process_group -- one way of eager initialization -- to work around this issue"
)


def _nccl_functions() -> tuple[int, int]:
    """Addresses of ``ncclCommRegister`` / ``ncclCommDeregister`` as the process resolves them
    (the NCCL PyTorch loaded)."""
    for lib in (ctypes.CDLL(None), ctypes.CDLL("libnccl.so.2")):
        try:
            register, deregister = lib.ncclCommRegister, lib.ncclCommDeregister
        except AttributeError:
            continue
        return ctypes.cast(register, ctypes.c_void_p).value or 0, ctypes.cast(deregister, ctypes.c_void_p).value or 0
    raise RuntimeError("stepalloc: NCCL's ncclCommRegister is not loaded in this process")


def _pool_of(pool: Any) -> tuple[int, tuple[int, int]]:
    pool_id = tuple(int(x) for x in pool.id)
    device = int(getattr(pool, "_device", 0))
    return device, (pool_id[0], pool_id[1])


def _comm(group: Any, device: int) -> int:
    comm = int(group._comm_ptr())
    if comm == 0:
        raise RuntimeError(UNINITIALIZED)
    bound = group.bound_device_id
    if bound is not None and bound.index is not None and int(bound.index) != device:
        raise RuntimeError(f"MemPool is on device {device} but this process group is bound to {bound}")
    return comm


def register_mem_pool(group: Any, pool: Any, symm: bool = False) -> None:
    """``ProcessGroupNCCL.register_mem_pool(pool, symm=False)``."""
    if symm:
        raise _lib.UnsupportedError(
            _lib.unsupported_message(
                "ProcessGroupNCCL.register_mem_pool(symm=True)",
                "symmetric windows are a collective registration stepalloc does not make",
                "register_mem_pool(pool) (symm=False): the pool's segments registered as user buffers",
            )
        )
    device, pool_id = _pool_of(pool)
    comm = _comm(group, device)
    register, deregister = _nccl_functions()
    lib = _lib.lib()
    _lib.check(int(lib.stepalloc_pool_register_segments(device, pool_id[0], pool_id[1], comm, register, deregister)))


def deregister_mem_pool(group: Any, pool: Any) -> None:
    """``ProcessGroupNCCL.deregister_mem_pool(pool)``."""
    device, pool_id = _pool_of(pool)
    comm = _comm(group, device)
    _lib.check(int(_lib.lib().stepalloc_pool_register_segments(device, pool_id[0], pool_id[1], comm, None, None)))


def route_backend() -> str | None:
    """Makes the "nccl" backend PyTorch's stock ``ProcessGroupNCCL`` (see the module's comment).
    torch registers its built-in backends on first use (``Backend._ensure_backend_registered``),
    so this registers "nccl" now. For the life of the process, as the allocator swap. Returns
    what it did: "registered" ("nccl" was not registered yet), "replaced" (it was nccl2), or None
    (nothing changed: no torch.distributed or NCCL, or "nccl" is the stock one already)."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_nccl_available():
        return None
    legacy = getattr(c10d, "_register_builtin_nccl_as_legacy", None)
    stock = getattr(c10d, "_create_nccl_process_group", None)
    plugins = c10d.Backend._plugins
    if legacy is None:
        return None
    plugin = plugins.get("NCCL")
    if plugin is not None and plugin.creator_fn is stock:
        return None
    legacy()
    return "registered" if plugin is None else "replaced"
