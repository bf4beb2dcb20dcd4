"""testdrv's shared device (HOSTCUDA_SHARED) and warm memory, at the driver level.

Each process here is a child Python that drives ``target/hostcuda/libcuda.so.1`` through ctypes
(no torch), so the figures are the driver's own: two processes naming the same file see one
capacity and one free figure, an allocation in one is out of memory past what the other holds,
memory released (or held by a process that died) comes back, and memory created again after a
release keeps its old bytes (warm memory, handed back uncleared).

Skipped when the driver is not built (``testdrv/build.sh``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "target" / "hostcuda" / "libcuda.so.1"
MIB = 1 << 20

pytestmark = pytest.mark.skipif(not DRIVER.exists(), reason="needs testdrv/build.sh")

PRELUDE = f"""
import ctypes, sys, time
cu = ctypes.CDLL({str(DRIVER)!r})
MIB = 1 << 20
def ok(r, what):
    assert r == 0, f"{{what}} -> {{r}}"
ok(cu.cuInit(0), "cuInit")
ctx = ctypes.c_void_p()
ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "retain")
ok(cu.cuCtxSetCurrent(ctx), "set current")
def free_bytes():
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    ok(cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)), "info")
    return f.value, t.value
def alloc(n):
    p = ctypes.c_uint64()
    r = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))
    return r, p.value
def create(n):
    class Prop(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("loc_type", ctypes.c_int),
                    ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("compression", ctypes.c_ubyte),
                    ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]
    prop = Prop(1, 0, 1, 0)
    h = ctypes.c_uint64()
    r = cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(n), ctypes.byref(prop), ctypes.c_ulonglong(0))
    return r, h.value, prop
def say(*a):
    print(*a, flush=True)
"""


def spawn(code: str, shared: Path, capacity_mb: int = 256) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTCUDA_")}
    env.update({"HOSTCUDA_SHARED": str(shared), "HOSTCUDA_CAPACITY_MB": str(capacity_mb), "HOSTCUDA_DEVICES": "1"})
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def expect(p: subprocess.Popen, prefix: str) -> str:
    """The child's next line, which must start with ``prefix``."""
    line = p.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith(prefix):
        out, err = p.communicate(timeout=30)
        pytest.fail(f"expected {prefix!r}, got {line!r}\n{out}\n{err}")
    return line[len(prefix) :].strip()


def send(p: subprocess.Popen, text: str) -> None:
    p.stdin.write(text + "\n")  # type: ignore[union-attr]
    p.stdin.flush()  # type: ignore[union-attr]


def finish(p: subprocess.Popen) -> None:
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, f"child failed ({p.returncode}):\n{out}\n{err}"


def test_two_processes_share_one_capacity_and_one_free_figure(tmp_path: Path) -> None:
    shared = tmp_path / "device"
    # The trainer holds 160 of 256 MiB (linear 96 + physical 64), then lets go on a signal.
    trainer = spawn(
        """
        r, a = alloc(96 * MIB); ok(r, "alloc")
        r, h, _ = create(64 * MIB); ok(r, "create")
        say("held", free_bytes()[0])
        sys.stdin.readline()
        ok(cu.cuMemFree_v2(ctypes.c_uint64(a)), "free")
        ok(cu.cuMemRelease(ctypes.c_uint64(h)), "release")
        say("released", free_bytes()[0])
        sys.stdin.readline()
        """,
        shared,
    )
    assert int(expect(trainer, "held")) == 96 * MIB
    engine = spawn(
        """
        f, t = free_bytes()
        say("sees", f, t)
        r, _ = alloc(128 * MIB)
        say("too_big", r)
        r, _, _ = create(128 * MIB)
        say("too_big_create", r)
        r, a = alloc(96 * MIB); ok(r, "alloc within the rest")
        say("fits", free_bytes()[0])
        sys.stdin.readline()
        say("after", free_bytes()[0])
        r, b = alloc(128 * MIB)
        say("now", r)
        """,
        shared,
    )
    assert expect(engine, "sees").split() == [str(96 * MIB), str(256 * MIB)]
    assert expect(engine, "too_big") == "2"  # CUDA_ERROR_OUT_OF_MEMORY
    assert expect(engine, "too_big_create") == "2"
    assert int(expect(engine, "fits")) == 0
    send(trainer, "release")
    assert int(expect(trainer, "released")) == 160 * MIB  # the engine's 96 MiB still count
    send(engine, "go")
    assert int(expect(engine, "after")) == 160 * MIB
    assert expect(engine, "now") == "0"
    finish(engine)
    send(trainer, "exit")
    finish(trainer)


def test_a_dead_process_memory_comes_back(tmp_path: Path) -> None:
    shared = tmp_path / "device"
    holder = spawn(
        """
        r, a = alloc(200 * MIB); ok(r, "alloc")
        say("held")
        sys.stdin.readline()
        """,
        shared,
    )
    expect(holder, "held")
    holder.kill()  # no clean exit: the slot is reclaimed because the process is gone
    holder.wait(timeout=30)
    probe = spawn('say("free", free_bytes()[0])\n', shared)
    assert int(expect(probe, "free")) == 256 * MIB
    finish(probe)


def test_released_physical_memory_is_handed_back_warm_and_uncleared(tmp_path: Path) -> None:
    # One process: a chunk written, unmapped and released is the next same-size chunk, with its
    # bytes; filling 64 MiB of it again does not fault page by page (its pages were populated
    # when it was made writable), so it is much faster than the first fill of fresh memory.
    probe = spawn(
        """
        import mmap
        class Access(ctypes.Structure):
            _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]
        acc = Access(1, 0, 3)
        N = 64 * MIB
        va = ctypes.c_uint64()
        U64, SZ = ctypes.c_uint64, ctypes.c_size_t
        ok(cu.cuMemAddressReserve(ctypes.byref(va), SZ(N), SZ(0), U64(0), U64(0)), "reserve")
        def mapped():
            r, h, _ = create(N); ok(r, "create")
            ok(cu.cuMemMap(U64(va.value), SZ(N), SZ(0), U64(h), U64(0)), "map")
            ok(cu.cuMemSetAccess(U64(va.value), SZ(N), ctypes.byref(acc), SZ(1)), "access")
            return h
        def unmap(h):
            ok(cu.cuMemUnmap(ctypes.c_uint64(va.value), ctypes.c_size_t(N)), "unmap")
            ok(cu.cuMemRelease(ctypes.c_uint64(h)), "release")
        page = 4096
        def fill(byte):
            t = time.perf_counter()
            for off in range(0, N, page):
                ctypes.memset(va.value + off, byte, 1)
            return time.perf_counter() - t
        h = mapped()
        fresh = fill(7)
        unmap(h)
        say("free_after_release", free_bytes()[0])
        h = mapped()
        say("kept", ctypes.c_ubyte.from_address(va.value + N - page).value)
        warm = fill(9)
        say("ratio", fresh / warm)
        unmap(h)
        """,
        shared=tmp_path / "device",
    )
    assert int(expect(probe, "free_after_release")) == 256 * MIB  # warm memory is not device memory
    assert expect(probe, "kept") == "7"
    ratio = float(expect(probe, "ratio"))
    finish(probe)
    # First touches of fresh memory fault (zero-fill) page by page; warm ones do not. The
    # margin is wide (a fault costs ~10x a store to a mapped page on any host).
    assert ratio > 2, ratio


def test_without_the_variable_each_process_has_its_own_device(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTCUDA_")}
    env.update({"HOSTCUDA_CAPACITY_MB": "256", "HOSTCUDA_DEVICES": "1"})
    code = PRELUDE + 'r, a = alloc(200 * MIB); ok(r, "alloc"); say("free", free_bytes()[0]); sys.stdin.readline()\n'
    a = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    b = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert int(expect(a, "free")) == 56 * MIB
    assert int(expect(b, "free")) == 56 * MIB
    for p in (a, b):
        send(p, "x")
        p.communicate(timeout=30)
        assert p.returncode == 0
