"""A pause drains every stream before it unmaps, over real PyTorch and testdrv's driver.

A copy queued on a side stream that stepalloc never saw (no allocation there, no
``record_stream``) may still write a tensor of the tag when the pause starts: on a GPU, unmapping
under it faults (vLLM PR #43020: unmapping under running kernels). testdrv's driver queues the
copies' completion ``HOSTCUDA_DELAY_US`` apart and counts every ``cuMemUnmap`` of memory that
unfinished work still uses (``hostcuda_unmaps_under_work``); the pause (without backup, so no
copy of its own waits the delay out) must leave it at 0, under
``install()`` and in MemPool mode (``stepalloc.cumem`` without ``install()``).
"""

from __future__ import annotations

import pytest
from test_sleep import needs_torch, run_torch

DRAIN = """
import ctypes
drv = ctypes.CDLL("libcuda.so.1")
drv.hostcuda_unmaps_under_work.restype = ctypes.c_longlong
if INSTALLED:
    stepalloc.install("backend:cuda")
    region = stepalloc.region("drain_w", backup=False)
else:
    from stepalloc.cumem import CuMemAllocator
    region = CuMemAllocator.get_instance().use_memory_pool("weights")
with region:
    x = torch.zeros(64 * MIB, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
src = torch.full((64 * MIB,), 7, dtype=torch.uint8).pin_memory()
side = torch.cuda.Stream()
drv.hostcuda_set(b"delay_us", b"100000")
with torch.cuda.stream(side):
    # Each piece of work completes 0.1 s after the one before it on its stream: the side stream
    # is busy 0.4 s, longer than an event recorded now on an idle stream takes (0.1 s).
    for _ in range(4):
        x.copy_(src, non_blocking=True)
if INSTALLED:
    stepalloc.pause("drain_w")
    stepalloc.resume("drain_w")
else:
    allocator = CuMemAllocator.get_instance()
    allocator.sleep(offload_tags=())
    allocator.wake_up()
say("under_work=%d" % drv.hostcuda_unmaps_under_work())
x.copy_(src)
say("usable=%d" % int(bool((x.cpu() == 7).all())))
"""


@needs_torch
@pytest.mark.parametrize("installed", [True, False], ids=["installed", "mempool"])
def test_a_pause_waits_for_a_side_streams_work_before_it_unmaps(installed: bool) -> None:
    out = run_torch(f"INSTALLED = {installed}\n" + DRAIN)
    assert out["under_work"] == "0", f"the pause unmapped memory a side stream's copy still used: {out}"
    assert out["usable"] == "1", out
