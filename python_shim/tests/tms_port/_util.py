"""Stands in for ``torch_memory_saver.testing_utils`` in the ported examples.

From: fzyzcjy/torch_memory_saver ``torch_memory_saver/testing_utils.py`` at 4a43c97 (the tree
the 0.0.10 wheel was built from). Changed: CUDA only (no XPU/ROCm branches); device memory in use
is read with ``torch.cuda.mem_get_info`` (the original reads NVML's ``device_memory_used``,
which testdrv does not provide); ``fill`` is a host fill copied to the device (kernels do not
run on testdrv), the stand-in for ``torch.full(..., device=...)``.
"""

import torch


def get_device() -> str:
    return "cuda"


def empty_cache() -> None:
    torch.cuda.empty_cache()


def get_and_print_gpu_memory(message, gpu_id=0):
    torch.cuda.synchronize(gpu_id)
    free, total = torch.cuda.mem_get_info(gpu_id)
    mem = total - free
    print(f"GPU {gpu_id} memory: {mem / 1024 ** 3:.2f} GB ({message})")
    return mem


def fill(shape, value, dtype=torch.uint8, device="cuda"):
    """``torch.full(shape, value, dtype=dtype, device=device)`` without a kernel."""
    return torch.full(shape, value, dtype=dtype).to(device)


def randn(shape, dtype=torch.float32, device="cuda"):
    """``torch.randn(shape, dtype=dtype, device=device)`` without a kernel."""
    return torch.randn(shape, dtype=dtype).to(device)
