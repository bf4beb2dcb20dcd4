"""Layer: statistics in the vocabulary of ``torch.cuda.memory_stats()``, read from the library.

Invariants:
- ``memory_stats()`` returns exactly torch's keys (an ``OrderedDict`` sorted by key, as torch
  returns it); stepalloc's own figures (fragmentation, steps, releases) come from
  ``stepalloc_stats()`` or ``memory_stats(include_stepalloc=True)``, under ``stepalloc.``.
- The figures are the library's (``stepalloc_stats_json``); nothing is computed twice here.
- A ``device`` argument is read like torch reads it (int, ``"cuda:1"``, ``torch.device``, None =
  the current device) without initialising CUDA just to answer, and checked against the range
  of a C ``int`` before it reaches ctypes.
- Nothing here creates the allocator (which would fix its configuration): before it exists the
  statistics are zero and the resets have nothing to do.
- ``gather_stats`` gathers every rank's figures to one rank through ``torch.distributed``;
  torch is imported only there, and only when the program already imported it.
"""

from __future__ import annotations

import collections
import json
import sys
import textwrap
from typing import Any, Union

from . import _lib
from .ranks import rank_device, rank_info

Device = Union[int, str, Any, None]

PREFIX = "stepalloc."


def device_index(device: Device = None) -> int:
    """The device ordinal for ``device`` as torch reads it, in 0..2**31-1 (``OverflowError``
    above, ``ValueError`` below).

    ``None`` is torch's current device when torch has initialised CUDA, else the rank's device
    under torchrun (``rank_device()``), else device 0 (asking torch would initialise CUDA, which
    ``install()`` must precede).
    """
    return _lib.c_int_arg(_device_number(device), f"device {device!r}: index")


def _device_number(device: Device) -> int:
    if device is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
        return rank_device()
    if isinstance(device, bool):
        raise TypeError("device must be an int, a str, a torch.device or None")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind != "cuda":
            raise ValueError(f"expected a CUDA device, got {device!r}")
        return int(index) if index else _device_number(None)
    device_type = getattr(device, "type", None)
    if device_type is not None:  # torch.device
        if device_type != "cuda":
            raise ValueError(f"expected a CUDA device, got {device!r}")
        return device.index if device.index is not None else _device_number(None)
    raise TypeError(f"device must be an int, a str, a torch.device or None, not {type(device).__name__}")


def _raw(device: Device) -> dict[str, Any]:
    index = device_index(device)
    text = _lib.read_text(_lib.lib().stepalloc_stats_json, index)
    if not text:
        # The library writes nothing when the call failed (e.g. a device that does not exist).
        _lib.check(int(_lib.lib().stepalloc_last_status()) or _lib.INVALID_ARGUMENT)
    return json.loads(text)


def memory_stats(device: Device = None, include_stepalloc: bool = False) -> collections.OrderedDict[str, Any]:
    """``torch.cuda.memory_stats(device)`` for memory allocated through stepalloc.

    Same keys, same meanings, sorted by key like torch's. With ``include_stepalloc=True`` the
    result also holds stepalloc's own figures under ``stepalloc.``.
    """
    raw = _raw(device)
    items = sorted((k, v) for k, v in raw.items() if include_stepalloc or not k.startswith(PREFIX))
    return collections.OrderedDict(items)


def stepalloc_stats(device: Device = None) -> dict[str, Any]:
    """stepalloc's own figures for ``device``, without the ``stepalloc.`` prefix: fragmentation
    (``fragmentation.external``, ``.internal``, ``.step``), steps (``steps``, ``steps.<phase>``),
    bytes released by reason, cache hits, driver time."""
    return {k[len(PREFIX) :]: v for k, v in sorted(_raw(device).items()) if k.startswith(PREFIX)}


def memory_allocated(device: Device = None) -> int:
    """Bytes currently held by live allocations (``allocated_bytes.all.current``)."""
    return int(memory_stats(device).get("allocated_bytes.all.current", 0))


def max_memory_allocated(device: Device = None) -> int:
    """Peak of ``memory_allocated`` since start or the last ``reset_peak_memory_stats``."""
    return int(memory_stats(device).get("allocated_bytes.all.peak", 0))


def memory_reserved(device: Device = None) -> int:
    """Bytes reserved from the device, cached or in use (``reserved_bytes.all.current``)."""
    return int(memory_stats(device).get("reserved_bytes.all.current", 0))


def max_memory_reserved(device: Device = None) -> int:
    """Peak of ``memory_reserved`` since start or the last ``reset_peak_memory_stats``."""
    return int(memory_stats(device).get("reserved_bytes.all.peak", 0))


def reset_peak_memory_stats(device: Device = None) -> None:
    """Sets every ``.peak`` statistic of ``device`` to its current value. Before the allocator
    exists every statistic is zero: nothing to reset, and nothing is created."""
    index = device_index(device)
    if _lib.initialised():
        _lib.check(_lib.lib().stepalloc_reset_peak_stats(index))


def reset_accumulated_memory_stats(device: Device = None) -> None:
    """Sets the ``.allocated``/``.freed`` totals and the event counters of ``device`` to 0
    (before the allocator exists they are 0 already: nothing is created)."""
    index = device_index(device)
    if _lib.initialised():
        _lib.check(_lib.lib().stepalloc_reset_accumulated_stats(index))


def reset_max_memory_allocated(device: Device = None) -> None:
    """Like torch's (deprecated there): resets every peak."""
    reset_peak_memory_stats(device)


def memory_stats_as_nested_dict(device: Device = None) -> dict[str, Any]:
    """``torch.cuda.memory_stats_as_nested_dict``: the keys split at dots into nested dicts."""
    nested: dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        *parents, leaf = key.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return nested


def _fmt_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps at most four digits before the point."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 10240 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.0f} {unit}"
        value /= 1024
    return f"{value} TiB"


def _fmt_count(n: float) -> str:
    value = float(n)
    for unit in ("", "K", "M", "G"):
        if abs(value) < 10000 or unit == "G":
            return f"{int(value)}{unit}" if unit == "" else f"{value:.0f}{unit}"
        value /= 1000
    return str(n)


def memory_summary(device: Device = None, abbreviated: bool = False) -> str:
    """A readable table of ``device``'s statistics, laid out like ``torch.cuda.memory_summary``
    (current / peak / total allocated / total freed, split by pool), followed by stepalloc's
    fragmentation and step figures. ``abbreviated`` leaves out the per-pool rows. Under torchrun
    the title names the rank (``rank 3 (local rank 1, node 1), device ID 1``)."""
    index = device_index(device)
    who = rank_info().describe()
    stats = memory_stats(index, include_stepalloc=True)
    rows: list[tuple[str, str, bool]] = [
        # (title, key, counts bytes)
        ("Allocated memory", "allocated_bytes", True),
        ("Active memory", "active_bytes", True),
        ("Requested memory", "requested_bytes", True),
        ("GPU reserved memory", "reserved_bytes", True),
        ("Non-releasable memory", "inactive_split_bytes", True),
        ("Allocations", "allocation", False),
        ("Active allocs", "active", False),
        ("GPU reserved segments", "segment", False),
        ("Non-releasable allocs", "inactive_split", False),
    ]
    width = 78
    line = "|" + "=" * width + "|"
    thin = "|" + "-" * width + "|"

    def row(label: str, cells: list[str]) -> str:
        return f"| {label:<25}|" + "|".join(f" {c:>10} " for c in cells) + "|"

    out = [
        line,
        f"| {'stepalloc memory summary, ' + (who + ', ' if who else '') + 'device ID ' + str(index):<{width - 1}}|",
        thin,
        f"| {'num_alloc_retries: ' + str(stats.get('num_alloc_retries', 0)):<36}"
        f"{'num_ooms: ' + str(stats.get('num_ooms', 0)):<{width - 37}}|",
        f"| {'num_device_alloc: ' + str(stats.get('num_device_alloc', 0)):<36}"
        f"{'num_device_free: ' + str(stats.get('num_device_free', 0)):<{width - 37}}|",
        line,
        row("Metric", ["Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"]),
    ]
    for title, key, is_bytes in rows:
        fmt = _fmt_bytes if is_bytes else _fmt_count
        out.append(thin)
        pools = [("all", title), ("large_pool", "      from large pool"), ("small_pool", "      from small pool")]
        for pool, label in pools[: 1 if abbreviated else 3]:
            cells = [fmt(stats.get(f"{key}.{pool}.{s}", 0)) for s in ("current", "peak", "allocated", "freed")]
            out.append(row(label, cells))
    out.append(line)
    oversize = (("Oversize allocations", "oversize_allocations"), ("Oversize GPU segments", "oversize_segments"))
    for title, key in oversize:
        cells = [_fmt_count(stats.get(f"{key}.{s}", 0)) for s in ("current", "peak", "allocated", "freed")]
        out.append(row(title, cells))
    out.append(line)
    own = {k[len(PREFIX) :]: v for k, v in stats.items() if k.startswith(PREFIX)}
    frag = (
        f"fragmentation: external {own.get('fragmentation.external', 0.0):.3f}, "
        f"internal {own.get('fragmentation.internal', 0.0):.3f}, last step {own.get('fragmentation.step', 0.0):.3f}"
    )
    phases = ", ".join(f"{k[len('steps.') :]} {v}" for k, v in own.items() if k.startswith("steps."))
    steps = f"steps: {own.get('steps', 0)}" + (f" ({phases})" if phases else "")
    released = ", ".join(
        f"{k[len('released_bytes.') :]} {_fmt_bytes(v)}" for k, v in own.items() if k.startswith("released_bytes.")
    )
    for text in (frag, steps, f"released: {released}" if released else "released: none"):
        # Wrapped, so that a long list (many phases, large figures) keeps the table's width.
        for piece in textwrap.wrap(text, width - 2, subsequent_indent="  "):
            out.append(f"| {piece:<{width - 1}}|")
    out.append(line)
    return "\n".join(out) + "\n"


# ----- every rank's figures on one rank ---------------------------------------------------------


def _process_group_ready() -> Any:
    """``torch.distributed`` when the program made a process group, else None. torch is not
    imported here: a program that never imported it has no process group."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def gather_stats(device: Any = None, dst: int = 0, group: Any = None) -> list[dict[str, Any]] | None:
    """Every rank's ``stepalloc_stats()`` (and peaks) on rank ``dst``, through ``torch.distributed``.

    Each rank contributes ``{"rank", "local_rank", "node", "device", "peak_reserved_bytes",
    "peak_allocated_bytes", "stats"}`` (``stats``: its ``stepalloc_stats(device)``; ``device``:
    the rank's device when None). On ``dst`` the result is the list of every rank's entry, in
    rank order; other ranks get None. Every rank of ``group`` must call it (a collective).
    Without a process group the result is this process's entry alone, in a list.
    """
    info = rank_info()
    index = rank_device() if device is None else device_index(device)
    peaks = memory_stats(index)
    own = {
        "rank": info.rank,
        "local_rank": info.local_rank,
        "node": info.node,
        "device": index,
        "peak_reserved_bytes": int(peaks.get("reserved_bytes.all.peak", 0)),
        "peak_allocated_bytes": int(peaks.get("allocated_bytes.all.peak", 0)),
        "stats": stepalloc_stats(index),
    }
    dist = _process_group_ready()
    if dist is None:
        return [own]
    # `dst` is a global rank, as in torch.distributed.gather_object; the list has one entry per
    # rank of `group`.
    size = dist.get_world_size(group)
    world = dist.get_world_size()
    if not isinstance(dst, int) or isinstance(dst, bool) or not 0 <= dst < world:
        raise ValueError(f"gather_stats: dst={dst!r} is not a rank of the job: accepted 0..{world - 1}")
    gathered: list[Any] | None = [None] * size if dist.get_rank() == dst else None
    dist.gather_object(own, gathered, dst=dst, group=group)
    return gathered
