"""Issue 33 over real PyTorch on testdrv's host-memory driver (see test_real_torch.py): autograd's
device thread follows the pool and the region of the thread that called backward (and no other
thread is captured); a region inside ``use_mem_pool`` is refused; ``empty_cache`` and step release
reach the free memory of an active pool.

The backward is a custom ``autograd.Function`` whose backward allocates (kernels do not run on
the stub runtime, so everything is ``torch.empty``). While it runs, a bystander thread allocates
too: it must land in the general pool, untagged. Each scenario first runs with the follow turned
off (``stepalloc.follow.disable()``: PyTorch's behaviour, the escape this fixes) and checks that
the escape shows, so the test cannot pass on a setup that does not exercise the engine's thread.
"""

from __future__ import annotations

import pytest

from test_real_torch import STUB_RUNTIME, run_torch, values
from conftest import torch_available

pytestmark = pytest.mark.skipif(
    not STUB_RUNTIME.exists() or not torch_available(),
    reason="needs torch and testdrv's stubs (testdrv/build.sh)",
)

# Defines F (backward allocates `scratch`, 5 MiB, and waits until the bystander allocated
# `other`, 3 MiB, on its own thread) and where(ptr) -> (pool id, tag) from a snapshot.
SCENARIO = """
import os, sys, threading
keep = {}

class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.empty(MIB, device="cuda")

    @staticmethod
    def backward(ctx, g):
        keep["thread"] = threading.current_thread().name
        keep["scratch"] = torch.empty(5 * MIB, dtype=torch.uint8, device="cuda")
        gate, done = threading.Event(), threading.Event()
        def bystander():
            gate.wait()
            keep["other"] = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
            done.set()
        threading.Thread(target=bystander).start()
        gate.set()
        assert done.wait(30)
        return torch.empty(MIB, device="cuda")

def where(ptr, segments):
    for s in segments:
        if s["address"] <= ptr < s["address"] + s["total_size"]:
            return tuple(s["segment_pool_id"]), s.get("tag")
    raise AssertionError(hex(ptr))

def backward(how):
    x = torch.empty(MIB, device="cuda", requires_grad=True)
    y = F.apply(x)
    g = torch.empty(MIB, device="cuda")
    if how == "grad":
        (gx,) = torch.autograd.grad(y, x, grad_outputs=g)
        return gx
    y.backward(g)
    return x.grad

def finish():
    sys.stdout.flush()
    os._exit(0)  # autograd's threads and the stub runtime: skip interpreter teardown
"""


def _pool_scenario(setup: str, snapshot: str) -> dict[str, str]:
    code = (
        setup
        + SCENARIO
        + f"""
for follow in (False, True):
    if follow:
        stepalloc.follow.enable()
    else:
        stepalloc.follow.disable()
    for how in ("backward", "grad"):
        keep.clear()
        with torch.cuda.use_mem_pool(pool):
            grad = backward(how)
            after = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")
        segments = {snapshot}
        key = ("on" if follow else "off") + "_" + how
        assert keep["thread"] != threading.current_thread().name
        print(key + "_scratch=" + str(where(keep["scratch"].data_ptr(), segments)[0] == pool.id))
        print(key + "_grad=" + str(where(grad.data_ptr(), segments)[0] == pool.id))
        print(key + "_other=" + str(where(keep["other"].data_ptr(), segments)[0] == pool.id))
        print(key + "_after=" + str(where(after.data_ptr(), segments)[0] == pool.id))
        print(key + "_use_count=" + str(pool.use_count()))
        del grad, after
        keep.clear()
finish()
"""
    )
    return values(run_torch(code))


def _check_pool(v: dict[str, str]) -> None:
    for how in ("backward", "grad"):
        # PyTorch's behaviour: backward's allocations escape the pool.
        assert v[f"off_{how}_scratch"] == "False", v
        assert v[f"off_{how}_after"] == "True", v
        # Followed: backward's scratch and gradient come from the pool; the bystander thread's
        # tensor does not; the caller's route is back after backward; every reference taken
        # was given back (the MemPool object's own is left).
        assert v[f"on_{how}_scratch"] == "True", v
        assert v[f"on_{how}_grad"] == "True", v
        assert v[f"on_{how}_other"] == "False", v
        assert v[f"on_{how}_after"] == "True", v
        assert v[f"on_{how}_use_count"] == "1", v


def test_backward_inside_use_mem_pool_of_stepalloc_mempool_allocates_from_the_pool() -> None:
    """MemPool mode: PyTorch's caching allocator in charge, the pool's segments from stepalloc
    (the e2e kit's mode); PyTorch's own snapshot says which pool each block is in."""
    _check_pool(
        _pool_scenario(
            'stepalloc.configure("backend:cuda")\npool = stepalloc.mempool()\n',
            "torch.cuda.memory_snapshot()",
        )
    )


def test_backward_inside_use_mem_pool_under_process_wide_stepalloc_allocates_from_the_pool() -> None:
    _check_pool(
        _pool_scenario(
            'stepalloc.install("backend:cuda", patch_torch=True)\npool = torch.cuda.MemPool()\n',
            'stepalloc.memory_snapshot()["segments"]',
        )
    )


def test_backward_inside_a_region_carries_the_regions_tag_and_pauses_with_it() -> None:
    out = run_torch(
        'stepalloc.install("backend:cuda")\n'
        + SCENARIO
        + """
for follow in (False, True):
    if follow:
        stepalloc.follow.enable()
    else:
        stepalloc.follow.disable()
    for how in ("backward", "grad"):
        keep.clear()
        with stepalloc.region("train"):
            grad = backward(how)
        outside = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")
        segments = stepalloc.memory_snapshot()["segments"]
        key = ("on" if follow else "off") + "_" + how
        for name, t in (("scratch", keep["scratch"]), ("grad", grad), ("other", keep["other"]), ("outside", outside)):
            print(key + "_" + name + "=" + str(where(t.data_ptr(), segments)[1]))
        if follow and how == "grad":
            # The scratch pauses with the tag: its bytes leave the device, its address stays.
            live = stepalloc.tags()["train"]["live_bytes"]
            ptr = keep["scratch"].data_ptr()
            report = stepalloc.pause("train")
            print("paused_released_ge_live=" + str(report.released_bytes >= live >= 5 * MIB))
            stepalloc.resume("train")
            print("same_address=" + str(keep["scratch"].data_ptr() == ptr))
        del grad, outside
        keep.clear()
finish()
"""
    )
    v = values(out)
    for how in ("backward", "grad"):
        assert v[f"off_{how}_scratch"] == "None", v  # PyTorch's behaviour: untagged
        assert v[f"on_{how}_scratch"] == "train", v
        assert v[f"on_{how}_grad"] == "train", v
        assert v[f"on_{how}_other"] == "None", v  # the bystander thread is not captured
        assert v[f"on_{how}_outside"] == "None", v  # the lease ended with the call
    assert v["paused_released_ge_live"] == "True", v
    assert v["same_address"] == "True", v


def test_a_region_inside_use_mem_pool_is_refused_and_a_pause_never_claims_what_it_did_not_release() -> None:
    """Issue 33 / 31 item 4. Before: the allocation went to the pool untagged, tags()["r"]
    showed 0 live bytes and pause("r") listed the tag as paused, releasing nothing."""
    out = run_torch(
        """
        stepalloc.install("backend:cuda", patch_torch=True)
        pool = torch.cuda.MemPool()
        for order in ("pool_outside", "region_outside"):
            try:
                if order == "pool_outside":
                    with torch.cuda.use_mem_pool(pool), stepalloc.region("r"):
                        t = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
                else:
                    with stepalloc.region("r"), torch.cuda.use_mem_pool(pool):
                        t = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
                print(order + "=allocated")
            except RuntimeError as e:
                text = str(e)
                ok = "region" in text and '"r"' in text and "use_mem_pool" in text and str(pool.id[1]) in text
                print(order + "=refused" + ("" if ok else ":" + text))
        with stepalloc.region("r"):
            t = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
        report = stepalloc.pause("r")
        print("released_ge=" + str(report.released_bytes >= 4 * MIB) + " tags=" + ",".join(report.tags))
        stepalloc.resume("r")
        print("usable=" + str(torch.empty(MIB, device="cuda").data_ptr() != 0))
        """
    )
    v = values(out)
    assert v["pool_outside"] == "refused" and v["region_outside"] == "refused", v
    assert v["released_ge"] == "True tags=r", v
    assert v["usable"] == "True", v


def test_empty_cache_and_step_release_reach_the_free_memory_of_an_active_pool() -> None:
    """PyTorch's empty_cache frees nothing while a pool is in use (vLLM PR #49151). Under
    stepalloc the pool's free segments go back, inside use_mem_pool, and live blocks stay."""
    out = run_torch(
        """
        stepalloc.install("backend:cuda,release_idle_steps:1", patch_torch=True)
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            live = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
            live.copy_(torch.arange(3 * MIB, dtype=torch.int64).to(torch.uint8))
            scratch = torch.empty(40 * MIB, dtype=torch.uint8, device="cuda")
            before = torch.cuda.memory_reserved()
            del scratch
            torch.cuda.empty_cache()
            print("empty_cache_released=" + str(before - torch.cuda.memory_reserved()))
            with stepalloc.step("train"):
                scratch = torch.empty(40 * MIB, dtype=torch.uint8, device="cuda")
                del scratch
            with stepalloc.step("train"):
                pass
            print("step_left=" + str(torch.cuda.memory_reserved()))
            print("live_intact=" + str(torch.equal(live.cpu(), torch.arange(3 * MIB, dtype=torch.int64).to(torch.uint8))))
        print("use_count=" + str(pool.use_count()))
        """
    )
    v = values(out)
    assert int(v["empty_cache_released"]) >= 40 << 20, v
    assert int(v["step_left"]) <= 20 << 20, v  # the live block's segment only
    assert v["live_intact"] == "True", v
    assert v["use_count"] == "1", v


def test_gradient_checkpointing_recomputes_inside_the_pool() -> None:
    """Gradient checkpointing (the e2e loop uses it) recomputes the forward during backward: with
    ``use_reentrant=True`` on autograd's thread through a nested ``backward()`` there, which
    follows as the thread does; with ``use_reentrant=False`` from saved-tensor hooks."""
    out = run_torch(
        """
        import os, sys, threading
        from torch.utils.checkpoint import checkpoint
        keep = {}
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                keep.setdefault("forward", []).append(
                    (threading.current_thread() is threading.main_thread(),
                     torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")))
                return torch.empty(MIB, device="cuda")
            @staticmethod
            def backward(ctx, g):
                keep["scratch"] = torch.empty(5 * MIB, dtype=torch.uint8, device="cuda")
                return torch.empty(MIB, device="cuda")
        stepalloc.configure("backend:cuda")
        pool = stepalloc.mempool()
        def where(ptr, segments):
            for s in segments:
                if s["address"] <= ptr < s["address"] + s["total_size"]:
                    return tuple(s["segment_pool_id"]) == pool.id
            raise AssertionError(hex(ptr))
        for follow in (False, True):
            (stepalloc.follow.enable if follow else stepalloc.follow.disable)()
            for reentrant in (True, False):
                keep.clear()
                with torch.cuda.use_mem_pool(pool):
                    x = torch.empty(MIB, device="cuda", requires_grad=True)
                    y = checkpoint(F.apply, x, use_reentrant=reentrant, preserve_rng_state=False)
                    y.backward(torch.empty(MIB, device="cuda"))
                segments = torch.cuda.memory_snapshot()
                key = ("on" if follow else "off") + ("_reentrant" if reentrant else "_plain")
                recomputed = [where(t.data_ptr(), segments) for main, t in keep["forward"] if not main]
                print(key + "_recomputed=" + str(recomputed))
                print(key + "_scratch=" + str(where(keep["scratch"].data_ptr(), segments)))
                print(key + "_grad=" + str(where(x.grad.data_ptr(), segments)))
                print(key + "_use_count=" + str(pool.use_count()))
                del x, y
        sys.stdout.flush()
        os._exit(0)
        """
    )
    v = values(out)
    assert v["off_reentrant_scratch"] == "False" and v["off_reentrant_recomputed"] == "[False]", v
    assert v["on_reentrant_recomputed"] == "[True]", v  # the forward recomputed on autograd's thread
    for kind in ("reentrant", "plain"):
        assert v[f"on_{kind}_scratch"] == "True" and v[f"on_{kind}_grad"] == "True", v
        assert v[f"on_{kind}_use_count"] == "1", v
