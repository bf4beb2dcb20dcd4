"""stepalloc on a real GPU without torch: libstepalloc.so with backend:cuda, driven through
ctypes, checked against the CUDA driver (memory really usable, context left as found, OOM
path, threads on real streams, record_stream, empty_cache returns memory to the device).

Output lines: RESULT PASS|FAIL|SKIP <name> <detail>. Usage: python3 cuda_smoke.py LIBRARY
"""

import ctypes
import random
import sys
import threading
import traceback

from cudrv import Driver
from stepalloc_ctypes import Stepalloc

MIB = 1 << 20
GIB = 1 << 30
failures = 0


def result(kind, name, detail=""):
    global failures
    failures += kind == "FAIL"
    print(f"RESULT {kind} {name} {detail}".rstrip(), flush=True)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def consistent(sa, device, live_count, live_requested):
    s = sa.stats(device)
    a = s["allocated_bytes.all.current"]
    check(a == s["allocated_bytes.small_pool.current"] + s["allocated_bytes.large_pool.current"], "pool sums")
    check(a <= s["active_bytes.all.current"] <= s["reserved_bytes.all.current"], "allocated <= active <= reserved")
    check(s["allocation.all.current"] == live_count, f"allocation.all.current {s['allocation.all.current']} != {live_count}")
    check(s["requested_bytes.all.current"] == live_requested, "requested bytes")
    return s


def test_memory_is_usable(sa, drv, devices):
    for device in range(devices):
        for size in (0, 1, 512, 4097, MIB, MIB + 1, 10 * MIB, 100 * MIB, GIB):
            p = sa.malloc(size, device, None)
            check(p, f"malloc({size}) on {device}: {sa.error()}")
            if size:
                value = 0x5A
                drv.check(drv.cuCtxSetCurrent(drv.primary_context(device)), "cuCtxSetCurrent")
                drv.check(drv.cuMemsetD8(p, value, size), f"memset of {size} bytes at {p:#x}")
                tail = ctypes.create_string_buffer(1)
                drv.check(drv.cuMemcpyDtoH(tail, p + size - 1, 1), "cuMemcpyDtoH")
                check(tail.raw[0] == value, "device memory holds what was written")
            sa.free(p, size, device, None)
            check(sa.last_status() == 0, f"free: {sa.error()}")
        consistent(sa, device, 0, 0)


def test_context_left_as_found(sa, drv, devices):
    ctx0 = drv.primary_context(0)
    try:
        for current in (ctx0, None):
            drv.check(drv.cuCtxSetCurrent(current), "cuCtxSetCurrent")
            for device in range(devices):
                p = sa.malloc(300 * MIB, device, None)  # a new segment: driver calls
                check(p, sa.error())
                sa.free(p, 300 * MIB, device, None)
            sa.empty_cache()  # cuMemFree on every device
            check(drv.current_context() == current, f"current context changed from {current} to {drv.current_context()}")
    finally:
        # The next tests call the driver directly and need a current context.
        drv.check(drv.cuCtxSetCurrent(ctx0), "cuCtxSetCurrent")


def test_out_of_memory(sa, drv):
    drv.check(drv.cuCtxSetCurrent(drv.primary_context(0)), "cuCtxSetCurrent")
    free0, total = drv.mem_info()
    check(sa.malloc(2 * total, 0, None) is None, "twice the device allocated")
    check(sa.status() == "OUT_OF_MEMORY", sa.status())
    check(sa.error().startswith("CUDA out of memory."), sa.error())
    # Fill the device in 1 GiB steps until the allocator reports out of memory.
    ptrs = []
    for _ in range(total // GIB + 8):
        p = sa.malloc(GIB, 0, None)
        if p is None:
            break
        ptrs.append(p)
    check(sa.status() == "OUT_OF_MEMORY", f"filling ended with {sa.status()}: {sa.error()}")
    report = sa.error()
    check(report.startswith("CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity of"), report)
    stats = consistent(sa, 0, len(ptrs), len(ptrs) * GIB)
    check(stats["num_ooms"] >= 2, "num_ooms counts both")
    for p in ptrs:
        sa.free(p, GIB, 0, None)
    p = sa.malloc(GIB, 0, None)
    check(p, f"1 GiB after freeing: {sa.error()}")
    sa.free(p, GIB, 0, None)
    sa.empty_cache()
    check(sa.stats(0)["reserved_bytes.all.current"] == 0, "empty_cache left memory reserved")
    free1, _ = drv.mem_info()
    check(free1 + 512 * MIB >= free0, f"device free memory {free0} before, {free1} after empty_cache")
    return f"filled {len(ptrs)} GiB of {total / GIB:.1f} GiB; report: {report[:160]}..."


def test_threads_on_streams(sa, drv):
    drv.check(drv.cuCtxSetCurrent(drv.primary_context(0)), "cuCtxSetCurrent")
    streams = [drv.stream() for _ in range(4)] + [None]
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        live = []
        try:
            for _ in range(3000):
                if live and (len(live) >= 32 or rng.random() < 0.5):
                    p, size, stream = live.pop(rng.randrange(len(live)))
                    if rng.random() < 0.1:
                        sa.record_stream(p, rng.choice(streams))
                        check(sa.last_status() == 0, f"record_stream: {sa.error()}")
                    sa.free(p, size, 0, stream)
                    check(sa.last_status() == 0, f"free: {sa.error()}")
                else:
                    size = rng.choice([rng.randrange(MIB), rng.randrange(1, 40 * MIB)])
                    stream = rng.choice(streams)
                    p = sa.malloc(size, 0, stream)
                    check(p, f"malloc: {sa.error()}")
                    live.append((p, size, stream))
            for p, size, stream in live:
                sa.free(p, size, 0, stream)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(not errors, "; ".join(errors[:3]))
    drv.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
    stats = consistent(sa, 0, 0, 0)
    sa.empty_cache()
    check(sa.stats(0)["reserved_bytes.all.current"] == 0, "memory left reserved after empty_cache")
    return f"{stats['stepalloc.num_mallocs']} mallocs, {stats['stepalloc.num_cache_hits']} cache hits"


def test_record_stream_delays_reuse(sa, drv):
    drv.check(drv.cuCtxSetCurrent(drv.primary_context(0)), "cuCtxSetCurrent")
    s1, s2 = drv.stream(), drv.stream()
    big_size = min(4 * GIB, drv.mem_info()[0] // 4)
    big = drv.alloc(big_size)
    size = 64 * MIB
    p = sa.malloc(size, 0, s1)
    check(p, sa.error())
    # Queue a lot of work on s2 that uses p, then free p with s2 recorded.
    for _ in range(20):
        drv.check(drv.cuMemsetD8Async(big, 1, big_size, s2), "memset")
    drv.check(drv.cuMemsetD8Async(p, 3, size, s2), "memset p on s2")
    sa.record_stream(p, s2)
    sa.free(p, size, 0, s1)
    check(sa.last_status() == 0, sa.error())
    busy = drv.cuStreamQuery(s2) != 0
    q = sa.malloc(size, 0, s1)
    check(q, sa.error())
    reused_early = busy and q == p
    drv.check(drv.cuCtxSynchronize(), "sync")
    sa.free(q, size, 0, s1)
    drv.cuMemFree(big)
    check(not reused_early, "a block used by another stream was reused before that stream's work finished")
    return "s2 was still busy at the next malloc" if busy else "s2 finished too early to observe (inconclusive)"


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    try:
        drv = Driver()
        devices = drv.init()
    except Exception as e:
        result("SKIP", "cuda_smoke", f"no usable CUDA driver: {e}")
        return 0
    sa = Stepalloc(sys.argv[1])
    if sa.configure(b"backend:cuda") != 0:
        result("FAIL", "configure", sa.error())
        return 1
    n = sa.device_count()
    if n != devices:
        result("FAIL", "device_count", f"stepalloc sees {n} devices ({sa.error()}), the driver {devices}")
        return 1
    result("PASS", "device_count", f"{n} device(s); stepalloc {sa.version().decode()}")
    # Creating the allocator opened every device but must not have created any context.
    active = [d for d in range(devices) if drv.primary_context_active(d)]
    if active:
        result("FAIL", "no_context_before_use", f"primary contexts active after init on devices {active}")
    else:
        # An impossible request on an unused device fails without creating its context (the
        # out-of-memory report must not create one just to read the free memory).
        huge = sa.malloc(1 << 50, devices - 1, None)
        if huge is not None or sa.status() != "OUT_OF_MEMORY" or drv.primary_context_active(devices - 1):
            result("FAIL", "oom_report_creates_no_context",
                   f"malloc {huge}, status {sa.status()}, context active {drv.primary_context_active(devices - 1)}")
        else:
            result("PASS", "oom_report_creates_no_context")
        p = sa.malloc(MIB, devices - 1, None)
        others = [d for d in range(devices - 1) if drv.primary_context_active(d)]
        ok = p is not None and drv.primary_context_active(devices - 1) and not others
        result("PASS" if ok else "FAIL", "no_context_before_use",
               f"a malloc on device {devices - 1} created its context only" if ok
               else f"malloc {p}, contexts on other devices {others}, error {sa.error()}")
        sa.free(p, MIB, devices - 1, None)
    for name, test in [
        ("memory_is_usable", lambda: test_memory_is_usable(sa, drv, devices)),
        ("context_left_as_found", lambda: test_context_left_as_found(sa, drv, devices)),
        ("out_of_memory_path", lambda: test_out_of_memory(sa, drv)),
        ("threads_on_real_streams", lambda: test_threads_on_streams(sa, drv)),
        ("record_stream_delays_reuse", lambda: test_record_stream_delays_reuse(sa, drv)),
    ]:
        try:
            detail = test()
            result("PASS", name, detail or "")
        except Exception as e:
            traceback.print_exc()
            result("FAIL", name, repr(e))
    # Leave an allocation live at exit: stepalloc must not call CUDA (or crash) at exit.
    sa.malloc(MIB, 0, None)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
