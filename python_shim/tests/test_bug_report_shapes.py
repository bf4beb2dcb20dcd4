"""Shapes of public bug reports against PyTorch's allocator, replayed with real PyTorch over
testdrv's host-memory CUDA (test_real_torch.py has the setup): each runs under PyTorch's own
allocator, which shows what PyTorch 2.15 does, and under stepalloc, which must do better.

- a request that a block freed after ``record_stream`` would fit, with the device otherwise
  full: the out-of-memory path waits for the block's events and must then serve the request
  from it (PyTorch raises);
- out of memory inside ``use_mem_pool`` of a pool whose free memory would fit the request: the
  out-of-memory path must release what stepalloc's ``empty_cache()`` releases (PyTorch raises,
  with or without ``empty_cache()`` first);
- a pool re-entered on one thread (P1, P2, P1): the routes must unwind as a stack (PyTorch
  refuses the re-entry and keeps a use count it took); without ``install()``, where PyTorch's
  allocator routes, the refusal must be clear and give the use count back;
- ``use_mem_pool(stepalloc.mempool(), device=1)`` from device 0: a clear error naming the
  devices (PyTorch enters the first time with its own segments, then fails an internal assert).

Skipped when the stubs are not built (``testdrv/build.sh``) or torch is not installed.
"""

from __future__ import annotations

import pytest
from test_real_torch import POOL_HELPERS, STUB_RUNTIME, run_torch, values

from conftest import torch_available

pytestmark = pytest.mark.skipif(
    not STUB_RUNTIME.exists() or not torch_available(),
    reason="needs torch and testdrv's stubs (testdrv/build.sh)",
)

# On the 1 GiB device a 600 MiB segment holds two 300 MiB blocks and the rest of the device is
# filled; one block is used on a side stream (record_stream) and freed, so its free waits on an
# event (0.5 s per piece of stream work), and no release can make room for 300 MiB.
RECORD_STREAM = """
x = u8(600 * MIB); del x
a = u8(300 * MIB); b = u8(300 * MIB)
assert b.data_ptr() == a.data_ptr() + 300 * MIB, "both halves of one segment"
free, _ = torch.cuda.mem_get_info()
fill = u8(free - 2 * MIB)
side = torch.cuda.Stream()
a.record_stream(side)
freed_at = a.data_ptr()
del a
try:
    again = u8(300 * MIB)
    print("result=served", again.data_ptr() == freed_at)
except torch.OutOfMemoryError as e:
    print("result=oom")
"""


@pytest.mark.parametrize("allocator", ["pytorch", "stepalloc"])
def test_a_block_freed_after_record_stream_serves_the_request_once_its_events_are_waited_for(allocator: str) -> None:
    install = 'stepalloc.install("backend:cuda")\n' if allocator == "stepalloc" else ""
    out = run_torch(install + POOL_HELPERS + RECORD_STREAM, delay_us=500_000)
    expected = "oom" if allocator == "pytorch" else "served True"
    assert values(out)["result"] == expected, out


ACTIVE_POOL = """
pool = torch.cuda.MemPool()
for name, empty_first in (("result", False), ("explicit", True)):
    with torch.cuda.use_mem_pool(pool):
        x = u8(768 * MIB)
        del x
        if empty_first:
            torch.cuda.empty_cache()
        try:
            y = u8(896 * MIB)
            print(name + "=served", pool_of(y.data_ptr()) == pool.id)
            del y
        except torch.OutOfMemoryError as e:
            print(name + "=oom")
    torch.cuda.empty_cache()
"""


@pytest.mark.parametrize("allocator", ["pytorch", "backend:cuda", "backend:cuda,RECOMMENDED"])
def test_out_of_memory_inside_use_mem_pool_releases_what_empty_cache_releases(allocator: str) -> None:
    install = ""
    if allocator != "pytorch":
        conf = repr(allocator).replace("RECOMMENDED'", "' + stepalloc.RECOMMENDED")
        install = f"stepalloc.install({conf}, patch_torch=True)\n"
    v = values(run_torch(install + POOL_HELPERS + ACTIVE_POOL))
    if allocator == "pytorch":
        # PyTorch 2.15 raises either way: its empty_cache() keeps a pool in use's free memory too.
        assert (v["result"], v["explicit"]) == ("oom", "oom"), v
    else:
        assert (v["result"], v["explicit"]) == ("served True", "served True"), v


REENTER = """
p1 = torch.cuda.MemPool()
p2 = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(p1):
    with torch.cuda.use_mem_pool(p2):
        try:
            with torch.cuda.use_mem_pool(p1):
                print("inner=" + str(pool_of(u8(MIB).data_ptr()) == p1.id))
        except RuntimeError as e:
            print("inner=refused " + type(e).__name__ + " " + str(e).splitlines()[0])
        print("back_in_p2=" + str(pool_of(u8(MIB).data_ptr()) == p2.id))
    print("back_in_p1=" + str(pool_of(u8(MIB).data_ptr()) == p1.id))
print("outside=" + str(pool_of(u8(MIB).data_ptr())))
print("use_counts=" + str((p1.use_count(), p2.use_count())))
"""


def test_a_pool_re_entered_on_one_thread_unwinds_as_a_stack() -> None:
    native = values(run_torch(POOL_HELPERS + REENTER))
    # PyTorch 2.15 refuses the re-entry, after taking a reference it never gives back.
    assert "already recording to mempool_id" in native["inner"], native
    assert native["use_counts"] == "(2, 1)", native
    for conf in ["backend:cuda", "backend:cuda,' + stepalloc.RECOMMENDED + '"]:
        ours = values(run_torch(f"stepalloc.install('{conf}', patch_torch=True)\n" + POOL_HELPERS + REENTER))
        assert ours["inner"] == "True", (conf, ours)
        assert ours["back_in_p2"] == ours["back_in_p1"] == "True", (conf, ours)
        assert ours["outside"] == "(0, 0)" and ours["use_counts"] == "(1, 1)", (conf, ours)


def test_without_install_a_re_entered_pool_is_refused_clearly_and_keeps_its_use_count() -> None:
    # PyTorch's allocator routes stepalloc.mempool()'s pools: PyTorch's refusal, made clear.
    code = REENTER.replace("torch.cuda.MemPool()", "stepalloc.mempool()")
    v = values(run_torch(POOL_HELPERS + code))
    assert v["inner"].startswith("refused StepallocError stepalloc: use_mem_pool of pool"), v
    assert "already inside" in v["inner"] and "install()" in v["inner"], v
    assert v["back_in_p2"] == v["back_in_p1"] == "True", v
    assert v["outside"] == "(0, 0)" and v["use_counts"] == "(1, 1)", v


OTHER_DEVICE = """
torch.cuda.set_device(0)
pool = stepalloc.mempool()
for attempt in range(2):
    try:
        with torch.cuda.use_mem_pool(pool, device=1):
            t = torch.empty(MIB, dtype=torch.uint8, device="cuda:1")
        print(f"attempt{attempt}=entered")
    except RuntimeError as e:
        print(f"attempt{attempt}=" + type(e).__name__ + " " + str(e).splitlines()[0])
print("use_count=" + str(pool.use_count()))
with torch.cuda.device(1):
    pool1 = stepalloc.mempool()
with torch.cuda.use_mem_pool(pool1, device=1):
    t = torch.empty(MIB, dtype=torch.uint8, device="cuda:1")
print("own_device=" + str(pool_of(t.data_ptr()) == pool1.id))
"""


@pytest.mark.parametrize("install", ["", "backend:cuda"])
def test_use_mem_pool_of_a_stepalloc_pool_on_another_device_names_both_devices(install: str) -> None:
    setup = f"stepalloc.install({install!r}, patch_torch=True)\n" if install else ""
    v = values(run_torch(setup + POOL_HELPERS + OTHER_DEVICE))
    for attempt in ("attempt0", "attempt1"):
        assert v[attempt].startswith("StepallocError stepalloc: use_mem_pool(pool, device=1)"), v
        assert "made on device 0" in v[attempt] and "Instead:" in v[attempt], v
    assert v["use_count"] == "1", v
    assert v["own_device"] == "True", v


def test_pytorchs_own_allocator_fails_an_internal_assert_on_the_second_entry_for_another_device() -> None:
    # What the check above replaces (PyTorch 2.15's own MemPool, no stepalloc).
    code = OTHER_DEVICE.replace("stepalloc.mempool()", "torch.cuda.MemPool()")
    v = values(run_torch(POOL_HELPERS + code))
    assert v["attempt0"] == "entered", v
    assert "use_count > 0 INTERNAL ASSERT FAILED" in v["attempt1"], v
