"""Checkpoints of a CUDA-graph pool (``torch._C._cuda_getCheckpointState`` /
``_cuda_setCheckpointPoolState``, what torch.compile's CUDA-graph trees call; stepalloc's are
``stepalloc.checkpoint``), in real PyTorch over testdrv (kernels do not run, copies do).

The bindings called directly, as graph trees call them: a pool's state is recorded, a block is
freed and another allocated since, the state is restored with the new block's storage passed as
stale and a storage that does not own its memory passed to get a deleter. The same script runs
under PyTorch's own allocator and under process-wide stepalloc (plain and recommended
configuration), and every answer must be the same; then what stepalloc refuses, changing
nothing. Then ``torch.compile(backend="cudagraphs")`` over copy-only functions, whose graph
trees restore a checkpoint twice, side by side. The ported graph-trees tests are in
torch_port/cudagraph_tree_cases.py.
"""

from __future__ import annotations

import pytest
from test_real_torch import STUB_RUNTIME, run_torch, values

from conftest import torch_available

pytestmark = pytest.mark.skipif(
    not STUB_RUNTIME.exists() or not torch_available(),
    reason="needs torch and testdrv's stubs (testdrv/build.sh)",
)

HELPERS = """
import gc
def u8(n):
    return torch.empty(n, dtype=torch.uint8, device="cuda")
def live(pool):
    addrs = []
    for s in torch.cuda.memory_snapshot():
        if tuple(s["segment_pool_id"]) == tuple(pool):
            addr = s["address"]
            for b in s["blocks"]:
                if b["state"] == "active_allocated":
                    addrs.append(addr)
                addr += b["size"]
    return sorted(addrs)
def in_pool(pool):
    torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
def out_of_pool(pool):
    torch._C._cuda_endAllocateToPool(0, pool)
    torch._C._cuda_releasePool(0, pool)
"""

SCRIPT = """
pool = torch.cuda.graph_pool_handle()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, pool=pool):
    a = u8(MIB)
    b = u8(3 * MIB)
    t = u8(MIB)
del t  # freed before the checkpoint: not in it
state = torch._C._cuda_getCheckpointState(0, pool)
a_ptr, b_ptr = a.data_ptr(), b.data_ptr()
print("at_checkpoint=", live(pool) == sorted([a_ptr, b_ptr]))
# What graph trees hold after a replay: a storage over the block that does not own it.
view = torch._C._construct_storage_from_data_pointer(b_ptr, b.device, 3 * MIB)
print("view_owns=", torch._C._has_Standard_Deleter(view._cdata))
del b  # freed since the checkpoint
in_pool(pool)
c = u8(5 * MIB)  # allocated since the checkpoint
out_of_pool(pool)
c_ptr = c.data_ptr()
print("before_restore=", live(pool) == sorted([a_ptr, c_ptr]))
torch._C._cuda_setCheckpointPoolState(0, state, [c.untyped_storage()._cdata], [view._cdata])
print("restored=", live(pool) == sorted([a_ptr, b_ptr]),
      torch._C._cuda_checkPoolLiveAllocations(0, pool, {a_ptr, b_ptr}))
print("owners=", torch._C._has_Standard_Deleter(view._cdata),
      torch._C._has_Standard_Deleter(c.untyped_storage()._cdata), view.data_ptr() == b_ptr, c.data_ptr() == c_ptr)
# The restored block holds data through the storage that now owns it.
bt = torch.empty(0, dtype=torch.uint8, device="cuda").set_(view)
bt.copy_(torch.full((3 * MIB,), 9, dtype=torch.uint8))
print("data=", int(bt.cpu()[-1]))
del c; gc.collect()
print("stale_dropped=", live(pool) == sorted([a_ptr, b_ptr]))
del bt, view; gc.collect()
print("owner_dropped=", live(pool) == [a_ptr])
# No storage for the restored block: it stays allocated until raw_delete (graph trees free the
# outputs that died since the checkpoint so).
torch._C._cuda_setCheckpointPoolState(0, state, [], [])
print("raw=", live(pool) == sorted([a_ptr, b_ptr]))
torch._C._cuda_cudaCachingAllocator_raw_delete(b_ptr)
print("raw_deleted=", live(pool) == [a_ptr])
# Restoring the state the pool is in changes nothing.
now = torch._C._cuda_getCheckpointState(0, pool)
torch._C._cuda_setCheckpointPoolState(0, now, [], [])
print("same=", live(pool) == [a_ptr])
del a; g.reset(); gc.collect(); torch.cuda.empty_cache()
print("end=", live(pool) == [], torch.cuda.memory_allocated())
"""


@pytest.fixture(scope="module")
def native() -> dict[str, str]:
    return values(run_torch(HELPERS + SCRIPT))


@pytest.mark.parametrize("conf", ["backend:cuda", "backend:cuda,RECOMMENDED"])
def test_checkpoint_bindings_answer_as_under_pytorchs_own_allocator(conf: str, native: dict[str, str]) -> None:
    conf_code = repr(conf).replace("RECOMMENDED'", "' + stepalloc.RECOMMENDED")
    ours = values(run_torch(f"stepalloc.install({conf_code}, patch_torch=True)\n" + HELPERS + SCRIPT))
    # What PyTorch answers (so the script checks something), then the same under stepalloc.
    assert native["at_checkpoint"].split() == ["True"] and native["view_owns"].split() == ["False"], native
    assert native["restored"].split() == ["True", "True"] and native["owners"].split() == [
        "True",
        "False",
        "True",
        "True",
    ], native
    assert native["data"].split() == ["9"] and native["raw_deleted"].split() == ["True"], native
    assert all(native[k].split()[0] == "True" for k in ("stale_dropped", "owner_dropped", "raw", "same", "end")), native
    assert ours == native, "\n".join(
        f"{k}: PyTorch {native.get(k)!r}, stepalloc {ours.get(k)!r}"
        for k in sorted(set(ours) | set(native))
        if ours.get(k) != native.get(k)
    )


def test_a_restore_stepalloc_cannot_do_is_refused_and_changes_nothing() -> None:
    out = run_torch(
        'stepalloc.install("backend:cuda", patch_torch=True)\n'
        + HELPERS
        + """
pool = torch.cuda.graph_pool_handle()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, pool=pool):
    a = u8(MIB)
state = torch._C._cuda_getCheckpointState(0, pool)
print("state=", type(state).__name__)
in_pool(pool)
c = u8(5 * MIB)  # allocated since, owned by c, not passed as stale
out_of_pool(pool)
before = live(pool)
try:
    torch._C._cuda_setCheckpointPoolState(0, state, [], [])
except RuntimeError as e:
    # PyTorch's own check (stale storages must cover the blocks freed), before stepalloc's
    # stricter one (every block freed must be a stale storage's).
    print("owned=", "must be passed to set checkpoint" in str(e), live(pool) == before)
in_pool(pool)
d = u8(MIB)  # allocated since; stale storages are passed for c and a (as many as PyTorch counts)
out_of_pool(pool)
before = live(pool)
try:
    torch._C._cuda_setCheckpointPoolState(0, state, [c.untyped_storage()._cdata, a.untyped_storage()._cdata], [])
except RuntimeError as e:
    print("owned2=", "still owned" in str(e) and hex(d.data_ptr()) in str(e), live(pool) == before,
          torch._C._has_Standard_Deleter(c.untyped_storage()._cdata))
del c, d; gc.collect()
# A pool's segment given back since the checkpoint (a MemPool that no graph captured into gives
# its free segments to empty_cache): refused with the reason.
mp = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(mp):
    m = u8(3 * MIB)
mstate = torch._C._cuda_getCheckpointState(0, mp.id)
del m; gc.collect(); torch.cuda.empty_cache()
try:
    torch._C._cuda_setCheckpointPoolState(0, mstate, [], [])
except stepalloc.StepallocError as e:
    print("segment_gone=", "no longer holds the segment" in str(e), live(mp.id) == [])
try:
    torch._C._cuda_setCheckpointPoolState(0, object(), [], [])
except TypeError as e:
    print("not_a_state=", "getCheckpointState" in str(e))
try:
    torch._C._cuda_getCheckpointState(0, (7, 7))
except stepalloc.StepallocError as e:
    print("no_pool=", "no memory pool" in str(e))
"""
    )
    v = values(out)
    assert v["state"].strip() == "CheckpointState", out
    assert v["owned"].split() == ["True", "True"], out
    assert v["owned2"].split() == ["True", "True", "True"], out
    assert v["segment_gone"].split() == ["True", "True"], out
    assert v["not_a_state"].split() == ["True"] and v["no_pool"].split() == ["True"], out


# torch.compile(backend="cudagraphs"): CUDA-graph trees over copy-only functions (testdrv runs
# no kernels; graph trees' input copy, a multi-tensor kernel, is done one copy_ at a time). The
# second function after the first is recorded, replayed, then a third replaces it after the
# first's replay: a new recording from a replayed path, which restores the pool's checkpoint
# (twice: its warm-up and its recording).
COMPILED = """
import gc
def _foreach_copy_(dst, src, non_blocking=False):
    for d, s in zip(dst, src):
        d.copy_(s)
torch._foreach_copy_ = _foreach_copy_
import torch._inductor.config as icfg
icfg.triton.slow_path_cudagraph_asserts = True  # the pool's live blocks == live tensors
cf = torch.compile(lambda x: x.clone(), backend="cudagraphs")
cg = torch.compile(lambda x: (x.clone(), x[: x.numel() // 2].clone()), backend="cudagraphs")
ch = torch.compile(lambda x: x[10:].clone(), backend="cudagraphs")
x = torch.arange(256, dtype=torch.uint8).repeat(4096).cuda()
out = []
for i in range(3):
    torch.compiler.cudagraph_mark_step_begin()
    a = cf(x); b = cg(a)
    out.append(int(b[1].cpu()[7]))
for i in range(3):
    torch.compiler.cudagraph_mark_step_begin()
    a = cf(x); c = ch(a)
    out.append(int(c.cpu()[5]))
m = torch._inductor.cudagraph_trees.get_container(0).tree_manager
print("values=", out)
print("tree=", m.debug_checkpointing_counter, [r.num_descendants() for r in m.get_roots()])
del a, b, c, m; gc.collect()
torch._dynamo.reset(); gc.collect(); torch.cuda.empty_cache()
print("pool_segments=", len([s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0)]))
"""


def test_torch_compile_cudagraphs_backend_restores_checkpoints_as_under_pytorchs_allocator() -> None:
    native = values(run_torch(COMPILED))
    ours = values(run_torch('stepalloc.install("backend:cuda", patch_torch=True)\n' + COMPILED))
    assert native["values"].strip() == "[7, 7, 7, 15, 15, 15]", native
    assert native["tree"].strip() == "2 [2]" and native["pool_segments"].strip() == "0", native
    assert ours == native
