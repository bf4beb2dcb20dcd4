"""CUDA IPC between a stepalloc process and a stock-PyTorch process (or two of either), as
``torch.multiprocessing`` does it: a tensor goes from the producer to a receiver (a child
process) through ``reduce_tensor`` / ``rebuild_cuda_tensor`` and back the other way, with the
bytes compared on each side.

Per pairing and segment kind (plain: ``expandable_segments:False``; expandable: ``True``):
- the receiver reads the producer's bytes; a write by the receiver is seen by the producer;
- the producer's block is not handed out again while the receiver holds it (the producer
  drops its tensor and allocates the same size: another address), and once the receiver
  dropped it and the producer ran ``torch.cuda.ipc_collect()`` it is (stepalloc producer);
- the receiver sends a tensor of its own back, which the producer reads;
- the receiver cannot pass the received tensor on (PyTorch's own refusal, same message);
- a stepalloc receiver refuses a storage outside the shared mapping (the offset moved 1 TiB
  past it, or the size set to 1 TiB) with an error naming offset, size and the mapping's size,
  before it opens the real one.
Runs on a GPU and over testdrv's host-memory driver (kernels never run: data moves by copies).

Output: one line ``RESULT PASS|FAIL ipc_<producer>_to_<receiver>_<segment> <detail>`` per
pairing, and with ``--json FILE`` the details. Exit status 1 when any pairing failed.
Usage: python3 ipc_check.py [--pairs stepalloc:stock,stock:stepalloc,stepalloc:stepalloc]
                            [--segments plain,expandable] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import pickle
import struct
import subprocess
import sys
import time
import traceback
from pathlib import Path

from testdrv_env import stub_runtime, with_stub

HERE = Path(__file__).resolve().parent
MIB = 1 << 20
# The shared tensor: after a 2 MiB + 512 B one, so that it lies at an offset in its segment
# (plain) or starts inside a page and spans pages (expandable, 2 MiB pages).
PAD_BYTES = 2 * MIB + 512
SHARED_BYTES = 3 * MIB + 1000
MARK = 0xAB


def python_path() -> str:
    """The stepalloc package: the bundle's python/, or python_shim/ in the repository."""
    for candidate in (HERE.parent / "python", HERE.parent / "python_shim"):
        if (candidate / "stepalloc").is_dir():
            return str(candidate)
    return ""


def send(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def receive(stream):
    head = stream.read(8)
    if len(head) != 8:
        raise EOFError("the other process closed the channel")
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))


def allow_descriptor_taking() -> None:
    """Under Yama's ptrace scope 1 only an ancestor may take this process's descriptors
    (``pidfd_getfd``); expandable segments are shared that way, so let any process of this
    user take them, as a PyTorch user would with ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)


def setup(kind: str, segment: str):
    """Imports torch as `kind` (stepalloc: installed process-wide with patch_torch; stock:
    PyTorch's allocator) with the segment kind."""
    expandable = "True" if segment == "expandable" else "False"
    if kind == "stock":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = f"expandable_segments:{expandable}"
        import torch

        return torch
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    import torch

    import stepalloc

    stepalloc.install(f"backend:cuda,expandable_segments:{expandable},large_segment_size_mb:2", patch_torch=True)
    return torch


def pattern(torch, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def digest(t) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


def tamper_refusals(fn, args) -> list:
    """What a stepalloc receiver says to the producer's tuple with the storage moved outside
    the shared mapping (rebuild_cuda_tensor's args: 8 is the storage's size, 9 its offset);
    each entry is the error text, or "opened" when it handed out a storage."""
    import stepalloc

    said = []
    for at, value in ((9, args[9] + (1 << 40)), (8, 1 << 40)):
        bad = list(args)
        bad[at] = value
        try:
            fn(*bad)
            said.append("opened")
        except stepalloc.StepallocError as e:
            said.append(str(e))
    return said


def receiver_main(kind: str, segment: str) -> None:
    channel_in, channel_out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # prints go to stderr; stdout is the channel
    allow_descriptor_taking()
    torch = setup(kind, segment)
    from torch.multiprocessing.reductions import reduce_tensor

    fn, args = receive(channel_in)
    tampered = tamper_refusals(fn, args) if kind == "stepalloc" else []
    t = fn(*args)
    got = digest(t)
    try:  # PyTorch refuses to pass on a received tensor (clone it first); so must stepalloc
        reduce_tensor(t)
        resend = "allowed"
    except RuntimeError as e:
        resend = str(e)
    t[:4096].copy_(torch.full((4096,), MARK, dtype=torch.uint8))
    torch.cuda.synchronize()
    back = pattern(torch, SHARED_BYTES, 2).cuda()
    reply = {"got": got, "size": t.numel(), "resend": resend, "back": reduce_tensor(back), "tampered": tampered}
    send(channel_out, reply)
    assert receive(channel_in) == "drop"
    del t, fn, args
    import gc

    gc.collect()
    send(channel_out, "dropped")
    assert receive(channel_in) == "exit"  # `back` stays alive until the producer read it


def producer(kind: str, receiver: str, segment: str) -> dict:
    allow_descriptor_taking()
    torch = setup(kind, segment)
    from torch.multiprocessing.reductions import reduce_tensor

    out: dict = {"producer": kind, "receiver": receiver, "segment": segment}
    pad = torch.empty(PAD_BYTES, dtype=torch.uint8, device="cuda")
    host = pattern(torch, SHARED_BYTES, 1)
    x = host.cuda()
    ptr = x.data_ptr()
    fn, args = reduce_tensor(x)
    out["handle_bytes"] = len(args[7])
    out["handle_kind"] = chr(args[7][1]) if len(args[7]) != 64 else "bare"
    out["offset"] = args[9]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (python_path(), env.get("PYTHONPATH", "")) if p)
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "receiver", "--kind", receiver, "--segment", segment],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        send(child.stdin, (fn, args))
        reply = receive(child.stdout)
        out["receiver_read_bytes"] = reply["got"] == digest(host) and reply["size"] == SHARED_BYTES
        out["resend_refused"] = reply["resend"].startswith(
            "Attempted to send CUDA tensor received from another process"
        )
        if receiver == "stepalloc":
            offset, size = args[9], args[8]
            wanted = [f"{size} bytes at offset {offset + (1 << 40)}", f"{1 << 40} bytes at offset {offset}"]
            out["tampered"] = reply["tampered"]
            out["tampered_refused"] = len(reply["tampered"]) == 2 and all(
                w in e and "shared mapping (" in e for w, e in zip(wanted, reply["tampered"])
            )
        seen = x[:4096].cpu()
        out["producer_sees_write"] = bool((seen == MARK).all())
        back_fn, back_args = reply["back"]
        back = back_fn(*back_args)
        out["back_bytes_equal"] = digest(back) == digest(pattern(torch, SHARED_BYTES, 2))
        del back, back_fn, back_args, reply
        # The block must not be handed out again while the receiver holds it.
        del x, fn, args
        y = torch.empty(SHARED_BYTES, dtype=torch.uint8, device="cuda")
        out["not_reused_while_held"] = y.data_ptr() != ptr
        send(child.stdin, "drop")
        assert receive(child.stdout) == "dropped"
        deadline = time.monotonic() + 10
        reused = False
        while time.monotonic() < deadline and not reused:
            torch.cuda.ipc_collect()
            z = torch.empty(SHARED_BYTES, dtype=torch.uint8, device="cuda")
            reused = z.data_ptr() == ptr
            del z
            if not reused:
                time.sleep(0.05)
        out["reused_after_release"] = reused
        send(child.stdin, "exit")
        child.stdin.close()
        out["receiver_status"] = child.wait(timeout=60)
        del y, pad
    finally:
        if child.poll() is None:
            child.kill()
    return out


def passed(r: dict) -> bool:
    keys = ["receiver_read_bytes", "producer_sees_write", "back_bytes_equal", "not_reused_while_held", "resend_refused"]
    if r["producer"] == "stepalloc":
        keys.append("reused_after_release")
    if r["receiver"] == "stepalloc":
        keys.append("tampered_refused")
    return all(r.get(k) for k in keys) and r.get("receiver_status") == 0


def run_one(pair: str, segment: str) -> dict:
    """One pairing in a fresh producer process (the allocator is chosen once per process)."""
    kind, receiver = pair.split(":")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (python_path(), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, __file__, "--role", "producer", "--kind", kind, "--receiver", receiver, "--segment", segment]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stdout + done.stderr)[-3000:]
        return {"producer": kind, "receiver": receiver, "segment": segment, "error": tail}
    return json.loads(lines[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["all", "producer", "receiver"], default="all")
    ap.add_argument("--kind", choices=["stepalloc", "stock"], default="stepalloc")
    ap.add_argument("--receiver", choices=["stepalloc", "stock"], default="stock")
    ap.add_argument("--segment", choices=["plain", "expandable"], default="plain")
    ap.add_argument("--pairs", default="stepalloc:stock,stock:stepalloc,stepalloc:stepalloc")
    ap.add_argument("--segments", default="plain,expandable")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.role == "receiver":
        receiver_main(a.kind, a.segment)
        return 0
    if a.role == "producer":
        try:
            print(json.dumps(producer(a.kind, a.receiver, a.segment)), flush=True)
        except Exception:  # noqa: BLE001 - reported to the caller, which names the pairing
            traceback.print_exc()
            return 1
        return 0
    runtime = stub_runtime() if os.environ.get("STEPALLOC_HOSTCUDA") == "1" else None
    if runtime is not None and str(runtime) not in os.environ.get("LD_PRELOAD", ""):
        # Over testdrv: again with its stub runtime, which must be loaded before torch is.
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], with_stub(dict(os.environ), runtime))
    try:
        import torch

        usable = torch.cuda.is_available()
    except Exception as e:  # noqa: BLE001 - a broken torch is a reason to skip, said as such
        usable, why = False, f"torch does not import ({e})"
    else:
        why = "torch has no CUDA device here"
    if not usable:
        print(f"RESULT SKIP ipc_check {why}", flush=True)
        return 0
    results = []
    for pair in a.pairs.split(","):
        for segment in a.segments.split(","):
            r = run_one(pair, segment)
            results.append(r)
            name = f"ipc_{r['producer']}_to_{r['receiver']}_{segment}"
            if "error" in r:
                print(f"RESULT FAIL {name} {r['error'][-600:]!r}", flush=True)
                continue
            detail = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("producer", "receiver", "segment"))
            print(f"RESULT {'PASS' if passed(r) else 'FAIL'} {name} {detail}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r and passed(r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
