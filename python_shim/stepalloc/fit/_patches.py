"""What the recorder changes in torch and transformers while it records, each undone on exit.

Layer: context managers that ``Recording.__enter__`` enters (``_recorder.py``); each patch says
why the fake run needs it to behave as a real run on the target GPU.

Invariants: every patch restores the original on exit, also after an exception
(``unittest.mock.patch.object``); none keeps a tensor alive.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any
from unittest import mock

import torch

from ._values import UnsupportedOpError


@contextlib.contextmanager
def target_attention(rec: Any):
    """``F.scaled_dot_product_attention`` runs with the target's backend: the first of
    ``rec.attention_order`` (``rec``: the ``Recording``) whose constraints the call meets. A
    patch of the function (not a function mode): autograd's thread, where checkpointed layers
    run again, sees it too."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    original = F.scaled_dot_product_attention
    names = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}

    @functools.wraps(original)
    def sdpa(*args, **kwargs):
        # Counted per backend, "+mask" when the call carries an attention mask (padding, or a
        # 4-D mask that a real run would not build).
        masked = (args[3] if len(args) > 3 else kwargs.get("attn_mask")) is not None
        errors = []
        for backend in rec.attention_order:
            if backend == "cudnn":
                out = _cudnn_attention(*args, **kwargs)
                if out is not None:
                    rec.attention_used["cudnn+mask" if masked else "cudnn"] += 1
                    return out
                errors.append("cudnn: constraints not met")
                continue
            try:
                with sdpa_kernel([names[backend]]), _quiet():
                    out = original(*args, **kwargs)
            except RuntimeError as exc:
                errors.append(f"{backend}: {str(exc).splitlines()[0]}")
                continue
            rec.attention_used[f"{backend}+mask" if masked else backend] += 1
            return out
        raise UnsupportedOpError(
            f"scaled_dot_product_attention in {rec.module() or 'code outside any module'}: no backend of "
            f"{rec.attention_order} takes this call ({'; '.join(errors)}). What to do: pick another with "
            "attention='math' (or flash / efficient / cudnn)."
        )

    with mock.patch.object(F, "scaled_dot_product_attention", sdpa):
        yield


@contextlib.contextmanager
def _quiet():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _cudnn_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """cuDNN attention as ``sdp_utils.cpp`` admits it (fp16/bf16, head dim <= 128 and a multiple
    of 8, as many K/V heads as query heads, 4-D inputs), called through its own ATen operator
    (its fake kernel and autograd formula); None when the call does not qualify."""
    if query.dim() != 4 or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    d = query.shape[-1]
    if d > 128 or d % 8 or key.shape[1] != query.shape[1] or value.shape[-1] != d:
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, attn_mask, need_grad, dropout_p, is_causal, False, scale=scale
    )
    return out[0]


@contextlib.contextmanager
def quiet_tracker():
    """ModTracker warns when a checkpointed layer runs its forward again inside the backward;
    that is expected here (the recomputation is part of the backward)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The module hierarchy tracking")
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*is deprecated")
        yield


@contextlib.contextmanager
def module_conversion():
    """``Module.cuda()`` / ``.to()`` swap a fake parameter with the converted one
    (``torch.utils.swap_tensors``), which refuses every fake tensor (each has a weak reference);
    for fakes, take the converted tensor's data and device instead, as a real ``.to()`` on the
    same device does with ``param.data = ...``."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch.utils.swap_tensors

    @functools.wraps(original)
    def swap(t1, t2):
        if isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor):
            with torch.no_grad():
                t1.data = t2.data if isinstance(t2, torch.nn.Parameter) else t2
            t1.fake_device = t2.fake_device
            return None
        return original(t1, t2)

    with mock.patch.object(torch.utils, "swap_tensors", swap):
        yield


@contextlib.contextmanager
def patched_resize(recorder: Any):
    """``UntypedStorage.resize_`` bypasses dispatch (MemTracker patches it the same way)."""
    original = torch.UntypedStorage.resize_

    @functools.wraps(original)
    def resize_(st, size):
        result = original(st, size)
        with recorder.lock:
            if st in recorder.storages:
                recorder._resized(st, "UntypedStorage.resize_", recorder.rec.module())
            elif st.device.type == recorder.rec.device_type:
                recorder._track(st, "UntypedStorage.resize_", recorder.rec.module())
        return result

    with mock.patch.object(torch.UntypedStorage, "resize_", resize_):
        yield


@contextlib.contextmanager
def transformers_as_real_run():
    """transformers asks ``is_fake_tensor`` to decide whether it is tracing; a real run is not,
    so its mask code takes the real run's path (no 4-D mask for an unpadded causal batch;
    ``is_causal`` and native GQA in SDPA), with the data-dependent checks served from values."""
    try:
        from transformers.utils import import_utils
    except ImportError:
        yield
        return
    with mock.patch.object(import_utils, "is_fake_tensor", lambda x: False):
        yield


@contextlib.contextmanager
def foreach_like_a_real_run():
    """On CUDA, torch's optimizers (and ``clip_grad_norm_``) run their foreach kernels unless told
    otherwise, and those keep temporaries for every parameter at once (AdamW's ``_foreach_sqrt``
    of the second moments: one more copy of the trained weights). torch decides by ``type(p)``
    against two lists, which a real run's parameters are on and fake ones are not: without this,
    a recording takes the per-parameter loop that a real run never takes. FakeTensor goes on both
    lists while recording, as DTensor puts itself on them (torch/distributed/tensor)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    lists = [optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types]
    added = [types for types in lists if FakeTensor not in types]
    for types in added:
        types.append(FakeTensor)
    try:
        yield
    finally:
        for types in added:
            types.remove(FakeTensor)


@contextlib.contextmanager
def threads_record(recorder: Any):
    """A thread started inside the recording runs under its modes too: torch's dispatch modes are
    per thread (a real run's worker threads allocate from the same caching allocator, so the
    recording must see them). ``threading.Thread.start`` (which ``ThreadPoolExecutor`` uses)
    takes the starting thread's mode stack, when it holds the recorder, and pushes it in the new
    thread around its ``run``. A pool's threads started before the recording are not seen."""
    import threading

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    original = threading.Thread.start

    @functools.wraps(original)
    def start(thread):
        modes = _get_current_dispatch_mode_stack()
        if recorder in modes:
            run = thread.run

            def recorded_run():
                for mode in modes:
                    torch._C._push_on_torch_dispatch_stack(mode)
                try:
                    run()
                finally:
                    for mode in reversed(modes):
                        torch._C._pop_torch_dispatch_stack(getattr(mode, "_mode_key", None))

            thread.run = recorded_run
        return original(thread)

    with mock.patch.object(threading.Thread, "start", start):
        yield


@contextlib.contextmanager
def streams_seen(recorder: Any):
    """Notes the first time a stream is made current (``torch.cuda.set_stream``,
    ``torch.cuda.stream(s)``, ``with s:``, ``torch.accelerator.set_stream``), so that only a
    recording that uses side streams asks the current stream at each allocation."""

    def seen(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            recorder.side_streams = True
            return original(*args, **kwargs)

        return wrapper

    with contextlib.ExitStack() as stack:
        for owner, name in ((torch._C, "_cuda_setStream"), (torch._C, "_accelerator_setStream"), (torch.cuda.Stream, "__enter__")):
            if hasattr(owner, name):  # mock.patch.object restores an inherited attribute by deleting the copy
                stack.enter_context(mock.patch.object(owner, name, seen(getattr(owner, name))))
        yield
