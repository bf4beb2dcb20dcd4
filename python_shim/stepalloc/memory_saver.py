"""Layer: a torch_memory_saver-shaped object over ``stepalloc.sleep``, so code written against
torch_memory_saver (0.0.10: SGLang, slime, AReaL, verl) moves with one import::

    from stepalloc.memory_saver import torch_memory_saver

    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        weights = torch.empty(..., device="cuda")
    with torch_memory_saver.region(tag="kv_cache"):
        kv = torch.empty(..., device="cuda")
    torch_memory_saver.pause("kv_cache"); torch_memory_saver.pause()   # memory goes back
    torch_memory_saver.resume()                                         # same addresses

Unchanged code that does ``from torch_memory_saver import torch_memory_saver`` gets this object
when run as ``python -m stepalloc.memory_saver script.py ARGS`` (the script runs as ``__main__``
with ``torch_memory_saver`` aliased to this module), or after
``stepalloc.memory_saver.alias_torch_memory_saver()`` (which ``import stepalloc`` calls when
``STEPALLOC_AS_TORCH_MEMORY_SAVER=1``).

Two routes, chosen at the first use, as torch_memory_saver's two hook modes:
- process-wide: stepalloc is (or becomes, when CUDA is not initialised yet and ``hook_mode`` is
  not ``"torch"``) PyTorch's allocator; a region is ``stepalloc.region``.
- pools (``hook_mode = "torch"``, or CUDA already initialised): PyTorch keeps its allocator, and
  each region allocates through a ``torch.cuda.MemPool`` over stepalloc (``stepalloc.mempool()``),
  one per (tag, backup store, device), as torch_memory_saver keeps one per key; PyTorch caches in front
  and stepalloc holds the tagged segments, which pause and resume keep at their addresses.

Invariants:
- Tags, pause, resume and the backup are the library's (``sleep``): whether and where bytes are
  backed up (pinned or mmap host memory, or disk files) belongs to each allocation (the region it
  was made in). This object keeps only its settings (margin, retain, backend names, the disk
  directory) and the regions and pools it opened.
- Settings are accepted before the first region (nothing is initialised by setting them).
- Where torch_memory_saver's behaviour and stepalloc's differ, this object follows
  torch_memory_saver when the difference would break code written for it (pausing a tag that
  has no memory and resuming one that is not paused do nothing) and says so in the README,
  "Sleep and wake".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from . import _lib, sleep

_TAG_DEFAULT = "default"
# torch_memory_saver's default tag is "default", which in stepalloc is the tag of memory
# allocated outside every region; its regions' "default" is this tag instead, so pausing it
# leaves memory outside regions alone (as torch_memory_saver does).
SAVER_DEFAULT_TAG = "memory_saver.default"
# Allocations inside ``disable()`` carry stepalloc's own default tag, which this object never
# pauses: torch_memory_saver leaves such memory alone.
DISABLED_TAG = "default"
# The environment variable that makes ``import torch_memory_saver`` give this module.
ALIAS_ENV = "STEPALLOC_AS_TORCH_MEMORY_SAVER"


def _tag(tag: str) -> str:
    """The stepalloc tag for a torch_memory_saver tag."""
    return SAVER_DEFAULT_TAG if tag == _TAG_DEFAULT else tag


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class TorchMemorySaver:
    """The shape of ``torch_memory_saver.TorchMemorySaver`` (0.0.10), over stepalloc."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._route: str | None = None  # "process" or "pools" once initialised
        self._margin = 0
        # As torch_memory_saver: host backups are given back after resume unless retained.
        self._retain = _env_flag("TMS_RETAIN_CPU_BACKUP")
        self._backend = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND") or "pinned"
        self._disk_dir = os.environ.get("TMS_DISK_BACKUP_DIR")
        self._tags: set[str] = set()  # the tags this object's regions named
        self._hook_mode: str | None = None
        self._pools: dict[tuple[str, bool, str, int], Any] = {}
        self._init_region: sleep.region | None = None
        self._init_at_import = False  # initialised at import by TMS_INIT_ENABLE

    # --- setup ---------------------------------------------------------------------------

    @property
    def _ready(self) -> bool:
        return self._route is not None

    @_ready.setter
    def _ready(self, value: bool) -> None:
        # Tests mark an object ready without touching PyTorch (the session's simulated device).
        self._route = "process" if value else None

    def _ensure_initialized(self) -> None:
        if self._route is not None:
            return
        with self._lock:
            if self._route is not None:
                return
            from . import torch as _torch

            if _torch.is_installed():
                route = "process"
            else:
                import torch

                if self._hook_mode == "torch" or torch.cuda.is_initialized():
                    route = "pools"
                else:
                    _torch.install()
                    route = "process"
            if route == "process" and _env_flag("TMS_INIT_ENABLE"):
                # torch_memory_saver's TMS_INIT_ENABLE: what this thread allocates outside any
                # region is pauseable under "default" (backed up with TMS_INIT_ENABLE_CPU_BACKUP).
                init_backup = self._backend if _env_flag("TMS_INIT_ENABLE_CPU_BACKUP") else False
                self._init_region = sleep.region(SAVER_DEFAULT_TAG, backup=init_backup)
                self._init_region.__enter__()
                self._adopt(SAVER_DEFAULT_TAG)
            self._route = route

    def _adopt(self, name: str) -> None:
        """A tag this object's regions named: its pause keeps the cached memory for the resume,
        as torch_memory_saver's, which maps a region's whole segments again
        (``sleep.keep_cached``; ``stepalloc.pause`` and the cumem room release it for good)."""
        if name not in self._tags:
            sleep.keep_cached(name, True)
            self._tags.add(name)

    def _init_from_env(self) -> None:
        """``TMS_INIT_ENABLE=1`` at import: initialise now (process-wide, with the init region)
        unless CUDA is initialised already (then at the first use, as without it)."""
        import torch

        if not torch.cuda.is_initialized():
            self._ensure_initialized()
            self._init_at_import = True

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> Any:
        raise AttributeError("hook_mode has only a setter (as in torch_memory_saver)")

    @hook_mode.setter
    def hook_mode(self, value: str) -> None:
        # "torch": the pools route (works after CUDA is initialised); "preload": stepalloc becomes
        # PyTorch's allocator at the first use (torch_memory_saver's LD_PRELOAD needs no more).
        if value not in ("preload", "torch"):
            raise ValueError(f"hook_mode must be 'preload' or 'torch', not {value!r}")
        if self._route is not None and value != self._hook_mode and (value == "torch") != (self._route == "pools"):
            if self._init_at_import:
                raise RuntimeError(
                    f"hook_mode={value!r} with TMS_INIT_ENABLE=1: that variable asks for the preload hook mode, "
                    "and the saver began process-wide when it was imported; unset it to use hook_mode='torch'"
                )
            raise RuntimeError(
                f"hook_mode={value!r} after the first region: the saver already runs "
                f"{'with pools' if self._route == 'pools' else 'process-wide'}; set hook_mode first"
            )
        self._hook_mode = value

    # --- regions ---------------------------------------------------------------------------

    def _pool(self, tag: str, store: bool | str) -> Any:
        """The ``torch.cuda.MemPool`` over stepalloc of (tag, backup store, device)."""
        import torch

        from . import torch as _torch

        key = (tag, store, torch.cuda.current_device())
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _torch.mempool()
        return pool

    @contextlib.contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        """Tensors allocated inside carry ``tag``; with ``enable_cpu_backup`` their bytes are
        kept on the host through ``pause``/``resume`` (in pinned memory, or pageable with
        ``cpu_backup_backend="mmap"``), with ``enable_disk_backup`` in files of the disk backup
        directory, else they are discarded. The choice belongs to the tensors made here: other
        regions of the same tag keep theirs."""
        _check_backend(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        self._ensure_initialized()
        name = _tag(tag)
        store = self._store(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        with contextlib.ExitStack() as stack:
            if self._route == "pools":
                import torch

                stack.enter_context(torch.cuda.use_mem_pool(self._pool(name, store)))
            stack.enter_context(sleep.region(name, backup=store, _pool_routed=self._route == "pools"))
            self._adopt(name)
            yield

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph: Any,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        """``torch.cuda.graph(...)`` captured inside a region of ``tag``: the graph's private
        pool (its intermediates and outputs) is put under the tag, so pausing the tag gives that
        memory back and ``resume`` maps it again at the same addresses: the graph replays with
        no recapture. The region is entered before the capture begins, which is when the pool
        takes its tag. As torch_memory_saver's, it needs the process-wide route (its
        ``cuda_graph`` needs the preload hook mode)."""
        _check_backend(enable_cpu_backup, False, cpu_backup_backend)
        self._ensure_initialized()
        store = self._store(enable_cpu_backup, False, cpu_backup_backend)
        if self._route != "process":
            raise RuntimeError(
                "cuda_graph needs stepalloc as PyTorch's allocator (hook_mode='preload' before CUDA is "
                "initialised); torch_memory_saver's hook_mode='torch' does not support it either"
            )
        import torch

        graph = torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode)
        with sleep.region(_tag(tag), backup=store), graph:
            self._adopt(_tag(tag))
            yield

    @contextlib.contextmanager
    def disable(self, dispose_mem_pool_after_use: bool = True) -> Iterator[None]:
        """Tensors allocated inside are not paused by this object's ``pause()``. At the exit,
        the memory they freed goes back to the device, as torch_memory_saver disposes the pool
        it allocated them from (its training_engine example asserts it): they are allocated
        from a pool of their own (PyTorch's in the pools route, one of stepalloc's private pools
        process-wide), dropped at the exit. Other cached memory, a paused tag's included, stays."""
        if not dispose_mem_pool_after_use:
            raise AssertionError("Only dispose_mem_pool_after_use=true is supported now")
        self._ensure_initialized()
        import torch

        if self._route == "pools":
            # PyTorch's own allocator, in a pool of its own (torch_memory_saver does the same).
            pool = torch.cuda.MemPool()
        else:
            from . import torch as _torch

            pool = _torch.mempool()
        with torch.cuda.use_mem_pool(pool), sleep.region(DISABLED_TAG, backup=False, _pool_routed=True):
            yield
        del pool

    # --- pause and resume ------------------------------------------------------------------

    def _targets(self, tag: str | None) -> list[str]:
        """The tags a call acts on: the one named, if it has memory (torch_memory_saver does
        nothing for a tag without allocations), else every tag this object's regions named."""
        known = sleep.tags()
        if tag is not None:
            return [_tag(tag)] if _tag(tag) in known else []
        return sorted(t for t in self._tags if t in known)

    def _check_capture(self, what: str) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"torch_memory_saver.{what}() during a CUDA graph capture: unmapping or mapping memory "
                f"would invalidate the capture; {what} after it ends"
            )

    def _check_state(self, what: str, tag: str | None, paused: bool) -> None:
        """A named tag with memory in the wrong state: torch_memory_saver prints "Cannot pause
        allocation that is not active" (or "... resume ... not paused") and exits the process;
        this raises instead and changes nothing."""
        if tag is None:
            return
        figures = sleep.tags().get(_tag(tag))
        if figures is None or bool(figures.get("paused")) != paused:
            return
        if paused or int(figures.get("live_bytes", 0)) > 0:
            raise RuntimeError(
                f"torch_memory_saver.{what}({tag!r}): the tag is {'paused already' if paused else 'not paused'} "
                f"(torch_memory_saver exits the process here); nothing was changed"
            )

    def pause(self, tag: str | None = None) -> sleep.SleepReport:
        """Releases the memory of ``tag`` (None: every tag of this object's regions), keeping
        the addresses; the tensors made in regions with a backup keep their bytes on the host.
        Returns stepalloc's report (torch_memory_saver returns None)."""
        self._ensure_initialized()
        self._check_capture("pause")
        self._check_state("pause", tag, paused=True)
        self._sync_pools()
        targets = self._targets(tag)
        if len(targets) > 1:
            # One call: the backed-up tags' copies run under the other tags' unmaps.
            return sleep.pause(targets)
        return _merge("pause", [sleep.pause(t) for t in targets])

    def resume(self, tag: str | None = None) -> sleep.SleepReport:
        """Maps the memory of ``tag`` (None: every paused tag of this object's regions) again and
        restores its backup. With ``memory_margin_bytes`` set, refuses (out of memory, nothing
        mapped) when less than the margin would stay free on the device afterwards."""
        self._ensure_initialized()
        self._check_capture("resume")
        self._check_state("resume", tag, paused=False)
        targets = self._targets(tag)
        if self._margin:
            self._check_margin(targets)
        report = sleep.resume(targets) if len(targets) > 1 else _merge("resume", [sleep.resume(t) for t in targets])
        if not self._retain:
            sleep.release_backup()
        return report

    def _sync_pools(self) -> None:
        """Pools route: PyTorch queued its work on its streams; stepalloc waits, stream-ordered,
        for the streams its segments were made on, which covers what PyTorch ran on them."""
        if self._route == "pools":
            import torch

            torch.cuda.synchronize()

    def _check_margin(self, targets: list[str]) -> None:
        import torch

        known = sleep.tags()
        need = sum(int(known[t].get("paused_bytes", 0)) for t in targets if known.get(t, {}).get("paused"))
        free, _ = torch.cuda.mem_get_info()
        if need and free < need + self._margin:
            raise _lib.out_of_memory_error(
                f"resume of {', '.join(targets)} needs {need} bytes and memory_margin_bytes={self._margin} "
                f"more free, but the device has {free} bytes free (short by {need + self._margin - free}); "
                "the tags stay paused, free memory and call resume again"
            )

    # --- settings (accepted before the first region) -----------------------------------------

    @property
    def memory_margin_bytes(self) -> int:
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        self._margin = _lib.c_size_arg(value, "memory_margin_bytes")

    @property
    def retain_cpu_backup(self) -> bool:
        """Whether host backup buffers are kept after ``resume`` (False by default, as
        torch_memory_saver; ``TMS_RETAIN_CPU_BACKUP=1`` makes it True). Kept buffers are reused
        by the next pause."""
        return self._retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._retain = bool(value)

    def set_disk_backup_dir(self, path: str) -> None:
        """The process-wide directory of disk backups (``enable_disk_backup``), created if
        needed; one that cannot be created or written raises ``ValueError`` naming it now."""
        sleep.set_backup_dir(path)
        self._disk_dir = None  # set: ``TMS_DISK_BACKUP_DIR`` no longer applies

    def _store(self, enable_cpu_backup: bool, enable_disk_backup: bool, backend: str | None) -> bool | str:
        """The library's backup store of a region (``sleep.region``'s ``backup``)."""
        if enable_disk_backup:
            if self._disk_dir is not None:
                # torch_memory_saver reads TMS_DISK_BACKUP_DIR once; so does this, at the first use.
                sleep.set_backup_dir(self._disk_dir)
                self._disk_dir = None
            return "disk"
        if enable_cpu_backup:
            return backend or self._backend
        return False

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        """The host copy of CUDA tensor ``x`` while its memory is paused with a host backup
        (a CPU tensor of the same dtype and shape; a copy unless ``zero_copy``), else None (as
        torch_memory_saver, for disk-backed memory too: its bytes are in a file)."""
        if not getattr(x, "is_cuda", False):
            raise ValueError(f"get_cpu_backup needs a CUDA tensor, not one on {getattr(x, 'device', type(x))}")
        if not x.is_contiguous():
            raise ValueError(f"get_cpu_backup needs a contiguous tensor (shape {tuple(x.shape)}, stride {x.stride()})")
        nbytes = int(x.numel() * x.element_size())
        if not sleep.has_backup_pointer() and not sleep.paused_tags():
            return None  # nothing is paused: no tensor has a backup
        host = sleep.backup_pointer(int(x.data_ptr()), nbytes)
        if not host:
            return None
        import numpy as np
        import torch

        raw = np.ctypeslib.as_array(ctypes.cast(host, ctypes.POINTER(ctypes.c_uint8)), shape=(nbytes,))
        out = torch.from_numpy(raw).view(x.dtype).view(x.shape)
        return out if zero_copy else out.clone()


def _check_backend(enable_cpu_backup: bool, enable_disk_backup: bool, backend: str | None) -> None:
    if enable_cpu_backup and enable_disk_backup:
        raise AssertionError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
    if backend is None:
        return
    if not enable_cpu_backup:
        raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
    if backend not in ("pinned", "mmap"):
        raise ValueError(f"cpu_backup_backend must be 'pinned' or 'mmap', not {backend!r}")


def _merge(op: str, reports: list[sleep.SleepReport]) -> sleep.SleepReport:
    """One report for several calls (one per tag)."""
    if len(reports) == 1:
        return reports[0]
    seconds = sum(r.seconds for r in reports)
    copied = sum(r.copied_bytes for r in reports)
    return sleep.SleepReport(
        op=op,
        tags=tuple(t for r in reports for t in r.tags),
        skipped=tuple(t for r in reports for t in r.skipped),
        released_bytes=sum(r.released_bytes for r in reports),
        mapped_bytes=sum(r.mapped_bytes for r in reports),
        copied_bytes=copied,
        discarded_bytes=sum(r.discarded_bytes for r in reports),
        seconds=seconds,
        gib_per_s=copied / (1 << 30) / seconds if seconds > 0 and copied else 0.0,
    )


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """torch_memory_saver's helper that sets ``LD_PRELOAD`` for child processes; stepalloc
    needs no preload, so it does nothing."""
    yield


def alias_torch_memory_saver() -> None:
    """Makes ``import torch_memory_saver`` (and ``from torch_memory_saver import
    torch_memory_saver``) give this module, so unchanged code uses stepalloc's saver. Call it
    before that import runs; ``STEPALLOC_AS_TORCH_MEMORY_SAVER=1`` does it at ``import stepalloc``."""
    existing = sys.modules.get("torch_memory_saver")
    if existing is not None and existing is not sys.modules[__name__]:
        raise RuntimeError(
            "alias_torch_memory_saver(): torch_memory_saver was imported already; call it (or set "
            f"{ALIAS_ENV}=1) before anything imports torch_memory_saver"
        )
    sys.modules["torch_memory_saver"] = sys.modules[__name__]


# The global singleton, as torch_memory_saver exports it.
torch_memory_saver = TorchMemorySaver()

if _env_flag("TMS_INIT_ENABLE"):
    # torch_memory_saver's preload library tracks from the process's start under
    # TMS_INIT_ENABLE, so what a program allocates before it first calls the saver is pauseable
    # (its training_engine example); the nearest point here is this import.
    torch_memory_saver._init_from_env()


def _main(argv: list[str]) -> int:
    """``python -m stepalloc.memory_saver script.py ARGS``: runs the script with
    ``torch_memory_saver`` aliased to stepalloc's saver."""
    import runpy

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m stepalloc.memory_saver script.py [args...]", file=sys.stderr)
        return 2
    from stepalloc import memory_saver

    memory_saver.alias_torch_memory_saver()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
