"""PyTorch's CUDA-graph trees tests (torch.compile's ``mode="reduce-overhead"``) that need no
kernels, ported to run over testdrv's host-memory CUDA.

Where from: pytorch/pytorch ``test/inductor/test_cudagraph_trees.py`` (``CudaGraphTreeTests``:
the tests that drive ``torch._inductor.cudagraph_trees.cudagraphify_impl`` directly, without
compiling: recording, replay, aliasing, and the checkpoints of the graph pool that a new
recording after a replay needs — ``torch._C._cuda_getCheckpointState`` /
``_cuda_setCheckpointPoolState``), as read at commit 4134df56 (the version the reference index
holds). Test names, the setUp/tearDown checks (no tree manager left, no live block and no
segment left in any graph pool) and the assertions are PyTorch's.

What changed, and why:
- testdrv runs no kernels: the functions under test computed ``x + 1``, ``x * x * x``, ``x + x``;
  here each output is a new tensor copied from the input (``fresh``: a device-to-device copy,
  which graphs capture and testdrv runs), which allocates from the graph pool just as the
  arithmetic did. Inputs made with ``torch.rand(..., device="cuda")`` are made on the host and
  copied; ``torch.zeros_like`` became ``torch.empty_like``.
- graph trees copy a recording's non-static inputs with ``torch._foreach_copy_``, a
  multi-tensor kernel: the test class replaces it with one ``copy_`` per tensor (copies).
- ``unittest.TestCase`` in place of ``torch._inductor.test_case.TestCase``; the config patches
  are PyTorch's (``triton.cudagraphs``, ``cudagraph_trees``, fast and slow path asserts, which
  check the pool's live blocks against the live tensors after every checkpoint).
- Not ported: the tests that compile with inductor or dynamo (kernels), multi-GPU tests.
"""

from __future__ import annotations

import contextlib
import gc
import unittest
import unittest.mock
import warnings

import torch
import torch._dynamo.config as dynamo_config
from torch._inductor import config
from torch._inductor.cudagraph_trees import cudagraphify_impl as tree_cudagraphify_impl


def cdata(t):
    return t.untyped_storage()._cdata


def fresh(x):
    """A new tensor of ``x``'s shape allocated where the graph allocates, filled by a copy."""
    return torch.empty_like(x).copy_(x)


def rand(shape):
    return torch.rand(shape).cuda()


def get_all_cudagraph_segments():
    segments = torch.cuda.memory_snapshot()
    return [segment for segment in segments if segment["segment_pool_id"] != (0, 0)]


def all_live_blocks():
    blocks_addrs = []
    for segment in get_all_cudagraph_segments():
        addr = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                blocks_addrs.append(addr)
            addr += block["size"]
    return blocks_addrs


def all_live_block_count():
    return len(all_live_blocks())


def _foreach_copy_(dst, src, non_blocking=False):
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking)


class CudaGraphTreeTests(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        self.graph_stack = contextlib.ExitStack()
        self.graph_stack.enter_context(
            config.patch(
                {
                    "triton.cudagraphs": True,
                    "triton.cudagraph_trees": True,
                    "triton.fast_path_cudagraph_asserts": True,
                    "triton.slow_path_cudagraph_asserts": True,
                }
            )
        )
        self.graph_stack.enter_context(dynamo_config.patch(automatic_dynamic_shapes=True))
        self.graph_stack.enter_context(unittest.mock.patch.object(torch, "_foreach_copy_", _foreach_copy_))
        self.device_idx = torch.empty([0], device="cuda").device.index
        warnings.filterwarnings("ignore")

    def tearDown(self):
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        self.graph_stack.close()

        self.assertIsNone(self.get_manager())
        self.assertEqual(all_live_block_count(), 0)
        self.assertEqual(len(get_all_cudagraph_segments()), 0)
        warnings.resetwarnings()

    def get_manager(self, device_index=None):
        return torch._inductor.cudagraph_trees.get_container(
            self.device_idx if not device_index else device_index  # noqa: SIM212 (PyTorch's)
        ).tree_manager

    def get_roots(self):
        return self.get_manager().get_roots()

    def curr_node(self):
        return self.get_manager().current_node

    def get_root_children(self):
        return [root.num_descendants() for root in self.get_roots()]

    def cudagraphify_impl(self, *args, is_inference=True, is_backward=False, **kwargs):
        return tree_cudagraphify_impl(
            *args,
            **kwargs,
            device_index=self.device_idx,
            is_inference=is_inference,
            is_backward=is_backward,
        )

    def num_checkpoints(self):
        return self.get_manager().debug_checkpointing_counter

    @config.patch("triton.skip_cudagraph_warmup", True)
    def test_tensor_dies_between_checkpoint(self):
        def foo(args):
            x = args[0]
            args.clear()
            return fresh(x), fresh(x)

        inp = rand([4])
        inp_list = [inp]
        foo_cg = self.cudagraphify_impl(foo, inp_list, ())
        foo_cg(inp_list)
        foo_cg([inp])

        out1, out2 = foo_cg([inp])
        inp = [out1]

        del out1, out2

        def foo2(args):
            x = args[0]
            args.clear()
            return [fresh(x)]

        self.assertEqual(self.num_checkpoints(), 0)
        foo2_cg = self.cudagraphify_impl(foo2, inp, ())

        x = foo2_cg(inp)[0]

        self.assertEqual(self.num_checkpoints(), 1)
        # out2 dies between the previous recording and the new one,
        # need to be manually deallocated after the checkpoint

        self.assertEqual(all_live_block_count(), 1)
        del x
        self.assertEqual(all_live_block_count(), 0)

    def test_aliased_static_parameter(self):
        inp = rand([20, 20])

        def foo(args):
            x = args[0]
            args.clear()
            return (x[0],)

        foo_cg = self.cudagraphify_impl(foo, [inp], (0,))

        for _ in range(3):
            out = foo_cg([inp])[0]
            self.assertEqual(cdata(inp), cdata(out))

        node = self.curr_node()
        self.assertEqual(node.cached_tensor_outputs, [None])
        self.assertEqual(node.unaliased_in_all_paths, [False])

    def test_unaligned_static_parameter(self):
        def gen_inp():
            inp = torch.ones([20]).cuda()
            return [inp[1:]]

        def foo(args):
            x = args[0]
            args.clear()
            return (fresh(x),)

        foo_cg = self.cudagraphify_impl(foo, gen_inp(), (0,))

        for _ in range(3):
            out = foo_cg(gen_inp())
            self.assertTrue(torch.equal(out[0].cpu(), foo(gen_inp())[0].cpu()))
            del out

        node = self.curr_node()
        self.assertEqual(node.static_input_data_ptrs, [None])

    def test_output_alias(self):
        inp = rand([20, 20])

        def foo(args):
            x = args[0]
            args.clear()
            out = fresh(x)  # noqa: F841 (PyTorch's x + x, unused there too)
            return (x, x[0])

        foo_cg = self.cudagraphify_impl(foo, [inp], ())

        for _ in range(3):
            out_1, out_2 = foo_cg([inp])
            self.assertEqual(cdata(out_1), cdata(out_2))
            del out_1, out_2
            self.assertEqual(len(list(self.curr_node().path_live_weakrefs())), 0)

        self.assertEqual(self.curr_node().cached_tensor_outputs, [None, None])

    @config.patch("triton.skip_cudagraph_warmup", True)
    def test_aliased_output_checkpoint(self):
        def foo(args):
            x = args[0]
            args.clear()
            y = fresh(x)
            return fresh(x), y, y[0]

        inp = rand([4, 4])
        foo_cg = self.cudagraphify_impl(foo, [inp], ())
        foo_cg([inp])
        foo_cg([inp])

        out1, out2, out3 = foo_cg([inp])
        inp = [out1]

        del out1, out2, out3

        def foo2(args):
            x = args[0]
            args.clear()
            return [fresh(x)]

        self.assertEqual(self.num_checkpoints(), 0)
        foo2_cg = self.cudagraphify_impl(foo2, inp, ())

        x = foo2_cg(inp)[0]

        self.assertEqual(self.num_checkpoints(), 1)
        # out2 and out3 dies between the previous recording and the new one,
        # need to be manually deallocated after the checkpoint

        self.assertEqual(all_live_block_count(), 1)
        del x
        self.assertEqual(all_live_block_count(), 0)

    @config.patch("triton.skip_cudagraph_warmup", True)
    def test_tensor_no_longer_in_pool(self):
        def foo(args):
            x = args[0]
            args.clear()
            return fresh(x), fresh(x)

        inp = rand([4])
        inp_list = [inp]
        foo_cg = self.cudagraphify_impl(foo, inp_list, ())
        x1, x2 = foo_cg(inp_list)

        def foo2(args):
            x = args[0]
            args.clear()
            return [fresh(x)]

        inp_list = [x1]
        foo2_cg = self.cudagraphify_impl(foo2, inp_list, ())
        foo2_cg(inp_list)

        del x1, x2
        # TODO make configurable

        x1, x2 = foo_cg([inp])  # noqa: RUF059 (PyTorch's)
        self.assertEqual(self.num_checkpoints(), 0)

        # input location has changed, should force recompile and checkpointing
        foo2_cg([torch.empty_like(x1)])

        self.assertEqual(self.num_checkpoints(), 1)
        self.assertEqual(self.get_root_children(), [2])

    @config.patch("triton.skip_cudagraph_warmup", True)
    def test_checkpoint_shared_output_storage_deallocation(self):
        def foo(args):
            x = args[0]
            args.clear()
            x_tmp = fresh(x)  # noqa: F841 (PyTorch's x + 1, unused there too)
            return x[0], x[1]

        inp = rand([2, 2])
        inp_list = [inp]
        foo_cg = self.cudagraphify_impl(foo, inp_list, ())
        foo_cg(inp_list)
        foo_cg([inp])

        x1, x2 = foo_cg([inp])
        inp = [x1]

        def foo2(args):
            x = args[0]
            args.clear()
            y = fresh(x)
            return y[0], y[1]

        foo2_cg = self.cudagraphify_impl(foo2, inp, ())
        foo2_cg(inp)

        self.assertEqual(self.num_checkpoints(), 1)
        self.assertEqual(x1.untyped_storage().data_ptr(), x2.untyped_storage().data_ptr())
        self.assertEqual(all_live_block_count(), 1)
        del x1
        self.assertEqual(all_live_block_count(), 1)
        del x2
        self.assertEqual(all_live_block_count(), 0)

    def test_dynamic_warmup(self):
        COUNTER = 0

        def f(inps):
            i, x = inps  # noqa: RUF059 (PyTorch's)
            inps.clear()
            nonlocal COUNTER
            COUNTER += 1
            return fresh(x)

        x = rand(2)
        inp_list = [2, x]
        foo_cg = self.cudagraphify_impl(f, inp_list, ())
        foo_cg(inp_list)  # warmup
        foo_cg([2, x])  # record
        foo_cg([2, x])  # replay
        self.assertEqual(COUNTER, 2)

        # Switching the size will require a warmup again
        x = rand(3)
        inp_list = [3, x]
        foo_cg(inp_list)  # warmup
        foo_cg([3, x])  # record
        foo_cg([3, x])  # replay
        self.assertEqual(COUNTER, 4)
