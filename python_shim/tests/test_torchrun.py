"""stepalloc under torchrun: two ranks, each on its own simulated device, scraped together by a
real Prometheus server through the target files the ranks write.

torchrun (run as ``python -m torch.distributed.run``, the same program) starts
``torchrun_worker.py`` in fresh processes, in two layouts: one node of two ranks
(``--standalone --nproc_per_node=2``), and two nodes of one rank each (two torchrun agents,
static rendezvous, ``--node_rank`` 0 and 1, on this machine). Each rank installs stepalloc,
trains a small DDP model on the CPU (gloo) with step markers, allocates its steps' buffers
through stepalloc, serves ``/metrics`` on its node's base port + ``LOCAL_RANK`` and writes its
snapshot and its ``file_sd`` target. Prometheus (Debian's ``prometheus``, as in
``tests/metrics_prometheus.rs``) reads the target directory; every query must return one series
per rank, with the values each rank reported and the labels ``rank``, ``local_rank``, ``node``
torchrun gave it. The Grafana dashboard's queries then run against it, the fleet panels checked
by value.

Skipped, saying why, without torch or without ``prometheus``; with ``CI`` set, a missing
``prometheus`` fails instead. Bounded: the whole test gives up after ``BUDGET_S``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, TypeVar

import pytest

from conftest import SHIM, torch_available

T = TypeVar("T")
ROOT = SHIM.parent
WORKER = Path(__file__).resolve().parent / "torchrun_worker.py"
DASHBOARD = ROOT / "dashboards" / "stepalloc.json"
BUDGET_S = 85
# torchrun, as the module it runs (the same interpreter as this test).
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

pytestmark = pytest.mark.skipif(not torch_available(), reason="torch is not installed: torchrun not tested")


def prometheus_or_skip() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("`prometheus` is not installed; CI must install Debian's `prometheus` package")
        pytest.skip("`prometheus` not found (apt-get install prometheus): the torchrun scrape is not tested")
    return path


def free_ports(count: int) -> int:
    """A base port with ``count`` consecutive free ports (bound and closed: a small race, on
    loopback only)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + count > 65535:
            continue
        try:
            held = []
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
        return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def wait_for(self, what: str, probe: Callable[[], T | None], why: Callable[[], str]) -> T:
        """Polls ``probe`` every 0.2 s until it gives a value; fails with ``why()`` at the deadline."""
        while True:
            value = probe()
            if value is not None:
                return value
            if self.left() == 0:
                pytest.fail(f"no {what} within the test's {BUDGET_S} s\n{why()}")
            time.sleep(0.2)


def query(prometheus: str, expr: str) -> list[dict[str, Any]] | None:
    """The result vector of an instant query, or None when Prometheus cannot answer yet."""
    url = f"http://{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read())
    except (OSError, ValueError):
        return None
    if body.get("status") != "success":
        return None
    return list(body["data"]["result"])


def dashboard_exprs() -> list[tuple[str, str]]:
    """Every (panel title, PromQL) of the dashboard, rows' nested panels included, with the
    template variables as Grafana fills them when "All" is chosen."""
    board = json.loads(DASHBOARD.read_text())
    panels = list(board["panels"])
    for panel in board["panels"]:
        panels.extend(panel.get("panels", []))
    out = []
    for panel in panels:
        for target in panel.get("targets", []):
            expr = (
                target["expr"]
                .replace("$device", ".*")
                .replace("$rank", ".*")
                .replace("$__rate_interval", "1m")
                .replace("$__range", "5m")
            )
            out.append((panel["title"], expr))
    return out


@dataclasses.dataclass(frozen=True)
class Rank:
    """What a rank of the job should report: its torchrun numbers and its endpoint's port."""

    rank: int
    local_rank: int
    node: int
    port: int


def launches(layout: str, out: Path) -> tuple[list[list[str]], list[Rank]]:
    """The torchrun command lines of ``layout`` (one per node) and the ranks they start."""
    if layout == "one node, two ranks":
        base = free_ports(2)
        command = [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(WORKER), str(out), str(base)]
        return [command], [Rank(r, r, 0, base + r) for r in (0, 1)]
    # Two nodes of one rank each, on this machine: torchrun's static rendezvous gives node i
    # GROUP_RANK i and RANK i; each node's endpoint has its own base port (both LOCAL_RANK 0).
    master = free_ports(3)
    bases = [master + 1, master + 2]
    commands = [
        [
            *TORCHRUN,
            "--nnodes=2",
            "--nproc_per_node=1",
            f"--node_rank={node}",
            "--rdzv_backend=static",
            "--master_addr=127.0.0.1",
            f"--master_port={master}",
            str(WORKER),
            str(out),
            str(bases[node]),
        ]
        for node in (0, 1)
    ]
    return commands, [Rank(r, 0, r, bases[r]) for r in (0, 1)]


@pytest.mark.parametrize("layout", ["one node, two ranks", "two nodes, one rank each"])
def test_ranks_under_torchrun_are_scraped_together(tmp_path: Path, layout: str) -> None:
    prometheus_bin = prometheus_or_skip()
    with open(tmp_path / "prometheus.log", "wb") as prom_log, open(tmp_path / "torchrun.log", "wb") as ranks_log:
        run_and_scrape(tmp_path, layout, prometheus_bin, prom_log, ranks_log)


def run_and_scrape(tmp_path: Path, layout: str, prometheus_bin: str, prom_log: Any, ranks_log: Any) -> None:
    deadline = Deadline(BUDGET_S)
    out = tmp_path / "out"
    targets = out / "targets"
    targets.mkdir(parents=True)
    commands, expected = launches(layout, out)
    prometheus = f"127.0.0.1:{free_ports(1)}"
    config = tmp_path / "prometheus.yml"
    # The scrape configuration python_shim/README.md documents, with a 1 s interval.
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: stepalloc\n    honor_labels: true\n"
        f"    file_sd_configs:\n      - files: ['{targets}/*.json']\n        refresh_interval: 1s\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("STEPALLOC_CONF", "RANK", "LOCAL_RANK", "GROUP_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    # All start at once: Prometheus waits for target files, the ranks import torch meanwhile.
    prom = subprocess.Popen(
        [
            prometheus_bin,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address={prometheus}",
            "--log.level=warn",
        ],
        stdin=subprocess.DEVNULL,
        stdout=prom_log,
        stderr=subprocess.STDOUT,
    )
    nodes = [
        subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=ranks_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: its ranks are killed with it
        )
        for command in commands
    ]

    def logs() -> str:
        exits = [n.poll() for n in nodes]
        return (
            f"torchrun (exit {exits}):\n{(tmp_path / 'torchrun.log').read_text(errors='replace')[-6000:]}\n"
            f"prometheus (exit {prom.poll()}):\n{(tmp_path / 'prometheus.log').read_text(errors='replace')[-3000:]}"
        )

    def alive() -> None:
        if any(n.poll() is not None for n in nodes) or prom.poll() is not None:
            pytest.fail(f"a process exited early\n{logs()}")

    def series(expr: str, count: int = 2) -> list[dict[str, Any]] | None:
        alive()
        result = query(prometheus, expr)
        return result if result is not None and len(result) == count else None

    try:
        deadline.wait_for(
            "ready ranks",
            lambda: alive() or (True if all((out / f"ready-rank{r}").exists() for r in (0, 1)) else None),
            logs,
        )
        ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}

        # Each rank: its own device, its own port, its rank in the summary.
        for r, own in ranks.items():
            want = expected[r]
            assert own["installation_device"] == 0, own
            assert own["metrics_address"] == f"127.0.0.1:{want.port}", own
            who = f"rank {r} (local rank {want.local_rank}, node {want.node})"
            assert f"stepalloc memory summary, {who}, device ID 0" in own["summary"], own["summary"]
            snap = pickle.loads((out / f"snapshot-rank{r}.pickle").read_bytes())
            assert len(snap["device_traces"]) == 1 and snap["device_traces"][0], "one device, traced"
            steps = [a for a in snap["external_annotations"] if a.get("stage") == "START"]
            assert len(steps) == 4, snap["external_annotations"]
        peaks = {r: ranks[r]["memory_stats"]["reserved_bytes.large_pool.peak"] for r in (0, 1)}
        assert peaks[1] > peaks[0] > 0, peaks  # rank 1's buffers are larger

        # Every rank's figures gathered to rank 0 through torch.distributed.
        gathered = json.loads((out / "gathered.json").read_text())
        assert [g["rank"] for g in gathered] == [0, 1]
        assert [(g["local_rank"], g["node"]) for g in gathered] == [(x.local_rank, x.node) for x in expected]
        assert [g["peak_reserved_bytes"] for g in gathered] == [
            ranks[r]["memory_stats"]["reserved_bytes.all.peak"] for r in (0, 1)
        ]
        assert all(g["stats"]["steps.train"] == 4 for g in gathered), gathered

        # The targets the ranks wrote, as Prometheus reads them.
        for r in (0, 1):
            entry = json.loads((targets / f"stepalloc-rank-{r}.json").read_text())
            labels = {"rank": str(r), "local_rank": str(expected[r].local_rank), "node": str(expected[r].node)}
            assert entry == [{"targets": [f"127.0.0.1:{expected[r].port}"], "labels": labels}], entry

        def both_up() -> list[dict[str, Any]] | None:
            up = series('up{job="stepalloc"}')
            return up if up and all(x["value"][1] == "1" for x in up) else None

        up = deadline.wait_for("two ranks up", both_up, logs)
        assert sorted(x["metric"]["rank"] for x in up) == ["0", "1"]

        # One series per rank, with each rank's own value and the label set of a rank.
        peak = deadline.wait_for(
            "a peak per rank", lambda: series('stepalloc_peak_reserved_bytes{job="stepalloc",pool="large"}'), logs
        )
        for s in peak:
            labels = s["metric"]
            r = int(labels["rank"])
            assert labels == {
                "__name__": "stepalloc_peak_reserved_bytes",
                "device": "0",
                "pool": "large",
                "rank": str(r),
                "local_rank": str(expected[r].local_rank),
                "node": str(expected[r].node),
                "instance": f"127.0.0.1:{expected[r].port}",
                "job": "stepalloc",
            }, labels
            assert float(s["value"][1]) == peaks[r], (r, s)
        steps = series('stepalloc_steps_total{phase="train"}')
        assert steps is not None and all(float(s["value"][1]) == 4 for s in steps), steps

        # The dashboard: every query runs; the fleet view's figures are the ranks'.
        checked = 0
        for title, expr in dashboard_exprs():
            result = query(prometheus, expr)
            assert result is not None, f"dashboard panel {title!r}: Prometheus refused `{expr}`"
            checked += 1
        assert checked >= 20, checked

        def panel_values(title: str) -> dict[str, float]:
            exprs = [e for t, e in dashboard_exprs() if t == title]
            assert exprs, f"no dashboard panel titled {title!r}"
            result = query(prometheus, exprs[0]) or []
            return {s["metric"].get("rank", ""): float(s["value"][1]) for s in result}

        all_peaks = {
            r: ranks[r]["memory_stats"]["reserved_bytes.large_pool.peak"]
            + ranks[r]["memory_stats"]["reserved_bytes.small_pool.peak"]
            for r in (0, 1)
        }
        assert panel_values("Worst rank's peak reserved") == {"": max(all_peaks.values())}
        assert panel_values("Worst rank") == {"1": max(all_peaks.values())}
        assert panel_values("Ranks reporting") == {"": 2.0}
        assert panel_values("Peak reserved by rank") == {str(r): float(v) for r, v in all_peaks.items()}
        frag = panel_values("External fragmentation by rank")
        assert sorted(frag) == ["0", "1"] and all(0.0 <= v <= 1.0 for v in frag.values()), frag
    finally:
        (out / "done").write_text("done\n")
        for node in nodes:
            try:
                node.wait(timeout=max(5.0, min(20.0, deadline.left())))
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        prom.kill()
        prom.wait()
    assert all(n.returncode == 0 for n in nodes), f"torchrun failed\n{logs()}"
