"""The test bodies of test_cumem_port.py (its docstring says where they come from and what
changed), run in a child interpreter with ``CuMemAllocator``, ``IMPL`` and ``MODE`` set by the
runner. Layer: tests; imports nothing of the test harness (vLLM's environment has no pytest).
"""

from __future__ import annotations

DEVICE = "cuda"
MIB = 1 << 20
# Set in the child: the allocator class, and which implementation and mode run.
CuMemAllocator = None  # type: ignore[assignment]
IMPL = ""
MODE = ""


# --- helpers the bodies use (run in the child) ---------------------------------------------


def say(key: str, value: object) -> None:
    print(f"{key}={value}", flush=True)


def mapped_usage(allocator) -> int:  # vLLM's helper, unchanged
    return sum(data.handle[1] for data in allocator.pointer_to_data.values() if not data.is_asleep)


def make_backend():
    """The default sleep-mode backend of each implementation (see the module docstring)."""
    if IMPL == "vllm":
        from vllm.device_allocator.sleep_mode_backend import CuMemBackend

        return CuMemBackend()
    try:
        from stepalloc.vllm_backend import StepallocBackend

        return StepallocBackend()
    except ImportError:  # vLLM is not installed: the backend's two calls on the allocator
        return _BackendCalls()


class _BackendCalls:
    def suspend(self, discardable=()):
        CuMemAllocator.get_instance().sleep(("weights", "runtime", "cudagraph"), discardable)

    def resume(self, tags=None):
        CuMemAllocator.get_instance().wake_up(tags)


def suspend(backend, level: int, weights=()) -> None:
    """``backend.suspend(level=level)`` of vLLM's newer tests, in 0.34's terms: at level 2 the
    weights' storage is discardable (gpu_worker.py's ``_discardable_parameters``)."""
    backend.suspend({w.untyped_storage().data_ptr() for w in weights} if level == 2 else set())


def filled(shape, value, dtype=None):
    import torch

    return torch.full(shape, value, dtype=dtype).to(DEVICE)


# --- test_cumem.py ----------------------------------------------------------------------------


def body_python_error() -> None:
    import torch

    allocator = CuMemAllocator.get_instance()
    total_bytes = torch.cuda.mem_get_info()[1]
    alloc_bytes = int(total_bytes * 0.7)
    tensors = []
    with allocator.use_memory_pool():
        x = torch.empty(alloc_bytes, dtype=torch.uint8, device=DEVICE)
        tensors.append(x)
    allocator.sleep(offload_tags=())
    y = torch.empty(alloc_bytes, dtype=torch.uint8, device=DEVICE)
    tensors.append(y)
    try:
        allocator.wake_up()
    except RuntimeError:
        say("raised", 1)
    else:
        raise AssertionError("wake_up with the memory taken did not raise RuntimeError")


def body_allocation_after_driver_error() -> None:
    """A rejected native allocation must not poison the next CuMem allocation."""
    import ctypes

    import torch

    allocator = CuMemAllocator.get_instance()
    torch.cuda.init()
    if IMPL == "vllm":
        import vllm.device_allocator.cumem as cumem

        native = ctypes.CDLL(cumem.lib_name)
        native.my_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        native.my_malloc.restype = ctypes.c_void_p
        # A zero-sized VA reservation fails before allocating physical memory.
        assert native.my_malloc(0, torch.cuda.current_device(), None) is None
    else:
        import stepalloc

        native = ctypes.CDLL(stepalloc.library_path())
        native.stepalloc_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        native.stepalloc_malloc.restype = ctypes.c_void_p
        # More than the device holds: the MemPool entry point's out-of-memory answer, NULL.
        assert native.stepalloc_malloc(1 << 50, torch.cuda.current_device(), None) is None
    with allocator.use_memory_pool():
        tensor = torch.ones(1024, dtype=torch.uint8).to(DEVICE)
    assert tensor.data_ptr() in allocator.pointer_to_data
    assert bool((tensor.cpu() == 1).all())


def body_basic_cumem() -> None:
    import torch

    shape = (1024, 1024)
    x = torch.zeros(shape).to(DEVICE)
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool():
        y = torch.ones(shape).to(DEVICE)  # y.zero_(); y += 1
        z = torch.full(shape, 2.0).to(DEVICE)  # z.zero_(); z += 2
    output = x.cpu() + y.cpu() + z.cpu()
    assert torch.allclose(output, torch.ones_like(output) * 3)
    mapped_bytes = mapped_usage(allocator)
    assert mapped_bytes >= y.nbytes + z.nbytes
    allocator.sleep()
    assert mapped_usage(allocator) == 0
    allocator.wake_up()
    assert mapped_usage(allocator) == mapped_bytes
    output = x.cpu() + y.cpu() + z.cpu()
    assert torch.allclose(output, torch.ones_like(output) * 3)


def body_discard_tags() -> None:
    import torch

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        weights = torch.ones(1024, 1024).to(DEVICE)
    with allocator.use_memory_pool("kv_cache"):
        kv = torch.ones(512, 512).to(DEVICE)
    mapped_bytes = mapped_usage(allocator)
    allocator.discard("kv_cache")
    mapped_bytes_after_discard = mapped_usage(allocator)
    assert mapped_bytes - mapped_bytes_after_discard >= kv.nbytes
    assert mapped_bytes_after_discard >= weights.nbytes
    assert torch.allclose(weights.cpu(), torch.ones(1024, 1024))
    allocator.wake_up()
    assert kv.shape == (512, 512)
    allocator.sleep(offload_tags="weights")
    allocator.wake_up()
    assert torch.allclose(weights.cpu(), torch.ones(1024, 1024))


def _selective_wake(tag) -> None:
    import torch

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag):
        internal = torch.empty(16 << 20, dtype=torch.uint8, device=DEVICE)
    with allocator.use_memory_pool("kv_cache"):
        kv = torch.empty(32 << 20, dtype=torch.uint8, device=DEVICE)
    allocator.sleep(offload_tags=())
    assert mapped_usage(allocator) == 0
    allocator.wake_up(tags=["weights"])
    assert mapped_usage(allocator) == internal.nbytes
    allocator.wake_up(tags=["kv_cache"])
    assert mapped_usage(allocator) == internal.nbytes + kv.nbytes


def body_selective_wake_restores_internal_tags_workspace() -> None:
    _selective_wake("workspace")


def body_selective_wake_restores_internal_tags_default() -> None:
    _selective_wake(None)


def body_workspace_scratch_discarded_on_sleep() -> None:
    """Workspace scratch lives in the sleep-mode pool: sleep discards it, any (selective) wake
    remaps it at the same address so captured graphs replay, and a buffer outgrown by a resize
    stays usable until it is released. (vLLM's WorkspaceManager: each resize allocates the new
    buffer in a new entry of the "workspace" pool.)"""
    import torch

    allocator = CuMemAllocator.get_instance()

    def get(nbytes):
        with allocator.use_memory_pool("workspace"):
            return torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)

    small = get(32 << 20)
    scratch = get(64 << 20)  # resize while a view of the old buffer is alive: the tag re-entered
    assert sum(d.tag == "workspace" for d in allocator.pointer_to_data.values()) == 2
    ones = torch.ones(64 << 20, dtype=torch.uint8).to(DEVICE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scratch.copy_(ones)  # scratch.add_(1) on zeros
    backend = make_backend()
    suspend(backend, 1)
    assert mapped_usage(allocator) == 0
    assert all(d.tag == "workspace" and d.cpu_backup_tensor is None for d in allocator.pointer_to_data.values())
    backend.resume(tags=["kv_cache"])
    assert mapped_usage(allocator) == small.nbytes + scratch.nbytes
    scratch.copy_(torch.zeros(64 << 20, dtype=torch.uint8))
    graph.replay()
    torch.cuda.synchronize()
    assert int(scratch.cpu().sum()) == scratch.numel()
    small.copy_(torch.ones(32 << 20, dtype=torch.uint8))
    # The next resize releases the outgrown buffer; wake does not remap it.
    del small
    big = get(128 << 20)
    assert mapped_usage(allocator) == scratch.nbytes + big.nbytes
    suspend(backend, 1)
    backend.resume(tags=["weights"])
    assert mapped_usage(allocator) == scratch.nbytes + big.nbytes


def _reentered_tag(free_x_early: bool) -> None:
    import gc

    import torch

    allocator = CuMemAllocator.get_instance()
    nbytes = 64 << 20
    with allocator.use_memory_pool("t"):
        xs = [torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)]
        if free_x_early:
            xs.clear()
    with allocator.use_memory_pool("t"):
        y = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    xs.clear()
    gc.collect()
    with allocator.use_memory_pool("t"):
        pass
    assert mapped_usage(allocator) == nbytes
    y.copy_(torch.ones(nbytes, dtype=torch.uint8))  # y.fill_(1)
    allocator.sleep(offload_tags="t")
    allocator.wake_up()
    assert int(y.cpu().sum()) == y.numel()
    allocator.release_pools()


def body_reentered_tag_x_freed() -> None:
    _reentered_tag(True)


def body_reentered_tag_x_alive() -> None:
    _reentered_tag(False)


def _runtime_state_survives_sleep(level: int) -> None:
    import torch

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool("runtime"):
        state = torch.arange(1 << 20).to(DEVICE)
        with allocator.use_memory_pool("kv_cache"):
            kv = torch.zeros(1 << 20).to(DEVICE)
    tags = {d.tag for d in allocator.pointer_to_data.values()}
    assert tags == {"runtime", "kv_cache"}, tags
    backend = make_backend()
    suspend(backend, level)
    assert mapped_usage(allocator) == 0
    backend.resume(tags=["weights"])
    assert torch.equal(state.cpu(), torch.arange(1 << 20))
    backend.resume(tags=["kv_cache"])
    kv.copy_(torch.ones(1 << 20))  # kv.fill_(1)
    assert int(kv.cpu().sum()) == kv.numel()


def body_runtime_state_survives_sleep_1() -> None:
    _runtime_state_survives_sleep(1)


def body_runtime_state_survives_sleep_2() -> None:
    _runtime_state_survives_sleep(2)


def body_level2_discards_ordinary_tensor_with_weights_tag() -> None:
    import torch

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        fake_weight = filled((4096,), 0x44, torch.uint8)
        ordinary_tensor = filled((4096,), 0x55, torch.uint8)
    pointers = (fake_weight.data_ptr(), ordinary_tensor.data_ptr())
    allocator.sleep(offload_tags=())
    if IMPL == "vllm":  # vLLM's _wake_up_with_poisoned_mappings
        import vllm.device_allocator.cumem as cumem

        original_create_and_map = cumem.create_and_map

        def create_and_map_with_poison(handle) -> None:
            original_create_and_map(handle)
            _, size, ptr, _ = handle
            cumem.libcudart.cudaMemset(ptr, 0xA5, size)

        cumem.create_and_map = create_and_map_with_poison
        try:
            allocator.wake_up()
        finally:
            cumem.create_and_map = original_create_and_map
    else:
        allocator.wake_up()  # fresh pages (HOSTCUDA_WARM_MB=0): zeros
    torch.cuda.synchronize()
    assert (fake_weight.data_ptr(), ordinary_tensor.data_ptr()) == pointers
    poison = 0xA5 if IMPL == "vllm" else 0
    assert bool((fake_weight.cpu() == poison).all()), "the discarded weight came back"
    assert bool((ordinary_tensor.cpu() == poison).all()), "the discarded tensor came back"


def body_cumem_with_cudagraph() -> None:
    import torch

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool():
        weight = torch.eye(1024).to(DEVICE)
    with allocator.use_memory_pool(tag="discard"):
        cache = torch.empty(1024, 1024, device=DEVICE)

    def model(x):
        out = x.clone()  # x @ weight, weight = identity
        cache[: out.size(0)].copy_(out)
        return weight[: out.size(0)].clone()  # out + 1: a read of the restored weight

    x = torch.empty(128, 1024, device=DEVICE)
    model(x)
    model_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(model_graph):
        y = model(x)
    mapped_bytes = mapped_usage(allocator)
    assert mapped_bytes >= weight.nbytes + cache.nbytes
    allocator.sleep()
    assert mapped_usage(allocator) == 0
    allocator.wake_up()
    assert mapped_usage(allocator) == mapped_bytes
    x.copy_(torch.randn(128, 1024))  # x.random_()
    model_graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(x.cpu(), cache[: x.size(0)].cpu())
    assert torch.allclose(y.cpu(), torch.eye(1024)[:128])


def _cudagraph_pool_sleep(level: int) -> None:
    """The graph pool backed up at both sleep levels and restored in place by any wake."""
    import torch

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        weight = torch.full((1 << 20,), 2.0).to(DEVICE)

    def capture() -> list:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with allocator.cudagraph_pool() as pool, torch.cuda.graph(graph, pool=pool, stream=stream):
            const = torch.empty_like(weight)  # never written by replay: needs a backup
            y = torch.empty_like(weight)
            z = torch.empty_like(weight)
            y.copy_(const)  # y = x * weight + const, as the copies the test checks
            z.copy_(weight)
        const.copy_(torch.full((1 << 20,), 3.0))  # const.fill_(3.0)
        return [graph, y, z, const]

    def graph_pool() -> dict[int, int]:
        data = allocator.pointer_to_data.items()
        return {p: d.handle[1] for p, d in data if d.tag == "cudagraph" and not d.is_asleep}

    held, backend = capture(), make_backend()
    mapped = graph_pool()
    assert mapped, "the capture allocated nothing in the graph pool"
    suspend(backend, level, weights=[weight])
    backend.resume(tags=["kv_cache"])
    assert graph_pool() == mapped
    backend.resume(tags=["weights"])
    weight.copy_(torch.full((1 << 20,), 2.0))  # level 2 discards weights; the reload
    held[0].replay()
    torch.cuda.synchronize()
    assert torch.equal(held[1].cpu(), torch.full((1 << 20,), 3.0)), "the graph pool's backup was not restored"
    assert torch.equal(held[2].cpu(), torch.full((1 << 20,), 2.0))


def body_cudagraph_pool_sleep_1() -> None:
    _cudagraph_pool_sleep(1)


def body_cudagraph_pool_sleep_2() -> None:
    _cudagraph_pool_sleep(2)


# --- test_cumem_sleep_sync.py -----------------------------------------------------------------


def body_sleep_drains_kernels_before_unmap() -> None:
    """The device is synchronized before the first unmap: an in-flight copy on a side stream
    (standing for a forward kernel of async scheduling) finishes before its memory goes."""
    import ctypes

    import torch

    drv = ctypes.CDLL("libcuda.so.1")
    drv.hostcuda_unmaps_under_work.restype = ctypes.c_longlong
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool():
        x = torch.zeros(64 << 20, dtype=torch.uint8).to(DEVICE)
    torch.cuda.synchronize()
    src = torch.full((64 << 20,), 7, dtype=torch.uint8).pin_memory()
    side = torch.cuda.Stream()
    drv.hostcuda_set(b"delay_us", b"100000")
    with torch.cuda.stream(side):
        for _ in range(4):  # busy 0.4 s: longer than any single wait the sleep makes itself
            x.copy_(src, non_blocking=True)
    allocator.sleep(offload_tags=())
    unmapped_under_work = drv.hostcuda_unmaps_under_work()
    drv.hostcuda_set(b"delay_us", b"0")
    allocator.wake_up()
    assert unmapped_under_work == 0, f"{unmapped_under_work} unmaps of memory an unfinished copy still used"


# --- test_sleep_mode.py: what its engine tests ask of the allocator --------------------------


def _model(allocator):
    """A model's memory as vLLM's worker allocates it."""
    import torch

    pattern = torch.randint(0, 256, (48 << 20,), dtype=torch.uint8)
    with allocator.use_memory_pool("weights"):
        weights = pattern.to(DEVICE)
    with allocator.use_memory_pool("runtime"):
        runtime = torch.arange(1 << 18).to(DEVICE)
    with allocator.use_memory_pool("kv_cache"):
        kv = torch.empty(96 << 20, dtype=torch.uint8, device=DEVICE)
    return pattern, weights, runtime, kv


def body_sleep_mode_end_to_end() -> None:
    """test_end_to_end: sleep(level=1), wake_up(), sleep(level=1), wake_up(["weights"]) maps the
    weights (and what cannot wait), wake_up(["kv_cache"]) the rest; the model is intact."""
    import torch

    allocator = CuMemAllocator.get_instance()
    pattern, weights, runtime, kv = _model(allocator)
    everything = mapped_usage(allocator)
    backend = make_backend()
    suspend(backend, 1)
    assert mapped_usage(allocator) == 0
    backend.resume()
    assert torch.equal(weights.cpu(), pattern) and torch.equal(runtime.cpu(), torch.arange(1 << 18))
    suspend(backend, 1)
    backend.resume(tags=["weights"])
    assert mapped_usage(allocator) == everything - kv.nbytes
    backend.resume(tags=["kv_cache"])
    assert mapped_usage(allocator) == everything
    assert torch.equal(weights.cpu(), pattern) and torch.equal(runtime.cpu(), torch.arange(1 << 18))


def body_sleep_mode_deep_sleep() -> None:
    """test_deep_sleep: sleep(level=2) keeps no copy of the weights; wake_up(["weights"]), the
    reload, wake_up(["kv_cache"]); the runtime state survives."""
    import torch

    allocator = CuMemAllocator.get_instance()
    pattern, weights, runtime, kv = _model(allocator)
    everything = mapped_usage(allocator)
    backend = make_backend()
    suspend(backend, 2, weights=[weights])
    assert all(d.cpu_backup_tensor is None for d in allocator.pointer_to_data.values() if d.tag == "weights")
    backend.resume(tags=["weights"])
    weights.copy_(pattern)  # reload_weights
    backend.resume(tags=["kv_cache"])
    assert mapped_usage(allocator) == everything
    assert torch.equal(weights.cpu(), pattern) and torch.equal(runtime.cpu(), torch.arange(1 << 18))


# --- added ------------------------------------------------------------------------------------


def body_wake_up_retried_after_memory_is_free_loses_nothing() -> None:
    import torch

    allocator = CuMemAllocator.get_instance()
    total_bytes = torch.cuda.mem_get_info()[1]
    alloc_bytes = int(total_bytes * 0.6)
    pattern = torch.randint(0, 256, (alloc_bytes,), dtype=torch.uint8)
    with allocator.use_memory_pool(tag="weights"):
        w = pattern.to(DEVICE)
    ptr = w.data_ptr()
    usage = allocator.get_current_usage()
    assert usage >= alloc_bytes, usage
    allocator.sleep(offload_tags="weights")
    assert allocator.get_current_usage() == usage
    hog = torch.empty(alloc_bytes, dtype=torch.uint8, device=DEVICE)
    try:
        allocator.wake_up()
    except RuntimeError as e:
        say("first_error", type(e).__name__)
    else:
        raise AssertionError("wake_up with the memory taken did not raise RuntimeError")
    del hog
    torch.cuda.empty_cache()
    allocator.wake_up()
    assert w.data_ptr() == ptr
    assert torch.equal(w.cpu(), pattern), "bytes lost across a failed and a retried wake_up"


def body_tag_not_offloaded_keeps_addresses_and_tags_wake_one_at_a_time() -> None:
    import torch

    allocator = CuMemAllocator.get_instance()
    n = 64 << 20
    with allocator.use_memory_pool(tag="weights"):
        w = torch.full((n,), 7, dtype=torch.uint8).to(DEVICE)
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = torch.empty(2 * n, dtype=torch.uint8, device=DEVICE)
    ptrs = (w.data_ptr(), kv.data_ptr())
    free0 = torch.cuda.mem_get_info()[0]
    allocator.sleep(offload_tags=("weights",))
    free1 = torch.cuda.mem_get_info()[0]
    assert free1 - free0 >= 3 * n, (free0, free1)
    allocator.wake_up(tags=["weights"])
    free2 = torch.cuda.mem_get_info()[0]
    assert free1 - free2 >= n and free2 - free0 >= 2 * n, (free0, free1, free2)  # the KV cache still asleep
    assert bool((w.cpu() == 7).all())
    allocator.wake_up(tags=["kv_cache"])
    assert (w.data_ptr(), kv.data_ptr()) == ptrs
    kv.copy_(torch.full((2 * n,), 3, dtype=torch.uint8))
    assert bool((kv.cpu() == 3).all()) and bool((w.cpu() == 7).all())


