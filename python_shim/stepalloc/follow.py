"""Layer: PyTorch glue. Autograd's thread follows the pool and the region of the thread that
called ``backward()``.

The autograd engine runs the backward of CUDA tensors on its own thread per device
(``pt_autograd_<device>``), not on the caller's. ``torch.cuda.use_mem_pool`` routes only the
thread that entered it, and ``stepalloc.region`` tags only what its thread allocates, so
gradients escaped both (PyTorch #167353: under ``stepalloc.mempool()`` the agent loop kept two
caches, 1.88x the memory; a ``pause`` of the training tag missed backward's memory). Here, for
each ``backward()`` / ``autograd.grad()`` called inside ``use_mem_pool`` of a stepalloc pool or
inside a region:

- the caller's pool route moves to the device thread for the length of the call: the caller's
  own route ends (PyTorch allows one route per pool), a pre-hook on the graph's root nodes —
  which run first, on the device thread — begins the device thread's
  (``_cuda_beginAllocateCurrentThreadToPool`` from that thread), and when the call returns the
  device thread's ends and the caller's begins again;
- the caller lends its region's tag (``stepalloc_region_lend``); the same pre-hook borrows it on
  the device thread (``stepalloc_region_borrow``); the lease ends when the call returns.

Routing follows the device thread, so no other thread is captured (a weight-sync thread, a
second engine): not by stream (the default stream is everyone's) and not device-wide
(``_cuda_beginAllocateToPool``). What it cannot tell apart: a second backward of another thread
running on the same device thread at the same time (the engine interleaves their nodes), and
nodes of the graph on a second device (only the roots' device thread follows). While the call
runs, the caller's own pool route is the device thread's: what the caller allocates on the
device meanwhile (it runs the CPU nodes; final callbacks may run on either thread) is not
routed; its tag stays.

The routing wrappers also guard ``use_mem_pool`` where PyTorch's own code goes wrong: a
stepalloc pool entered for another device than the one it was made on is refused, naming both
(PyTorch's allocator would create an empty pool there, and assert ``use_count > 0`` the second
time); and where PyTorch's allocator routes (``stepalloc.mempool()`` without ``install()``) a
pool re-entered on one thread is refused clearly, the reference PyTorch took before refusing
given back. Under ``install()`` stepalloc routes, and re-entered pools nest.

Invariants:
- Only ``Variable._execution_engine`` (every Python ``backward`` / ``grad`` goes through its
  ``run_backward``) and the two routing functions ``use_mem_pool`` calls (module globals of
  ``torch.cuda.memory``) are wrapped; ``disable()`` restores them. The wrappers record, check
  the device of a stepalloc pool and forward: outside a followed pool or region a backward
  costs one thread-local read more.
- A hook never raises into the engine: a failure is recorded and warned about after the call.
- Every reference the moves take on the pool (each begin) is given back (a release), so the
  pool's use count is what ``use_mem_pool`` alone leaves.
- torch is imported inside the functions, never at module import.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import warnings
from typing import Any

from . import _lib

_lock = threading.RLock()
_installed: dict[tuple[Any, str], Any] | None = None
# False after disable(): nothing puts the wrappers back until enable().
_wanted = True
# Pools whose routes follow autograd: stepalloc.mempool() and stepalloc.MemPool ids, each with
# the device it was made on (the one device it serves).
_pools: dict[tuple[int, int], int] = {}
# Per thread: the (device, pool id) of each use_mem_pool entered and not left, innermost last.
_routes = threading.local()


def _stack() -> list[tuple[int, tuple[int, int]]]:
    stack = getattr(_routes, "stack", None)
    if stack is None:
        stack = _routes.stack = []
    return stack


def follow_pool(pool_id: Any, device: int) -> None:
    """Routes into pool ``pool_id``, made on ``device``, follow autograd from now on (and the
    wrappers are in place)."""
    with _lock:
        _pools[tuple(int(x) for x in pool_id)] = int(device)
    if _wanted:
        _install()


def ensure() -> None:
    """A region was entered: from now on a backward asks the library for the caller's tag. Puts
    the wrappers in place if torch is imported already (a region needs no torch) and
    ``disable()`` did not turn the follow off."""
    global _regions_used
    _regions_used = True
    if _installed is None and _wanted and "torch" in sys.modules:
        _install()


def enable() -> None:
    """Autograd's thread follows pools and regions (the default; idempotent)."""
    global _wanted
    with _lock:
        _wanted = True
        _install()


def _install() -> None:
    global _installed
    import torch

    with _lock:
        if _installed is not None:
            return
        memory = torch.cuda.memory
        variable = torch.autograd.variable.Variable
        saved: dict[tuple[Any, str], Any] = {}
        begin = getattr(memory, "_cuda_beginAllocateCurrentThreadToPool", None)
        end = getattr(memory, "_cuda_endAllocateToPool", None)
        if begin is not None and end is not None:
            saved[(memory, "_cuda_beginAllocateCurrentThreadToPool")] = begin
            saved[(memory, "_cuda_endAllocateToPool")] = end
            memory._cuda_beginAllocateCurrentThreadToPool = _recording_begin(begin)
            memory._cuda_endAllocateToPool = _recording_end(end)
        engine = variable._execution_engine
        saved[(variable, "_execution_engine")] = engine
        variable._execution_engine = _Engine(engine)
        _installed = saved


def disable() -> None:
    """Restores what ``enable`` wrapped, until ``enable()``: backward runs on autograd's thread
    unrouted and untagged, as in PyTorch."""
    global _installed, _wanted
    with _lock:
        _wanted = False
        if _installed is None:
            return
        for (owner, name), original in _installed.items():
            setattr(owner, name, original)
        _installed = None


def enabled() -> bool:
    """Whether autograd's thread follows pools and regions now."""
    return _installed is not None


# PyTorch's refusal of a pool already routed to (its allocator allows one route per pool).
_ALREADY_ROUTED = "already recording to mempool_id"


def _recording_begin(original: Any) -> Any:
    def stepalloc_begin_allocate_current_thread_to_pool(device: int, pool_id: Any) -> Any:
        key = (int(device), tuple(int(x) for x in pool_id))
        made_on = _pools.get(key[1])
        if made_on is not None and made_on != key[0]:
            raise _lib.StepallocError(
                f"stepalloc: use_mem_pool(pool, device={key[0]}) with pool {key[1]}, which was made on "
                f"device {made_on}: a pool serves the device that was current when it was made (PyTorch's "
                f"allocator would give device {key[0]} an empty pool without the pool's allocator, and "
                f"fail its internal assert use_count > 0 the second time). Instead: make the pool with "
                f"device {key[0]} current (with torch.cuda.device({key[0]}): pool = stepalloc.mempool()), "
                f"or enter this one with device={made_on}.",
                _lib.INVALID_ARGUMENT,
            )
        try:
            result = original(device, pool_id)
        except RuntimeError as e:
            if _ALREADY_ROUTED not in str(e):
                raise
            import torch

            # PyTorch took a reference to the pool before it refused; give it back.
            torch._C._cuda_releasePool(device, pool_id)
            raise _lib.StepallocError(
                f"stepalloc: use_mem_pool of pool {key[1]} on device {key[0]}, which this thread is "
                "already inside: PyTorch's allocator, which routes pools without install(), allows one "
                "route per pool at a time. Instead: leave the outer use_mem_pool first, or use "
                "stepalloc.install(), under which re-entered pools nest.",
                _lib.INVALID_ARGUMENT,
            ) from e
        _stack().append(key)
        return result

    stepalloc_begin_allocate_current_thread_to_pool.__wrapped__ = original  # type: ignore[attr-defined]
    return stepalloc_begin_allocate_current_thread_to_pool


def _recording_end(original: Any) -> Any:
    def stepalloc_end_allocate_to_pool(device: int, pool_id: Any) -> Any:
        key = (int(device), tuple(int(x) for x in pool_id))
        stack = _stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] == key:
                del stack[i]
                break
        return original(device, pool_id)

    stepalloc_end_allocate_to_pool.__wrapped__ = original  # type: ignore[attr-defined]
    return stepalloc_end_allocate_to_pool


def _original(name: str) -> Any:
    import torch

    fn = getattr(torch.cuda.memory, name)
    return getattr(fn, "__wrapped__", fn)


_lend_declared = False
# Whether any region was entered in this process: until then a backward has no tag to lend and
# skips the library call.
_regions_used = False


def _lend() -> int:
    """The caller's region tag lent (a lease token), or 0: no region, or no library loaded
    (then no region was ever entered)."""
    global _lend_declared
    if not _regions_used or getattr(_lib, "_lib", None) is None:
        return 0
    cdll = _lib.lib()
    if not hasattr(cdll, "stepalloc_region_lend"):
        return 0
    if not _lend_declared:
        cdll.stepalloc_region_lend.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        cdll.stepalloc_region_lend.restype = ctypes.c_int
        for name in ("stepalloc_region_borrow", "stepalloc_region_lend_end"):
            getattr(cdll, name).argtypes = [ctypes.c_uint64]
            getattr(cdll, name).restype = ctypes.c_int
        _lend_declared = True
    lease = ctypes.c_uint64(0)
    _lib.check(int(cdll.stepalloc_region_lend(ctypes.byref(lease))))
    return int(lease.value)


class _Follow:
    """One ``run_backward`` whose device thread follows the caller's pool route and/or tag."""

    def __init__(self, route: tuple[int, tuple[int, int]] | None, lease: int) -> None:
        self.route = route
        self.lease = lease
        self.caller = threading.get_ident()
        self.seen: set[int] = set()
        self.moved_to: int | None = None  # the device thread that took the pool route
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()

    def prehook(self, _grad_outputs: Any) -> None:
        """Runs on the thread that runs a root node: the device thread takes the route / tag."""
        me = threading.get_ident()
        if me == self.caller:
            return None
        with self.lock:
            if me in self.seen:
                return None
            self.seen.add(me)
            take_route = self.route is not None and self.moved_to is None
        try:
            if self.lease:
                _lib.check(int(_lib.lib().stepalloc_region_borrow(self.lease)))
            if take_route:
                import torch

                device, pool_id = self.route  # type: ignore[misc]
                if int(torch.cuda.current_device()) == device:
                    _original("_cuda_beginAllocateCurrentThreadToPool")(device, pool_id)
                    with self.lock:
                        self.moved_to = me
        except BaseException as e:  # noqa: BLE001 - never into the engine
            self.errors.append(e)
        return None

    def run(self, engine: Any, t_outputs: Any, args: Any, kwargs: Any) -> Any:
        import torch

        roots = []
        for out in t_outputs:
            node = getattr(out, "grad_fn", None) if isinstance(out, torch.Tensor) else getattr(out, "node", None)
            if node is not None and hasattr(node, "register_prehook"):
                roots.append(node)
        handles = [node.register_prehook(self.prehook) for node in roots]
        end = _original("_cuda_endAllocateToPool")
        begin = _original("_cuda_beginAllocateCurrentThreadToPool")
        release = torch._C._cuda_releasePool
        if self.route is not None and roots:
            end(*self.route)  # the device thread takes it (one route per pool)
        try:
            return engine.run_backward(t_outputs, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            if self.lease:
                _lib.lib().stepalloc_region_lend_end(self.lease)
            if self.route is not None and roots:
                if self.moved_to is not None:
                    end(*self.route)
                    release(*self.route)  # the device thread's begin took a reference
                begin(*self.route)
                release(*self.route)  # so did the caller's second begin
            if self.errors:
                warnings.warn(
                    f"stepalloc: autograd's thread could not follow the pool/region of backward(): {self.errors[0]!r}",
                    RuntimeWarning,
                    stacklevel=3,
                )


class _Engine:
    """``Variable._execution_engine`` with ``run_backward`` followed; everything else forwarded."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def run_backward(self, t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        follow = _plan()
        if follow is None:
            return self._engine.run_backward(t_outputs, *args, **kwargs)
        if not isinstance(t_outputs, (tuple, list)):
            t_outputs = tuple(t_outputs)  # read twice: for the roots, then by the engine
        return follow.run(self._engine, t_outputs, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _plan() -> _Follow | None:
    """What the calling thread's backward should carry over, or None."""
    import torch

    if torch._C._current_graph_task_id() != -1:
        # Inside a backward already (a reentrant backward runs on this thread, which follows).
        return None
    stack = getattr(_routes, "stack", None)
    route = stack[-1] if stack and stack[-1][1] in _pools else None
    if route is not None and stack.count(route) > 1:
        # A pool this thread re-entered (stepalloc's routes nest): an end from this thread
        # removes this thread's newest route of the pool, which after the move would be the
        # outer one rather than the device thread's. Not moved: backward allocates unrouted.
        route = None
    try:
        lease = _lend()
    except _lib.StepallocError as e:  # e.g. 64 leases open: backward runs, unfollowed
        warnings.warn(f"stepalloc: autograd's thread cannot borrow this thread's tag: {e}", RuntimeWarning, stacklevel=4)
        lease = 0
    if route is None and lease == 0:
        return None
    return _Follow(route, lease)
