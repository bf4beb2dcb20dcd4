"""CUDA-graph memory released without recapture, in real PyTorch over testdrv (no GPU): a graph
captured with ``stepalloc.region`` around ``torch.cuda.graph`` (or with
``memory_saver.cuda_graph(g, tag=...)``) has its private pool under the tag; pausing the tag
gives the pool's bytes back (``torch.cuda.mem_get_info``), and after ``resume`` the same graph
replays over the same addresses with the right results. testdrv's graphs replay their copies,
so the graph here is made of copies.

Also the agent loop of vLLM #21336 over testdrv, short: many cycles of pause / resume with a
KV cache of a new size every rollout, default-tag churn, a backed-up and a discarded tag, with
free memory while paused, host memory held for backups and backed-up bytes all flat (the long
run is Rust's, tests/sleep_cycles.rs).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from conftest import check_child, run_python

ROOT = Path(__file__).resolve().parents[2]
HOSTCUDA = ROOT / "target" / "hostcuda"
RUNTIME = HOSTCUDA / "runtime"
STUB_RUNTIME = RUNTIME / "libcudart.so.13"


def _torch_ok() -> bool:
    from conftest import torch_available

    return STUB_RUNTIME.exists() and torch_available()


needs_torch = pytest.mark.skipif(not _torch_ok(), reason="needs torch and testdrv's stubs (testdrv/build.sh)")

PRELUDE = """
import torch, stepalloc
MIB = 1 << 20
def say(k, v):
    print(f"{k}={v}", flush=True)
"""


def run_torch(code: str, capacity_mb: int = 1024) -> dict[str, str]:
    library_path = [str(RUNTIME), str(HOSTCUDA), str(HOSTCUDA / "standins"), os.environ.get("LD_LIBRARY_PATH", "")]
    env = {
        "LD_PRELOAD": str(STUB_RUNTIME),
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in library_path if p),
        "HOSTCUDA_DEVICES": "1",
        "HOSTCUDA_CAPACITY_MB": str(capacity_mb),
        "PYTORCH_CUDA_ALLOC_CONF": "",
    }
    out = check_child(run_python(PRELUDE + textwrap.dedent(code), env=env, timeout=300))
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


# The graph: static_in -> a -> b -> static_out, copies of 64 MiB; a and b are freed inside the
# capture (the pool keeps their blocks for the graph: static_out takes a's, b's stays free).
GRAPH = """
n = 64 * MIB
static_in = torch.zeros(n, dtype=torch.uint8, device="cuda")
def body():
    a = static_in.clone()
    b = a.clone()
    del a
    out = b.clone()
    del b
    return out
body()  # warm-up, as before any capture
torch.cuda.synchronize()
torch.cuda.empty_cache()  # the warm-up's cache would blur the pool's figure
g = torch.cuda.CUDAGraph()
free_before = torch.cuda.mem_get_info()[0]
{capture}
torch.cuda.synchronize()
pool_bytes = free_before - torch.cuda.mem_get_info()[0]
say("pool_bytes", pool_bytes)
out_ptr = static_out.data_ptr()
free0 = torch.cuda.mem_get_info()[0]
{pause}
free1 = torch.cuda.mem_get_info()[0]
say("gained", free1 - free0)
{resume}
say("back", free1 - torch.cuda.mem_get_info()[0])
src = torch.randint(0, 256, (n,), dtype=torch.uint8)
static_in.copy_(src)
g.replay()
torch.cuda.synchronize()
say("same_ptr", static_out.data_ptr() == out_ptr)
say("replayed", torch.equal(static_out.cpu(), src))
# Twice more, with new inputs: the graph is the one captured, over the same memory.
for seed in (1, 2):
    {pause}
    {resume}
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    static_in.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    say(f"replayed{{seed}}", torch.equal(static_out.cpu(), src))
"""

CAPTURES = {
    "region": (
        'with stepalloc.region("graph"):\n    with torch.cuda.graph(g):\n        static_out = body()',
        'stepalloc.pause("graph")',
        'stepalloc.resume("graph")',
    ),
    "memory_saver": (
        "from stepalloc.memory_saver import torch_memory_saver as tms\n"
        'with tms.cuda_graph(g, tag="graph"):\n    static_out = body()',
        'tms.pause("graph")',
        'tms.resume("graph")',
    ),
}


@needs_torch
@pytest.mark.parametrize("conf", ["backend:cuda,expandable_segments:True,page_reuse:True,big_page_mb:16", "backend:cuda"])
@pytest.mark.parametrize("how", list(CAPTURES))
def test_pausing_a_graphs_tag_releases_its_pool_and_the_graph_replays_after_resume(how: str, conf: str) -> None:
    capture, pause, resume = CAPTURES[how]
    code = f"stepalloc.install({conf!r})\n" + GRAPH.format(capture=capture, pause=pause, resume=resume)
    v = run_torch(code)
    pool = int(v["pool_bytes"])
    assert pool >= 2 * 64 * (1 << 20), v  # an intermediate and the output (in the first one's block)
    assert int(v["gained"]) >= pool, v  # the whole pool went back to the device
    assert int(v["back"]) == int(v["gained"]), v  # and all of it came back at resume
    assert v["same_ptr"] == "True", v
    assert v["replayed"] == "True" and v["replayed1"] == "True" and v["replayed2"] == "True", v


@needs_torch
def test_an_untagged_graph_pool_stays_through_a_pause() -> None:
    # The control: without a region around the capture the pool has no tag, a pause of another
    # tag leaves it, and the graph replays as before.
    capture = "with torch.cuda.graph(g):\n    static_out = body()"
    pause = 'stepalloc.pause("other")'
    resume = 'stepalloc.resume("other")'
    code = (
        "stepalloc.install('backend:cuda')\n"
        'with stepalloc.region("other"):\n    other = torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")\n'
        + GRAPH.format(capture=capture, pause=pause, resume=resume)
    )
    v = run_torch(code)
    assert int(v["gained"]) < int(v["pool_bytes"]), v
    assert v["replayed"] == "True" and v["replayed2"] == "True", v


@needs_torch
def test_an_agent_loop_over_many_cycles_holds_memory_flat() -> None:
    # vLLM #21336 over real PyTorch (short; the 300-cycle run is tests/sleep_cycles.rs): each
    # cycle a KV cache of a new size (discarded), default-tag churn, backed-up weights.
    v = run_torch(
        """
        stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED)
        import random
        rng = random.Random(5)
        sizes = [3 * MIB + 17, MIB, 5 * MIB + 4096, 7 * MIB]
        host = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(sizes)]
        with stepalloc.region("loop_weights", backup=True):
            ws = [h.cuda() for h in host]
        ptrs = [w.data_ptr() for w in ws]
        params = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")  # the trainer's, default tag
        seen = set()
        kv = None
        for cycle in range(40):
            with stepalloc.region("loop_kv"):
                kv = torch.empty((8 + rng.randrange(96)) * MIB + rng.randrange(MIB), dtype=torch.uint8, device="cuda")
            scratch = [torch.empty(1 + rng.randrange(24 * MIB), dtype=torch.uint8, device="cuda") for _ in range(rng.randrange(1, 6))]
            del scratch
            if cycle % 2:
                del kv
                kv = None
            r = stepalloc.pause()
            free_paused = torch.cuda.mem_get_info()[0]
            t = stepalloc.tags()["loop_weights"]
            seen.add((free_paused, t["host_bytes"], t["backup_bytes"], r.copied_bytes))
            grads = [torch.empty(1 + rng.randrange(32 * MIB), dtype=torch.uint8, device="cuda") for _ in range(rng.randrange(1, 6))]
            del grads
            stepalloc.resume()
            kv = None
        say("distinct", len(seen))
        say("seen", sorted(seen))
        say("ptrs_kept", ptrs == [w.data_ptr() for w in ws])
        say("bytes_kept", all(torch.equal(w.cpu(), h) for w, h in zip(ws, host)))
        say("copied", sum(sizes))
        """
    )
    # One (free while paused, host held, backed-up bytes, copied) for all 40 cycles.
    assert v["distinct"] == "1", v
    assert v["ptrs_kept"] == "True" and v["bytes_kept"] == "True", v
    assert f", {v['copied']})" in v["seen"], v
