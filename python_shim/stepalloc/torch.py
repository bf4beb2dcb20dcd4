"""Layer: PyTorch glue. ``install()`` (process-wide mode), ``mempool()`` (MemPool mode) and
``patch_torch()`` (torch.cuda's statistics answered by stepalloc).

Invariants:
- torch is imported inside the functions, never at module import.
- PyTorch's loader gets ``_lib.library_path()``, the same absolute path ctypes loaded, so both
  talk to one allocator state.
- ``install()`` happens at most once per process: PyTorch allows one allocator swap, before
  CUDA is first used. A second call with the same arguments returns the same handle.
- ``install()`` fixes the configuration: it validates it (``conf``, else ``STEPALLOC_CONF``,
  else ``RECOMMENDED``) before swapping, and ``configure()`` refuses from then on. It holds
  ``_lib._config_lock`` from its ``configure`` to the swap, so a racing ``configure()`` lands
  before (and is replaced) or after (and is refused), never in between.
- The ``CUDAPluggableAllocator`` objects are kept alive here for the life of the process
  (PyTorch may free tensors through them until exit).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
import threading
import warnings
from typing import Any, Callable

from . import _lib, _oom, ipc, nccl, ranks, snapshot, stats
from .metrics import served_address

# PyTorch's optional hooks: the setter on the pluggable allocator -> the library's symbol.
HOOKS: dict[str, str] = {
    "set_init_fn": "stepalloc_init",
    "set_reset_fn": "stepalloc_empty_cache",
    "set_memory_fraction_fn": "stepalloc_set_memory_fraction",
    "set_base_alloc_fn": "stepalloc_base_alloc",
    "set_record_stream_fn": "stepalloc_record_stream",
    "set_begin_allocate_to_pool": "stepalloc_begin_allocate_to_pool",
    "set_end_allocate_to_pool_fn": "stepalloc_end_allocate_to_pool",
    "set_release_pool": "stepalloc_release_pool",
}
# The best measured configuration (docs/performance.md); `install()` uses it when given none and
# STEPALLOC_CONF is unset. The same string as the core's `config::RECOMMENDED`.
RECOMMENDED = "expandable_segments:True,large_segment_size_mb:2,page_reuse:True,big_page_mb:16,pack_small:True,close_holes:True,param_lane:True"

ALLOC_FN = "stepalloc_torch_malloc"
MEMPOOL_ALLOC_FN = "stepalloc_malloc"
FREE_FN = "stepalloc_free"

_CUDA_INITIALISED_MESSAGE = (
    "stepalloc.install() must run before CUDA is first used, but CUDA is already initialised in "
    "this process (something created a CUDA tensor, moved a model to the GPU or called a "
    "torch.cuda function that initialises CUDA). PyTorch can swap its allocator only before that. "
    "Fix: call stepalloc.install() right after `import torch`, at the top of the entry script "
    "(before models, data loaders or libraries touch the GPU), or use stepalloc.mempool() with "
    "torch.cuda.use_mem_pool(...) to use stepalloc for part of the program."
)


@dataclasses.dataclass(frozen=True)
class Installation:
    """What ``install()`` set up.

    Attributes:
        library_path: the ``libstepalloc.so`` PyTorch and ctypes share.
        version: the library's version.
        conf: the configuration string passed to ``install`` (None: ``STEPALLOC_CONF`` or defaults).
        alloc_fn / free_fn: the symbols PyTorch allocates and frees with.
        hooks: each PyTorch setter called -> the library symbol it was given.
        metrics_address: where the Prometheus endpoint serves (None: not started here).
        torch_patched: whether torch.cuda's statistics functions were routed to stepalloc.
        device: the rank's device under torchrun (``LOCAL_RANK``, see ``stepalloc.rank_device``),
            made torch's current device when CUDA initialises; None outside torchrun.
    """

    library_path: str
    version: str
    conf: str | None
    alloc_fn: str
    free_fn: str
    hooks: dict[str, str]
    metrics_address: str | None
    torch_patched: bool
    mode: str = "process-wide"
    device: int | None = None


_lock = threading.RLock()
_installation: Installation | None = None
_keep_alive: list[Any] = []
_mempool_allocator: Any = None


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ImportError("stepalloc's PyTorch integration needs torch; `pip install torch`") from e
    if not hasattr(torch.cuda, "memory") or not hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
        raise RuntimeError(f"torch {torch.__version__} has no CUDAPluggableAllocator (needs torch >= 2.0)")
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError(f"torch {torch.__version__} was built without CUDA; stepalloc needs a CUDA build")
    return torch


def is_installed() -> bool:
    """Whether ``install()`` has swapped PyTorch's allocator in this process."""
    return _installation is not None


def installation() -> Installation | None:
    """The handle ``install()`` returned, or None."""
    return _installation


def install(
    conf: str | None = None,
    metrics_port: int | None = None,
    patch_torch: bool = False,
) -> Installation:
    """Makes stepalloc PyTorch's CUDA allocator for this whole process.

    Call it right after ``import torch`` and before anything uses CUDA. Every CUDA tensor is
    then allocated by stepalloc; ``torch.cuda.empty_cache()``,
    ``torch.cuda.set_per_process_memory_fraction``, ``Tensor.record_stream`` and CUDA graph
    pools keep working through the hooks wired here.

    Args:
        conf: configuration in ``PYTORCH_CUDA_ALLOC_CONF`` syntax (``"phase_trim:True"``); None
            keeps ``STEPALLOC_CONF``, or when that is unset uses ``RECOMMENDED``. A bad string
            (``conf`` or ``STEPALLOC_CONF``) raises ``ValueError`` here, before anything is
            swapped. From here on the configuration is fixed: ``configure()`` raises.
        metrics_port: serve Prometheus metrics on 127.0.0.1 at this port.
        patch_torch: route ``torch.cuda.memory_stats`` and friends to stepalloc (they raise
            under a pluggable allocator otherwise); see ``patch_torch()``.

    Under torchrun (``LOCAL_RANK`` set) the rank's device (``stepalloc.rank_device()``:
    ``LOCAL_RANK`` when the process sees every GPU of its node, device 0 when it sees only its
    own) becomes torch's current device when CUDA initialises, as
    ``torch.cuda.set_device(local_rank)`` would; a later ``set_device`` still wins.

    Returns the ``Installation``; calling again with compatible arguments returns the same one
    (``patch_torch=True`` or a ``metrics_port`` on a later call are applied then).

    Raises:
        RuntimeError: CUDA is already initialised (the message says how to fix it), or torch
            lacks CUDA support.
        ValueError: ``conf`` was rejected, or differs from the installed configuration, or
            ``LOCAL_RANK`` names no device this process sees.
    """
    global _installation
    with _lock, _lib._config_lock:
        if _installation is not None:
            return _update_installation(conf, metrics_port, patch_torch)
        torch = _import_torch()
        if torch.cuda.is_initialized():
            raise RuntimeError(_CUDA_INITIALISED_MESSAGE)
        if conf is None and "STEPALLOC_CONF" not in os.environ:
            conf = RECOMMENDED
        if conf is not None:
            _lib.configure(conf)
        else:
            _lib.adopt_environment()  # a bad STEPALLOC_CONF fails here, not at the first tensor
        # Under torchrun, the rank's device; a LOCAL_RANK without a device fails before the swap.
        device = ranks.rank_device() if ranks.rank_info().local_rank is not None else None
        path = _lib.library_path()
        _lib.lib()  # load through ctypes first: a missing symbol gives our message, not torch's
        allocator = torch.cuda.memory.CUDAPluggableAllocator(path, ALLOC_FN, FREE_FN)
        raw = allocator.allocator()
        wired: dict[str, str] = {}
        for setter, symbol in HOOKS.items():
            set_fn: Callable[[int], None] | None = getattr(raw, setter, None)
            if set_fn is None:
                raise RuntimeError(
                    f"torch {torch.__version__} lacks CUDAPluggableAllocator.{setter}; stepalloc needs every "
                    "hook (upgrade torch to >= 2.5)"
                )
            set_fn(_lib.symbol_address(symbol))
            wired[setter] = symbol
        try:
            torch.cuda.memory.change_current_allocator(allocator)
        except RuntimeError as e:
            raise RuntimeError(f"{_CUDA_INITIALISED_MESSAGE} (PyTorch said: {e})") from e
        _keep_alive.append(allocator)
        if device is not None:
            _queue_rank_device(torch, device)
        # Out of memory raises torch.OutOfMemoryError (else RuntimeError, with a warning).
        _oom.enable(torch)
        # torch 2.15's default "nccl" (nccl2) aborts the process under a pluggable allocator:
        # "nccl" is PyTorch's stock ProcessGroupNCCL from now on, as the swap (stepalloc.nccl).
        nccl.route_backend()
        # Recorded before the optional extras: if serving metrics fails, the swap still stands
        # and a later install() call retries only the extras.
        _installation = Installation(
            library_path=path,
            version=_lib.version(),
            conf=conf,
            alloc_fn=ALLOC_FN,
            free_fn=FREE_FN,
            hooks=wired,
            metrics_address=None,
            torch_patched=False,
            device=device,
        )
        # PyTorch now allocates through the library: the configuration is the one it will use.
        _lib.fix_configuration("install()")
        return _update_installation(None, metrics_port, patch_torch)


def _queue_rank_device(torch: Any, device: int) -> None:
    """Makes ``device`` torch's current device when CUDA initialises (``set_device`` now would
    initialise CUDA here, in ``install()``)."""

    def stepalloc_set_rank_device() -> None:
        torch.cuda.set_device(device)

    # torch's own queue of calls that wait for CUDA's initialisation (torch.cuda.manual_seed
    # uses it); private, so a torch without it gets a warning instead of a failed install().
    lazy_call = getattr(torch.cuda, "_lazy_call", None)
    if lazy_call is None:
        warnings.warn(
            f"stepalloc.install(): torch {torch.__version__} has no torch.cuda._lazy_call; call "
            f"torch.cuda.set_device({device}) yourself to put this rank's tensors on its device",
            stacklevel=3,
        )
        return
    lazy_call(stepalloc_set_rank_device)


def _update_installation(conf: str | None, metrics_port: int | None, patch: bool) -> Installation:
    global _installation
    assert _installation is not None
    if conf is not None and conf != _installation.conf:
        raise ValueError(
            f"stepalloc is already installed with conf={_installation.conf!r}; the configuration is fixed "
            f"once installed, so conf={conf!r} cannot apply (set it in the first install() call)"
        )
    changes: dict[str, Any] = {}
    if metrics_port is not None:
        if _installation.metrics_address is None:
            changes["metrics_address"] = _serve_metrics(metrics_port)
        elif _installation.metrics_address != served_address(metrics_port):
            raise ValueError(f"stepalloc already serves metrics on {_installation.metrics_address}")
    if patch and (_patched is None or not _process_wide_patched):
        patch_torch()
    if _installation.torch_patched != (_patched is not None):  # patched now, or unpatched since
        changes["torch_patched"] = _patched is not None
    if changes:
        _installation = dataclasses.replace(_installation, **changes)
    return _installation


def _serve_metrics(port: int | None) -> str | None:
    if port is None:
        return None
    from .metrics import serve_metrics

    return serve_metrics(port)


def mempool(use_on_oom: bool = False) -> Any:
    """A ``torch.cuda.MemPool`` whose segments come from stepalloc.

    PyTorch's caching allocator stays in charge and asks stepalloc for whole segments while the
    pool is active::

        pool = stepalloc.mempool()
        with torch.cuda.use_mem_pool(pool):
            kv_cache = torch.empty(...)

    After ``install()`` it returns a ``stepalloc.MemPool`` (one of stepalloc's private pools).
    Needs torch >= 2.5. Unlike ``install()`` it can be used after CUDA is initialised, and only
    the code inside ``use_mem_pool`` is affected; but PyTorch's own cache sits in front of
    stepalloc, so step release and stepalloc's statistics see segments, not tensors. Since
    PyTorch caches, stepalloc runs in MemPool mode from here on: a segment PyTorch frees goes
    back to the device, so ``torch.cuda.empty_cache()`` returns memory.

    A pool serves the device that is current when it is made: make one per device (with
    ``torch.cuda.device(d)`` current) and enter each with its own device.
    ``torch.cuda.use_mem_pool(pool, device=d)`` for another device raises ``StepallocError``
    naming both devices (PyTorch's allocator would give device ``d`` an empty pool without
    stepalloc behind it, then fail its internal assert ``use_count > 0``); the check lives in
    the routing wrappers of ``stepalloc.follow``, so after ``stepalloc.follow.disable()`` it is
    PyTorch's behaviour again.

    Without ``install()`` PyTorch's allocator routes the pool, so re-entering it on one thread
    (``use_mem_pool(p1)``, ``use_mem_pool(p2)``, ``use_mem_pool(p1)``) is refused as PyTorch
    refuses it, with ``StepallocError`` and without the use count PyTorch's refusal leaks; under
    ``install()`` the routes nest and unwind as a stack.
    """
    global _mempool_allocator
    torch = _import_torch()
    if not hasattr(torch.cuda, "MemPool"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.cuda.MemPool (needs torch >= 2.5)")
    if _installation is not None:
        # Process-wide already: every tensor is stepalloc's; a pool is one of its private pools.
        from .pools import MemPool

        return MemPool(use_on_oom=use_on_oom)
    with _lock:
        _lib.adopt_environment()  # a bad STEPALLOC_CONF fails naming the variable
        if _mempool_allocator is None:
            _lib.lib()
            _mempool_allocator = torch.cuda.memory.CUDAPluggableAllocator(
                _lib.library_path(), MEMPOOL_ALLOC_FN, FREE_FN
            )
            _keep_alive.append(_mempool_allocator)
        status = int(_lib.lib().stepalloc_set_mempool_mode(1))
        if status != _lib.OK:
            raise _lib.error_for(status)
    device = int(torch.cuda.current_device())  # where PyTorch's MemPool creates the pool
    pool = torch.cuda.MemPool(_mempool_allocator.allocator(), use_on_oom=use_on_oom)
    from . import captures, follow

    follow.follow_pool(pool.id, device)  # backward() inside use_mem_pool allocates from the pool too
    captures.ensure()  # a pause refuses to run during a capture PyTorch's allocator routes
    return pool


# ----- patch_torch ---------------------------------------------------------------------------

_patched: dict[tuple[Any, str], Any] | None = None
# Whether the process-wide wrappers (parity.patches: MemPool, the table's raising entry points)
# are in place; they apply only after install().
_process_wide_patched = False
_INHERITED = object()  # marks a class attribute patch_torch added over an inherited one


def _torch_snapshot(device: stats.Device = None, augment_with_fx_traces: bool = False) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot`` answered by stepalloc (all devices; fx traces ignored)."""
    snap = snapshot.memory_snapshot()
    _pool_ids_as_tuples(snap["segments"])
    return snap


def _pool_ids_as_tuples(segments: list[dict[str, Any]]) -> None:
    """A segment's pool id as PyTorch gives it, a tuple (JSON has lists)."""
    for s in segments:
        s["segment_pool_id"] = tuple(s.get("segment_pool_id", (0, 0)))


def _torch_record_memory_history(
    enabled: str | None = "all",
    context: str | None = "all",
    stacks: str = "all",
    max_entries: int = sys.maxsize,
    device: Any = None,
    clear_history: bool = False,
    **_ignored: Any,
) -> None:
    """``torch.cuda.memory._record_memory_history`` answered by stepalloc.

    Starts stepalloc's event ring anew on every device with room for the newest
    ``max_entries`` events (at most 2**26; ``trace_entries`` in the configuration sets the
    ring at start), which ``_snapshot`` / ``_dump_snapshot`` then show as ``device_traces``;
    ``enabled=None`` stops recording and drops the history. stepalloc records no Python
    stacks, so ``context`` and ``stacks`` are accepted and change nothing; the history is
    always started anew, so ``clear_history`` changes nothing either. ``enabled=True`` /
    ``False`` (PyTorch's legacy form) mean ``"all"`` / None.
    """
    if isinstance(enabled, bool):  # the legacy form (``_record_memory_history_legacy``)
        enabled = "all" if enabled else None
    if enabled not in (None, "state", "all"):
        raise ValueError(f"enabled must be None, 'state' or 'all', not {enabled!r}")
    entries = 0 if enabled is None else max(0, min(int(max_entries), 1 << 26))
    limit = ctypes.c_uint64(0)
    _lib.check(_lib.lib().stepalloc_record_history(entries, ctypes.byref(limit)))


def _torch_memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> list[dict[str, Any]]:
    """``torch.cuda.memory_snapshot`` answered by stepalloc: the segments list."""
    segments = snapshot.memory_snapshot()["segments"]
    if mempool_id is not None:
        wanted = list(mempool_id)
        segments = [s for s in segments if list(s.get("segment_pool_id", [])) == wanted]
    _pool_ids_as_tuples(segments)
    return segments


REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "memory_stats": stats.memory_stats,
    "memory_stats_as_nested_dict": stats.memory_stats_as_nested_dict,
    "memory_allocated": stats.memory_allocated,
    "max_memory_allocated": stats.max_memory_allocated,
    "memory_reserved": stats.memory_reserved,
    "max_memory_reserved": stats.max_memory_reserved,
    "memory_cached": stats.memory_reserved,
    "max_memory_cached": stats.max_memory_reserved,
    "reset_peak_memory_stats": stats.reset_peak_memory_stats,
    "reset_accumulated_memory_stats": stats.reset_accumulated_memory_stats,
    "reset_max_memory_allocated": stats.reset_max_memory_allocated,
    "reset_max_memory_cached": stats.reset_max_memory_allocated,
    "memory_summary": stats.memory_summary,
    "memory_snapshot": _torch_memory_snapshot,
    "_snapshot": _torch_snapshot,
    "_record_memory_history": _torch_record_memory_history,
}


def _accelerator_device(device: Any) -> int | None:
    """A ``torch.accelerator`` device argument as a CUDA ordinal, checked as torch.accelerator
    checks it (a ``torch.device`` or string of another type is refused)."""
    try:
        from torch.accelerator._utils import _get_device_index
    except ImportError:  # a torch whose private helper moved: torch.cuda's reading
        return None if device is None else stats.device_index(device)
    return _get_device_index(device, optional=True)


def _accelerator_replacements(torch: Any) -> dict[str, Callable[..., Any]]:
    """``torch.accelerator``'s memory functions answered as ``torch.cuda``'s are: under a
    pluggable allocator torch's own report an empty dict (``_accelerator_isAllocatorInitialized``
    is False) and ``empty_cache`` does nothing."""

    def on_device(fn: Callable[[Any], Any]) -> Callable[..., Any]:
        def stepalloc_accelerator(device_index: Any = None, /) -> Any:
            return fn(_accelerator_device(device_index))

        stepalloc_accelerator.__name__ = stepalloc_accelerator.__qualname__ = fn.__name__
        stepalloc_accelerator.__doc__ = fn.__doc__
        return stepalloc_accelerator

    cuda_empty_cache, cuda_mem_get_info = torch.cuda.empty_cache, torch.cuda.mem_get_info

    def empty_cache() -> None:
        """``torch.accelerator.empty_cache``: ``torch.cuda.empty_cache``, which reaches stepalloc."""
        cuda_empty_cache()

    def get_memory_info(device_index: Any = None, /) -> tuple[int, int]:
        """``torch.accelerator.get_memory_info``: ``torch.cuda.mem_get_info`` (free, total)."""
        index = _accelerator_device(device_index)
        return tuple(cuda_mem_get_info(torch.cuda.current_device() if index is None else index))

    return {
        "memory_stats": on_device(stats.memory_stats),
        "memory_allocated": on_device(stats.memory_allocated),
        "max_memory_allocated": on_device(stats.max_memory_allocated),
        "memory_reserved": on_device(stats.memory_reserved),
        "max_memory_reserved": on_device(stats.max_memory_reserved),
        "reset_peak_memory_stats": on_device(stats.reset_peak_memory_stats),
        "reset_accumulated_memory_stats": on_device(stats.reset_accumulated_memory_stats),
        "empty_cache": empty_cache,
        "get_memory_info": get_memory_info,
    }


def patch_torch() -> list[str]:
    """Routes torch.cuda's memory statistics to stepalloc; returns the names replaced.

    Under a pluggable allocator PyTorch's own ``torch.cuda.memory_stats``,
    ``memory_allocated``, ``memory_reserved``, ``max_memory_*``, ``reset_peak_memory_stats``,
    ``memory_summary`` and ``memory_snapshot`` raise; after this they answer from stepalloc
    (in ``torch.cuda`` and ``torch.cuda.memory``; ``torch.accelerator``'s memory functions,
    ``empty_cache`` and ``get_memory_info`` answer as torch.cuda's), so HF Trainer's memory
    metrics, Lightning's ``DeviceStatsMonitor``, ``torch.cuda.memory._record_memory_history`` and
    ``torch.cuda.memory._dump_snapshot`` keep working. Under process-wide stepalloc it also
    makes CUDA IPC work (``torch.multiprocessing`` queues, ``reduce_tensor``,
    ``torch.cuda.ipc_collect``; see ``stepalloc.ipc``), with stock PyTorch or stepalloc on the
    other side.
    After ``install()`` it also puts ``stepalloc.MemPool`` in place of ``torch.cuda.MemPool``
    and wraps the other entry points of the parity table (``stepalloc.parity``): those stepalloc
    cannot serve raise ``stepalloc.parity.UnsupportedError`` naming the alternative.
    Idempotent; ``unpatch_torch()`` restores the originals.
    """
    global _patched, _process_wide_patched
    torch = _import_torch()
    with _lock:
        if _patched is None:
            saved: dict[tuple[Any, str], Any] = {}
            for module in (torch.cuda, torch.cuda.memory):
                for name, fn in REPLACEMENTS.items():
                    if hasattr(module, name):
                        saved[(module, name)] = getattr(module, name)
                        setattr(module, name, fn)
            # torch.accelerator (torch >= 2.8), whose accelerator is CUDA in a CUDA build (asking
            # torch.accelerator.current_accelerator() here could initialise CUDA before install).
            accelerator = getattr(torch, "accelerator", None)
            if accelerator is not None:
                modules = [accelerator] + [m for m in [getattr(accelerator, "memory", None)] if m is not None]
                for name, fn in _accelerator_replacements(torch).items():
                    for module in modules:
                        if hasattr(module, name):
                            saved[(module, name)] = getattr(module, name)
                            setattr(module, name, fn)
            ipc.patch(torch, is_installed)
            _patched = saved
        if _installation is not None and not _process_wide_patched:
            from . import parity

            for owner, name, fn in parity.patches(torch, _torch_record_memory_history):
                # A class's own attribute is restored; an inherited one is deleted again.
                inherited = isinstance(owner, type) and name not in owner.__dict__
                original = _INHERITED if inherited else vars(owner)[name]
                _patched.setdefault((owner, name), original)
                setattr(owner, name, fn)
            _process_wide_patched = True
        return sorted({name for _, name in _patched})


def unpatch_torch() -> None:
    """Restores the torch.cuda functions ``patch_torch()`` replaced."""
    global _patched, _process_wide_patched
    with _lock:
        if _patched is not None:
            for (owner, name), fn in _patched.items():
                if fn is _INHERITED:
                    delattr(owner, name)
                else:
                    setattr(owner, name, fn)
            import torch

            ipc.unpatch(torch)
            _patched = None
            _process_wide_patched = False
