"""Layer: sleep and wake — tagged regions, ``pause`` / ``resume`` of a tag's memory with its
addresses kept, and the host backup — over the library's C ABI (``stepalloc_region_enter``,
``stepalloc_pause``, ...).

Invariants:
- The tag of an allocation is the library's: the innermost region of the allocating thread (a
  thread-local stack in the library), else ``"default"``. Python keeps no second copy of it, so
  allocations made by PyTorch on this thread inside ``with region(...)`` carry the tag whatever
  path they take into the library.
- ``pause`` / ``resume`` return what the library reports for this call (read on the same thread
  right after it, from a thread-local), never figures computed here.
- A failed call raises the exception for its status with the library's message; an
  out-of-memory resume is ``torch.cuda.OutOfMemoryError`` (also a ``MemoryError``) and leaves the
  tag paused with its backup, so it can be retried.
- The symbols are declared on first use, so a library without them fails with a message that
  says so, not at import.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from . import _lib, captures, follow, ipc

DEFAULT_TAG = "default"

_declared = False
_declare_lock = threading.Lock()


def _c() -> ctypes.CDLL:
    """The library with the sleep/wake symbols declared (once)."""
    global _declared
    cdll = _lib.lib()
    if _declared:
        return cdll
    with _declare_lock:
        if not _declared:
            c_int, c_char_p, c_size_t = ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t
            table: dict[str, tuple[list, object]] = {
                "stepalloc_region_enter": ([c_char_p, c_int], c_int),
                "stepalloc_region_exit": ([], c_int),
                "stepalloc_pause": ([c_char_p, c_int], c_int),
                "stepalloc_resume": ([c_char_p], c_int),
                "stepalloc_pause_tags": ([c_char_p, c_int], c_int),
                "stepalloc_pause_tags_discarding": (
                    [c_char_p, c_int, ctypes.POINTER(ctypes.c_uint64), c_size_t],
                    c_int,
                ),
                "stepalloc_resume_tags": ([c_char_p], c_int),
                "stepalloc_sleep_report_json": ([c_char_p, c_size_t], c_size_t),
                "stepalloc_release_backup": ([], c_int),
                "stepalloc_tags_json": ([c_char_p, c_size_t], c_size_t),
                "stepalloc_set_backup_dir": ([c_char_p], c_int),
                "stepalloc_backup_dir": ([c_char_p, c_size_t], c_size_t),
            }
            try:
                for name, (argtypes, restype) in table.items():
                    fn = getattr(cdll, name)
                    fn.argtypes = argtypes
                    fn.restype = restype
            except AttributeError as e:
                raise _lib.LibraryNotFoundError(
                    f"{_lib.library_path()} has no sleep/wake calls ({e}); it is older than this package, rebuild it"
                ) from e
            _declared = True
    return cdll


def _tag_arg(tag: object, what: str) -> bytes:
    """A tag as the library takes it; the library checks its form (1..=64 bytes of
    ``[A-Za-z0-9_.:-]``) and names it in its error."""
    return _lib.c_string(tag, what)


@dataclass(frozen=True)
class SleepReport:
    """What one ``pause`` or ``resume`` did (the library's report of the call).

    ``released_bytes``: physical memory given back to the device (pause); ``mapped_bytes``:
    physical memory mapped again (resume); ``copied_bytes``: bytes copied to the host backup
    (pause) or back from it (resume); ``discarded_bytes``: live bytes of tags without backup,
    whose contents are gone (pause); ``seconds`` and ``gib_per_s`` (copied bytes per second, 0
    when nothing was copied); ``tags``: the tags it acted on; ``skipped``: tags it left alone
    (already paused on pause, not paused on resume).
    """

    op: str
    tags: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    released_bytes: int = 0
    mapped_bytes: int = 0
    copied_bytes: int = 0
    discarded_bytes: int = 0
    seconds: float = 0.0
    gib_per_s: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, text: str) -> SleepReport:
        d = json.loads(text)
        return cls(
            op=str(d.get("op", "")),
            tags=tuple(d.get("tags", ())),
            skipped=tuple(d.get("skipped", ())),
            released_bytes=int(d.get("released_bytes", 0)),
            mapped_bytes=int(d.get("mapped_bytes", 0)),
            copied_bytes=int(d.get("copied_bytes", 0)),
            discarded_bytes=int(d.get("discarded_bytes", 0)),
            seconds=float(d.get("seconds", 0.0)),
            gib_per_s=float(d.get("gib_per_s", 0.0)),
            raw=d,
        )

    def __str__(self) -> str:
        gib = 1 << 30
        moved = self.released_bytes if self.op == "pause" else self.mapped_bytes
        return (
            f"{self.op} {', '.join(self.tags) or '(nothing)'}: "
            f"{moved / gib:.3f} GiB {'released' if self.op == 'pause' else 'mapped'}, "
            f"{self.copied_bytes / gib:.3f} GiB copied, {self.discarded_bytes / gib:.3f} GiB discarded, "
            f"{self.seconds * 1e3:.1f} ms ({self.gib_per_s:.2f} GiB/s)"
            + (f"; skipped {', '.join(self.skipped)}" if self.skipped else "")
        )


def _report() -> SleepReport:
    return SleepReport.from_json(_lib.read_text(_c().stepalloc_sleep_report_json))


# ``region(backup=...)``: the library's number of each backup store.
BACKUP_STORES = {False: 0, True: 1, "none": 0, "pinned": 1, "mmap": 2, "disk": 3}


def _store_number(backup: object) -> int:
    try:
        return BACKUP_STORES[backup]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ValueError(
            f"region: backup must be False, True, 'pinned', 'mmap' or 'disk', not {backup!r}"
        ) from None


def _served_by_pytorchs_allocator() -> bool:
    """Whether this thread's CUDA tensors go to PyTorch's own caching allocator: torch is
    imported, CUDA is initialised, stepalloc was not installed and the library drives the real
    device (on the simulated device the library's own calls allocate, whatever torch does)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        if not torch.cuda.is_initialized() or torch.cuda.memory.get_allocator_backend() != "native":
            return False
    except Exception:  # noqa: BLE001 - a torch without CUDA or these calls: nothing to check
        return False
    conf, _ = _lib.pending_configuration()
    return "backend:sim" not in conf.replace(" ", "")


class region:
    """``with stepalloc.region(tag, backup=False):`` — what this thread allocates inside carries
    ``tag`` (the innermost region wins; outside every region, ``"default"``).

    ``backup`` belongs to what is allocated inside: at ``pause``, True (or ``"pinned"``) copies
    those bytes to pinned host memory before the memory is released, ``"mmap"`` to pageable host
    memory (not pinned: slower copies, but the OS may reclaim it), ``"disk"`` to one file per
    allocation in the backup directory (``set_backup_dir``; the files are removed at resume),
    False discards them. Two regions of one tag with different ``backup`` never change each
    other's memory. Regions nest and are per thread;
    other threads are not affected, except autograd's device thread while it runs a
    ``backward()`` / ``autograd.grad()`` called inside the region: it borrows the tag for that
    call (``stepalloc.follow``). A bad tag (empty,
    over 64 bytes, characters outside ``[A-Za-z0-9_.:-]``, the 33rd distinct tag) raises
    ``ValueError`` with the library's message. Allocating inside the region of a paused tag
    raises ``stepalloc.PausedError``: resume it first.
    """

    def __init__(self, tag: str = DEFAULT_TAG, backup: bool | str = False, *, _pool_routed: bool = False) -> None:
        self.tag = tag
        self._store = _store_number(backup)
        self.backup = backup if isinstance(backup, str) else bool(backup)
        self._data = _tag_arg(tag, "region: tag")
        # The rooms (memory_saver, cumem) enter a region inside use_mem_pool of a stepalloc
        # pool when PyTorch keeps its own allocator: those allocations do reach stepalloc.
        self._pool_routed = _pool_routed

    def __enter__(self) -> region:
        if not self._pool_routed and _served_by_pytorchs_allocator():
            raise _lib.ConfigError(
                f"stepalloc.region({self.tag!r}): PyTorch's own allocator serves this process's CUDA "
                "memory (CUDA was initialised before stepalloc.install()), so the region would tag "
                f"nothing and pause({self.tag!r}) would release nothing. Call stepalloc.install() right "
                "after `import torch`, before anything touches the GPU, or use "
                "stepalloc.memory_saver (hook_mode='torch') or stepalloc.cumem, whose regions allocate "
                "through stepalloc's pools",
                _lib.INVALID_ARGUMENT,
            )
        _lib.check(int(_c().stepalloc_region_enter(self._data, self._store)))
        follow.ensure()  # backward() inside: autograd's thread borrows the tag (stepalloc.follow)
        captures.ensure()  # a pause refuses to run during a capture PyTorch's allocator routes
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        paused = _refused_as_paused(exc, self.tag)
        _lib.check(int(_c().stepalloc_region_exit()))
        if paused is not None:
            # PyTorch reports the library's refusal as its own error (process-wide: a
            # RuntimeError with the library's text; a pool: an out-of-memory error that says the
            # device is free): the innermost region whose tag is paused says what it is.
            raise _lib.PausedError(paused, _lib.PAUSED) from exc

    def __repr__(self) -> str:
        return f"stepalloc.region({self.tag!r}, backup={self.backup!r})"


# Set on an exception a region turned into ``PausedError`` or let pass: the regions around it
# leave it as it is.
_SEEN = "_stepalloc_region_seen"


def _refused_as_paused(exc: BaseException | None, tag: str) -> str | None:
    """The ``PausedError`` message for ``exc`` leaving the innermost region (of ``tag``) when
    it is PyTorch's report of an allocation the library refused because ``tag`` is paused: a
    ``RuntimeError`` (``torch.OutOfMemoryError`` is one) while the tag is paused. None otherwise,
    and for every region around the first one the exception leaves."""
    if exc is None or isinstance(exc, _lib.StepallocError) or not isinstance(exc, RuntimeError):
        return None
    if getattr(exc, _SEEN, False):
        return None
    try:
        setattr(exc, _SEEN, True)
    except AttributeError:
        return None
    if tag == DEFAULT_TAG or tag not in paused_tags():
        return None
    return (
        f"allocation in a region of tag {tag!r}, which is paused: resume it first "
        f"(stepalloc.resume({tag!r}), or wake_up() of stepalloc.cumem); PyTorch reported: {str(exc).splitlines()[0]}"
    )


def pause(tag: str | Sequence[str] | None = None, backup: bool | None = None) -> SleepReport:
    """Releases the physical memory of ``tag`` (a list of tags: all of them in one call; None:
    every tag that has had a region) to the device, keeping every address: tensors keep their
    ``data_ptr()`` and CUDA graphs captured before stay valid once ``resume`` ran. Live bytes are
    copied to host memory first when the region they were allocated in asked for a backup (or
    ``backup`` is True), else discarded. No host memory for the backup fails the pause before
    anything is released. Synchronizes the device first (every stream's queued work, also on
    streams stepalloc never saw allocate), so no kernel still uses the memory it unmaps; when it
    returns, another process sees the memory free.

    Several tags (a list, or None) go in one call: the backed-up tags' copies are queued first
    and the other pages released while they run, so the call takes about the copies' time.

    A tag never seen raises ``ValueError``; a tag already paused is skipped (``.skipped``);
    during a CUDA graph capture, ``ValueError``; a tag one of whose tensors was sent to another
    process (CUDA IPC) that may still hold it, ``ValueError`` naming the tag (the receiver keeps
    the memory it mapped). With a list, each name is checked before anything changes.
    """
    if tag is not None and not isinstance(tag, str):
        return _pause_each({t: backup for t in _tag_list(tag, "pause")})
    data = None if tag is None else _tag_arg(tag, "pause: tag")
    mode = -1 if backup is None else (1 if backup else 0)
    # Tensors sent to other processes whose receivers all let go no longer hold the pause back.
    ipc.collect()
    with captures.none_underway(f"pause of {tag!r}" if tag is not None else "pause"):
        _lib.check(int(_c().stepalloc_pause(data, mode)))
        return _report()


def _tag_list(tags: object, what: str) -> list[str]:
    """A list of tag names as the list calls take them (names hold no ``,`` or ``=``, which
    the library's list syntax uses)."""
    if isinstance(tags, (bytes, bytearray)) or not isinstance(tags, Iterable):
        raise TypeError(f"{what}: tag must be a str, a list of str or None, not {type(tags).__name__}")
    names = list(tags)
    if not names:
        raise ValueError(f"{what}: an empty list of tags")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{what}: tag must be a str, not {type(name).__name__}")
        if "," in name or "=" in name:
            raise ValueError(f"{what}: tag {name!r}: a tag name holds no ',' or '='")
    return names


def _pause_each(tags: dict[str, bool | None], discard: Sequence[int] = ()) -> SleepReport:
    """Pauses every tag of ``tags`` in one call, each with its own backup choice (None: its
    regions'); the live allocations starting at an address of ``discard`` are discarded, not
    copied, whatever their tag's choice (vLLM's ``discardable``)."""
    parts = [name if b is None else f"{name}={int(bool(b))}" for name, b in tags.items()]
    data = _tag_arg(",".join(parts), "pause: tags")
    ipc.collect()
    with captures.none_underway(f"pause of {list(tags)}"):
        if discard:
            addresses = (ctypes.c_uint64 * len(discard))(*(_lib.c_pointer_arg(a, "pause: discard") for a in discard))
            _lib.check(int(_c().stepalloc_pause_tags_discarding(data, -1, addresses, len(discard))))
        else:
            _lib.check(int(_c().stepalloc_pause_tags(data, -1)))
        return _report()


def resume(tag: str | Sequence[str] | None = None) -> SleepReport:
    """Maps physical memory at the addresses ``tag`` (a list of tags: all of them in one call,
    each batch's pages mapped while the batch before copies; None: every paused tag) had and
    restores its backed-up bytes. When the device cannot give the memory back, raises
    ``torch.cuda.OutOfMemoryError`` naming the tag and the shortfall; the tag stays paused with
    its backup and ``resume`` can be called again once memory is free. A tag that is not paused
    is skipped (``.skipped``)."""
    if tag is not None and not isinstance(tag, str):
        data = _tag_arg(",".join(_tag_list(tag, "resume")), "resume: tags")
        with captures.none_underway(f"resume of {list(tag)}"):
            _lib.check(int(_c().stepalloc_resume_tags(data)))
            return _report()
    data = None if tag is None else _tag_arg(tag, "resume: tag")
    with captures.none_underway(f"resume of {tag!r}" if tag is not None else "resume"):
        _lib.check(int(_c().stepalloc_resume(data)))
        return _report()


def release_backup() -> None:
    """Gives back the host backup buffers that hold no paused bytes (the buffers are otherwise
    kept across pauses: allocating pinned memory costs more than the copy)."""
    _lib.check(int(_c().stepalloc_release_backup()))


def set_backup_dir(path: str | os.PathLike[str]) -> None:
    """Sets the directory ``region(backup="disk")`` backups go to from the next pause on, for the
    whole process (created if missing; before any call, ``STEPALLOC_BACKUP_DIR`` or the system's
    temporary directory). A path that cannot be created or where no file can be created raises
    ``ValueError`` naming it. A pause that cannot write there (full disk, file-size limit,
    directory removed) raises naming the tag and the file, with the tag resident and intact."""
    path = os.fspath(path)
    _lib.check(int(_c().stepalloc_set_backup_dir(_lib.c_string(path, "set_backup_dir: path"))))


def backup_dir() -> str:
    """The directory disk backups go to now."""
    return _lib.read_text(_c().stepalloc_backup_dir)


def keep_cached(tag: str, on: bool = True) -> None:
    """Sets whether a pause of ``tag`` gives its free cached memory back only until the resume,
    which maps it again (no copy) as the tag's cached memory, so a resume takes back as much
    device memory as the pause released (torch_memory_saver's semantics; its room turns this
    on for its tags). Off by default: a pause releases cached memory for good and a resume maps
    only the live tensors' pages. Takes effect at the next pause (``stepalloc_tag_keep_cached``)."""
    data = _tag_arg(tag, "keep_cached: tag")
    fn = getattr(_c(), "stepalloc_tag_keep_cached", None)
    if fn is None:
        raise NotImplementedError(f"{_lib.library_path()} has no stepalloc_tag_keep_cached")
    fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    _lib.check(int(fn(data, 1 if on else 0)))


def tags() -> dict[str, dict[str, Any]]:
    """Every tag with its figures: ``live_bytes``, ``paused``, ``paused_bytes``, ``backup``,
    ``backup_bytes``, ``host_bytes`` (pinned), ``mmap_bytes`` (pageable), ``disk_bytes`` (in
    backup files), ``pauses``, ``resumes``, ``pause_seconds``, ``resume_seconds``."""
    return json.loads(_lib.read_text(_c().stepalloc_tags_json) or "{}")


def has_backup_pointer() -> bool:
    """Whether the library can tell where a paused range's backup lies (``backup_pointer``)."""
    return hasattr(_c(), "stepalloc_backup_pointer")


def backup_pointer(ptr: int, nbytes: int) -> int:
    """The host address holding the backed-up bytes ``[ptr, ptr + nbytes)`` of a paused tag, or
    0 when those bytes are not paused with a backup (``stepalloc_backup_pointer``)."""
    ptr = _lib.c_pointer_arg(ptr, "backup_pointer: ptr")
    nbytes = _lib.c_size_arg(nbytes, "backup_pointer: nbytes")
    fn = getattr(_c(), "stepalloc_backup_pointer", None)
    if fn is None:
        raise NotImplementedError(
            f"{_lib.library_path()} has no stepalloc_backup_pointer: reading a paused tensor's backup needs it"
        )
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_void_p
    return int(fn(ptr or None, nbytes) or 0)


def paused_tags() -> list[str]:
    """The tags that are paused now."""
    return [t for t, v in tags().items() if v.get("paused")]
