"""NCCL user-buffer registration of a memory pool (``ProcessGroupNCCL.register_mem_pool`` /
``deregister_mem_pool``; stepalloc's are ``stepalloc.nccl``), in real PyTorch over testdrv with
testdrv/hostnccl.c preloaded: a one-rank stand-in for NCCL on which ProcessGroupNCCL creates its
communicator, and which records every ``ncclCommRegister`` / ``ncclCommDeregister``.

The same script runs under PyTorch's own allocator and under process-wide stepalloc: the pool's
segment is registered at ``register_mem_pool``, a segment the pool creates afterwards is
registered when created, both with the communicator PyTorch made; ``deregister_mem_pool``
deregisters exactly those; a segment created afterwards is not registered. Every answer must be
the same, and each registered range must be a segment of the pool (the allocator's snapshot).
Then what only stepalloc does: a registered segment the pool gives back is deregistered first;
``symm=True`` is refused.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_real_torch import ROOT, STUB_RUNTIME, run_torch, values

from conftest import torch_available

pytestmark = pytest.mark.skipif(
    not STUB_RUNTIME.exists() or not torch_available(),
    reason="needs torch and testdrv's stubs (testdrv/build.sh)",
)


def build_hostnccl(directory: Path) -> Path:
    """Builds testdrv/hostnccl.c into ``directory``; returns the library's path."""
    lib = directory / "libhostnccl.so"
    source = ROOT / "testdrv" / "hostnccl.c"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(source), "-lpthread"], check=True)
    return lib


def preload_env(hostnccl: Path) -> dict[str, str]:
    """The child's environment additions: hostnccl preloaded after testdrv's runtime, and a
    rendezvous address for a one-rank group."""
    return {
        "LD_PRELOAD": f"{STUB_RUNTIME} {hostnccl}",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29400 + os.getpid() % 500),
    }


@pytest.fixture(scope="module")
def hostnccl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hostnccl(tmp_path_factory.mktemp("hostnccl"))


HELPERS = """
import ctypes, gc
import torch.distributed as dist
def u8(n):
    return torch.empty(n, dtype=torch.uint8, device="cuda")
def log():
    lib = ctypes.CDLL(None)
    n = lib.hostnccl_log(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.hostnccl_log(buf, n + 1)
    return [line.split() for line in buf.value.decode().splitlines()]
def pool_segments(pool_id):
    return sorted((s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()
                  if tuple(s["segment_pool_id"]) == tuple(pool_id))
def registered(lines, comm):
    live = {}
    for op, c, *rest in lines:
        assert op != "bad-deregister", lines
        if int(c, 16) != comm:
            continue
        addr, size, handle = int(rest[0], 16), int(rest[1]), rest[2]
        if op == "register":
            live[handle] = (addr, size)
        else:
            assert live.pop(handle) == (addr, size), (handle, lines)
    return sorted(live.values())
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
comm = pg._comm_ptr()
"""

SCRIPT = """
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    a = u8(3 * MIB)
print("before=", len(log()))
pg.register_mem_pool(pool)
first = registered(log(), comm)
print("first=", [size for _, size in first], first == pool_segments(pool.id))
with torch.cuda.use_mem_pool(pool):
    b = u8(30 * MIB)  # a segment of its own, created while registered
both = registered(log(), comm)
print("grown=", sorted(size for _, size in both), both == pool_segments(pool.id))
pg.deregister_mem_pool(pool)
print("deregistered=", registered(log(), comm), len(log()))
with torch.cuda.use_mem_pool(pool):
    c = u8(60 * MIB)
print("after=", registered(log(), comm), len(log()))
del a, b, c, pool; gc.collect()
dist.destroy_process_group()
"""


def test_register_mem_pool_registers_as_under_pytorchs_own_allocator(hostnccl: Path) -> None:
    env = preload_env(hostnccl)
    # PyTorch's stock ProcessGroupNCCL on both sides: what "nccl" is under stepalloc (nccl2's
    # would abort the process, see stepalloc.nccl), chosen natively with TORCH_DIST_USE_NCCL2=0.
    native = values(run_torch(HELPERS + SCRIPT, extra_env={**env, "TORCH_DIST_USE_NCCL2": "0"}))
    ours = values(run_torch('stepalloc.install("backend:cuda", patch_torch=True)\n' + HELPERS + SCRIPT, extra_env=env))
    # What PyTorch does (so the script checks something): its segment, then the new one.
    assert native["before"].split() == ["0"], native
    assert native["first"].strip() == "[20971520] True", native
    assert native["grown"].strip() == "[20971520, 31457280] True", native
    assert native["deregistered"].strip() == "[] 4" and native["after"].strip() == "[] 4", native
    assert ours == native


def test_a_released_segment_is_deregistered_first_and_symm_is_refused(hostnccl: Path) -> None:
    out = run_torch(
        'stepalloc.install("backend:cuda", patch_torch=True)\n'
        + HELPERS
        + """
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    a = u8(3 * MIB)
    b = u8(30 * MIB)
pg.register_mem_pool(pool)
print("registered=", len(registered(log(), comm)))
try:
    pg.register_mem_pool(pool)
except stepalloc.StepallocError as e:
    print("twice=", "already registered" in str(e))
del b; gc.collect()
torch.cuda.empty_cache()  # stepalloc gives the pool's free segment back: deregistered first
print("released=", registered(log(), comm) == pool_segments(pool.id), len(registered(log(), comm)))
try:
    pg.register_mem_pool(torch.cuda.MemPool(), symm=True)
except stepalloc.parity.UnsupportedError as e:
    print("symm=", "symm=False" in str(e))
pg.deregister_mem_pool(pool)
print("end=", registered(log(), comm))
try:
    pg.deregister_mem_pool(pool)
except stepalloc.StepallocError as e:
    print("not_registered=", "not registered" in str(e))
del a, pool; gc.collect()
dist.destroy_process_group()
""",
        extra_env=preload_env(hostnccl),
    )
    v = values(out)
    assert v["registered"].split() == ["2"] and v["twice"].split() == ["True"], out
    assert v["released"].split() == ["True", "1"], out
    assert v["symm"].split() == ["True"] and v["end"].strip() == "[]", out
    assert v["not_registered"].split() == ["True"], out


def test_the_nccl_backend_under_stepalloc_is_pytorchs_stock_one(hostnccl: Path) -> None:
    """torch 2.15's default "nccl" (nccl2) asks the allocator for a snapshot when it makes its
    memory hook, which PyTorch's pluggable-allocator class refuses inside a constructor, so the
    process aborts; under process-wide stepalloc "nccl" is PyTorch's stock ProcessGroupNCCL,
    which makes and destroys its group; from install() on, as the allocator swap (patch_torch
    or not)."""
    env = preload_env(hostnccl)
    out = run_torch(
        'stepalloc.install("backend:cuda")\n'
        + HELPERS
        + """
print("backend=", type(pg).__name__)
dist.destroy_process_group()
""",
        extra_env=env,
    )
    v = values(out)
    assert v["backend"].strip() == "ProcessGroupNCCL", out
    with pytest.raises(AssertionError, match="CUDAPluggableAllocator does not yet support snapshot"):
        run_torch(
            'stepalloc.install("backend:cuda", patch_torch=True)\n'
            + HELPERS.replace('init_process_group("nccl"', 'init_process_group("nccl2"')
            + "dist.destroy_process_group()\n",
            extra_env=env,
        )
