"""Ported from fzyzcjy/torch_memory_saver ``test/examples/multi_device.py`` at 4a43c97.

Changed: ``torch.full(..., device=...)`` is a host fill copied to the device (testdrv runs no
kernels); GPU memory is read with ``mem_get_info`` (``_util``). The assertions are the original's.
"""

import logging
import sys

import torch
from torch_memory_saver import torch_memory_saver

from ._util import fill, get_and_print_gpu_memory, get_device


def run(hook_mode: str):
    torch_memory_saver.hook_mode = hook_mode
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)

    device = get_device()
    set_device = torch.cuda.set_device

    checker = _MemoryChecker()

    set_device(1)

    with torch_memory_saver.region():
        dev0_a = fill((100_000_000,), 10, device=f'{device}:0')

    checker.check_and_update("alloc dev0_a", min_delta=(80_000_000, 0))

    with torch_memory_saver.region():
        dev1_a = fill((100_000_000,), 10, device=device)

    checker.check_and_update("alloc dev1_a", min_delta=(0, 80_000_000))

    with torch_memory_saver.region():
        dev1_b = fill((100_000_000,), 10, device=f'{device}:1')

    checker.check_and_update("alloc dev1_b", min_delta=(0, 80_000_000))

    torch_memory_saver.pause()
    torch_memory_saver.resume()

    checker.check_and_update("End", min_delta=(0, 0))
    del dev0_a, dev1_a, dev1_b


class _MemoryChecker:
    def __init__(self):
        self._prev = self._get("Initial")

    def _get(self, message: str):
        return (
            get_and_print_gpu_memory(message, gpu_id=0),
            get_and_print_gpu_memory(message, gpu_id=1),
        )

    def check_and_update(self, message: str, min_delta):
        curr = self._get(message)
        assert all(
            (curr_i - prev_i) >= min_delta_i
            for curr_i, prev_i, min_delta_i in zip(curr, self._prev, min_delta, strict=True)
        ), (message, curr, self._prev)
        self._prev = curr
