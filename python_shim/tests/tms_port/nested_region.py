"""Ported from fzyzcjy/torch_memory_saver ``test/examples/nested_region.py`` at 4a43c97.

Changed: the reads of torch_memory_saver's library state (``_impl._binary_wrapper.cdll``:
current tag, backup flag, backend) are left out (internals of the original); ``torch.full`` on
the device is a host fill copied there, and ``sum()`` / ``fill_`` are made on the host (testdrv
runs no kernels); GPU memory is read with ``mem_get_info``. The pause/resume assertions are the
original's.
"""

import logging
import os
import sys

import torch
from torch_memory_saver import torch_memory_saver

from ._util import fill, get_and_print_gpu_memory


def run(hook_mode: str):
    assert os.environ["TMS_INIT_ENABLE"] == "1"
    assert os.environ["TMS_INIT_ENABLE_CPU_BACKUP"] == "1"
    assert hook_mode == "preload"

    torch_memory_saver.hook_mode = hook_mode
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)

    SIZE = 10_000_000  # ~40MB in float32

    torch_memory_saver._ensure_initialized()

    # --- Allocate model weights (default tag, cpu_backup=True) ---
    model_weight = fill((SIZE,), 42.0, dtype=torch.float32, device="cuda")

    # --- Allocate grad buffer inside nested region (cpu_backup=False) ---
    with torch_memory_saver.region(tag="grad_buffer", enable_cpu_backup=False):
        grad_buffer = fill((SIZE,), 99.0, dtype=torch.float32, device="cuda")

    with torch_memory_saver.region(enable_cpu_backup=True, cpu_backup_backend="mmap"):
        _ = fill((1024,), 1, dtype=torch.uint8, device="cuda")

    mem_before_pause = get_and_print_gpu_memory("Before pause")

    # --- Pause all ---
    torch_memory_saver.pause()
    mem_after_pause = get_and_print_gpu_memory("After pause")

    assert mem_after_pause < mem_before_pause - SIZE * 4 * 0.5, (
        f"Expected significant memory reduction after pause, "
        f"before={mem_before_pause}, after={mem_after_pause}"
    )

    # --- Resume all ---
    torch_memory_saver.resume()
    get_and_print_gpu_memory("After resume")

    assert model_weight.cpu().sum().item() == 42.0 * SIZE, (
        f"Model weight should be preserved after resume, got sum={model_weight.cpu().sum().item()}"
    )

    grad_buffer.copy_(torch.zeros(SIZE, dtype=torch.float32))
    assert grad_buffer.cpu().sum().item() == 0.0

    extra_tensor = fill((SIZE,), 7.0, dtype=torch.float32, device="cuda")

    torch_memory_saver.pause()
    torch_memory_saver.resume()

    assert extra_tensor.cpu().sum().item() == 7.0 * SIZE, (
        f"Extra tensor (default tag) should be preserved, got sum={extra_tensor.cpu().sum().item()}"
    )
    print("nested region OK")
