"""Ported from fzyzcjy/torch_memory_saver ``test/examples/training_engine.py`` at 4a43c97.

Changed: testdrv runs no kernels, so the forward pass's arithmetic (``w.float().mean()``, the
activations ``ones * avg`` and their mean) is made on the host from copies of the weights, and
its activations are device tensors filled by host copies of the same size as the original's;
``torch.full`` on the device is a host fill copied there, ``x += 1`` and the checks' ``max`` /
``min`` / ``mean`` are made on the host; the cache-eviction tensors, whose bytes are never read,
are ``torch.zeros`` (a memset) instead of a fill of 42. In the disabled region the original's
uint8 tensor and its ``float()`` copy (5 GiB) are the uint8 tensor and a float32 copy made on the
host and copied to the device. Sizes: the gibibyte-scale tensors are an eighth of the original's
(the 1 GiB weight 128 MiB, the 4 GiB activations 512 MiB) to fit testdrv's 4 GiB device, and so
are the thresholds that are made of them (5 GiB and 4 GiB become 640 and 512 MiB); the margins
for overheads (200, 10, 50 and 1 MiB) and the fractions of the device (0.3, 0.6) are the
original's. GPU memory is read with ``mem_get_info`` (``_util``). Every assertion is the
original's.
"""

import logging
import os
import sys
from functools import reduce

import torch
from torch_memory_saver import torch_memory_saver

from ._util import fill, get_and_print_gpu_memory

SCALE = 8  # the gibibyte-scale sizes and thresholds are the original's divided by this
GIB = 1024**3


def run(hook_mode: str):
    assert os.environ["TMS_INIT_ENABLE"] == "1"
    assert os.environ["TMS_INIT_ENABLE_CPU_BACKUP"] == "1"
    assert hook_mode == "preload"

    torch_memory_saver.hook_mode = hook_mode
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)

    initial_tensor = fill((1_000_000,), 42, dtype=torch.uint8, device="cuda")
    mem_initial = get_and_print_gpu_memory("Init")

    model_weights = [
        fill((size,), 42, dtype=torch.uint8, device="cuda") for size in [GIB // SCALE, 1024**2, 1024**1, 42]
    ]

    _execute_forward_pass_and_assert(model_weights)
    mem_after_forward_pass = get_and_print_gpu_memory("After forward pass")
    assert mem_after_forward_pass > mem_initial + 5 * GIB // SCALE

    torch_memory_saver.pause()
    mem_after_pause = get_and_print_gpu_memory("After pause")
    assert mem_after_pause < mem_initial + 200 * 1024**2

    with torch_memory_saver.disable():
        mem_after_disable = get_and_print_gpu_memory("After disable")
        assert mem_after_disable == mem_after_pause

        # Can still execute code in disabled region
        tensor_in_disabled_region = fill((GIB // SCALE,), 53, dtype=torch.uint8, device="cuda")
        as_float = tensor_in_disabled_region.cpu().float().to("cuda")  # the original's .float()
        out = as_float.cpu().mean().item()
        assert out == 53, f"{out=}"

        mem_after_exec_in_disable = get_and_print_gpu_memory("After exec in disable")
        assert mem_after_exec_in_disable > mem_after_disable + 4 * GIB // SCALE

        del tensor_in_disabled_region, as_float

    # should do cleanup
    mem_after_exit_disable = get_and_print_gpu_memory("After exiting disable")
    assert mem_after_exit_disable <= mem_after_pause + 10 * 1024**2

    torch_memory_saver.resume()
    mem_after_resume = get_and_print_gpu_memory("After resume")
    delta_expect = mem_after_forward_pass - mem_after_pause
    delta_actual = mem_after_resume - mem_after_exit_disable
    assert delta_expect - 50 * 1024**2 < delta_actual < delta_expect + 50 * 1024**2

    _execute_forward_pass_and_assert(model_weights)
    mem_after_second_forward_pass = get_and_print_gpu_memory("After second forward pass")
    assert mem_after_resume - 1024**2 < mem_after_second_forward_pass < mem_after_resume + 1024**2

    # simulate cache eviction
    _, total_mem = torch.cuda.mem_get_info()
    print(f"Total memory: {total_mem / 1e9}GB")
    a = torch.zeros((int(total_mem * 0.3),), dtype=torch.uint8, device="cuda")
    get_and_print_gpu_memory("[cache-eviction-test] after alloc a")
    b = torch.zeros((int(total_mem * 0.3),), dtype=torch.uint8, device="cuda")
    get_and_print_gpu_memory("[cache-eviction-test] after alloc b")
    del a, b
    get_and_print_gpu_memory("[cache-eviction-test] after del a,b")
    c = torch.zeros((int(total_mem * 0.6),), dtype=torch.uint8, device="cuda")
    get_and_print_gpu_memory("[cache-eviction-test] after alloc c")
    initial_tensor.copy_(initial_tensor.cpu() + 1)
    host = initial_tensor.cpu()
    assert (host.max() == 43) and (host.min() == 43)
    get_and_print_gpu_memory("[cache-eviction-test] after using other tensors")

    del initial_tensor, c


def _execute_forward_pass_and_assert(weights: list[torch.Tensor]):
    # simulate large activations during forward pass (device tensors of the original's count/8)
    n = GIB // SCALE
    ones = fill((n,), 1.0, dtype=torch.float32, device="cuda")
    sum_avg_weights = reduce(lambda a, b: (a + b) / 2, [w.cpu().float().mean() for w in weights])
    outs = torch.empty_like(ones)
    outs.copy_(ones.cpu() * sum_avg_weights)
    out = outs.cpu().mean().item()
    assert out == 42, f"{out=}"
