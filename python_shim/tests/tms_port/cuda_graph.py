"""Ported from fzyzcjy/torch_memory_saver ``test/examples/cuda_graph.py`` at 4a43c97.

Changed: testdrv runs no kernels but its graphs replay the copies captured into them, so the
graph is made of copies. ``KVCache.execute`` allocates the big intermediate in the graph's pool
as the original does (there ``torch.ones(...) * ans``), copies the input and one element of each
KV row (the rows are uniform, as in the original) into its head, and returns a clone of that head;
the original's arithmetic (``(arg + kv.mean(dim=1)).mean()``) is then made on the host from the
graph's output, and compared with the original's values (101, then 202 after resume). Sizes are a
quarter of the original's (KV cache 500 MB, intermediate 1 GB, the other big tensor 625 MB) to fit
testdrv's 4 GiB device, and so are the released-memory thresholds (100 MB, 750 MB); memory is
read with ``mem_get_info`` (``_util``). Fills (``torch.full`` on the device, ``x[...] = v``) are
host tensors copied to the device; the ``time.sleep`` pauses and the printing of device tensors
(a kernel in their repr) are dropped. Every assertion is the original's.
"""

import logging
import sys
from typing import Callable

import torch
from torch_memory_saver import torch_memory_saver

from ._util import fill, get_and_print_gpu_memory

SCALE = 4  # sizes and thresholds are the original's divided by this
dummy_tensor_size = (5, 100_000_000 // SCALE)
cuda_graph_intermediate_tensor_size = (1_000_000_000 // SCALE,)


def _ptr(x):
    assert isinstance(x, torch.Tensor)
    return hex(x.data_ptr())


def _value(out: torch.Tensor) -> float:
    """The original's ``(arg + kv_buffer.mean(dim=1)).mean()`` from the graph's copies."""
    host = out.cpu()
    return float((host[:5] + host[5:10]).mean())


class KVCache:
    def __init__(self):
        self.create_buffers(1)

    def create_buffers(self, value):
        with torch_memory_saver.region(tag="kv_cache"):
            # or model weights, etc
            self.kv_buffer = fill(dummy_tensor_size, value, dtype=torch.float32, device="cuda")
        print(f"create_buffers {_ptr(self.kv_buffer)=}")

    def clear_buffers(self):
        del self.kv_buffer

    def execute(self, arg: torch.Tensor) -> torch.Tensor:
        big_intermediate_tensor = torch.empty(cuda_graph_intermediate_tensor_size, dtype=torch.float32, device="cuda")
        big_intermediate_tensor[:5].copy_(arg)
        for row in range(dummy_tensor_size[0]):
            big_intermediate_tensor[5 + row : 6 + row].copy_(self.kv_buffer[row, :1])
        return big_intermediate_tensor[:10].clone()


def create_cuda_graph(fn: Callable, hook_mode):
    # warmup
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        print("with torch.cuda.stream(s) execute fn")
        fn()
    torch.cuda.current_stream().wait_stream(s)

    # capture
    g = torch.cuda.CUDAGraph()
    ctx = torch_memory_saver.cuda_graph(g, tag="graph") if hook_mode == "preload" else torch.cuda.graph(g)
    with ctx:
        print("with torch.cuda.graph(g) execute fn")
        fn()

    return g


def run(hook_mode: str):
    torch_memory_saver.hook_mode = hook_mode
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)

    cache = KVCache()
    static_input = torch.zeros((5,), dtype=torch.float32, device="cuda")
    static_output = torch.zeros((10,), dtype=torch.float32, device="cuda")
    print(f"{_ptr(static_input)=} {_ptr(static_output)=}")

    def fn():
        nonlocal static_output
        static_output = cache.execute(static_input)

    g = create_cuda_graph(fn, hook_mode=hook_mode)

    print("replay #1")
    static_input.copy_(torch.full((5,), 100.0))
    g.replay()
    print(f"{_value(static_output)=}")
    assert _value(static_output) == 101, f"{_value(static_output)=}"

    print("torch.cuda.empty_cache()")
    torch.cuda.empty_cache()

    mem_before_pause = get_and_print_gpu_memory("Before pause")

    print('call memory_saver.pause("kv_cache")')
    torch_memory_saver.pause("kv_cache")

    mem_after_pause_kv_cache = get_and_print_gpu_memory("After pause kv_cache")
    assert mem_before_pause - mem_after_pause_kv_cache > 400_000_000 // SCALE

    if hook_mode == "preload":
        print('call memory_saver.pause("graph")')
        torch_memory_saver.pause("graph")

        mem_after_pause_graph = get_and_print_gpu_memory("After pause graph")
        assert mem_after_pause_kv_cache - mem_after_pause_graph > 3_000_000_000 // SCALE

    print("when kv cache is released, we can allocate *other* big tensors")
    other_big_tensor = torch.zeros((2500_000_000 // SCALE,), dtype=torch.uint8, device="cuda")
    print(f"{other_big_tensor.shape=}")
    del other_big_tensor
    torch.cuda.empty_cache()

    if hook_mode == "preload":
        print('call memory_saver.resume("graph")')
        torch_memory_saver.resume("graph")
    print('call memory_saver.resume("kv_cache")')
    torch_memory_saver.resume("kv_cache")

    dummy = torch.zeros((3,), device="cuda")
    print(f"{_ptr(dummy)=}")

    cache.kv_buffer.copy_(torch.full(dummy_tensor_size, 2.0))

    print("replay #2")
    static_input.copy_(torch.full((5,), 200.0))
    g.replay()
    print(f"{_value(static_output)=}")
    assert _value(static_output) == 202, f"{_value(static_output)=}"

    print(f"{dummy.cpu()=}")
