"""Ported from fzyzcjy/torch_memory_saver ``test/examples/multi_device_torch_mode.py`` at 4a43c97.

Changed: ``torch.full(..., device=...)`` and ``fill_`` are host fills copied to the device
(testdrv runs no kernels); GPU memory is read with ``mem_get_info`` (``_util``); XPU branches
dropped. The assertions are the original's.
"""

import torch
from torch_memory_saver import torch_memory_saver

from ._util import fill, get_and_print_gpu_memory

_ALLOC_BYTES = 256 * 1024 * 1024 * 4  # 256M float32 = 1 GiB
_FREED_GIB = 0.8  # expected drop/restore, with slack for alignment/noise


def run(hook_mode: str):
    assert hook_mode == "torch", "multi-device torch-mode test requires hook_mode='torch'"
    mod = torch.cuda
    assert mod.device_count() >= 2, "needs two devices (HOSTCUDA_DEVICES=2)"

    torch_memory_saver.hook_mode = hook_mode

    def used_gib(d):
        mod.synchronize(d)
        return get_and_print_gpu_memory(f"dev{d}", gpu_id=d) / 1024**3

    d0, d1 = 0, 1

    mod.set_device(d0)
    with torch_memory_saver.region(tag="t"):
        a = fill((_ALLOC_BYTES // 4,), 1.0, dtype=torch.float32, device=f"cuda:{d0}")
    mod.set_device(d1)
    with torch_memory_saver.region(tag="t"):
        b = fill((_ALLOC_BYTES // 4,), 1.0, dtype=torch.float32, device=f"cuda:{d1}")
    alloc0, alloc1 = used_gib(d0), used_gib(d1)

    torch_memory_saver.pause("t")
    pause0, pause1 = used_gib(d0), used_gib(d1)

    torch_memory_saver.resume("t")
    a.copy_(torch.full(a.shape, 2.0))
    b.copy_(torch.full(b.shape, 2.0))
    resume0, resume1 = used_gib(d0), used_gib(d1)

    assert (alloc0 - pause0) > _FREED_GIB, "device 0 not freed on pause"
    assert (alloc1 - pause1) > _FREED_GIB, "device 1 not freed on pause"
    assert (resume0 - pause0) > _FREED_GIB, "device 0 not re-committed on resume"
    assert (resume1 - pause1) > _FREED_GIB, "device 1 not re-committed on resume"
    assert float(a[0]) == 2.0, "device 0 tensor unusable after resume"
    assert float(b[0]) == 2.0, "device 1 tensor unusable after resume"
    print("multi_device_torch_mode OK")
