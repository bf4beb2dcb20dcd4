"""Sixth adversarial pass, real PyTorch over testdrv: vLLM's sleep mode as its users drive it
(``stepalloc.cumem`` as vLLM uses it, MemPool mode, and under ``install()``), and pools on
several threads.

- allocating in an asleep tag: ``stepalloc.PausedError`` naming the tag in both modes (PyTorch
  had reported a RuntimeError, or in MemPool mode an out-of-memory error saying the device was
  free);
- a sleep while another thread captures a CUDA graph: refused naming the capture, the capture
  replays (in MemPool mode the library is not told of captures; the pause's device synchronize
  had failed and invalidated the capture);
- sequences vLLM's users produce: wake without sleep, sleep twice, ``discardable`` naming a
  runtime tensor and an address inside a weight, ``cudagraph_pool`` entered while asleep,
  ``release_pools`` / ``close`` with live tensors then more cycles, ``discard`` then wake, two
  threads entering different tags, two threads sleeping and waking at once;
- ``use_mem_pool`` nested, re-entered and left by exceptions on four threads, then out of memory
  inside a pool with a block freed after ``record_stream`` on a stream still copying.

docs/testing.md (the adversarial pass) records what each attempt found.
"""

from __future__ import annotations

import ast
import textwrap

import pytest
from test_sleep import PRELUDE, needs_torch, torch_env

from conftest import check_child, run_python

MODES = ["mempool", "installed"]
INSTALL = 'stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED, patch_torch=True)\n'


def run(code: str, mode: str, **env: str) -> dict:
    """Runs ``code`` in a fresh torch process (``install()`` first in the installed mode); the
    child prints one ``result=`` line with a Python literal."""
    e = torch_env()
    e.update(env)
    text = PRELUDE + (INSTALL if mode == "installed" else "") + textwrap.dedent(code)
    out = check_child(run_python(text, env=e, timeout=240))
    line = next(line for line in out.splitlines() if line.startswith("result="))
    return ast.literal_eval(line.split("=", 1)[1])


CUMEM = """
from stepalloc.cumem import CuMemAllocator
a = CuMemAllocator.get_instance()
def put(t, v):
    t.copy_(torch.full((t.numel(),), v, dtype=torch.uint8))
def val(t):
    h = t.cpu()
    return int(h[0]), int(h[-1])
with a.use_memory_pool("weights"):
    w = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
with a.use_memory_pool("runtime"):
    r = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")
put(w, 7); put(r, 9)
"""


@needs_torch
@pytest.mark.parametrize("mode", MODES)
def test_allocating_in_an_asleep_tag_raises_paused_error_naming_the_tag(mode: str) -> None:
    got = run(
        CUMEM
        + """
a.sleep(offload_tags=("weights", "runtime"))
out = []
for n in (MIB, 30 * MIB):
    try:
        with a.use_memory_pool("weights"):
            x = torch.empty(n, dtype=torch.uint8, device="cuda")
        out.append("served")
    except Exception as e:
        out.append((type(e).__name__, isinstance(e, stepalloc.PausedError), "weights" in str(e)))
a.wake_up()
out.append(val(w))
with a.use_memory_pool("weights"):
    x = torch.empty(MIB, dtype=torch.uint8, device="cuda")  # awake again: served
out.append("served after wake")
print("result=" + repr(out))
""",
        mode,
    )
    assert got == [("PausedError", True, True)] * 2 + [(7, 7), "served after wake"], got


CAPTURE = (
    CUMEM
    + """
import sys, threading
x = torch.empty(MIB, device="cuda"); x.copy_(torch.ones(MIB))
s = torch.cuda.Stream()
inside, done, out = threading.Event(), threading.Event(), {}
def capture():
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=s, capture_error_mode=CAPTURE_MODE):
            y = torch.empty_like(x); y.copy_(x)
            inside.set()
            done.wait(20)
            z = torch.empty_like(y); z.copy_(y)
        g.replay(); torch.cuda.synchronize()
        out["capture"] = "replayed"
    except Exception as e:
        out["capture"] = type(e).__name__ + ": " + str(e)[:120]
        inside.set()
t = threading.Thread(target=capture, name="capturer"); t.start()
inside.wait(20)
for what, call in (("sleep", lambda: a.sleep(offload_tags=("weights",))), ("pause", lambda: stepalloc.pause("weights"))):
    try:
        call()
        out[what] = "ran"
    except ValueError as e:
        out[what] = ("refused", "capture" in str(e), "capturer" in str(e) or "capture" in str(e))
    except Exception as e:
        out[what] = type(e).__name__ + ": " + str(e)[:120]
done.set(); t.join()
a.sleep(offload_tags=("weights",))  # after the capture: runs
a.wake_up()
out["weights"] = val(w)
print("result=" + repr(out))
"""
)


@needs_torch
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("capture_mode", ["global", "thread_local"])
def test_a_sleep_during_another_threads_capture_is_refused_and_the_capture_replays(mode: str, capture_mode: str) -> None:
    got = run(CAPTURE.replace("CAPTURE_MODE", repr(capture_mode)), mode)
    assert got == {
        "sleep": ("refused", True, True),
        "pause": ("refused", True, True),
        "capture": "replayed",
        "weights": (7, 7),
    }, got


SEQUENCES = (
    CUMEM
    + """
import gc, threading
out = {}
a.wake_up(); a.wake_up(["weights"])                       # wake without sleep
out["wake_without_sleep"] = (val(w), val(r))
# discardable naming a runtime tensor (not weights) and an address inside a weight: both kept
a.sleep(offload_tags=("weights", "runtime"), discardable=[r.data_ptr(), w.data_ptr() + 4096])
a.sleep(offload_tags=())                                   # twice: the policy of the first holds
a.wake_up()
out["sleep_twice_discardable"] = (val(w), val(r))
a.sleep(offload_tags=("weights", "runtime"))
with a.cudagraph_pool() as pool_id:                        # entered while asleep
    out["graph_pool_while_asleep"] = isinstance(pool_id, tuple)
a.wake_up()
out["after_graph_pool"] = (val(w), val(r))
a.release_pools(); a.close()                               # with live tensors
with a.use_memory_pool("weights"):
    w2 = torch.empty(MIB, dtype=torch.uint8, device="cuda")
put(w2, 3)
a.sleep(offload_tags=("weights", "runtime")); a.wake_up()
out["after_close"] = (val(w), val(w2), val(r))
a.discard("weights"); a.wake_up(["weights"])               # discarded: contents undefined
a.sleep(offload_tags=("weights", "runtime")); a.wake_up()
out["after_discard_runtime"] = val(r)
put(w, 7)
bar, errs = threading.Barrier(2), []
def enter(tag):
    try:
        for _ in range(5):
            with a.use_memory_pool(tag):
                bar.wait(timeout=20)
                t = torch.empty(MIB, dtype=torch.uint8, device="cuda")
                bar.wait(timeout=20)
            got = [d.tag for p, d in a.pointer_to_data.items() if p <= t.data_ptr() < p + d.handle[1]]
            if got != [tag]:
                errs.append((tag, got))
    except Exception as e:
        errs.append((tag, type(e).__name__))
ts = [threading.Thread(target=enter, args=(t,)) for t in ("weights", "kv_cache")]
[t.start() for t in ts]; [t.join() for t in ts]
out["two_threads_two_tags"] = errs
def cycles():
    for _ in range(5):
        try:
            a.sleep(offload_tags=("weights", "runtime")); a.wake_up()
        except Exception as e:
            errs.append(type(e).__name__)
ts = [threading.Thread(target=cycles) for _ in range(2)]
[t.start() for t in ts]; [t.join() for t in ts]
out["concurrent_cycles"] = (errs, val(w), val(r), stepalloc.sleep.paused_tags())
print("result=" + repr(out))
"""
)


@needs_torch
@pytest.mark.parametrize("mode", MODES)
def test_sequences_vllms_users_produce_keep_every_byte(mode: str) -> None:
    got = run(SEQUENCES, mode)
    assert got == {
        "wake_without_sleep": ((7, 7), (9, 9)),
        "sleep_twice_discardable": ((7, 7), (9, 9)),
        "graph_pool_while_asleep": True,
        "after_graph_pool": ((7, 7), (9, 9)),
        "after_close": ((7, 7), (3, 3), (9, 9)),
        "after_discard_runtime": (9, 9),
        "two_threads_two_tags": [],
        "concurrent_cycles": ([], (7, 7), (9, 9), []),
    }, got


POOLS = """
import gc, random, threading
def pool_of(t):
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= t.data_ptr() < seg["address"] + seg["total_size"]:
            return tuple(seg["segment_pool_id"])
pools = [torch.cuda.MemPool() for _ in range(3)]
errors = []
def worker(k):
    rng = random.Random(k)
    def enter(depth):
        p = rng.choice(pools)
        try:
            with torch.cuda.use_mem_pool(p):
                t = torch.empty(rng.choice([512, 3 * MIB, 12 * MIB]), dtype=torch.uint8, device="cuda")
                if pool_of(t) != p.id:
                    errors.append((k, "routed", depth))
                if depth < 3 and rng.random() < 0.6:
                    enter(depth + 1)
                if rng.random() < 0.2:
                    raise KeyError("inside")
                t2 = torch.empty(MIB, dtype=torch.uint8, device="cuda")
                if pool_of(t2) != p.id:
                    errors.append((k, "after the inner pools", depth))
        except KeyError:
            pass
    try:
        for _ in range(30):
            enter(0)
            if pool_of(torch.empty(MIB, dtype=torch.uint8, device="cuda")) != (0, 0):
                errors.append((k, "outside"))
    except Exception as e:
        errors.append((k, type(e).__name__, str(e)[:100]))
ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
out = {"errors": errors, "use_counts": [p.use_count() for p in pools]}
s = torch.cuda.Stream()
with torch.cuda.use_mem_pool(pools[0]):
    x = torch.empty(300 * MIB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(s):
        x.copy_(torch.zeros(300 * MIB, dtype=torch.uint8, device="cuda"), non_blocking=True)
    x.record_stream(s)
    del x
    y = torch.empty(600 * MIB, dtype=torch.uint8, device="cuda")   # 1 GiB device: needs x's memory
    out["oom_after_record_stream"] = pool_of(y) == pools[0].id
    del y
try:
    with torch.cuda.use_mem_pool(pools[1]):
        torch.empty(2000 * MIB, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError:
    out["real_oom"] = True
out["after_oom_outside"] = pool_of(torch.empty(MIB, dtype=torch.uint8, device="cuda"))
print("result=" + repr(out))
"""


@needs_torch
@pytest.mark.parametrize("conf", ["backend:cuda", "recommended"])
def test_pools_nested_re_entered_and_left_by_exceptions_on_four_threads_route_right(conf: str) -> None:
    install = "stepalloc.install(" + ('"backend:cuda," + stepalloc.RECOMMENDED' if conf == "recommended" else repr(conf)) + ", patch_torch=True)\n"
    e = torch_env()
    e["HOSTCUDA_DELAY_US"] = "200000"  # the side stream's copy is still running at the free
    out = check_child(run_python(PRELUDE + install + textwrap.dedent(POOLS), env=e, timeout=240))
    got = ast.literal_eval(next(line for line in out.splitlines() if line.startswith("result=")).split("=", 1)[1])
    assert got == {
        "errors": [],
        "use_counts": [1, 1, 1],
        "oom_after_record_stream": True,
        "real_oom": True,
        "after_oom_outside": (0, 0),
    }, got
