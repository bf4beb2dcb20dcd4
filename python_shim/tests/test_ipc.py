"""CUDA IPC under process-wide stepalloc, with real PyTorch in two processes over testdrv.

``gpu/ipc_check.py`` (also a GPU-kit step) runs a producer and a receiver, each stock PyTorch
or stepalloc, in plain and expandable segments: the receiver reads the producer's bytes, a
write by the receiver is seen by the producer, the producer's block is not handed out again
until the receiver dropped it (and is once it did and ``torch.cuda.ipc_collect()`` ran), a
tensor goes back the other way, and a received tensor cannot be passed on. The tests here run
each pairing and check what it saw; the single-process tests check the format stepalloc sends
(read back through PyTorch's own counter code) and that the patches stay out of PyTorch's way
when stepalloc is not PyTorch's allocator.

Skipped when the stubs are not built (``testdrv/build.sh``) or torch is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import check_child, run_python, torch_available

ROOT = Path(__file__).resolve().parents[2]
HOSTCUDA = ROOT / "target" / "hostcuda"
RUNTIME = HOSTCUDA / "runtime"
STUB_RUNTIME = RUNTIME / "libcudart.so.13"
CHECK = ROOT / "gpu" / "ipc_check.py"

pytestmark = pytest.mark.skipif(
    not STUB_RUNTIME.exists() or not torch_available(),
    reason="needs torch and testdrv's stubs (testdrv/build.sh)",
)


def torch_env() -> dict[str, str]:
    """Real torch over the stub runtime (as test_real_torch.py runs it)."""
    library_path = [str(RUNTIME), str(HOSTCUDA), str(HOSTCUDA / "standins"), os.environ.get("LD_LIBRARY_PATH", "")]
    return {
        "LD_PRELOAD": str(STUB_RUNTIME),
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in library_path if p),
        "HOSTCUDA_DEVICES": "2",
        "HOSTCUDA_CAPACITY_MB": "1024",
        "HOSTCUDA_DELAY_US": "0",
        "PYTORCH_CUDA_ALLOC_CONF": "",
    }


@pytest.mark.parametrize("segment", ["plain", "expandable"])
@pytest.mark.parametrize("pair", ["stepalloc:stock", "stock:stepalloc", "stepalloc:stepalloc"])
def test_a_tensor_crosses_processes_and_comes_back(pair: str, segment: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "STEPALLOC_CONF"}
    env.update(torch_env())
    out = tmp_path / "ipc.json"
    done = subprocess.run(
        [sys.executable, str(CHECK), "--pairs", pair, "--segments", segment, "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.exists(), done.stdout + done.stderr
    (r,) = json.loads(out.read_text())
    assert "error" not in r, r.get("error")
    producer, receiver = pair.split(":")
    expected_kind = "c" if segment == "plain" else "e"
    assert r["handle_kind"] == expected_kind, r
    assert r["receiver_read_bytes"], f"the {receiver} receiver did not read the {producer} producer's bytes: {r}"
    assert r["producer_sees_write"], f"the receiver's write did not reach the producer: {r}"
    assert r["back_bytes_equal"], f"the tensor sent back did not arrive intact: {r}"
    assert r["not_reused_while_held"], f"the producer handed the shared block out while it was held: {r}"
    assert r["resend_refused"], r
    if receiver == "stepalloc":
        assert r["tampered_refused"], f"a storage outside the shared mapping was not refused: {r['tampered']}"
    if producer == "stepalloc":
        assert r["reused_after_release"], f"the block never came back after the receiver dropped it: {r}"
    assert r["receiver_status"] == 0, r
    assert done.returncode == 0, done.stdout + done.stderr


def run_torch(code: str) -> str:
    prelude = "import os, torch, stepalloc\nfrom torch.multiprocessing.reductions import reduce_tensor\nMIB = 1 << 20\n"
    return check_child(run_python(prelude + code, env=torch_env(), timeout=180))


def test_what_stepalloc_sends_is_pytorchs_format() -> None:
    out = run_torch(
        """
stepalloc.install("backend:cuda,expandable_segments:False", patch_torch=True)
import stepalloc.ipc as ipc
pad = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")  # x lies after it, in one segment
x = torch.zeros(3 * MIB, dtype=torch.uint8).cuda()
fn, args = reduce_tensor(x[100:])
device, handle, size, offset, counter, slot, event, sync = args[6:8] + args[8:10] + args[11:15]
assert fn.__name__ == "rebuild_cuda_tensor" and args[3] == 100, (fn, args[3])
assert handle[:2] == b"\\x03c" and len(handle) == 66, handle[:2]
assert size == 3 * MIB and offset == x.data_ptr() - pad.data_ptr() == 2 * MIB, (size, offset)
assert len(event) == 64 and sync is True
path = "/dev/shm" + counter.decode()
assert os.path.getsize(path) == 64 + 8 * 10000
assert ipc.held() == 1
del x, fn, args
torch.cuda.ipc_collect()
assert ipc.held() == 1, "held while the receiver's counter is up"
# What a receiver does when it drops the storage: PyTorch's own counter code.
torch.UntypedStorage._release_ipc_counter_cuda(counter, slot)
torch.cuda.ipc_collect()
print("held_after=" + str(ipc.held()))
print("allocated_after=" + str(stepalloc.memory_stats(0)["allocated_bytes.all.current"]))
"""
    )
    assert "held_after=0" in out, out
    assert f"allocated_after={2 << 20}" in out, out


def test_sharing_names_what_it_cannot_share() -> None:
    # A pointer stepalloc never allocated (from a storage wrapping foreign memory) gets a clear
    # error rather than PyTorch's "does not yet support shareIPcHandle".
    out = run_torch(
        """
stepalloc.install("backend:cuda", patch_torch=True)
import stepalloc.ipc as ipc
x = torch.zeros(4096, dtype=torch.uint8).cuda()
class Foreign:
    __cuda_array_interface__ = {"shape": (512,), "typestr": "|u1", "data": (x.data_ptr() + 512, False), "version": 2}
view = torch.as_tensor(Foreign(), device="cuda")
try:
    reduce_tensor(view)
except RuntimeError as e:
    print("error=" + str(e))
"""
    )
    assert "error=stepalloc cannot share this CUDA tensor with another process" in out, out
    assert "not a live stepalloc allocation" in out, out


def test_the_patches_leave_pytorchs_own_sharing_alone() -> None:
    # patch_torch() without install(): PyTorch's allocator shares its own memory; unpatching
    # restores the C methods.
    out = run_torch(
        """
original = torch.UntypedStorage._share_cuda_
stepalloc.patch_torch()
assert torch.UntypedStorage._share_cuda_ is not original
x = torch.zeros(4096, dtype=torch.uint8).cuda()
fn, args = reduce_tensor(x)
print("kind=" + chr(args[7][1]) + " counter=" + args[11].decode()[:7])
stepalloc.unpatch_torch()
print("restored=" + str(torch.UntypedStorage._share_cuda_ == original))
print("collect_restored=" + str(torch.cuda.ipc_collect.__module__))
"""
    )
    assert "kind=c counter=/torch_" in out, out
    assert "restored=True" in out, out
    assert "collect_restored=torch.cuda" in out, out


def test_handles_are_written_in_the_installed_torchs_version() -> None:
    """torch before 2.13 refuses version 3 ("a future version of torch"): what a producer sends
    is rewritten to version 2 there, with the same payload ('c') or header less the handle type
    ('e'), which src/ipc.rs reads back as the same memory (reads_version_2_handles)."""
    import stepalloc.ipc as ipc

    assert [ipc.torch_handle_version(v) for v in ("2.11.0+cu130", "2.12.1", "2.13.0", "2.15.0", "3.0", "x")] == [
        2,
        2,
        3,
        3,
        3,
        3,
    ]
    # The library writes the version it is asked for (src/ipc.rs: encodes_each_version_exactly
    # has the bytes); the same tensor shared again gives the same handle.
    for segments in ("False", "True"):
        out = run_torch(
            f"""
stepalloc.install("backend:cuda,expandable_segments:{segments},large_segment_size_mb:2", patch_torch=True)
x = torch.zeros(3 * MIB, dtype=torch.uint8).cuda()
h3 = reduce_tensor(x)[1][7]
again = reduce_tensor(x)[1][7]
torch.__version__ = "2.12.1"
h2 = reduce_tensor(x)[1][7]
rest = (h3[2:], h2[2:]) if h3[1:2] == b"c" else (h3[2:26] + h3[34:], h2[2:])
print("versions=%d,%d same_again=%s same_payload=%s" % (h3[0], h2[0], h3 == again, rest[0] == rest[1]))
"""
        )
        assert "versions=3,2 same_again=True same_payload=True" in out, (segments, out)
