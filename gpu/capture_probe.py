"""Settles an open question of the design on a real GPU: which driver calls are legal while a
stream is being captured into a CUDA graph, in each capture mode, on the capturing thread and
on another thread. For each (mode, call) it begins a capture on a fresh non-blocking stream
(with a memset node before and after), makes the call, and reports the call's result, whether
the capture survived (cuStreamEndCapture), and whether the context is still healthy.

Output lines (parsed by validate.sh):
  CAPTURE mode=<m> call=<name> rc=<CUresult> end=<CUresult> verdict=<LEGAL|REFUSED|BREAKS_CAPTURE>
  # <mode> capture, <verdict>: <calls>        (the table by verdict)
  ANSWER <what it means for stepalloc>
  RESULT PASS|FAIL|SKIP <name> <detail>
Usage: python3 capture_probe.py
"""

import sys
import threading
from ctypes import byref, c_int, c_size_t, c_uint64, c_void_p

from cudrv import CAPTURE_MODES, CAPTURE_STATUS, Driver

MIB = 1 << 20


def result(kind, name, detail=""):
    print(f"RESULT {kind} {name} {detail}".rstrip(), flush=True)


class Probe:
    def __init__(self, drv):
        self.drv = drv
        self.ctx = drv.primary_context(0)
        drv.check(drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.other = drv.stream()
        self.scratch = drv.alloc(MIB)

    def relaxed(self, call):
        """Runs `call` in relaxed capture mode, as stepalloc's CUDA backend does around cuMemAlloc."""
        previous = self.drv.exchange_capture_mode(2)
        try:
            return call()
        finally:
            self.drv.exchange_capture_mode(previous)

    def on_thread(self, call):
        """Runs `call` on another thread (with the context current there); returns its CUresult."""
        out = {}

        def body():
            self.drv.cuCtxSetCurrent(self.ctx)
            out["rc"] = call()

        t = threading.Thread(target=body)
        t.start()
        t.join()
        return out["rc"]

    def actions(self):
        """(name, prepare, act, cleanup): prepare runs before the capture and returns state;
        act(state, capturing_stream) runs during it and returns a CUresult; cleanup(state) after."""
        d = self

        def nothing():
            return {}

        def pre_alloc():
            return {"ptr": d.drv.alloc(2 * MIB)}

        def pre_event():
            ev = d.drv.event()
            d.drv.check(d.drv.cuEventRecord(ev, d.other), "cuEventRecord")
            d.drv.check(d.drv.cuEventSynchronize(ev), "cuEventSynchronize")
            return {"event": ev}

        def new_event():
            return {"event": d.drv.event()}

        def free_if_unfreed(state):
            if state.get("ptr") and not state.get("freed"):
                d.drv.cuMemFree(state["ptr"])

        def free_allocated(state):
            p = state.get("out")
            if p is not None and p.value:
                d.drv.cuMemFree(p.value)

        def destroy_event(state):
            if state.get("event"):
                d.drv.cuEventDestroy(state["event"])

        def alloc(state, _):
            state["out"] = c_uint64()
            return d.drv.cuMemAlloc(byref(state["out"]), 2 * MIB)

        def free(state, _):
            rc = d.drv.cuMemFree(state["ptr"])
            state["freed"] = rc == 0
            return rc

        def mem_info(state, _):
            f, t = c_size_t(), c_size_t()
            return d.drv.cuMemGetInfo(byref(f), byref(t))

        def ctx_get(state, _):
            c = c_void_p()
            return d.drv.cuCtxGetCurrent(byref(c))

        def event_create(state, _):
            e = c_void_p()
            rc = d.drv.cuEventCreate(byref(e), 2)
            state["event"] = e.value
            return rc

        def record_then_query(state, cap):
            rc = d.drv.cuEventRecord(state["event"], cap)
            return rc if rc else d.drv.cuEventQuery(state["event"])

        return [
            ("cuCtxGetCurrent", nothing, ctx_get, None),
            ("cuCtxSetCurrent(same)", nothing, lambda s, c: d.drv.cuCtxSetCurrent(d.ctx), None),
            ("cuMemGetInfo", nothing, mem_info, None),
            ("cuMemAlloc", nothing, alloc, free_allocated),
            ("cuMemAlloc[relaxed]", nothing, lambda s, c: d.relaxed(lambda: alloc(s, c)), free_allocated),
            ("cuMemAlloc[other thread]", nothing, lambda s, c: d.on_thread(lambda: alloc(s, c)), free_allocated),
            ("cuMemFree", pre_alloc, free, free_if_unfreed),
            ("cuMemFree[relaxed]", pre_alloc, lambda s, c: d.relaxed(lambda: free(s, c)), free_if_unfreed),
            ("cuMemFree[other thread]", pre_alloc, lambda s, c: d.on_thread(lambda: free(s, c)), free_if_unfreed),
            ("cuEventCreate", nothing, event_create, destroy_event),
            ("cuEventRecord(other stream)", new_event, lambda s, c: d.drv.cuEventRecord(s["event"], d.other),
             destroy_event),
            ("cuEventRecord(capturing stream)", new_event, lambda s, c: d.drv.cuEventRecord(s["event"], c),
             destroy_event),
            ("cuEventQuery(event recorded before capture)", pre_event, lambda s, c: d.drv.cuEventQuery(s["event"]),
             destroy_event),
            ("cuEventQuery(event recorded before capture)[relaxed]", pre_event,
             lambda s, c: d.relaxed(lambda: d.drv.cuEventQuery(s["event"])), destroy_event),
            ("cuEventQuery(event recorded in capture)", new_event, record_then_query, destroy_event),
            ("cuEventSynchronize(event recorded before capture)", pre_event,
             lambda s, c: d.drv.cuEventSynchronize(s["event"]), destroy_event),
            ("cuStreamQuery(capturing stream)", nothing, lambda s, c: d.drv.cuStreamQuery(c), None),
            ("cuStreamQuery(other stream)", nothing, lambda s, c: d.drv.cuStreamQuery(d.other), None),
            ("cuStreamSynchronize(other stream)", nothing, lambda s, c: d.drv.cuStreamSynchronize(d.other), None),
            ("cuCtxSynchronize", nothing, lambda s, c: d.drv.cuCtxSynchronize(), None),
        ]

    def run_one(self, mode, name, prepare, act, cleanup):
        drv = self.drv
        state = prepare()
        cap = drv.stream()
        drv.check(drv.cuMemsetD8Async(self.scratch, 0, 4096, cap), "cuMemsetD8Async")
        drv.check(drv.cuStreamBeginCapture(cap, mode), "cuStreamBeginCapture")
        drv.cuMemsetD8Async(self.scratch, 1, 4096, cap)
        try:
            rc = act(state, cap)
        except Exception as e:  # a Python-side failure is reported, never hidden
            print(f"# {name}: probe error {e!r}", flush=True)
            rc = -1
        drv.cuMemsetD8Async(self.scratch, 2, 4096, cap)
        status = c_int(-1)
        drv.cuStreamIsCapturing(cap, byref(status))
        graph = c_void_p()
        end = drv.cuStreamEndCapture(cap, byref(graph))
        if graph.value:
            drv.cuGraphDestroy(graph)
        if cleanup:
            cleanup(state)
        drv.cuStreamSynchronize(cap)
        drv.cuStreamDestroy(cap)
        healthy = drv.cuCtxSynchronize()
        if rc == 0 and end == 0:
            verdict = "LEGAL"
        elif end != 0:
            verdict = "BREAKS_CAPTURE"
        else:
            verdict = "REFUSED"
        rc_name = drv.name(rc) if rc >= 0 else "probe-error"
        print(
            f"CAPTURE mode={CAPTURE_MODES[mode]} call={name.replace(' ', '_')} rc={rc_name} "
            f"status_after={CAPTURE_STATUS.get(status.value, status.value)} end={drv.name(end)} "
            f"ctx_after={drv.name(healthy)} verdict={verdict}",
            flush=True,
        )
        return verdict, healthy


def main():
    try:
        drv = Driver()
        count = drv.init()
    except Exception as e:
        result("SKIP", "capture_probe", f"no usable CUDA driver: {e}")
        return 0
    if count < 1:
        result("SKIP", "capture_probe", "no CUDA device")
        return 0
    probe = Probe(drv)
    verdicts = {}
    broken = False
    for mode in (0, 1, 2):
        for name, prepare, act, cleanup in probe.actions():
            verdict, healthy = probe.run_one(mode, name, prepare, act, cleanup)
            verdicts[(mode, name)] = verdict
            if healthy != 0:
                print(f"# the context is broken after {name} in {CAPTURE_MODES[mode]} mode: {drv.name(healthy)}")
                broken = True
                break
        if broken:
            break
    for mode in (0, 1, 2):
        for v in ("LEGAL", "REFUSED", "BREAKS_CAPTURE"):
            calls = [n for (m, n), x in verdicts.items() if m == mode and x == v]
            print(f"# {CAPTURE_MODES[mode]} capture, {v}: {', '.join(calls) if calls else '(none)'}")

    # What it means for stepalloc's CUDA backend (PyTorch captures in global mode by default).
    def legal(name, mode=0):
        return verdicts.get((mode, name)) == "LEGAL"

    implications = [
        ("growing a graph pool during capture (context switch + relaxed cuMemAlloc)",
         legal("cuCtxGetCurrent") and legal("cuCtxSetCurrent(same)") and legal("cuMemAlloc[relaxed]")),
        ("cuEventQuery of frees recorded before the capture (heap.process_events)",
         legal("cuEventQuery(event recorded before capture)")),
        ("cuMemFree while capturing (release_oversize on a failed reserve)", legal("cuMemFree")),
        ("cuEventRecord on the capturing stream (free of a record_stream'ed block in capture)",
         legal("cuEventRecord(capturing stream)")),
        ("cuEventQuery of an event recorded in the capture", legal("cuEventQuery(event recorded in capture)")),
        ("cuMemAlloc by another thread during a global capture", legal("cuMemAlloc[other thread]")),
    ]
    for what, ok in implications:
        print(f"ANSWER stepalloc in global-mode capture: {what}: {'legal' if ok else 'NOT legal'}")
    if broken:
        result("FAIL", "capture_probe", "a call during capture left the context broken (see above)")
        return 1
    needed = implications[0][1]
    result(
        "PASS" if needed else "FAIL",
        "capture_probe",
        "stepalloc's reserve path is legal during a global-mode capture" if needed
        else "stepalloc's reserve path is NOT legal during a global-mode capture",
    )
    return 0 if needed else 1


if __name__ == "__main__":
    sys.exit(main())
