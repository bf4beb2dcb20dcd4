"""stepalloc.cumem's own behaviours beyond vLLM's test files (test_cumem_port.py runs those), over
real PyTorch and testdrv's driver.

- ``use_memory_pool`` turns PyTorch's expandable segments off inside and restores every setting.
- Memory freed while asleep (MemPool mode, no ``install()``): a tensor freed while its tag
  sleeps is not mapped again by the wake, and once every tensor is freed ``empty_cache()``
  gives its memory back, cycle after cycle (the growth-over-cycles family of vLLM #21336).
"""

from __future__ import annotations

import textwrap

from test_sleep import PRELUDE, needs_torch, run_torch, torch_env

from conftest import check_child, run_python

FREED_WHILE_ASLEEP = """
import gc
from stepalloc.cumem import CuMemAllocator
def used():
    free, total = torch.cuda.mem_get_info()
    return total - free
anchor = torch.empty(1, device="cuda")  # PyTorch's own first segment stays in the baseline
base = used()
allocator = CuMemAllocator.get_instance()
for cycle in range(3):
    with allocator.use_memory_pool("weights"):
        w = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (60 * MIB, 40 * MIB, 20 * MIB)]
    with allocator.use_memory_pool("kv_cache"):
        kv = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (100 * MIB, 60 * MIB, 40 * MIB)]
    allocator.sleep(offload_tags=("weights",))
    del w[0], kv[0]  # freed while asleep
    gc.collect()
    allocator.wake_up()
    live = sum(t.nbytes for t in w + kv)
    say(f"cycle{cycle}_awake_mib={(used() - base) // MIB}")
    say(f"cycle{cycle}_live_mib={live // MIB}")
    del w, kv
    gc.collect()
    torch.cuda.empty_cache()
    say(f"cycle{cycle}_after_empty_cache_mib={(used() - base) // MIB}")
"""


@needs_torch
def test_memory_freed_while_asleep_is_not_mapped_again_and_empty_cache_returns_it() -> None:
    out = run_torch(FREED_WHILE_ASLEEP)
    for cycle in range(3):
        awake, live = int(out[f"cycle{cycle}_awake_mib"]), int(out[f"cycle{cycle}_live_mib"])
        # Sizes in whole 20 MiB pages (stepalloc's pages of a tag's large blocks): what is
        # mapped is exactly what is live.
        assert awake == live, f"cycle {cycle}: {awake} MiB mapped after wake_up, {live} MiB live: {out}"
        assert out[f"cycle{cycle}_after_empty_cache_mib"] == "0", f"cycle {cycle}: {out}"


EXPANDABLE = """
from stepalloc.cumem import CuMemAllocator
get = torch._C._accelerator_getAllocatorSettings
torch.empty(1, device="cuda")
before = get()
allocator = CuMemAllocator.get_instance()
with allocator.use_memory_pool("weights"):
    inside = get()
    w = torch.ones(8 * MIB, dtype=torch.uint8).to("cuda")
say("before=" + before)
say("inside=" + inside)
say("after=" + get())
say("tagged=%d" % len(allocator.pointer_to_data))
"""


@needs_torch
def test_use_memory_pool_turns_expandable_segments_off_inside_and_keeps_every_other_setting() -> None:
    """As vLLM's: a pool of a pluggable allocator does not mix with expandable segments
    (pytorch #147851); the whole settings string is rewritten, since PyTorch resets every option
    it leaves out, and restored after."""
    env = torch_env()
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True,max_split_size_mb:256"
    text = check_child(run_python(PRELUDE + textwrap.dedent(EXPANDABLE), env=env, timeout=240))
    out = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    assert out["before"] == "expandable_segments:True,max_split_size_mb:256", out
    assert out["inside"] == "expandable_segments:False,max_split_size_mb:256", out
    assert out["after"] == out["before"], out
    assert out["tagged"] == "1", out
