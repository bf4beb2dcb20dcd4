"""stepalloc: a CUDA caching allocator for PyTorch with step-boundary release and
fragmentation metrics (Python side of ``libstepalloc.so``).

Typical use::

    import torch
    import stepalloc
    stepalloc.install("phase_trim:True", patch_torch=True)   # before CUDA is first used

    for batch in loader:
        with stepalloc.step("rollout"):
            with torch.no_grad():
                ...
        with stepalloc.step("train"):
            ...
    print(stepalloc.memory_summary())

Layer map: ``_lib`` (the ctypes handle, errors), ``steps`` (step hooks), ``stats``
(torch-compatible statistics), ``snapshot`` (memory-viewer snapshots), ``metrics``
(Prometheus), ``ranks`` (torchrun: the rank's device, Prometheus targets, gathering every
rank's figures), ``torch`` (install / mempool / patch_torch), ``pools`` (``MemPool``, which
``patch_torch`` puts in place of ``torch.cuda.MemPool`` under ``install``), ``parity`` (what
each torch.cuda memory API does under stepalloc, and the wrappers that say so), ``integrations``
(framework callbacks, agent loops), ``sleep`` (tagged regions, pause / resume with addresses
kept), ``memory_saver`` (a torch_memory_saver-shaped object over ``sleep``), ``follow``
(autograd's device thread follows the pool and the region of the thread that called
``backward()``). Importing this
package loads no library and imports neither torch
nor any framework: everything happens on first use.
"""

from __future__ import annotations

from ._lib import (
    ConfigError,
    LibraryNotFoundError,
    PausedError,
    StepallocError,
    config_help,
    configure,
    device_count,
    find_library,
    library_path,
    raw_alloc,
    raw_free,
    version,
)
from .integrations import AgentLoop, PhaseRecord, hf_callback, lightning_callback
from .metrics import StepallocCollector, metrics_text, register_prometheus, serve_metrics
from .pools import MemPool
from .ranks import RankInfo, prometheus_target, rank_device, rank_info, write_prometheus_targets
from .sleep import SleepReport, backup_dir, pause, paused_tags, region, release_backup, resume, set_backup_dir, tags
from .snapshot import dump_snapshot, dump_trace, memory_snapshot, trace_jsonl
from .stats import (
    gather_stats,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_stats_as_nested_dict,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    stepalloc_stats,
)
from .steps import step, step_begin, step_end
from .torch import RECOMMENDED, Installation, install, installation, is_installed, mempool, patch_torch, unpatch_torch

if __import__("os").environ.get("STEPALLOC_AS_TORCH_MEMORY_SAVER", "") == "1":
    # `import torch_memory_saver` gives stepalloc's saver (stepalloc.memory_saver, "Sleep and wake").
    from .memory_saver import alias_torch_memory_saver as _alias

    _alias()

__version__ = "0.1.0"


def empty_cache() -> None:
    """Releases every unused cached segment to the device (``torch.cuda.empty_cache`` calls
    this too once ``install()`` ran). Before the allocator exists nothing is cached: nothing to
    do, and nothing is created (which would fix the configuration)."""
    from . import _lib

    if not _lib.initialised():
        return
    _lib.lib().stepalloc_empty_cache()
    _lib.check(int(_lib.lib().stepalloc_last_status()))


__all__ = [
    "AgentLoop",
    "ConfigError",
    "Installation",
    "LibraryNotFoundError",
    "MemPool",
    "PausedError",
    "PhaseRecord",
    "RECOMMENDED",
    "RankInfo",
    "SleepReport",
    "StepallocCollector",
    "StepallocError",
    "config_help",
    "configure",
    "device_count",
    "dump_snapshot",
    "dump_trace",
    "empty_cache",
    "find_library",
    "gather_stats",
    "hf_callback",
    "install",
    "installation",
    "is_installed",
    "library_path",
    "lightning_callback",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_summary",
    "mempool",
    "metrics_text",
    "patch_torch",
    "pause",
    "paused_tags",
    "prometheus_target",
    "rank_device",
    "rank_info",
    "raw_alloc",
    "raw_free",
    "region",
    "register_prometheus",
    "release_backup",
    "set_backup_dir",
    "backup_dir",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "resume",
    "serve_metrics",
    "step",
    "step_begin",
    "step_end",
    "stepalloc_stats",
    "tags",
    "trace_jsonl",
    "unpatch_torch",
    "version",
    "write_prometheus_targets",
]
