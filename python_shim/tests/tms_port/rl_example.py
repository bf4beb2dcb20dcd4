"""Ported from fzyzcjy/torch_memory_saver ``test/examples/rl_example.py`` at 4a43c97.

Changed: testdrv runs no kernels but its graphs replay the copies captured into them, so the
graph is made of copies. ``KVCache.execute`` copies the input and one element of each KV row into
a buffer of the graph's pool; ``Model.forward`` copies the input and the weight's first and last
rows (every row is equal in this example: all ones, then all twos) into another; the original's
arithmetic (``(arg + kv.mean(dim=1)).mean() + linear(x).mean()``) is made on the host from the
graph's outputs and compared with the original's values (2048101, then 8192202 after resume).
The weights are made without PyTorch's init kernels (``torch.nn.utils.skip_init``) and set to
ones by a host copy; fills (``torch.full`` on the device, ``x[...] = v``) are host tensors copied
to the device. The KV cache is half the original's (1 GB) so that it and the 1.68 GB weights fit
testdrv's 4 GiB device; the model's sizes (and so the expected values) are the original's.
The ``time.sleep`` pauses and the long tutorial docstrings are dropped. Added: the selective
pause's access of the weights reads the element (``.item()``, a copy) and checks it, where the
original's ``weight[0, 0]`` makes a view and reads nothing. Every other assertion is the
original's.
"""

import logging
import sys
from typing import Callable

import torch
from torch_memory_saver import torch_memory_saver

from ._util import fill, get_and_print_gpu_memory

dummy_tensor_size = (5, 100_000_000 // 2)


def _ptr(x):
    assert isinstance(x, torch.Tensor)
    return hex(x.data_ptr())


class Model:
    def __init__(self, input_size=20_480, output_size=20_480):
        self.input_size = input_size
        self.output_size = output_size
        self.create_weights()

    def create_weights(self):
        with torch_memory_saver.region(tag="model_weights"):
            # Size: 20480 * 20480 * 4 bytes ≈ 1.6GB
            self.linear = torch.nn.utils.skip_init(
                torch.nn.Linear, self.input_size, self.output_size, bias=False, device="cuda"
            )
            with torch.no_grad():
                self.linear.weight.copy_(torch.ones(1, self.input_size).expand(self.output_size, -1))

        print(f"Model weights created: {_ptr(self.linear.weight)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((3, self.input_size), dtype=torch.float32, device="cuda")
        out[0].copy_(x)
        out[1].copy_(self.linear.weight[0])
        out[2].copy_(self.linear.weight[-1])
        return out

    def clear_weights(self):
        del self.linear


def _model_value(out: torch.Tensor) -> float:
    """``linear(x).mean()`` over the copied rows (all rows are equal here)."""
    host = out.cpu().double()
    return float(((host[1] * host[0]).sum() + (host[2] * host[0]).sum()) / 2)


class KVCache:
    def __init__(self):
        self.create_buffers(1)

    def create_buffers(self, value):
        with torch_memory_saver.region(tag="kv_cache"):
            self.kv_buffer = fill(dummy_tensor_size, value, dtype=torch.float32, device="cuda")
        print(f"KV cache created: {_ptr(self.kv_buffer)}")

    def clear_buffers(self):
        del self.kv_buffer

    def execute(self, arg: torch.Tensor) -> torch.Tensor:
        out = torch.empty((10,), dtype=torch.float32, device="cuda")
        out[:5].copy_(arg)
        for row in range(dummy_tensor_size[0]):
            out[5 + row : 6 + row].copy_(self.kv_buffer[row, :1])
        return out


def _kv_value(out: torch.Tensor) -> float:
    """``(arg + kv_buffer.mean(dim=1)).mean()`` from the copies (KV rows are uniform)."""
    host = out.cpu().double()
    return float((host[:5] + host[5:10]).mean())


def create_cuda_graph(fn: Callable):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()

    return g


def run(hook_mode: str):
    torch_memory_saver.hook_mode = hook_mode
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)

    cache = KVCache()
    model = Model()
    original_kv_cache_ptr = _ptr(cache.kv_buffer)
    original_model_weights_ptr = _ptr(model.linear.weight)
    print(f"Original addresses - KV cache: {original_kv_cache_ptr}, Model weights: {original_model_weights_ptr}")

    static_input = torch.zeros((20_480,), dtype=torch.float32, device="cuda")
    outputs = {}

    def fn():
        outputs["kv"] = cache.execute(static_input[:5])
        outputs["model"] = model.forward(static_input)

    def static_output() -> float:
        return _kv_value(outputs["kv"]) + _model_value(outputs["model"])

    g = create_cuda_graph(fn)

    static_input.copy_(torch.full((20_480,), 100.0))
    g.replay()
    print(f"First execution result: {static_output()}")
    if static_output() != 2048101:
        raise ValueError(f"Expected 2048101, got {static_output()}")
    print("CUDA graph first execution passed")

    print("\n=== Pausing memory regions ===")
    get_and_print_gpu_memory("model_weights: allocated, kv_cache: allocated")
    torch_memory_saver.pause("kv_cache")
    get_and_print_gpu_memory("model_weights: allocated, kv_cache: released")
    torch_memory_saver.pause("model_weights")
    get_and_print_gpu_memory("model_weights: released, kv_cache: released")

    print("\n=== Resuming memory regions ===")
    torch_memory_saver.resume("model_weights")
    get_and_print_gpu_memory("model_weights: resumed, kv_cache: released")
    torch_memory_saver.resume("kv_cache")
    get_and_print_gpu_memory("model_weights: resumed, kv_cache: resumed")

    print("\n=== Virtual Address Verification ===")
    kv_cache_ptr_after_resume = _ptr(cache.kv_buffer)
    model_weights_ptr_after_resume = _ptr(model.linear.weight)

    kv_address_unchanged = kv_cache_ptr_after_resume == original_kv_cache_ptr
    model_address_unchanged = model_weights_ptr_after_resume == original_model_weights_ptr

    print(f"KV cache address unchanged: {kv_address_unchanged}")
    print(f"Model weights address unchanged: {model_address_unchanged}")

    assert kv_address_unchanged, "KV cache virtual address changed"
    assert model_address_unchanged, "Model weights virtual address changed"

    print("\n=== Testing functionality after resume ===")
    cache.kv_buffer.copy_(torch.full(dummy_tensor_size, 2.0))
    with torch.no_grad():
        model.linear.weight.copy_(torch.full((1, model.input_size), 2.0).expand(model.output_size, -1))

    static_input.copy_(torch.full((20_480,), 200.0))
    g.replay()
    print(f"Second execution result: {static_output()}")
    if static_output() != 8192202:
        raise ValueError(f"Expected 8192202, got {static_output()}")
    print("CUDA graph second execution passed")

    print("\n=== Testing selective pause/resume ===")
    torch_memory_saver.pause("kv_cache")
    get_and_print_gpu_memory("model_weights: resumed, kv_cache: released")

    _ = model.linear.weight[0, 0]
    assert model.linear.weight[0, 0].item() == 2
    print("Model weights access successful")

    torch_memory_saver.resume("kv_cache")
    get_and_print_gpu_memory("model_weights: resumed, kv_cache: resumed")

    print("Selective pause/resume test passed")
