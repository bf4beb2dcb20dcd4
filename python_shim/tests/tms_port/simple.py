"""Ported from fzyzcjy/torch_memory_saver ``test/examples/simple.py`` at 4a43c97.

Changed: ``torch.full(..., device=...)`` is a host fill copied to the device (testdrv runs no
kernels); GPU memory is read with ``mem_get_info`` (``_util``); the ``time.sleep(1)`` pauses and
the printing of tensors (a kernel in their repr) are dropped. The assertions are the original's.
"""

import logging
import sys

import torch
from torch_memory_saver import torch_memory_saver

from ._util import empty_cache, fill, get_and_print_gpu_memory, get_device


def run(hook_mode: str):
    torch_memory_saver.hook_mode = hook_mode
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)

    device = get_device()

    normal_tensor = fill((1_000_000,), 100, device=device)

    with torch_memory_saver.region():
        pauseable_tensor = fill((1_000_000_000,), 100, device=device)

    original_address = pauseable_tensor.data_ptr()
    print(f"Pauseable tensor virtual address: 0x{original_address:x}")

    mem_before_pause = get_and_print_gpu_memory("Before pause")

    torch_memory_saver.pause()
    mem_after_pause = get_and_print_gpu_memory("After pause")

    assert mem_before_pause - mem_after_pause > 0.9 * 1024 ** 3

    torch_memory_saver.resume()
    mem_after_resume = get_and_print_gpu_memory("After resume")

    assert mem_after_resume - mem_after_pause > 0.9 * 1024 ** 3

    new_address = pauseable_tensor.data_ptr()
    print(f"Pauseable tensor virtual address: 0x{new_address:x}")

    assert original_address == new_address, 'Tensor virtual address should be the same'

    get_and_print_gpu_memory("Before empty cache")
    empty_cache()
    get_and_print_gpu_memory("After empty cache")

    del normal_tensor, pauseable_tensor

    get_and_print_gpu_memory("Before empty cache (tensor deleted)")
    empty_cache()
    get_and_print_gpu_memory("After empty cache (tensor deleted)")
