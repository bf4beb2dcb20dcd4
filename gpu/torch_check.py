"""stepalloc under real PyTorch on a real GPU. Settles an open question of the design
(whether an exception thrown from the alloc function leaves PyTorch's pluggable allocator
usable) and checks process-wide mode end to end: hooks, CUDA graphs and their private pools,
record_stream, memory fraction, MemPool mode, exit with live tensors.

Each check runs in its own process (the allocator can be changed once per process, before
CUDA is used). Output lines: RESULT PASS|FAIL|SKIP <name> <detail>, ANSWER <text>.
Usage: python3 torch_check.py LIBRARY            (all checks)
       python3 torch_check.py LIBRARY CHECK      (one check, in this process)
"""

import ctypes
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from stepalloc_ctypes import Stepalloc  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
HOOKS = [
    ("set_init_fn", "stepalloc_init"),
    ("set_reset_fn", "stepalloc_empty_cache"),
    ("set_memory_fraction_fn", "stepalloc_set_memory_fraction"),
    ("set_base_alloc_fn", "stepalloc_base_alloc"),
    ("set_record_stream_fn", "stepalloc_record_stream"),
    ("set_begin_allocate_to_pool", "stepalloc_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "stepalloc_end_allocate_to_pool"),
    ("set_release_pool", "stepalloc_release_pool"),
]


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def install(library, conf="backend:cuda"):
    """Process-wide mode with every hook, as the Python package installs it."""
    import torch

    sa = Stepalloc(library)
    check(sa.configure(conf.encode()) == 0, f"configure: {sa.error()}")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(library, "stepalloc_torch_malloc", "stepalloc_free")
    hooks = alloc.allocator()
    missing = []
    for setter, symbol in HOOKS:
        if hasattr(hooks, setter):
            getattr(hooks, setter)(sa.address(symbol))
        else:
            missing.append(setter)
    torch.cuda.memory.change_current_allocator(alloc)
    return torch, sa, missing


def live_bytes(sa):
    return sa.stats(0)["allocated_bytes.all.current"]


# ----- checks (each returns a detail string or raises) --------------------------------------


def check_basic(library):
    torch, sa, missing = install(library)
    check(not missing, f"this torch lacks hooks: {missing}")
    a = torch.randn(1024, 1024, device="cuda")
    b = a @ a
    ref = a.cpu().double() @ a.cpu().double()
    check(torch.allclose(b.cpu().double(), ref, rtol=1e-3, atol=1e-2), "matmul result")
    check(live_bytes(sa) >= 2 * 4 * MIB, "stepalloc sees the tensors")
    ptr = a.data_ptr()
    del a, b
    torch.cuda.synchronize()
    before = sa.stats(0)["reserved_bytes.all.current"]
    torch.cuda.empty_cache()  # the reset hook (cuBLAS keeps its workspace allocated)
    after = sa.stats(0)
    check(after["reserved_bytes.all.current"] < before, "empty_cache hook released nothing")
    check(after["allocated_bytes.all.current"] <= after["reserved_bytes.all.current"], "stats consistent")
    size = ctypes.c_size_t()
    keep = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
    base = sa.base_alloc(keep.data_ptr() + 100, ctypes.byref(size))
    check(base is not None and base <= keep.data_ptr() and keep.data_ptr() + 3 * MIB <= base + size.value,
          "base_alloc hook data")
    c = torch.empty(0, device="cuda")  # size 0 through the allocator
    check(c.numel() == 0, "empty tensor")
    return f"torch {torch.__version__}, hooks all set, first tensor at {ptr:#x}, empty_cache {before} -> {after['reserved_bytes.all.current']} bytes reserved"


def check_oom_exception(library):
    torch, sa, _ = install(library)
    total = torch.cuda.get_device_properties(0).total_memory
    kept = torch.ones(256 * MIB // 4, device="cuda")
    messages = []
    for i in range(3):
        try:
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
            raise AssertionError("no exception for twice the device")
        except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
            messages.append(f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            check("CUDA out of memory." in str(e), f"message: {e}")
    # Fill the device with 1 GiB tensors until it refuses, then free and go on.
    hog = []
    try:
        for _ in range(total // GIB + 8):
            hog.append(torch.empty(GIB, dtype=torch.uint8, device="cuda"))
        raise AssertionError("the device never filled")
    except RuntimeError as e:
        check("CUDA out of memory." in str(e), f"message: {e}")
    filled = len(hog)
    del hog
    x = torch.randn(4096, 4096, device="cuda")
    y = x @ x
    torch.cuda.synchronize()
    ref = (x[:4].cpu().double() @ x.cpu().double())
    check(torch.allclose(y[:4].cpu().double(), ref, rtol=1e-3, atol=1e-1), "matmul after OOMs")
    check(bool((kept == 1).all()), "a tensor from before the OOMs was corrupted")
    stats = sa.stats(0)
    check(stats["num_ooms"] >= 4, f"num_ooms {stats['num_ooms']}")
    print(f"ANSWER exception from the alloc function leaves the pluggable allocator usable: YES "
          f"(4 OOMs raised {messages[0]}; filled {filled} GiB; allocation and kernels work after)")
    return messages[0]


def check_graphs(library):
    torch, sa, missing = install(library)
    check(not any("pool" in m for m in missing), f"this torch lacks the pool hooks: {missing}")
    details = []
    modes = ["global", "thread_local", "relaxed"]
    for mode in modes:
        n = 1 << 20
        static_in = torch.randn(n, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                static_in * 2 + 1
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        kwargs = {"capture_error_mode": mode}
        try:
            ctx = torch.cuda.graph(g, **kwargs)
        except TypeError:
            ctx, mode = torch.cuda.graph(g), "default"
        with ctx:
            # Read here: entering the context empties the cache first.
            reserved_before = sa.stats(0)["reserved_bytes.all.current"]
            tmp = static_in * 2
            # Larger than anything cached: the private pool must grow (cuMemAlloc) in capture.
            big = torch.full((300 * MIB // 4,), 1.0, device="cuda")
            out = tmp + big[:n]
        check(sa.stats(0)["reserved_bytes.all.current"] > reserved_before, "the pool got no segment")
        new_in = torch.randn(n, device="cuda")
        static_in.copy_(new_in)
        g.replay()
        torch.cuda.synchronize()
        check(torch.allclose(out, new_in * 2 + 1), f"{mode}: graph output")
        # Fill the cache with general allocations of the same sizes; none may overlap the graph.
        graph_ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (tmp, big, out)]
        fillers = [torch.full((n,), 7.0, device="cuda") for _ in range(64)]
        fillers += [torch.full((300 * MIB // 4,), 7.0, device="cuda") for _ in range(2)]
        for f in fillers:
            lo, hi = f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()
            for glo, ghi in graph_ranges:
                check(hi <= glo or lo >= ghi, f"{mode}: general allocation overlaps the graph's private pool")
        static_in.copy_(torch.randn(n, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        check(torch.allclose(out, static_in * 2 + 1), f"{mode}: graph output after fillers")
        check(all(bool((f == 7.0).all()) for f in fillers), f"{mode}: replay overwrote general memory")
        del fillers
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # only the graph's pool (and live tensors) stay reserved
        reserved_with_graph = sa.stats(0)["reserved_bytes.all.current"]
        # torch.cuda.graph keeps a reference to the graph: drop the context object too, or
        # `del g` frees nothing and the pool is never released.
        del ctx, g, tmp, big, out
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        released = reserved_with_graph - sa.stats(0)["reserved_bytes.all.current"]
        check(released >= 300 * MIB, f"{mode}: releasing the graph returned only {released} bytes")
        details.append(mode)
    return "capture, replay, isolation and release in modes: " + ", ".join(details)


def check_record_stream(library):
    torch, sa, missing = install(library)
    check("set_record_stream_fn" not in missing, "this torch lacks set_record_stream_fn")
    side = torch.cuda.Stream()
    size = 64 * MIB
    x = torch.empty(size, dtype=torch.uint8, device="cuda")
    ptr = x.data_ptr()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the side stream
        x.fill_(3)
    x.record_stream(side)
    check(sa.last_status() == 0, f"record_stream hook: {sa.error()}")
    del x
    y = torch.empty(size, dtype=torch.uint8, device="cuda")
    busy = not side.query()
    check(not (busy and y.data_ptr() == ptr), "memory still used by another stream was handed out again")
    torch.cuda.synchronize()
    return "side stream busy at reuse; a different block was given" if busy else "inconclusive: side stream done"


def check_memory_fraction(library):
    torch, sa, _ = install(library)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25, 0)
    try:
        torch.empty(total // 2, dtype=torch.uint8, device="cuda")
        raise AssertionError("half the device allocated under a 0.25 fraction")
    except RuntimeError as e:
        check("CUDA out of memory." in str(e) and "per_process_memory_fraction" in str(e), f"message: {e}")
    x = torch.ones(MIB, device="cuda")
    check(float(x.sum()) == MIB, "allocation after the refusal")
    return "limit enforced; message names per_process_memory_fraction"


def check_mempool(library):
    import torch

    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
        return "SKIP: torch.cuda.MemPool not in this torch"
    sa = Stepalloc(library)
    check(sa.configure(b"backend:cuda") == 0, sa.error())
    alloc = torch.cuda.memory.CUDAPluggableAllocator(library, "stepalloc_malloc", "stepalloc_free")
    pool = torch.cuda.MemPool(alloc.allocator())
    with torch.cuda.use_mem_pool(pool):
        x = torch.randn(1 << 20, device="cuda")
    check(live_bytes(sa) >= 4 * MIB, "PyTorch's allocator took no segment from stepalloc")
    y = x * 2
    check(torch.allclose(y, x * 2), "compute on MemPool memory")
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        with torch.cuda.use_mem_pool(pool):
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        raise AssertionError("no exception")
    except RuntimeError as e:
        check("out of memory" in str(e).lower(), f"message: {e}")
    return "segments come from stepalloc_malloc; NULL became an OOM exception"


def check_exit_with_live_tensors(library):
    torch, sa, _ = install(library)
    keep = [torch.randn(1 << 18, device="cuda") for _ in range(8)]
    g = torch.cuda.CUDAGraph()
    s = torch.randn(1 << 10, device="cuda")
    with torch.cuda.graph(g):
        o = s + 1
    globals()["_keep"] = (keep, g, o)
    return "tensors and a graph alive at exit"


CHECKS = {
    "basic": check_basic,
    "oom_exception": check_oom_exception,
    "graphs": check_graphs,
    "record_stream": check_record_stream,
    "memory_fraction": check_memory_fraction,
    "mempool": check_mempool,
    "exit_with_live_tensors": check_exit_with_live_tensors,
}


def run_one(library, name):
    try:
        detail = CHECKS[name](library)
    except Exception as e:
        traceback.print_exc()
        print(f"RESULT FAIL {name} {e!r}", flush=True)
        return 1
    if isinstance(detail, str) and detail.startswith("SKIP: "):
        print(f"RESULT SKIP {name} {detail[6:]}", flush=True)
    else:
        print(f"RESULT PASS {name} {detail}", flush=True)
    return 0


def main():
    if len(sys.argv) == 3:
        return run_one(os.path.abspath(sys.argv[1]), sys.argv[2])
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    library = os.path.abspath(sys.argv[1])
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        print(f"RESULT SKIP torch_check torch not importable: {probe.stderr.strip().splitlines()[-1:]}")
        print("ANSWER exception from the alloc function leaves the pluggable allocator usable: UNKNOWN (no torch)")
        return 0
    version, available = probe.stdout.split()
    if available != "True":
        print(f"RESULT SKIP torch_check torch {version}: torch.cuda.is_available() is False")
        print("ANSWER exception from the alloc function leaves the pluggable allocator usable: UNKNOWN (no GPU)")
        return 0
    failed = 0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("STEPALLOC_CONF", None)
    for name in CHECKS:
        start = time.time()
        try:
            proc = subprocess.run([sys.executable, __file__, library, name], capture_output=True, text=True,
                                  timeout=150, env=env)
            out = proc.stdout + proc.stderr
            code = proc.returncode
        except subprocess.TimeoutExpired as e:
            out = f"{e.stdout or ''}{e.stderr or ''}\nRESULT FAIL {name} timed out after 150 s\n"
            code = -1
        lines = out.splitlines()
        reported = [line for line in lines if line.startswith(("RESULT", "ANSWER"))]
        if code != 0 and not any(line.startswith("RESULT FAIL") for line in reported):
            # A crash: the check's own PASS line (if any) does not count.
            reported = [line for line in reported if not line.startswith("RESULT PASS")]
            reported.append(f"RESULT FAIL {name} process ended with code {code}")
            if name == "oom_exception":
                reported.append("ANSWER exception from the alloc function leaves the pluggable allocator usable: "
                                "NO (the process died; see the log)")
        if name == "oom_exception" and code != 0 and not any(r.startswith("ANSWER") for r in reported):
            reported.append("ANSWER exception from the alloc function leaves the pluggable allocator usable: "
                            "NO or UNKNOWN (the check failed; see the log)")
        if any(line.startswith("RESULT FAIL") for line in reported):
            failed += 1
            print("\n".join(f"  | {line}" for line in lines[-40:]))
        for line in reported:
            print(line, flush=True)
        print(f"# {name}: {time.time() - start:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
