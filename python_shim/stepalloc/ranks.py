"""Layer: ranks under torchrun. Which rank this process is, which device it uses and the
Prometheus target it offers (every rank's figures gathered to one rank: ``stats.gather_stats``).

stepalloc is per process; the distributed machinery is PyTorch's (torchrun, ``torch.distributed``)
and the fleet view is Prometheus's. This module only reads torchrun's environment and uses a
process group the program already made.

Invariants:
- The rank numbers are those of torchrun's environment: ``RANK`` (global), ``LOCAL_RANK`` (on
  this node) and ``GROUP_RANK`` (the node's index), read as the library reads them (the metric
  label ``rank`` is ``RANK``, else ``LOCAL_RANK``). A value that is not a non-negative integer is
  an error naming the variable.
- The rank's device is ``LOCAL_RANK`` when the process sees more devices than that (every GPU of
  the node visible), device 0 when it sees exactly one (one GPU per process, e.g.
  ``CUDA_VISIBLE_DEVICES`` set per rank, or the simulated device); anything else is an error.
- A target file is written whole under a temporary name and renamed, so Prometheus (which
  watches the directory) never reads half a file.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import socket
from typing import Any

from . import _lib

# torchrun's variables, in the order the labels are listed.
ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_NODE = "GROUP_RANK"


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """This process's place in a torchrun job; every field is None outside torchrun.

    Attributes:
        rank: the global rank (``RANK``, else ``LOCAL_RANK``; the metrics' ``rank`` label).
        local_rank: the rank on this node (``LOCAL_RANK``).
        node: the node's index in the job (``GROUP_RANK``).
    """

    rank: int | None
    local_rank: int | None
    node: int | None

    @property
    def under_torchrun(self) -> bool:
        return self.rank is not None

    def labels(self) -> dict[str, str]:
        """The Prometheus labels naming this rank: ``rank``, ``local_rank``, ``node``, those known."""
        named = (("rank", self.rank), ("local_rank", self.local_rank), ("node", self.node))
        return {name: str(value) for name, value in named if value is not None}

    def describe(self) -> str:
        """``rank 3 (local rank 1, node 1)``, or an empty string outside torchrun."""
        if self.rank is None:
            return ""
        where = [f"local rank {self.local_rank}"] if self.local_rank is not None else []
        where += [f"node {self.node}"] if self.node is not None else []
        return f"rank {self.rank}" + (f" ({', '.join(where)})" if where else "")


def _env_number(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    if not text.isdigit():
        raise ValueError(
            f"{name}={raw!r} (from the torchrun environment) is not a rank: expected a non-negative integer"
        )
    return int(text)


def rank_info() -> RankInfo:
    """Where this process runs in a torchrun job, read from the environment now."""
    local_rank = _env_number(ENV_LOCAL_RANK)
    rank = _env_number(ENV_RANK)
    return RankInfo(rank=rank if rank is not None else local_rank, local_rank=local_rank, node=_env_number(ENV_NODE))


def rank_device(count: int | None = None) -> int:
    """The device this rank uses: see the module's invariants. ``count`` is the number of
    devices the process sees (default: ``stepalloc.device_count()``, which creates nothing).
    Outside torchrun: device 0."""
    local_rank = _env_number(ENV_LOCAL_RANK)
    if local_rank is None:
        return 0
    if count is None:
        count = _lib.device_count()
    if local_rank < count:
        return local_rank
    if count == 1:
        return 0  # one device per process: the rank's own
    raise ValueError(
        f"LOCAL_RANK={local_rank} (from the torchrun environment) has no device: this process sees {count} "
        f"devices, so the rank's device must be in 0..{count - 1} (LOCAL_RANK), or the process must see exactly "
        "one device (e.g. CUDA_VISIBLE_DEVICES set per rank, or sim_devices:1)"
    )


# ----- Prometheus service discovery ------------------------------------------------------------


def prometheus_target(address: str | None = None, host: str | None = None) -> dict[str, Any]:
    """This rank's entry of a Prometheus file-based service discovery list::

        {"targets": ["node7:9836"], "labels": {"rank": "9", "local_rank": "1", "node": "1"}}

    ``address``: where the endpoint serves (``host:port``); default: the address ``install(
    metrics_port=...)`` or ``serve_metrics()`` started it on in this process. ``host`` replaces
    the address's host in the target; by default an endpoint bound to every interface
    (``0.0.0.0``, ``::``) is named by this machine's host name, which other nodes can reach.
    """
    if address is None:
        from .metrics import current_address

        address = current_address()
        if address is None:
            raise _lib.StepallocError(
                "prometheus_target: no metrics endpoint serves in this process; start one with "
                "install(metrics_port=...) or serve_metrics(), or pass address='host:port'",
                _lib.UNAVAILABLE,
            )
    served_host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"prometheus_target: address {address!r}: expected host:port with a port in 1..65535")
    served_host = served_host.strip("[]")
    if host is None:
        host = socket.gethostname() if _unspecified(served_host) else served_host
    shown = f"[{host}]" if ":" in host else host
    return {"targets": [f"{shown}:{int(port)}"], "labels": rank_info().labels()}


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == ""


def write_prometheus_targets(
    directory: str | os.PathLike[str], address: str | None = None, host: str | None = None
) -> str:
    """Writes this rank's target (see ``prometheus_target``) to
    ``directory/stepalloc-rank-<rank>.json`` (``stepalloc.json`` outside torchrun) for a
    Prometheus ``file_sd_configs`` entry reading ``directory/*.json``; returns the path.

    Every rank calls it; each writes its own file, so no rank waits for another and a restarted
    rank replaces its own entry. The directory is created if missing.
    """
    target = prometheus_target(address, host)
    info = rank_info()
    name = "stepalloc.json" if info.rank is None else f"stepalloc-rank-{info.rank}.json"
    folder = os.fspath(directory)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    # Prometheus only reads files matching its pattern (`*.json`): the temporary name does not.
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump([target], f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path
