"""The measured side of gpu/sleep_check.py: one of its parts in this process, ``--role cycle``
(stepalloc installed process-wide: pause / resume against a pinned ``copy_()``, the kept pointers
and bytes, a CUDA graph replayed after a resume, a graph's pool released and mapped again) or
``--role tms`` (torch_memory_saver's own wheel on the same tensors and bytes). It prints its
figures and checks as one JSON line; sleep_check.py starts it, judges the line and writes the
table. A process per part, since the allocator is chosen once per process: torch, stepalloc and
torch_memory_saver are imported here only, inside the parts.

Usage (as sleep_check.py runs it): python3 sleep_worker.py --role cycle|tms --backup-mb N
    --discard-mb N --tensors N --cycles N --graph-mb N
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from testdrv_env import on_host_driver

HERE = Path(__file__).resolve().parent
MIB = 1 << 20
GIB = 1 << 30
WEIGHTS, KV, GRAPH = "sleep_weights", "sleep_kv", "sleep_graph"
# The sizes sleep_check.py passes on.
SIZE_ARGS = ("backup_mb", "discard_mb", "tensors", "cycles", "graph_mb")


def sizes(total: int, n: int) -> list[int]:
    """``n`` sizes summing to ``total``, varied (1x..3x a base) like a model's tensors, 512-byte
    multiples (as scripts/sleep_bench.py makes them)."""
    weights = [1 + (i * 7919) % 3 for i in range(n)]
    base = total / sum(weights)
    out = [max(512, int(base * w) // 512 * 512) for w in weights]
    out[-1] += total - sum(out)
    return out


def source_bytes(torch, total: int):
    """The bytes the backed-up tensors hold: random, the same in every process."""
    g = torch.Generator().manual_seed(20261204)
    return torch.empty(total, dtype=torch.uint8).random_(0, 256, generator=g)


def fill(ws: list, src) -> list[int]:
    offsets, off = [], 0
    for w in ws:
        w.copy_(src[off : off + w.numel()])
        offsets.append(off)
        off += w.numel()
    return offsets


def same_bytes(torch, ws: list, src, offsets: list[int]) -> bool:
    return all(torch.equal(w.cpu(), src[o : o + w.numel()]) for w, o in zip(ws, offsets))


def row(name: str, nbytes: int, pauses: list[float], resumes: list[float]) -> dict:
    """Steady state (cycles 2 and later): median seconds and GiB/s of each direction."""
    p, r = statistics.median(pauses[1:]), statistics.median(resumes[1:])
    return {
        "name": name,
        "bytes": nbytes,
        "pause_s": p,
        "resume_s": r,
        "pause_gib_s": nbytes / GIB / p if p > 0 else 0.0,
        "resume_gib_s": nbytes / GIB / r if r > 0 else 0.0,
        "pause_all_s": pauses,
        "resume_all_s": resumes,
    }


def device_info(torch) -> dict:
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "host_memory_driver": on_host_driver(),
    }


def cycle_main(a: argparse.Namespace) -> dict:
    """Part ``cycle``: pause / resume against copy_(), the kept pointers and bytes, the graph."""
    import torch

    if not torch.cuda.is_available():
        return {"skip": "torch has no CUDA device here"}
    import stepalloc

    installation = stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED)
    out = device_info(torch)
    out["hooks"] = sorted(installation.hooks)
    backup, discard = a.backup_mb * MIB, a.discard_mb * MIB
    with stepalloc.region(WEIGHTS, backup=True):
        ws = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes(backup, a.tensors)]
    with stepalloc.region(KV):
        kv = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes(discard, 8)]
    src = source_bytes(torch, backup)
    offsets = fill(ws, src)
    ptrs = [t.data_ptr() for t in ws + kv]
    pinned = torch.empty(backup, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(0)  # touched once: the copies below find it warm, as stepalloc's kept buffers
    side = torch.cuda.Stream()
    t: dict[str, list[float]] = {k: [] for k in ("out", "back", "wp", "wr", "kp", "kr")}
    gained_w, gained_kv, reported = [], [], []

    def timed(key: str, fn) -> object:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        t[key].append(time.perf_counter() - t0)
        return r

    def copy_out() -> None:
        with torch.cuda.stream(side):
            for w, o in zip(ws, offsets):
                pinned[o : o + w.numel()].copy_(w, non_blocking=True)
        side.synchronize()

    def copy_back() -> None:
        with torch.cuda.stream(side):
            for w, o in zip(ws, offsets):
                w.copy_(pinned[o : o + w.numel()], non_blocking=True)
        side.synchronize()

    for _ in range(a.cycles):
        timed("out", copy_out)
        timed("back", copy_back)
        free0 = torch.cuda.mem_get_info()[0]
        rp = timed("wp", lambda: stepalloc.pause(WEIGHTS))
        free1 = torch.cuda.mem_get_info()[0]
        timed("kp", lambda: stepalloc.pause(KV))
        free2 = torch.cuda.mem_get_info()[0]
        timed("kr", lambda: stepalloc.resume(KV))
        rr = timed("wr", lambda: stepalloc.resume(WEIGHTS))
        gained_w.append(free1 - free0)
        gained_kv.append(free2 - free1)
        reported.append({"pause": rp.raw, "resume": rr.raw})  # type: ignore[attr-defined]
    for k in kv:  # the discarded tensors are usable again
        k.copy_(torch.full((k.numel(),), 7, dtype=torch.uint8))
    out["sizes"] = {"backup_bytes": backup, "tensors": a.tensors, "discard_bytes": discard, "cycles": a.cycles}
    out["stepalloc_backup"] = row("stepalloc pause/resume, backed up", backup, t["wp"], t["wr"])
    out["stepalloc_discard"] = row("stepalloc pause/resume, discarded", discard, t["kp"], t["kr"])
    out["copy"] = row("copy_() into kept pinned memory and back", backup, t["out"], t["back"])
    out["library_reports"] = reported
    # Judged from the second cycle on: the first pause creates the copy stream and pins the host
    # buffers, for which the driver may take some device memory of its own (2 MiB on an H200).
    out["gained_bytes"] = {
        "backup_min": min(gained_w[1:]),
        "discard_min": min(gained_kv[1:]),
        "backup_all": gained_w,
        "discard_all": gained_kv,
    }
    out["ptrs_kept"] = ptrs == [x.data_ptr() for x in ws + kv]
    out["bytes_kept"] = same_bytes(torch, ws, src, offsets)
    out["copied_bytes_ok"] = all(r["pause"].get("copied_bytes", 0) >= backup for r in reported)
    out["memory_released"] = min(gained_w[1:]) >= backup and min(gained_kv[1:]) >= discard
    out["discard_usable"] = all(int(k[-1:].cpu()) == 7 and int(k[:1].cpu()) == 7 for k in kv)
    out["graph"] = graph_check(torch, stepalloc, a.graph_mb * MIB)
    out["graph_pool"] = graph_pool_check(torch, stepalloc, a.graph_mb * MIB)
    return out


def graph_check(torch, stepalloc, n: int) -> dict:
    """A CUDA graph captured before a pause replays after the resume with the right result
    (test_sleep.py's check): it reads a paused tensor and writes both a paused tensor and its
    own output (in the graph's private pool), plus on a GPU a kernel into a paused tensor.
    Where the capture's own allocations counted (the tag, so paused with it, or untagged and
    resident: a capture begun inside a region tags its pool, src/heap/graphs.rs) is recorded,
    not judged
    (``pool_tagged``, ``capture_growth``)."""
    kernels = not on_host_driver()
    with stepalloc.region(GRAPH, backup=True):
        static_in = torch.zeros(n, dtype=torch.uint8, device="cuda")
        kept_out = torch.zeros(n, dtype=torch.uint8, device="cuda")
        x = torch.zeros(n // 4, dtype=torch.float32, device="cuda") if kernels else None
        z = torch.zeros(n // 4, dtype=torch.float32, device="cuda") if kernels else None
        before = stepalloc.tags()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = static_in.clone()  # allocated in the graph's pool, a copy on replay
            kept_out.copy_(static_in)  # a copy into paused memory
            if x is not None and z is not None:
                torch.add(x * 2, 1, out=z)  # a kernel into paused memory
        after = stepalloc.tags()

    def growth(tag: str) -> int:
        return int(after.get(tag, {}).get("live_bytes", 0)) - int(before.get(tag, {}).get("live_bytes", 0))

    outputs = [static_out, kept_out] + ([z] if z is not None else [])
    ptrs = [t.data_ptr() for t in [static_in, *outputs]]
    paused = stepalloc.pause(GRAPH)
    stepalloc.resume(GRAPH)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    static_in.copy_(src)
    xs = torch.randn(n // 4, generator=torch.Generator().manual_seed(6))
    if x is not None:
        x.copy_(xs)
    graph.replay()
    torch.cuda.synchronize()
    right = torch.equal(static_out.cpu(), src) and torch.equal(kept_out.cpu(), src)
    if z is not None:
        right = right and torch.allclose(z.cpu(), xs * 2 + 1)
    return {
        "bytes": n,
        "kernel": kernels,
        "released_bytes": paused.released_bytes,
        "released": paused.released_bytes >= 2 * n,  # static_in and kept_out at least
        # the graph's own output (n bytes) counted in the tag; a capture itself may add a few
        # bytes of PyTorch's own there (1 KiB under torch 2.11 on an H200)
        "pool_tagged": growth(GRAPH) >= n,
        # live bytes the capture added to the tag and to "default" (where untagged pools count)
        "capture_growth": {"tag": growth(GRAPH), "default": growth("default")},
        "ptr_kept": ptrs == [t.data_ptr() for t in [static_in, *outputs]],
        "replay_right": bool(right),
    }


def graph_pool_check(torch, stepalloc, n: int) -> dict:
    """CUDA-graph memory released without recapture: a graph captured inside a region of
    ``sleep_graph_pool`` (no backup) has its private pool under the tag. Its intermediates
    (``a``, ``b``: freed inside the capture, kept by the pool for the graph) and its output hold
    at least ``2 n`` bytes; pausing the tag must give them back to the device
    (``torch.cuda.mem_get_info``) and, after the resume, the same graph must replay with the
    right result over the same addresses (twice, with new inputs each time). The input lives
    outside the region, so it stays resident. On a GPU the graph also runs a kernel on an
    intermediate of the pool."""
    kernels = not on_host_driver()
    tag = GRAPH + "_pool"
    static_in = torch.zeros(n, dtype=torch.uint8, device="cuda")
    xf = torch.zeros(n // 4, dtype=torch.float32, device="cuda") if kernels else None

    def body():
        a = static_in.clone()
        b = a.clone()
        del a
        out = b.clone()
        del b
        z = torch.add(xf * 2, 1) if xf is not None else None  # xf * 2: an intermediate of the pool
        return out, z

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with stepalloc.region(tag):
        with torch.cuda.graph(graph):
            static_out, z = body()
    torch.cuda.synchronize()
    ptrs = [t.data_ptr() for t in (static_in, static_out)]
    free0 = torch.cuda.mem_get_info()[0]
    paused = stepalloc.pause(tag)
    gained = torch.cuda.mem_get_info()[0] - free0
    resumed = stepalloc.resume(tag)
    right = []
    for seed in (7, 8):
        if seed == 8:
            stepalloc.pause(tag)
            stepalloc.resume(tag)
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        static_in.copy_(src)
        xs = torch.randn(n // 4, generator=torch.Generator().manual_seed(seed))
        if xf is not None:
            xf.copy_(xs)
        graph.replay()
        torch.cuda.synchronize()
        ok = torch.equal(static_out.cpu(), src)
        if z is not None:
            ok = ok and torch.allclose(z.cpu(), xs * 2 + 1)
        right.append(bool(ok))
    return {
        "bytes": n,
        "kernel": kernels,
        "released_bytes": paused.released_bytes,
        "mapped_bytes": resumed.mapped_bytes,
        "gained_bytes": gained,
        "released": gained >= 2 * n and paused.released_bytes >= 2 * n,
        "mapped_back": resumed.mapped_bytes >= 2 * n,
        "ptr_kept": ptrs == [t.data_ptr() for t in (static_in, static_out)],
        "replay_right": all(right),
    }


def unpack_bundled_wheel() -> str | None:
    """torch_memory_saver from the bundle's wheels/ (scripts/gpu-bundle.sh), unpacked into a
    temporary folder put first on sys.path: a wheel is a zip, and its extension cannot load from
    one. The wheel's name, or None when the bundle has none."""
    import tempfile
    import zipfile

    wheels = sorted((HERE.parent / "wheels").glob("torch_memory_saver-*.whl"))
    if not wheels:
        return None
    target = tempfile.mkdtemp(prefix="stepalloc-tms-")
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(target)
    sys.path.insert(0, target)
    return wheels[-1].name


def tms_main(a: argparse.Namespace) -> dict:
    """Part ``tms``: torch_memory_saver's own wheel on the same tensors and bytes."""
    source = "installed"
    try:
        try:
            import torch_memory_saver
        except ImportError:
            source = unpack_bundled_wheel()
            if source is None:
                raise
            import torch_memory_saver
        from torch_memory_saver import torch_memory_saver as tms
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip, said as such
        return {"skip": f"torch_memory_saver does not import ({type(e).__name__}: {e})"}
    import torch

    if not torch.cuda.is_available():
        return {"skip": "torch has no CUDA device here"}
    from importlib import metadata

    try:
        version = metadata.version("torch_memory_saver")
    except metadata.PackageNotFoundError:
        version = getattr(torch_memory_saver, "__version__", "unknown")
    tms.hook_mode = "torch"  # its pluggable-allocator mode: no LD_PRELOAD needed
    out = device_info(torch)
    out["version"] = version
    out["source"] = source
    out["hook_mode"] = "torch"
    backup, discard = a.backup_mb * MIB, a.discard_mb * MIB
    with tms.region(tag=WEIGHTS, enable_cpu_backup=True):
        ws = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes(backup, a.tensors)]
    with tms.region(tag=KV):
        kv = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes(discard, 8)]
    src = source_bytes(torch, backup)
    offsets = fill(ws, src)
    ptrs = [t.data_ptr() for t in ws + kv]
    t: dict[str, list[float]] = {k: [] for k in ("wp", "wr", "kp", "kr")}

    def timed(key: str, fn) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        t[key].append(time.perf_counter() - t0)

    for _ in range(a.cycles):
        timed("wp", lambda: tms.pause(WEIGHTS))
        timed("kp", lambda: tms.pause(KV))
        timed("kr", lambda: tms.resume(KV))
        timed("wr", lambda: tms.resume(WEIGHTS))
    out["backup"] = row(f"torch_memory_saver {version}, backed up", backup, t["wp"], t["wr"])
    out["discard"] = row(f"torch_memory_saver {version}, discarded", discard, t["kp"], t["kr"])
    out["ptrs_kept"] = ptrs == [x.data_ptr() for x in ws + kv]
    out["bytes_kept"] = same_bytes(torch, ws, src, offsets)
    return out


def child_main(role: str, a: argparse.Namespace) -> int:
    try:
        doc = cycle_main(a) if role == "cycle" else tms_main(a)
    except Exception:  # noqa: BLE001 - reported to the parent, which names the part
        traceback.print_exc()
        return 1
    print(json.dumps(doc), flush=True)
    sys.stdout.flush()
    # torch_memory_saver 0.0.10's torch hook mode fails at interpreter teardown
    # (scripts/sleep_bench.py); its figures are out, so leave without the teardown.
    if role == "tms":
        os._exit(0)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["cycle", "tms"], required=True)
    for k in SIZE_ARGS:
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, required=True)
    a = ap.parse_args()
    return child_main(a.role, a)


if __name__ == "__main__":
    sys.exit(main())
