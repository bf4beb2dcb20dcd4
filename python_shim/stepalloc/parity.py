"""Layer: PyTorch glue. What each memory entry point of ``torch.cuda`` / ``torch.cuda.memory``
/ ``torch.accelerator`` (torch 2.15) does under process-wide stepalloc
(``install(patch_torch=True)``), as data: one ``Row`` per entry point, from which ``markdown()``
writes the table in python_shim/README.md (a test fails when the two differ) and ``patches()``
makes the wrappers ``patch_torch`` installs, so that every ``raises`` row raises
``UnsupportedError`` naming the alternative instead of PyTorch's "does not yet support" or a
silent wrong answer. ``PORTED``: PyTorch's own allocator tests (tests/torch_port) and their
results under PyTorch's allocator and under stepalloc, which ``ported_markdown()`` writes.

Invariants:
- ``ROWS`` has exactly one row per entry point; a test runs each row's check in real PyTorch.
- ``PORTED`` has one entry per ported test, with the outcome tests/torch_port observes under
  each allocator (a test fails when they differ); a test PyTorch's allocator passes passes under
  stepalloc, and one that fails under PyTorch too says why.
- A ``raises`` row has an ``instead`` (the alternative), which its error message ends with; so
  has a ``not applicable`` row, which raises the same way.
- torch is imported inside the functions, never at module import.
"""

from __future__ import annotations

import ctypes
import dataclasses
import warnings
from typing import Any, Callable

from . import _lib, checkpoint, pools
from . import nccl as nccl_glue

WORKS, DIFFERS, RAISES = "works", "works differently", "raises"
# An entry point whose one supported use install() itself makes, and which PyTorch's own
# allocator refuses, as stepalloc does, in the state install() leaves.
NOT_APPLICABLE = "not applicable"


UnsupportedError = _lib.UnsupportedError


@dataclasses.dataclass(frozen=True)
class Row:
    """One entry point. ``note``: how it works (or differs, or why it raises); ``instead``: for a
    ``raises`` row, the alternative its error names."""

    name: str
    status: str
    note: str
    instead: str = ""


_STATS = "answered by stepalloc (patch_torch), same keys and meanings as PyTorch's"
_NVML = "answered by NVML, not by the allocator: as under PyTorch's own allocator"
_HOST = "PyTorch's pinned-memory (host) allocator, which stepalloc does not replace"
_HOOK = "PyTorch's pool hooks, served by stepalloc's private pools"
_UNCACHED = (
    "while caching is disabled each allocation takes a device allocation of its own that goes back "
    "to the device when freed (PyTorch's calls cudaMalloc / cudaFree); stepalloc's statistics count "
    "them, PyTorch's do not"
)

ROWS: tuple[Row, ...] = (
    # Allocation and caching.
    Row("torch.cuda.caching_allocator_alloc", WORKS, "allocates from stepalloc (raw_alloc)"),
    Row("torch.cuda.caching_allocator_delete", WORKS, "frees to stepalloc"),
    Row("torch.cuda.caching_allocator_enable", DIFFERS, _UNCACHED),
    Row("torch.cuda.caching_allocator_disabled", DIFFERS, _UNCACHED),
    Row(
        "torch.cuda.empty_cache",
        WORKS,
        "returns stepalloc's unused cached segments to the device, those of pools in use included (not "
        "of a pool a CUDA graph captured into), as the out-of-memory path does before it raises; PyTorch's "
        "frees nothing while a pool is in use, nor does its out-of-memory path",
    ),
    Row("torch.cuda.set_per_process_memory_fraction", WORKS, "stepalloc enforces the limit"),
    Row("torch.cuda.get_per_process_memory_fraction", WORKS, "the fraction stepalloc enforces (patch_torch)"),
    Row("torch.cuda.mem_get_info", WORKS, "the driver's free and total bytes"),
    Row("torch.cuda.get_allocator_backend", DIFFERS, "returns 'pluggable'"),
    Row(
        "torch.cuda.memory._set_allocator_settings",
        DIFFERS,
        "`expandable_segments` reaches stepalloc (the general pool's new segments, as in PyTorch) and "
        "`pinned_*` PyTorch's host allocator; any other key warns: set it in STEPALLOC_CONF (same "
        "syntax) or install(conf=...)",
    ),
    Row(
        "torch.cuda.change_current_allocator",
        NOT_APPLICABLE,
        "PyTorch swaps its allocator once, before the allocator is initialised: install() is that swap. "
        "Another one raises (UnsupportedError), as PyTorch's own raises \"Can't swap an already initialized "
        'allocator" for any swap after CUDA use or after a first swap',
        "MemPool(allocator=...) with use_mem_pool for another allocator's memory",
    ),
    Row("torch.cuda.memory._get_current_allocator", WORKS, "stepalloc's CUDAPluggableAllocator"),
    Row("torch.cuda.memory.CUDAPluggableAllocator", WORKS, "another library's allocator, for MemPool(allocator=...)"),
    # Statistics.
    *(
        Row(f"torch.cuda.{name}", WORKS, _STATS)
        for name in (
            "memory_stats",
            "memory_stats_as_nested_dict",
            "memory_allocated",
            "max_memory_allocated",
            "memory_reserved",
            "max_memory_reserved",
            "memory_cached",
            "max_memory_cached",
            "reset_peak_memory_stats",
            "reset_accumulated_memory_stats",
            "reset_max_memory_allocated",
            "reset_max_memory_cached",
            "memory_summary",
        )
    ),
    *(
        Row(f"torch.cuda.{name}", WORKS, _HOST)
        for name in (
            "host_memory_stats",
            "host_memory_stats_as_nested_dict",
            "reset_accumulated_host_memory_stats",
            "reset_peak_host_memory_stats",
        )
    ),
    *(
        Row(f"torch.accelerator.{name}", WORKS, "answered as torch.cuda's (patch_torch); torch's own read nothing")
        for name in (
            "memory_stats",
            "memory_allocated",
            "max_memory_allocated",
            "memory_reserved",
            "max_memory_reserved",
            "reset_peak_memory_stats",
            "reset_accumulated_memory_stats",
            "empty_cache",
            "get_memory_info",
        )
    ),
    Row("torch.cuda.list_gpu_processes", WORKS, _NVML),
    Row("torch.cuda.memory_usage", WORKS, _NVML),
    Row("torch.cuda.device_memory_used", WORKS, _NVML),
    # Snapshots and history.
    Row("torch.cuda.memory_snapshot", WORKS, "stepalloc's segments; `mempool_id` selects one pool's"),
    Row("torch.cuda.memory._snapshot", WORKS, "stepalloc's snapshot, in PyTorch's layout"),
    Row("torch.cuda.memory._dump_snapshot", WORKS, "a pickle PyTorch's memory viewer opens"),
    Row(
        "torch.cuda.memory._record_memory_history",
        DIFFERS,
        "records allocation events without Python stacks (`context`, `stacks` change nothing)",
    ),
    Row("torch.cuda.memory._record_memory_history_legacy", DIFFERS, "as _record_memory_history"),
    Row("torch.cuda.memory._allocation_traceback", DIFFERS, "returns None: stepalloc records no stacks"),
    Row("torch.cuda.memory._memory_metadata_supported", DIFFERS, "returns False"),
    Row("torch.cuda.memory._set_memory_metadata", DIFFERS, "PyTorch warns; the metadata is not recorded"),
    Row("torch.cuda.memory._annotate_tensor", DIFFERS, "PyTorch warns; the annotation is not recorded"),
    # MemPool.
    Row("torch.cuda.MemPool", WORKS, "stepalloc.MemPool: one of stepalloc's private pools (patch_torch)"),
    Row(
        "torch.cuda.MemPool(allocator=...)",
        WORKS,
        "the pool's segments come from that allocator and go back through its free function",
    ),
    Row(
        "torch.cuda.MemPool(use_on_oom=True)",
        WORKS,
        "a general allocation that finds no memory takes a free block of the pool",
    ),
    Row(
        "torch.cuda.MemPool(no_split=True)",
        WORKS,
        "each block takes a whole segment of the pool, never split (as PyTorch's)",
    ),
    Row("torch.cuda.MemPool.id", WORKS, "(0, n), from PyTorch's own pool counter"),
    Row("torch.cuda.MemPool.use_count", WORKS, "references: the pool, each use_mem_pool, each graph"),
    Row("torch.cuda.MemPool.snapshot", WORKS, "the pool's segments"),
    Row(
        "torch.cuda.use_mem_pool",
        WORKS,
        _HOOK + "; backward() inside allocates from the pool too (autograd's thread follows it: "
        "stepalloc.follow); a stepalloc.region inside (or around) it is refused at the allocation; a pool "
        "entered again inside itself nests (PyTorch refuses it, keeping a use count); `device` other than "
        "the pool's raises StepallocError naming both (PyTorch enters an empty pool there, then asserts)",
    ),
    # CUDA graphs.
    Row("torch.cuda.graph_pool_handle", WORKS, "a pool id for graphs to share"),
    Row("torch.cuda.CUDAGraph (capture, replay, reset, pool)", WORKS, _HOOK),
    Row("torch.cuda.graph(pool=MemPool)", WORKS, "captures into the MemPool's private pool"),
    Row(
        "torch.cuda.CUDAGraph._retain_pool",
        DIFFERS,
        "what use_mem_pool calls during a capture: the graph holds a reference to the pool until it is "
        "reset or destroyed, as in PyTorch, but graph.pools() does not list it",
    ),
    Row("torch.cuda.make_graphed_callables", WORKS, "its captures share one of stepalloc's private pools"),
    Row("torch._C._cuda_beginAllocateCurrentThreadToPool", WORKS, _HOOK),
    Row("torch._C._cuda_beginAllocateToPool", WORKS, _HOOK),
    Row("torch._C._cuda_endAllocateToPool", WORKS, _HOOK),
    Row("torch._C._cuda_releasePool", WORKS, _HOOK),
    # torch.compile's CUDA-graph trees (mode="reduce-overhead").
    Row(
        "torch._C._cuda_getCheckpointState",
        WORKS,
        "records the pool's segments and allocated blocks (stepalloc.checkpoint, patch_torch)",
    ),
    Row(
        "torch._C._cuda_setCheckpointPoolState",
        WORKS,
        "frees the pool's blocks allocated since and allocates again, at their addresses, those freed since, "
        "through PyTorch's allocator (stale storages stop owning theirs; the storages given deleters own "
        "theirs); refused, changing nothing, if a recorded segment is gone or a block allocated since is "
        "still owned by a storage not passed as stale",
    ),
    Row(
        "torch._C._cuda_checkPoolLiveAllocations", WORKS, "compares the pool's allocated blocks in stepalloc's snapshot"
    ),
    Row(
        "torch._C._cuda_attach_out_of_memory_observer",
        WORKS,
        "stepalloc calls the observer (device, bytes asked for, bytes allowed, bytes free) before it raises",
    ),
    # CUDA IPC.
    Row(
        "torch.multiprocessing.reductions.reduce_tensor (CUDA)",
        WORKS,
        "PyTorch's own handle format, in the installed torch's version (a legacy IPC handle for plain "
        "segments, the pages' POSIX file descriptors for expandable ones); the receiver may run stock "
        "PyTorch or stepalloc (stepalloc.ipc)",
    ),
    Row(
        "torch.UntypedStorage._share_cuda_",
        WORKS,
        "PyTorch's 8-tuple: handle, reference counter in shared memory, producer event; the block is "
        "not reused until every receiver dropped it and ipc_collect ran",
    ),
    Row(
        "torch.UntypedStorage._new_shared_cuda",
        WORKS,
        "opens handles from stock PyTorch and from stepalloc; a malformed handle is a StepallocError",
    ),
    Row("torch.cuda.ipc_collect", WORKS, "releases shared blocks whose receivers all dropped them"),
    # Host allocator.
    Row("torch.Tensor.pin_memory", WORKS, _HOST),
    Row("torch.cuda.memory._host_allocator", WORKS, _HOST),
    Row("torch._C._host_emptyCache", WORKS, _HOST),
    # NCCL.
    Row(
        "ProcessGroupNCCL.register_mem_pool",
        WORKS,
        "the pool's segments registered with the group's communicator (ncclCommRegister): those it holds, "
        "and each it creates later (stepalloc.nccl, patch_torch); symm=True (symmetric windows) raises "
        "UnsupportedError",
    ),
    Row(
        "ProcessGroupNCCL.deregister_mem_pool",
        WORKS,
        "deregisters the pool's registered segments (ncclCommDeregister); a segment the pool releases "
        "is deregistered before its memory goes back",
    ),
)

ROW_BY_NAME: dict[str, Row] = {row.name: row for row in ROWS}

# ----- PyTorch's own allocator tests (python_shim/tests/torch_port) ---------------------------

PASSES, FAILS = "passes", "fails"
# The allocators each ported test runs under (tests/torch_port/run_cases.py's modes), in the
# table's column order, with the column's heading.
ALLOCATORS: tuple[tuple[str, str], ...] = (
    ("pytorch", "PyTorch's allocator"),
    ("pytorch-expandable", "PyTorch's, expandable segments"),
    ("stepalloc", "stepalloc (recommended)"),
    ("stepalloc-plain", "stepalloc, plain segments"),
)


@dataclasses.dataclass(frozen=True)
class Ported:
    """One of PyTorch's tests (``Class.test_name`` of its test/test_cuda.py, or of
    test/inductor/test_cudagraph_trees.py for ``CudaGraphTreeTests``) and its outcome under
    each of ``ALLOCATORS``, in order. ``why``: for a test that fails under PyTorch's allocator
    too, why it cannot pass on this harness. ``by_design``: for a test PyTorch's allocator
    passes and stepalloc does not, the behaviour stepalloc chose on purpose instead (the two
    such tests assert what PyTorch cannot do: give a pool in use's free memory back, through
    ``empty_cache()`` and on the out-of-memory path)."""

    test: str
    outcomes: tuple[str, str, str, str]
    why: str = ""
    by_design: str = ""


_ALL_PASS = (PASSES, PASSES, PASSES, PASSES)
PORTED: tuple[Ported, ...] = (
    Ported("TestCuda.test_memory_allocation", _ALL_PASS),
    Ported("TestCuda.test_memory_stats", _ALL_PASS),
    Ported("TestCuda.test_out_of_memory", _ALL_PASS),
    Ported("TestCuda.test_out_of_memory_retry", _ALL_PASS),
    Ported("TestCuda.test_set_per_process_memory_fraction", _ALL_PASS),
    Ported("TestCuda.test_get_per_process_memory_fraction", _ALL_PASS),
    Ported("TestCuda.test_copy_non_blocking", _ALL_PASS),
    Ported(
        "TestCuda.test_copy_non_blocking_type_conversion",
        (FAILS, FAILS, FAILS, FAILS),
        "the float-to-long conversion of the host-to-device copy is a kernel, and testdrv runs none",
    ),
    Ported("TestMemPool.test_mempool_id", _ALL_PASS),
    Ported("TestMemPool.test_mempool_empty_cache", _ALL_PASS),
    Ported("TestMemPool.test_mempool_empty_cache_inactive", _ALL_PASS),
    Ported("TestMemPool.test_mempool_with_allocator", _ALL_PASS),
    Ported("TestMemPool.test_tensor_delete_after_allocator_delete", _ALL_PASS),
    Ported(
        "TestMemPool.test_mempool_limited_memory_with_allocator",
        (PASSES, PASSES, FAILS, FAILS),
        by_design="by design: the test asserts that an allocation fails while a pool in use that is not "
        "use_on_oom holds a free 40 MiB segment (\"out of memory since can't use mempool_do_not_use\"); "
        "stepalloc's out-of-memory path gives that free segment back, as empty_cache() does, and the "
        "allocation gets memory of its own (the pool's blocks are never lent)",
    ),
    Ported("TestMemPool.test_mempool_no_split", _ALL_PASS),
    Ported("TestMemPool.test_deleted_mempool_not_used_on_oom", _ALL_PASS),
    Ported("TestMemPool.test_mempool_multithread", _ALL_PASS),
    Ported(
        "TestMemPool.test_mempool_emptycache_multithread",
        (PASSES, PASSES, FAILS, FAILS),
        by_design="by design: the test asserts that empty_cache() inside use_mem_pool frees nothing of the "
        "active pool (\"Expected to have a single segment\"); stepalloc gives a pool in use's free segments "
        "back (release while a pool is active: PyTorch strands that memory, vLLM PR #49151), live blocks untouched",
    ),
    Ported("TestMemPool.test_nested_mempool", _ALL_PASS),
    Ported("TestMemPool.test_mempool_expandable", _ALL_PASS),
    Ported("TestMemPool.test_mempool_ctx_multithread", _ALL_PASS),
    # torch.compile's CUDA-graph trees (test/inductor/test_cudagraph_trees.py): recordings,
    # replays and the graph pool's checkpoints (_cuda_getCheckpointState / _cuda_setCheckpointPoolState).
    Ported("CudaGraphTreeTests.test_tensor_dies_between_checkpoint", _ALL_PASS),
    Ported("CudaGraphTreeTests.test_aliased_static_parameter", _ALL_PASS),
    Ported("CudaGraphTreeTests.test_unaligned_static_parameter", _ALL_PASS),
    Ported("CudaGraphTreeTests.test_output_alias", _ALL_PASS),
    Ported("CudaGraphTreeTests.test_aliased_output_checkpoint", _ALL_PASS),
    Ported("CudaGraphTreeTests.test_tensor_no_longer_in_pool", _ALL_PASS),
    Ported("CudaGraphTreeTests.test_checkpoint_shared_output_storage_deallocation", _ALL_PASS),
    Ported("CudaGraphTreeTests.test_dynamic_warmup", _ALL_PASS),
)

PORTED_BY_TEST: dict[str, Ported] = {p.test: p for p in PORTED}


def ported_markdown() -> str:
    """The table of PyTorch's ported tests, as python_shim/README.md shows it."""
    lines = [
        "| PyTorch's test | " + " | ".join(heading for _, heading in ALLOCATORS) + " | why it fails or differs |",
        "|---|" + "---|" * len(ALLOCATORS) + "---|",
    ]
    for p in PORTED:
        note = (p.why or p.by_design).replace("|", "/")
        lines.append(f"| `{p.test}` | " + " | ".join(p.outcomes) + f" | {note} |")
    return "\n".join(lines) + "\n"


def error_message(name: str) -> str:
    """The message of the ``UnsupportedError`` a ``raises`` row's entry point raises."""
    row = ROW_BY_NAME[name]
    return _lib.unsupported_message(name, row.note, row.instead)


def markdown() -> str:
    """The parity table, as python_shim/README.md shows it."""
    lines = ["| entry point | under stepalloc | how |", "|---|---|---|"]
    for row in ROWS:
        how = row.note + (f"; instead: {row.instead}" if row.instead and row.status != WORKS else "")
        lines.append(f"| `{row.name}` | {row.status} | {how.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


# ----- the wrappers patch_torch installs under process-wide stepalloc ------------------------


def _raiser(name: str) -> Callable[..., Any]:
    def stepalloc_unsupported(*_args: Any, **_kwargs: Any) -> Any:
        raise UnsupportedError(error_message(name))

    return stepalloc_unsupported


def _set_caching_enabled(enabled: bool) -> None:
    """``torch._C._cuda_cudaCachingAllocator_enable`` (what ``caching_allocator_enable`` and
    ``caching_allocator_disabled`` call)."""
    _lib.check(int(_lib.lib().stepalloc_set_caching_enabled(int(bool(enabled)))))


def _caching_enabled() -> bool:
    """``torch._C._cuda_cudaCachingAllocator_is_enabled``."""
    answer = int(_lib.lib().stepalloc_caching_enabled())
    if answer < 0:
        raise _lib.error_for(int(_lib.lib().stepalloc_last_status()))
    return bool(answer)


def _set_allocator_settings(original: Callable[[str], Any]) -> Callable[[str], Any]:
    def stepalloc_set_allocator_settings(env: str) -> Any:
        ignored = []
        for item in str(env).split(","):
            key, _, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if key == "expandable_segments":
                # As PyTorch's allocator takes it at run time: the general pool's new segments.
                if value not in ("True", "False"):
                    raise ValueError(f"expandable_segments expects True or False, not {value!r}")
                _lib.check(int(_lib.lib().stepalloc_set_expandable_segments(int(value == "True"))))
            elif key and not key.startswith("pinned_"):  # pinned_*: PyTorch's host allocator
                ignored.append(item.strip())
        if ignored:
            warnings.warn(
                f"stepalloc: torch.cuda.memory._set_allocator_settings({','.join(ignored)!r}) configures PyTorch's "
                "own allocator, which stepalloc replaces: it does not change stepalloc. Set STEPALLOC_CONF (same "
                "syntax) or stepalloc.install(conf=...) instead.",
                stacklevel=2,
            )
        return original(env)

    return stepalloc_set_allocator_settings


def _check_pool_live_allocations(device: int, pool_id: Any, expected: Any) -> bool:
    """``torch._C._cuda_checkPoolLiveAllocations``: whether the pool's allocated blocks are exactly
    the pointers in ``expected``."""
    from . import snapshot

    wanted = tuple(int(x) for x in pool_id)
    live = {
        int(block["address"])
        for segment in snapshot.memory_snapshot()["segments"]
        if int(segment["device"]) == int(device) and tuple(segment["segment_pool_id"]) == wanted
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    }
    return live == {int(p) for p in expected}


def _get_memory_fraction(device: int) -> float:
    """``torch._C._cuda_getMemoryFraction`` (what ``torch.cuda.get_per_process_memory_fraction``
    calls): the fraction stepalloc enforces on ``device``, last set by
    ``set_per_process_memory_fraction`` or else the configuration's."""
    fraction = float(_lib.lib().stepalloc_memory_fraction(int(device)))
    if fraction < 0:
        raise _lib.error_for(int(_lib.lib().stepalloc_last_status()))
    return fraction


# PyTorch's observer signature as a C function; the made functions stay alive with the process
# (the library keeps calling them).
_OOM_OBSERVER_FN = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t)
_oom_observers: list[Any] = []


def _attach_out_of_memory_observer(observer: Callable[[int, int, int, int], Any]) -> None:
    """``torch._C._cuda_attach_out_of_memory_observer``: ``observer(device, alloc,
    device_allocated_limit, device_free)`` runs on every out-of-memory before it raises, as
    PyTorch calls it (an observer typically dumps ``torch.cuda.memory._snapshot()``). An
    exception in it is printed and the out-of-memory error raised as ever."""
    if not callable(observer):
        raise TypeError(f"an out-of-memory observer must be callable, not {type(observer).__name__}")

    def call(device: int, alloc: int, limit: int, free: int) -> None:
        observer(int(device), int(alloc), int(limit), int(free))

    fn = _OOM_OBSERVER_FN(call)
    _oom_observers.append(fn)
    _lib.check(int(_lib.lib().stepalloc_attach_oom_observer(ctypes.cast(fn, ctypes.c_void_p))))


def _record_memory_history_legacy(record: Callable[..., None]) -> Callable[..., None]:
    def stepalloc_record_memory_history_legacy(
        enabled: bool, record_context: bool = True, trace_alloc_max_entries: int = 1, *_args: Any, **_kwargs: Any
    ) -> None:
        record("all" if enabled else None, max_entries=trace_alloc_max_entries)

    return stepalloc_record_memory_history_legacy


def _retain_pool(self: Any, pool: Any) -> None:
    """``CUDAGraph._retain_pool`` (``use_mem_pool`` during a capture): the graph holds a reference
    to the pool until it is reset or destroyed. PyTorch's own asks the allocator to
    ``createOrIncrefPool``, which its pluggable-allocator class refuses."""
    import torch

    pool_id = torch.cuda.graphs._get_pool_id(pool)
    if pool_id is None:
        raise RuntimeError("CUDAGraph._retain_pool expected a memory pool")
    device = int(torch.cuda.current_device())
    pool_id = tuple(int(x) for x in pool_id)
    _lib.check(int(_lib.lib().stepalloc_pool_create(device, *pool_id)))

    def release() -> None:  # must not reference the graph (see register_destroy_callback)
        torch._C._cuda_releasePool(device, pool_id)

    self.register_destroy_callback(release, synchronize_before_release=True)


def patches(torch: Any, record_history: Callable[..., None]) -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, replacement)`` for every wrapper of the table's rows, for the torch
    given (owners that this build lacks are left out). ``record_history``: stepalloc's
    ``_record_memory_history`` (``stepalloc.torch`` owns it and calls this module)."""

    cuda, memory, c = torch.cuda, torch.cuda.memory, torch._C
    out: list[tuple[Any, str, Any]] = []
    for module in (cuda, memory):
        out += [
            (module, "MemPool", pools.MemPool),
            (module, "change_current_allocator", _raiser("torch.cuda.change_current_allocator")),
        ]
    out += [
        (memory, "_set_allocator_settings", _set_allocator_settings(memory._set_allocator_settings)),
        (memory, "_record_memory_history_legacy", _record_memory_history_legacy(record_history)),
        (torch.cuda.graphs.CUDAGraph, "_retain_pool", _retain_pool),
        (c, "_cuda_customAllocator", pools.record_custom_allocator(c._cuda_customAllocator)),
        (c, "_cuda_getCheckpointState", checkpoint.get_checkpoint_state),
        (c, "_cuda_setCheckpointPoolState", checkpoint.set_checkpoint_pool_state),
        (c, "_cuda_checkPoolLiveAllocations", _check_pool_live_allocations),
        (c, "_cuda_getMemoryFraction", _get_memory_fraction),
        (c, "_cuda_cudaCachingAllocator_enable", _set_caching_enabled),
        (c, "_cuda_cudaCachingAllocator_is_enabled", _caching_enabled),
        (c, "_cuda_attach_out_of_memory_observer", _attach_out_of_memory_observer),
    ]
    # PyTorch's stock ProcessGroupNCCL and nccl2's ProcessGroupNCCL2 (torch >= 2.15).
    for name in ("ProcessGroupNCCL", "ProcessGroupNCCL2"):
        nccl = getattr(getattr(c, "_distributed_c10d", None), name, None)
        if nccl is not None:
            out += [
                (nccl, "register_mem_pool", nccl_glue.register_mem_pool),
                (nccl, "deregister_mem_pool", nccl_glue.deregister_mem_pool),
            ]
    return [(owner, name, new) for owner, name, new in out if hasattr(owner, name)]
