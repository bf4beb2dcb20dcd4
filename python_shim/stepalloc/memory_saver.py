"""Layer: a torch_memory_saver-shaped object over ``stepalloc.sleep``, so code written against
torch_memory_saver (0.0.10: SGLang, slime, AReaL) moves with one import::

    from stepalloc.memory_saver import torch_memory_saver

    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        weights = torch.empty(..., device="cuda")
    with torch_memory_saver.region(tag="kv_cache"):
        kv = torch.empty(..., device="cuda")
    torch_memory_saver.pause("kv_cache"); torch_memory_saver.pause()   # memory goes back
    torch_memory_saver.resume()                                         # same addresses

Invariants:
- Tags, pause and resume are the library's (``sleep``); this object keeps only its own
  settings (memory margin, whether to keep host buffers) and the regions it opened.
- The first use installs stepalloc as PyTorch's allocator when nothing did (torch_memory_saver
  also takes over allocation on first use); an installation made before is used as it is.
- Where torch_memory_saver's behaviour and stepalloc's differ, this object follows
  torch_memory_saver when the difference would break code written for it (pausing a tag that
  has no memory is a no-op, not an error) and says so in python_shim/README.md, "Sleep and
  wake".
"""

from __future__ import annotations

import contextlib
import ctypes
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


def _tag(tag: str) -> str:
    """The stepalloc tag for a torch_memory_saver tag."""
    return SAVER_DEFAULT_TAG if tag == _TAG_DEFAULT else tag


class TorchMemorySaver:
    """The shape of ``torch_memory_saver.TorchMemorySaver`` (0.0.10), over stepalloc."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = False
        self._margin = 0
        self._retain = True  # stepalloc keeps its host buffers; False gives them back on resume
        self._tags: set[str] = set()  # the tags this object's regions named
        self._hook_mode: str | None = None

    # --- setup ---------------------------------------------------------------------------

    def _ensure_initialized(self) -> None:
        if self._ready:
            return
        with self._lock:
            if self._ready:
                return
            from . import torch as _torch

            if not _torch.is_installed():
                _torch.install()
            self._ready = True

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> Any:
        raise AttributeError("hook_mode has only a setter (as in torch_memory_saver)")

    @hook_mode.setter
    def hook_mode(self, value: str) -> None:
        # torch_memory_saver chooses LD_PRELOAD or a pluggable allocator; stepalloc is always
        # PyTorch's pluggable allocator, so both modes are the same here.
        if value not in ("preload", "torch"):
            raise ValueError(f"hook_mode must be 'preload' or 'torch', not {value!r}")
        self._hook_mode = value

    # --- regions ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        """Tensors allocated inside carry ``tag``; with ``enable_cpu_backup`` their bytes are
        kept on the host through ``pause``/``resume``, else they are discarded."""
        _check_backend(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        self._ensure_initialized()
        with sleep.region(_tag(tag), backup=enable_cpu_backup):
            self._tags.add(_tag(tag))
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
        takes its tag."""
        _check_backend(enable_cpu_backup, False, cpu_backup_backend)
        self._ensure_initialized()
        import torch

        graph = torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode)
        with sleep.region(_tag(tag), backup=enable_cpu_backup), graph:
            self._tags.add(_tag(tag))
            yield

    @contextlib.contextmanager
    def disable(self, dispose_mem_pool_after_use: bool = True) -> Iterator[None]:
        """Tensors allocated inside are not paused by this object's ``pause()``."""
        if not dispose_mem_pool_after_use:
            raise AssertionError("Only dispose_mem_pool_after_use=true is supported now")
        self._ensure_initialized()
        with sleep.region(DISABLED_TAG, backup=False):
            yield

    # --- pause and resume ------------------------------------------------------------------

    def _targets(self, tag: str | None) -> list[str]:
        """The tags a call acts on: the one named, if it has memory (torch_memory_saver does
        nothing for a tag without allocations), else every tag this object's regions named."""
        known = sleep.tags()
        if tag is not None:
            return [_tag(tag)] if _tag(tag) in known else []
        return sorted(t for t in self._tags if t in known)

    def pause(self, tag: str | None = None) -> sleep.SleepReport:
        """Releases the memory of ``tag`` (None: every tag of this object's regions), keeping
        the addresses. Returns stepalloc's report (torch_memory_saver returns None)."""
        self._ensure_initialized()
        return _merge("pause", [sleep.pause(t) for t in self._targets(tag)])

    def resume(self, tag: str | None = None) -> sleep.SleepReport:
        """Maps the memory of ``tag`` (None: every paused tag of this object's regions) again and
        restores its backup. With ``memory_margin_bytes`` set, refuses (out of memory, nothing
        mapped) when less than the margin would stay free on the device afterwards."""
        self._ensure_initialized()
        targets = self._targets(tag)
        if self._margin:
            self._check_margin(targets)
        report = _merge("resume", [sleep.resume(t) for t in targets])
        if not self._retain:
            sleep.release_backup()
        return report

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

    # --- settings --------------------------------------------------------------------------

    @property
    def memory_margin_bytes(self) -> int:
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        self._margin = _lib.c_size_arg(value, "memory_margin_bytes")

    @property
    def retain_cpu_backup(self) -> bool:
        """Whether host backup buffers are kept after ``resume`` (True by default here:
        stepalloc reuses them at the next pause; torch_memory_saver's default is False)."""
        return self._retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._retain = bool(value)
        if not self._retain:
            sleep.release_backup()

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        """The host copy of CUDA tensor ``x`` while its memory is paused with a backup (a CPU
        tensor of the same dtype and shape; a copy unless ``zero_copy``), else None."""
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
    if enable_disk_backup:
        raise NotImplementedError(
            "enable_disk_backup: stepalloc backs up to pinned host memory only (enable_cpu_backup=True)"
        )
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


# The global singleton, as torch_memory_saver exports it.
torch_memory_saver = TorchMemorySaver()
