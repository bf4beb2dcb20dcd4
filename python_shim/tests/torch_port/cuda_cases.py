"""PyTorch's own kernel-free allocator tests, ported to run over testdrv's host-memory CUDA.

Where from: pytorch/pytorch ``test/test_cuda.py`` (``TestCuda``: memory allocation, memory
stats, out of memory, per-process memory fraction get/set, non-blocking copies; ``TestMemPool``:
the tests with and without ``load_inline``'s dummy allocator) as read at commit 000e43cd (the
version of the file nearest torch 2.15 that the reference index holds), and
``test/test_cuda_expandable_segments.py``, which runs the same classes with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (here: the runner's ``pytorch-expandable``
mode, see run_cases.py). Test names and assertions are PyTorch's.

What changed, and why:
- testdrv runs no kernels: a tensor a test fills with a kernel (``torch.randn(..., device="cuda")``,
  ``torch.zeros``, ``torch.arange``, ``tensor.fill_``) is made with ``torch.empty`` and, where the
  test reads its values, filled by a copy from the host (``cuda_tensor``, ``fill``); comparisons
  of device tensors compare their host copies (``same``).
- ``unittest.TestCase`` in place of ``torch.testing._internal.common_utils.TestCase`` (whose
  CUDA leak check and dynamo settings are PyTorch CI's harness, not the allocator's behaviour);
  ``assertEqual`` on tensors became ``same``.
- ``torch.cuda._sleep`` (a kernel) is left out of ``test_copy_non_blocking_type_conversion``.
- The file is a little newer than torch 2.15: ``test_mempool_id`` falls back to
  ``torch.cuda.graph_pool_handle`` where ``torch.accelerator.generate_graph_pool_handle`` is
  missing, and ``test_mempool_with_allocator`` leaves out its two asserts on ``MemPool.allocator``,
  an attribute torch 2.15's ``MemPool`` lacks.
- Every ``get_dummy_allocator`` call builds a library of its own, so the dummy allocator's
  counters start at 0 in each test (``load_inline`` hands every test of a process the same one).
- The dummy allocator is built with the system C++ compiler instead of ``load_inline``: this
  machine has no CUDA toolkit (``load_inline(with_cuda=True)`` needs one, and the source's
  ``ATen/cuda/Exceptions.h`` pulls in cuBLAS headers), so the source declares the two CUDA
  runtime functions it calls; ``cudaMalloc`` stands in for ``cudaMallocManaged``, which testdrv's
  runtime does not provide. Its counters and return values are PyTorch's.
- Not ported: tests whose point is a kernel or its timing (``test_to_non_blocking``, which spins
  the stream with ``_sleep`` and asserts it is still busy), the pinned-memory (host allocator)
  tests, and graph tests with kernels (``test_graph_capture_reclaim_*``, ``test_allocate_in_thread_to_pool``).
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import tempfile
import threading
import unittest
from collections import defaultdict

import torch

# test_cuda_expandable_segments.py: PyTorch's EXPANDABLE_SEGMENTS, read from the environment.
EXPANDABLE_SEGMENTS = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
TEST_CUDAMALLOCASYNC = False


def cuda_tensor(host: torch.Tensor) -> torch.Tensor:
    """A device tensor holding ``host``'s values, made with a copy (no kernel)."""
    out = torch.empty(host.shape, dtype=host.dtype, device="cuda")
    out.copy_(host)
    return out


def fill(tensor: torch.Tensor, value: float) -> None:
    """``tensor.fill_(value)`` for a device tensor, as a copy from the host."""
    tensor.copy_(torch.full(tensor.shape, value, dtype=tensor.dtype))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """PyTorch's ``assertEqual(a, b)`` on tensors of any devices: equal values on the host."""
    return torch.equal(a.cpu(), b.cpu())


DUMMY_ALLOCATOR_SOURCE = r"""
#include <cstddef>
extern "C" {
int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);
__attribute__((visibility("default"))) int called_dummy_alloc = 0;
__attribute__((visibility("default"))) int called_dummy_free = 0;

__attribute__((visibility("default"))) void *dummy_alloc(size_t size, int device, void *stream) {
    (void)device; (void)stream;
#ifdef CHECK_VARS
    called_dummy_alloc = 123;
#endif
    void *ptr = nullptr;
    if (cudaMalloc(&ptr, size) != 0) return nullptr;
    return ptr;
}

__attribute__((visibility("default"))) void dummy_free(void *ptr, size_t size, int device, void *stream) {
    (void)size; (void)device; (void)stream;
#ifdef CHECK_VARS
    called_dummy_free = 321;
#endif
    cudaFree(ptr);
}
}
"""

_BUILD_DIR = tempfile.mkdtemp(prefix="dummy_allocator")
_built: list[str] = []


def build_dummy_allocator(check_vars: bool) -> str:
    """A dummy allocator library of its own for each call (its counters start at 0 in every
    test, as when each test runs in a process of its own)."""
    src = os.path.join(_BUILD_DIR, "dummy_allocator.cpp")
    if not os.path.exists(src):
        with open(src, "w") as f:
            f.write(DUMMY_ALLOCATOR_SOURCE)
    lib = os.path.join(_BUILD_DIR, f"dummy_allocator_{len(_built)}{'_vars' if check_vars else ''}.so")
    flags = ["-DCHECK_VARS"] if check_vars else []
    subprocess.run([os.environ.get("CXX", "c++"), "-shared", "-fPIC", "-O1", *flags, src, "-o", lib], check=True)
    _built.append(lib)
    return lib


class TestCuda(unittest.TestCase):
    @property
    def expandable_segments(self):
        return EXPANDABLE_SEGMENTS

    def test_memory_allocation(self):
        gc.collect()
        torch.cuda.empty_cache()
        mem = None
        size = 1
        prev = 0
        try:
            prev = torch.cuda.memory_allocated()
            mem = torch.cuda.caching_allocator_alloc(size)
            self.assertGreater(torch.cuda.memory_allocated(), prev)
        finally:
            if mem is not None:
                torch.cuda.caching_allocator_delete(mem)
                self.assertEqual(torch.cuda.memory_allocated(), prev)

    def test_memory_stats(self):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()
        prev_allocated = torch.accelerator.memory_allocated()
        prev_reserved = torch.accelerator.memory_reserved()
        prev_max_allocated = torch.accelerator.max_memory_allocated()
        prev_max_reserved = torch.accelerator.max_memory_reserved()
        self.assertEqual(prev_allocated, prev_max_allocated)
        self.assertEqual(prev_reserved, prev_max_reserved)
        # Activate 1kB memory
        prev_active_current = torch.accelerator.memory_stats()["active_bytes.all.current"]
        tmp = cuda_tensor(torch.randn(256))  # was torch.randn(256, device="cuda")
        # Detect if the current active memory is 1kB
        self.assertEqual(
            torch.accelerator.memory_stats()["active_bytes.all.current"],
            1024 + prev_active_current,
        )
        self.assertEqual(torch.accelerator.memory_stats()["active_bytes.all.freed"], 0)
        del tmp
        gc.collect()
        torch.accelerator.empty_cache()
        self.assertEqual(
            torch.accelerator.memory_stats()["active_bytes.all.current"],
            prev_active_current,
        )
        self.assertEqual(torch.accelerator.memory_stats()["active_bytes.all.freed"], 1024)
        torch.accelerator.reset_peak_memory_stats()
        self.assertEqual(torch.accelerator.max_memory_allocated(), prev_max_allocated)
        self.assertEqual(torch.accelerator.max_memory_reserved(), prev_max_reserved)

    def test_out_of_memory(self):
        tensor = cuda_tensor(torch.zeros(1024))  # was torch.zeros(1024, device="cuda")

        oom_regex = (
            "would exceed allowed memory"
            if TEST_CUDAMALLOCASYNC
            else f"Tried to allocate 800000000.00 GiB. GPU {tensor.device.index} has a total capacity of"
        )
        with self.assertRaisesRegex(RuntimeError, oom_regex):
            torch.empty(1024 * 1024 * 1024 * 800000000, dtype=torch.int8, device="cuda")

        with self.assertRaisesRegex(RuntimeError, "Tried to allocate more than 1EB memory"):
            torch.empty(1024 * 1024 * 1024 * 8000000000, dtype=torch.int8, device="cuda")

        # ensure out of memory error doesn't disturb subsequent kernel
        fill(tensor, 1)  # was tensor.fill_(1)
        self.assertTrue((tensor.cpu() == 1).all())

    def test_out_of_memory_retry(self):
        torch.cuda.empty_cache()
        total_memory = torch.cuda.get_device_properties(0).total_memory
        oom_regex = "would exceed allowed memory" if TEST_CUDAMALLOCASYNC else "Tried to allocate"
        size = int(total_memory * 0.5)
        a = torch.empty(size, dtype=torch.int8, device="cuda")
        with self.assertRaisesRegex(RuntimeError, oom_regex):
            b = torch.empty(size, dtype=torch.int8, device="cuda")
        del a
        b = torch.empty(size, dtype=torch.int8, device="cuda")
        del b
        # We used a lot of memory here, clean up so we don't affect other tests too much
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def test_set_per_process_memory_fraction(self):
        orig = torch.cuda.get_per_process_memory_fraction(0)
        torch.cuda.reset_peak_memory_stats(0)
        try:
            # test invalid fraction value.
            with self.assertRaisesRegex(TypeError, "Invalid type"):
                torch.cuda.set_per_process_memory_fraction(1)
            with self.assertRaisesRegex(ValueError, "Invalid fraction value"):
                torch.cuda.set_per_process_memory_fraction(-0.1)
            with self.assertRaisesRegex(ValueError, "Invalid fraction value"):
                torch.cuda.set_per_process_memory_fraction(2.0)

            tensor = cuda_tensor(torch.zeros(1024))  # was torch.zeros(1024, device="cuda")
            torch.cuda.empty_cache()
            total_memory = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(0.5, 0)

            # test 0.499 allocation is ok.
            application = int(total_memory * 0.499) - torch.cuda.max_memory_reserved()
            tmp_tensor = torch.empty(application, dtype=torch.int8, device="cuda")
            del tmp_tensor
            torch.cuda.empty_cache()

            application = int(total_memory * 0.5)
            # it will get OOM when try to allocate more than half memory.
            oom_regex = "would exceed allowed memory" if TEST_CUDAMALLOCASYNC else "out of memory"
            with self.assertRaisesRegex(RuntimeError, oom_regex):
                torch.empty(application, dtype=torch.int8, device="cuda")

            # ensure out of memory error doesn't disturb subsequent kernel
            fill(tensor, 1)  # was tensor.fill_(1)
            self.assertTrue((tensor.cpu() == 1).all())
        finally:
            torch.cuda.set_per_process_memory_fraction(orig, 0)

    def test_get_per_process_memory_fraction(self):
        # get the initial memory fraction
        init_fraction = torch.cuda.get_per_process_memory_fraction()

        # set and get the limiting cases
        torch.cuda.set_per_process_memory_fraction(1.0)
        self.assertEqual(torch.cuda.get_per_process_memory_fraction(), 1.0)
        torch.cuda.set_per_process_memory_fraction(0.0)
        self.assertEqual(torch.cuda.get_per_process_memory_fraction(), 0.0)

        # test a few random cases
        for val in torch.rand(3):
            torch.cuda.set_per_process_memory_fraction(float(val))
            self.assertEqual(torch.cuda.get_per_process_memory_fraction(), float(val))

        # restore the initial memory fraction
        torch.cuda.set_per_process_memory_fraction(init_fraction)

    def test_copy_non_blocking(self):
        def _test_copy_non_blocking(a, b):
            event = torch.cuda.Event()
            a.copy_(b, non_blocking=True)
            event.record()
            event.synchronize()
            self.assertTrue(same(a, b))

        # 10MB copies
        x = torch.ones(10000000, dtype=torch.uint8).cuda()
        y = torch.zeros(10000000, dtype=torch.uint8).pin_memory()
        _test_copy_non_blocking(x, y)

        x = torch.zeros(10000000, dtype=torch.uint8).pin_memory()
        y = torch.ones(10000000, dtype=torch.uint8).cuda()
        _test_copy_non_blocking(x, y)

        # Test the case where the pinned data_ptr is not equal to the storage data_ptr.
        x_base = torch.zeros(10000000, dtype=torch.uint8).pin_memory()
        x = x_base[1:]
        self.assertTrue(x.is_pinned())
        self.assertTrue(x_base.is_pinned())
        self.assertNotEqual(x_base.data_ptr(), x.data_ptr())
        self.assertEqual(x_base.storage().data_ptr(), x.storage().data_ptr())
        y = torch.ones(10000000 - 1, dtype=torch.uint8).cuda()
        _test_copy_non_blocking(x, y)

    def test_copy_non_blocking_type_conversion(self):
        a = cuda_tensor(torch.ones(1))  # was torch.ones(1, device="cuda")
        b = torch.zeros(1, device="cpu", pin_memory=True)
        c = torch.empty(1, device="cuda", dtype=torch.long)
        # (torch.cuda._sleep, a kernel, left out)
        b.copy_(a, non_blocking=True)
        c.copy_(b, non_blocking=True)
        self.assertTrue(torch.equal(a.cpu().long(), c.cpu()))  # was assertEqual(a, c, exact_dtype=False)


class TestMemPool(unittest.TestCase):
    def _setup_mempool_limited_memory_test(self, additional_allowed_memory_in_mb):
        device = torch.device("cuda:0")

        self.init_fraction = torch.cuda.get_per_process_memory_fraction()
        torch.cuda.memory.empty_cache()
        mb = 1024 * 1024
        _, all_memory = torch.cuda.memory.mem_get_info(device)
        pre_reserved = torch.cuda.memory_reserved(device)
        total_allowed = additional_allowed_memory_in_mb * mb + pre_reserved
        fraction_allowed = total_allowed / all_memory
        torch.cuda.memory.set_per_process_memory_fraction(fraction_allowed, device)

        dtype = torch.int8
        return device, dtype

    def _teardown_mempool_limited_memory_test(self):
        torch.cuda.memory.empty_cache()
        torch.cuda.memory.set_per_process_memory_fraction(self.init_fraction)

    def test_mempool_id(self):
        pool1 = torch.cuda.graph_pool_handle()
        pool2 = torch.cuda.MemPool().id
        # torch.accelerator.generate_graph_pool_handle is newer than torch 2.15: where it is
        # missing, torch.cuda.graph_pool_handle (the same counter) takes its place.
        pool3 = getattr(torch.accelerator, "generate_graph_pool_handle", torch.cuda.graph_pool_handle)()

        # first value of id in a user created pool is always zero
        self.assertEqual(pool1[0] == 0, pool2[0] == 0)
        self.assertEqual(pool1[0] == 0, pool3[0] == 0)

        # each call to torch.cuda.graph_pool_handle(), torch.cuda.MemPool()
        # or torch.accelerator.generate_graph_pool_handle() increments the id
        self.assertTrue((pool2[1] - pool1[1]) > 0)
        self.assertTrue((pool3[1] - pool2[1]) > 0)

    def get_dummy_allocator(self, check_vars):
        dummy_allocator = build_dummy_allocator(check_vars)  # was load_inline(...)
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            dummy_allocator,
            "dummy_alloc",
            "dummy_free",
        )
        return allocator, dummy_allocator

    def test_mempool_empty_cache(self):
        torch.cuda.empty_cache()
        pool = torch.cuda.MemPool()
        x = torch.empty(1024, 1024, device="cuda")

        with torch.cuda.use_mem_pool(pool):
            y = torch.empty(1024, 1024, device="cuda")

        del y
        del x
        del pool
        segments = torch.cuda.memory._snapshot()["segments"]
        self.assertTrue(len(segments) > 0, "expected more than one segment")

    def test_mempool_empty_cache_inactive(self):
        torch.cuda.empty_cache()
        allocator, dummy_allocator = self.get_dummy_allocator(check_vars=True)
        alloc_lib = ctypes.CDLL(dummy_allocator)
        called_dummy_alloc = ctypes.c_int.in_dll(alloc_lib, "called_dummy_alloc")
        called_dummy_free = ctypes.c_int.in_dll(alloc_lib, "called_dummy_free")
        self.assertEqual(called_dummy_alloc.value, 0)
        self.assertEqual(called_dummy_free.value, 0)

        def f():
            pool = torch.cuda.MemPool(allocator.allocator())

            # allocate memory with ncclMemAlloc
            with torch.cuda.use_mem_pool(pool):
                x = torch.empty(1024 * 1024 * 2, dtype=torch.long, device="cuda")  # was torch.arange
            # Note: pool will be destroyed upon function return, but x, which
            # was allocated via the pool is still alive.
            return x

        x = f()
        self.assertEqual(called_dummy_alloc.value, 123)
        self.assertEqual(called_dummy_free.value, 0)

        del x
        torch.cuda.empty_cache()
        self.assertEqual(called_dummy_free.value, 321)

    def test_mempool_with_allocator(self):
        pool = torch.cuda.MemPool()

        # MemPool doesn't have an allocator by default
        # (left out: torch 2.15's MemPool has no `allocator` attribute)
        allocator, dummy_allocator = self.get_dummy_allocator(check_vars=True)

        pool = torch.cuda.MemPool(allocator.allocator())

        # pool should point to the same allocator as the one passed into it
        # (left out, as above)

        # pool's use count should be 1 at this point as MemPool object
        # holds a reference
        self.assertEqual(pool.use_count(), 1)

        # no allocations happened yet, so called_dummy_alloc and
        # called_dummy_free should be 0
        alloc_lib = ctypes.CDLL(dummy_allocator)
        called_dummy_alloc = ctypes.c_int.in_dll(alloc_lib, "called_dummy_alloc")
        called_dummy_free = ctypes.c_int.in_dll(alloc_lib, "called_dummy_free")
        self.assertEqual(called_dummy_alloc.value, 0)
        self.assertEqual(called_dummy_free.value, 0)

        nelem_1mb = 1024 * 1024 // 4

        with torch.cuda.use_mem_pool(pool):
            out_0 = torch.empty(nelem_1mb, device="cuda")  # was torch.randn

            # pool's use count should be 2 at this point as use_mem_pool
            # holds a reference
            self.assertEqual(pool.use_count(), 2)

        # pool's use count should be back to 1 at this point as use_mem_pool
        # released its reference
        self.assertEqual(pool.use_count(), 1)

        # called_dummy_alloc should be 123 if dummy_alloc was used to allocate
        # out tensor
        self.assertEqual(called_dummy_alloc.value, 123)

        out_non_pool = torch.empty(nelem_1mb, device="cuda")

        with torch.cuda.use_mem_pool(pool):
            # pool should have 1 segment since we made a small allocation (1 MB)
            # above and so the CUDACachingAllocator packed it into a 2 MB buffer
            self.assertEqual(len(pool.snapshot()), 1)

            out_1 = torch.empty(nelem_1mb, device="cuda")  # was torch.randn

            # pool should still have 1 segment since we made another small allocation
            # (1 MB) that got packed into the existing 2 MB buffer
            self.assertEqual(len(pool.snapshot()), 1)

            out_2 = torch.empty(nelem_1mb, device="cuda")  # was torch.randn

            # pool now should have 2 segments since the CUDACachingAllocator had
            # to make a new 2 MB buffer to accommodate out_2
            self.assertEqual(len(pool.snapshot()), 2)

        self.assertEqual(len(pool.snapshot()), 2)

        del out_0, out_1, out_2

        # pool's destructor calls emptyCache()
        del pool

        # called_dummy_free should be 321 if dummy_free was used to deallocate
        # out tensor
        self.assertEqual(called_dummy_free.value, 321)

    def test_tensor_delete_after_allocator_delete(self):
        allocator, dummy_allocator = self.get_dummy_allocator(check_vars=True)
        pool = torch.cuda.MemPool(allocator.allocator())

        with torch.cuda.use_mem_pool(pool):
            data = torch.empty(4, device="cuda")

        alloc_lib = ctypes.CDLL(dummy_allocator)
        called_dummy_alloc = ctypes.c_int.in_dll(alloc_lib, "called_dummy_alloc")
        called_dummy_free = ctypes.c_int.in_dll(alloc_lib, "called_dummy_free")

        self.assertEqual(called_dummy_alloc.value, 123)
        self.assertEqual(called_dummy_free.value, 0)

        # Explicitly drop the allocator before releasing the
        # tensor. CUDACachingAllocator's PrivatePool instance should
        # keep the allocator live until all tensors die.

        # N.B.: Deleting the pool doesn't actually do anything, since
        # it doesn't own the allocator object. But we do it anyway
        # because it is the situation that users are likely to face.
        del pool
        del allocator

        self.assertEqual(called_dummy_free.value, 0)

        del data
        torch.cuda.empty_cache()

        self.assertEqual(called_dummy_free.value, 321)

    def test_mempool_limited_memory_with_allocator(self):
        allocator, _ = self.get_dummy_allocator(check_vars=False)
        pool_do_not_use = torch.cuda.MemPool(allocator.allocator())
        pool_use = torch.cuda.MemPool(allocator.allocator(), use_on_oom=True)

        nelem_1mb = 1024 * 1024 // 4

        self._setup_mempool_limited_memory_test(80)
        # remaining free mem: 80 mb
        # mempool_use [] 0 mb
        # mempool_do_not_use [] 0 mb
        # default pool [] 0 mb
        with torch.cuda.use_mem_pool(pool_do_not_use):
            a = torch.empty(40 * nelem_1mb, device="cuda")  # was torch.randn, here and below
        with torch.cuda.use_mem_pool(pool_use):
            b = torch.empty(40 * nelem_1mb, device="cuda")
        a_dataptr = a.data_ptr()  # noqa: F841 (as in PyTorch's test)
        b_dataptr = b.data_ptr()
        # remaining free mem: 0 mb
        # mempool_do_not_use [aaaa] 40 mb
        # mempool_use [bbbb] 40 mb
        # default pool [] 0 mb
        with self.assertRaises(torch.OutOfMemoryError):
            # out of memory
            c = torch.empty(40 * nelem_1mb, device="cuda")

        del a, b
        # remaining free mem: 0 mb
        # mempool_do_not_use [____] 40 mb
        # mempool_use [____] 40 mb
        # default pool [] 0 mb

        # c should not oom and instead can use mempool_use as fallback
        c = torch.empty(30 * nelem_1mb, device="cuda")
        c_dataptr = c.data_ptr()
        # remaining free mem: 0 mb
        # mempool_do_not_use [____] 40 mb
        # mempool_use [ccc_] 40 mb
        # default pool [] 0 mb
        with self.assertRaises(torch.OutOfMemoryError):
            # out of memory since can't use mempool_do_not_use
            d = torch.empty(30 * nelem_1mb, device="cuda")  # noqa: F841

        del c
        # remaining free mem: 0 mb
        # mempool_do_not_use [____] 40 mb
        # mempool_use [____] 40 mb
        # default pool [] 0 mb

        # expect that we used same memory address for both a and c
        self.assertEqual(b_dataptr, c_dataptr)

        # make sure we can still use mempool_use as intended after c is deleted
        with torch.cuda.use_mem_pool(pool_use):
            e = torch.empty(20 * nelem_1mb, device="cuda")
        # remaining free mem: 0 mb
        # mempool_do_not_use [____] 40 mb
        # mempool_use [ee__] 40 mb
        # default pool [] 0 mb

        e_dataptr = e.data_ptr()
        del e

        self.assertEqual(e_dataptr, c_dataptr)

        # pool's destructor calls emptyCache()
        del pool_use, pool_do_not_use

        self._teardown_mempool_limited_memory_test()

    def test_mempool_no_split(self):
        torch.cuda.empty_cache()

        # Create two pools - one with no_split=True, one without
        pool_split = torch.cuda.MemPool()  # default: no_split=False
        pool_no_split = torch.cuda.MemPool(no_split=True)

        # 1 MB in number of float32 elements
        nelem_1mb = 1024 * 1024 // 4

        # Allocate 4 MB in each pool - this should allocate a 20 MB segment
        with torch.cuda.use_mem_pool(pool_split):
            a_split = torch.empty(4 * nelem_1mb, device="cuda")  # was torch.randn, here and below
        with torch.cuda.use_mem_pool(pool_no_split):
            a_no_split = torch.empty(4 * nelem_1mb, device="cuda")  # noqa: F841

        # Now allocate another 4 MB - this should cause splitting in the normal
        # pool but not in the no_split pool. Instead, the no_split pool should
        # have a new segment.
        with torch.cuda.use_mem_pool(pool_split):
            b_split = torch.empty(4 * nelem_1mb, device="cuda")  # noqa: F841
        with torch.cuda.use_mem_pool(pool_no_split):
            b_no_split = torch.empty(4 * nelem_1mb, device="cuda")  # noqa: F841

        # assert the number of segments in the no_split pool is larger than that
        # of the split pool
        assert len(pool_no_split.snapshot()) > len(pool_split.snapshot()), (
            f"Expected no_split pool to have more segments, "
            f"but got {len(pool_no_split.snapshot())} vs {len(pool_split.snapshot())}"
        )

        # Specifically, the no_split pool should have exactly 1 block per segment
        for seg in pool_no_split.snapshot():
            assert len(seg["blocks"]) == 1, f"Expected 1 block in no_split segment, got {len(seg['blocks'])}"

        # Count blocks in each pool
        def count_blocks(pool):
            total = 0
            for seg in pool.snapshot():
                total += len(seg["blocks"])
            return total

        blocks_split = count_blocks(pool_split)
        blocks_no_split = count_blocks(pool_no_split)

        # The pool with no_split should have fewer blocks because it doesn't
        # have a remaining block representing the remaining memory in the segment.
        self.assertLess(
            blocks_no_split,
            blocks_split,
            f"Expected no_split pool to have fewer blocks, but got {blocks_no_split} vs {blocks_split}",
        )
        del a_split

    def test_deleted_mempool_not_used_on_oom(self):
        """
        Test that a deleted mempool with use_on_oom=True is properly removed from use_on_oom_pools.
        """
        allocator, _ = self.get_dummy_allocator(check_vars=False)

        nelem_1mb = 1024 * 1024 // 4

        # set 40 mb total available memory
        self._setup_mempool_limited_memory_test(40)

        # Create many pools with use_on_oom=True, allocate memory, then delete the pools
        for _ in range(10):
            pool_use_on_oom = torch.cuda.MemPool(allocator.allocator(), use_on_oom=True)
            with torch.cuda.use_mem_pool(pool_use_on_oom):
                a = torch.empty(40 * nelem_1mb, device="cuda")  # was torch.randn, here and below
            del a
            del pool_use_on_oom

        # create new pool that we want to use_on_oom, all other pools should be deleted
        # all available 40mb in use by mempool
        new_pool_use_on_oom = torch.cuda.MemPool(allocator.allocator(), use_on_oom=True)
        with torch.cuda.use_mem_pool(new_pool_use_on_oom):
            a = torch.empty(40 * nelem_1mb, device="cuda")
        del a

        # allocate tensors that will fallback to use_on_oom pool since all available 40mb in use by mempool
        # tensors should only use valid pool and not deleted pools
        b = torch.empty(20 * nelem_1mb, device="cuda")
        c = torch.empty(20 * nelem_1mb, device="cuda")

        del b
        del c
        del new_pool_use_on_oom
        self._teardown_mempool_limited_memory_test()

    def test_mempool_multithread(self):
        pool_ids = []

        def create_mempool_and_make_active():
            pool = torch.cuda.MemPool()
            pool_ids.extend([pool.id])

        num_threads = 4
        threads = [threading.Thread(target=create_mempool_and_make_active) for t in range(num_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        # each thread should create a unique mempool, since
        # mempool id creation is atomic
        self.assertEqual(len(set(pool_ids)), 4)

    def test_mempool_emptycache_multithread(self):
        num_threads = 4

        def my_function(pool):
            with torch.cuda.use_mem_pool(pool):
                x = torch.empty(4, device="cuda")  # was torch.randn
                del x
                torch.cuda.empty_cache()

        pools = [torch.cuda.MemPool() for _ in range(num_threads)]
        threads = [threading.Thread(target=my_function, args=(pools[i],)) for i in range(num_threads)]

        for t in threads:
            t.start()
        for t in threads:
            t.join()

        # empty_cache should have done nothing under mempool context
        for p in pools:
            s = p.snapshot()
            self.assertEqual(len(s), 1, "Expected to have a single segment")

    def test_nested_mempool(self):
        torch.cuda.empty_cache()
        pool1 = torch.cuda.MemPool()
        pool2 = torch.cuda.MemPool()
        pool3 = torch.cuda.MemPool()

        data = []
        nelem_1mb = 1024 * 1024 // 4

        def allocate_data():
            x = torch.empty(nelem_1mb * 20, device="cuda")
            data.append(x)

        with torch.cuda.use_mem_pool(pool1):
            allocate_data()
            with torch.cuda.use_mem_pool(pool2):
                allocate_data()
                with torch.cuda.use_mem_pool(pool3):
                    allocate_data()
                allocate_data()
            allocate_data()

        pool1_segments = torch.cuda.memory.memory_snapshot(pool1.id)
        pool2_segments = torch.cuda.memory.memory_snapshot(pool2.id)
        pool3_segments = torch.cuda.memory.memory_snapshot(pool3.id)

        self.assertEqual(len(pool1_segments), 2)
        self.assertEqual(len(pool2_segments), 2)
        self.assertEqual(len(pool3_segments), 1)

    def test_mempool_expandable(self):
        torch.cuda.empty_cache()
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        allocator, _ = self.get_dummy_allocator(check_vars=False)
        pool = torch.cuda.MemPool(allocator.allocator())

        data = []
        nelem = 1024 * 1024 // 4
        with torch.cuda.use_mem_pool(pool):
            data.append(torch.empty(nelem, device="cuda"))

        # the second allocation should be in expandable segment
        data.append(torch.empty(nelem, device="cuda"))

        segments = torch.cuda.memory.memory_snapshot()

        num_expandable_segments = 0
        for segment in segments:
            if segment["is_expandable"]:
                num_expandable_segments += 1

        self.assertEqual(len(segments), 2, "Expected to have 2 segment")
        self.assertEqual(num_expandable_segments, 1, "Expected to have 1 expandable segment only")

        torch.cuda.memory._set_allocator_settings("expandable_segments:False")

    def test_mempool_ctx_multithread(self):
        torch.cuda.empty_cache()
        segments = torch.cuda.memory._snapshot()["segments"]
        self.assertEqual(len(segments), 0, "Expected empty pool in the beginning")

        nelem = 1024 * 1024
        trigger_alloc = threading.Event()
        done_allocation = threading.Event()

        def main_thread_fn():
            pool = torch.cuda.MemPool()
            out1 = torch.empty(nelem, dtype=torch.int8, device="cuda")  # noqa: F841
            with torch.cuda.use_mem_pool(pool):
                out = torch.empty(nelem, dtype=torch.int8, device="cuda")
                del out
                trigger_alloc.set()
                done_allocation.wait()

        def side_thread_fn(segments):
            trigger_alloc.wait()
            out = torch.empty(nelem, dtype=torch.int8, device="cuda")  # noqa: F841
            s = torch.cuda.memory._snapshot()["segments"]
            segments.append(s)
            done_allocation.set()

        segments = []
        main_thread = threading.Thread(target=main_thread_fn)
        side_thread = threading.Thread(target=side_thread_fn, args=(segments,))

        main_thread.start()
        side_thread.start()
        main_thread.join(timeout=10)
        side_thread.join(timeout=10)

        if main_thread.is_alive() or side_thread.is_alive():
            # release threads so that they don't hang forever
            trigger_alloc.set()
            done_allocation.set()
            self.fail("Test timed out - threads did not complete within the allowed time")

        self.assertEqual(len(segments), 1, "Expected to have memory snapshot")
        self.assertEqual(len(segments[0]), 2, "Expected to have 2 segments allocated")
        active = defaultdict(int)
        for s in segments[0]:
            active[s["segment_pool_id"]] += s["active_size"]
        for k, v in active.items():
            if k == (0, 0):
                self.assertEqual(v, 2097152, "Expected to have 2MB allocated in the default pool")
            else:
                self.assertEqual(v, 0, "Expected to have 0 bytes allocated in the custom pool")
