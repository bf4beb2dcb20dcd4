"""CUDA-graph pool checkpoints and NCCL pool registration under stepalloc, beside stock PyTorch:
the same child script runs under PyTorch's caching allocator and under process-wide stepalloc
(``install(patch_torch=True)``), and their answers must be equal.

- ``graph_checkpoints``: ``torch._C._cuda_getCheckpointState`` / ``_cuda_setCheckpointPoolState``
  called as torch.compile's CUDA-graph trees call them: a pool's state recorded, a block freed
  and another allocated since, the state restored with the new block's storage stale and a
  storage that does not own its memory given a deleter; the pool's live blocks, the storages'
  owners and the bytes through the restored block after each step.
- ``graph_trees_compile``: ``torch.compile(backend="cudagraphs")`` over two paths of a tree
  (recording, replay, a new recording after a replay: two checkpoint restores), values and the
  tree's checkpoint count.
- ``nccl_register``: a one-rank NCCL process group (``init_method=file://``);
  ``register_mem_pool`` of a pool, a segment it creates afterwards, ``deregister_mem_pool``; on a
  GPU an all_reduce of a tensor of the registered pool (values checked). Both sides use PyTorch's
  stock ProcessGroupNCCL (what "nccl" is under stepalloc; ``TORCH_DIST_USE_NCCL2=0`` natively).
  Over testdrv it needs a stand-in NCCL (``--hostnccl LIB``, testdrv/hostnccl.c built), which
  also records the registrations, compared against the pool's segments; without one it is
  skipped.

Runs on a GPU and over testdrv's host-memory driver (no kernels: copies only, except the GPU's
all_reduce). Output: ``RESULT PASS|FAIL|SKIP <name> <detail>`` per check; ``--json FILE``.
Usage: python3 graph_pool_check.py [--checks graph_checkpoints,graph_trees_compile,nccl_register]
                                   [--hostnccl LIB] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from testdrv_env import stub_runtime, with_stub

HERE = Path(__file__).resolve().parent

PRELUDE = """
import ctypes, gc, os, sys
import torch
MIB = 1 << 20
if os.environ.get("CHECK_MODE") == "stepalloc":
    import stepalloc
    stepalloc.install("backend:cuda", patch_torch=True)
OVER_TESTDRV = bool(os.environ.get("STEPALLOC_HOSTCUDA"))
if OVER_TESTDRV:  # graph trees copy inputs with a multi-tensor kernel; testdrv runs none
    def _foreach_copy_(dst, src, non_blocking=False):
        for d, s in zip(dst, src):
            d.copy_(s)
    torch._foreach_copy_ = _foreach_copy_
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
"""

CHECKPOINTS = """
pool = torch.cuda.graph_pool_handle()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, pool=pool):
    a = u8(MIB)
    b = u8(3 * MIB)
state = torch._C._cuda_getCheckpointState(0, pool)
a_ptr, b_ptr = a.data_ptr(), b.data_ptr()
view = torch._C._construct_storage_from_data_pointer(b_ptr, b.device, 3 * MIB)
del b
torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
c = u8(5 * MIB)
torch._C._cuda_endAllocateToPool(0, pool)
torch._C._cuda_releasePool(0, pool)
c_ptr = c.data_ptr()
print("before=", live(pool) == sorted([a_ptr, c_ptr]))
torch._C._cuda_setCheckpointPoolState(0, state, [c.untyped_storage()._cdata], [view._cdata])
print("restored=", live(pool) == sorted([a_ptr, b_ptr]), torch._C._has_Standard_Deleter(view._cdata),
      torch._C._has_Standard_Deleter(c.untyped_storage()._cdata))
bt = torch.empty(0, dtype=torch.uint8, device="cuda").set_(view)
bt.copy_(torch.full((3 * MIB,), 9, dtype=torch.uint8))
print("data=", int(bt.cpu()[-1]))
del c; gc.collect()
print("stale_dropped=", live(pool) == sorted([a_ptr, b_ptr]))
del bt, view; gc.collect()
print("owner_dropped=", live(pool) == [a_ptr])
del a; g.reset(); gc.collect(); torch.cuda.empty_cache()
print("end=", live(pool) == [])
"""

COMPILE = """
import torch._inductor.config as icfg
icfg.triton.slow_path_cudagraph_asserts = True
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
"""

NCCL = """
import torch.distributed as dist
dist.init_process_group("nccl", init_method="file://" + os.environ["CHECK_STORE"], rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
print("backend=", type(pg).__name__)
def registered():
    if not os.environ.get("CHECK_HOSTNCCL"):
        return None
    lib = ctypes.CDLL(None)
    n = lib.hostnccl_log(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.hostnccl_log(buf, n + 1)
    live = {}
    for op, comm, *rest in (line.split() for line in buf.value.decode().splitlines()):
        if op == "register":
            live[rest[2]] = (int(rest[0], 16), int(rest[1]))
        elif op == "deregister":
            live.pop(rest[2])
        else:
            return "bad " + op
    return sorted(live.values())
def segments(pool_id):
    return sorted((s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()
                  if tuple(s["segment_pool_id"]) == tuple(pool_id))
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    t = u8(3 * MIB)
pg.register_mem_pool(pool)
with torch.cuda.use_mem_pool(pool):
    t2 = u8(30 * MIB)
r = registered()
print("registered=", None if r is None else (sorted(size for _, size in r), r == segments(pool.id)))
if not OVER_TESTDRV:
    with torch.cuda.use_mem_pool(pool):
        f = torch.full((1024,), 3.0, device="cuda")
    dist.all_reduce(f)
    torch.cuda.synchronize()
    print("all_reduce=", float(f[5].item()))
pg.deregister_mem_pool(pool)
print("deregistered=", registered())
del t, t2, pool; gc.collect()
dist.destroy_process_group()
"""

CHECKS = {
    "graph_checkpoints": CHECKPOINTS,
    "graph_trees_compile": COMPILE,
    "nccl_register": NCCL,
}


def expected(name: str, over_testdrv: bool, hostnccl: bool) -> dict[str, str]:
    """What stock PyTorch answers (so the comparison checks something)."""
    if name == "graph_checkpoints":
        return {
            "before": "True",
            "restored": "True True False",
            "data": "9",
            "stale_dropped": "True",
            "owner_dropped": "True",
            "end": "True",
        }
    if name == "graph_trees_compile":
        return {"values": "[7, 7, 7, 15, 15, 15]", "tree": "2 [2]"}
    answers = {"backend": "ProcessGroupNCCL"}
    if hostnccl:
        answers.update(
            {"registered": "([20971520, 31457280], True)", "deregistered": "[]"}
        )
    if not over_testdrv:
        answers["all_reduce"] = "3.0"
    return answers


def python_path() -> str:
    """The stepalloc package: the bundle's python/, or python_shim/ in the repository."""
    for candidate in (HERE.parent / "python", HERE.parent / "python_shim"):
        if (candidate / "stepalloc").is_dir():
            return str(candidate)
    return ""


def run(
    name: str, mode: str, hostnccl: str | None, store: str
) -> tuple[int, dict[str, str], str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (python_path(), env.get("PYTHONPATH", "")) if p
    )
    env["CHECK_MODE"] = mode
    env["CHECK_STORE"] = store
    env["TORCH_DIST_USE_NCCL2"] = "0"  # PyTorch's stock ProcessGroupNCCL on both sides
    runtime = stub_runtime()
    if runtime is not None:
        env = with_stub(env, runtime)
    if hostnccl:
        env["LD_PRELOAD"] = os.pathsep.join(
            p for p in (env.get("LD_PRELOAD", ""), hostnccl) if p
        )
        env["CHECK_HOSTNCCL"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + CHECKS[name]],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    answers = dict(
        line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line
    )
    return proc.returncode, answers, proc.stderr[-1500:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", default=",".join(CHECKS))
    parser.add_argument(
        "--hostnccl", default=None, help="testdrv/hostnccl.c built (over testdrv)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    for name in args.checks.split(","):
        if name not in CHECKS:
            parser.error(f"unknown check {name!r}; known: {', '.join(CHECKS)}")
        if name == "nccl_register" and stub_runtime() is not None and not args.hostnccl:
            results.append(
                {
                    "name": name,
                    "result": "SKIP",
                    "detail": "over testdrv without --hostnccl",
                }
            )
            continue
        with tempfile.TemporaryDirectory() as tmp:
            stock = run(name, "stock", args.hostnccl, os.path.join(tmp, "stock"))
            ours = run(name, "stepalloc", args.hostnccl, os.path.join(tmp, "stepalloc"))
        if stock[0] != 0 or ours[0] != 0:
            side = "stock" if stock[0] != 0 else "stepalloc"
            detail = f"{side} child failed: {(stock if side == 'stock' else ours)[2].strip().splitlines()[-1:]}"
            results.append(
                {
                    "name": name,
                    "result": "FAIL",
                    "detail": detail,
                    "stock": stock[1],
                    "stepalloc": ours[1],
                }
            )
            continue
        differ = sorted(
            k for k in set(stock[1]) | set(ours[1]) if stock[1].get(k) != ours[1].get(k)
        )
        want = expected(name, stub_runtime() is not None, bool(args.hostnccl))
        unexpected = sorted(
            k for k, v in want.items() if stock[1].get(k, "").strip() != v
        )
        if unexpected and not differ:
            detail = (
                "stock PyTorch answered otherwise than the check expects: "
                + "; ".join(
                    f"{k}={stock[1].get(k, '').strip()!r} (expected {want[k]!r})"
                    for k in unexpected
                )
            )
            results.append(
                {
                    "name": name,
                    "result": "FAIL",
                    "detail": detail,
                    "stock": stock[1],
                    "stepalloc": ours[1],
                }
            )
            continue
        ok = not differ and not unexpected
        detail = "same answers: " + "; ".join(
            f"{k}={v.strip()}" for k, v in sorted(stock[1].items())
        )
        if differ:
            detail = "differ: " + "; ".join(
                f"{k}: stock {stock[1].get(k)!r}, stepalloc {ours[1].get(k)!r}"
                for k in differ
            )
        results.append(
            {
                "name": name,
                "result": "PASS" if ok else "FAIL",
                "detail": detail,
                "stock": stock[1],
                "stepalloc": ours[1],
            }
        )
    for r in results:
        print(f"RESULT {r['result']} {r['name']} {r['detail']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if any(r["result"] == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
