"""Real values beside the fakes: serving data-dependent operations without a GPU.

Layer: a helper of the recorder's dispatch mode (``_recorder.py`` calls ``RealValues.run`` for
every operator). Under ``FakeTensorMode`` a tensor has a shape but no contents, so ``.item()``,
``.tolist()``, ``bool(t)``, ``nonzero``, ``argwhere`` and boolean indexing cannot be answered.
Models use them on small integer tensors: token ids, attention masks, position ids, image grids
(LLaVA's ``get_placeholder_mask``, Qwen2-VL's ``get_rope_index``, transformers' mask code). So each
fake tensor may carry its real value, a CPU tensor: inputs given with values (``attach``), and every
operator whose tensor arguments all carry values computes its result on the CPU as well, when the
result is small (``MAX_REAL_NUMEL`` elements; random operators draw from torch's seeded CPU
generator). A data-dependent operator is answered from those values; its device output is still a
fake tensor, allocated as the real kernel allocates it.

Invariants: a real value is never wrong: an in-place operator that cannot update it (an argument
without a value) drops it; an operator that needs a value nobody has raises ``DataDependentError``
naming the operator, never a guess. Float activations never carry values (they come from weights
that have none), so this costs little: the recorder computes only index arithmetic on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

# Results larger than this (elements) get no real value (activations, weights, big masks).
MAX_REAL_NUMEL = 1 << 22

aten = torch.ops.aten
# Operators answered from values: their result depends on the contents, not only the shapes.
SCALAR_OPS = {aten._local_scalar_dense.default}
# Operators that pick token ids from logits (sampling, greedy decoding): when the logits have no
# value (they never do: they come from weights), the ids are drawn uniformly from the valid range
# by a seeded generator. Only which tokens come out depends on it, never a shape, except where a
# loop stops at an end-of-sequence token (then at a drawn one, like a sampled run).
PICKERS = {aten.multinomial.default, aten.argmax.default}
# Operators that never get a real value computed (their cost or meaning is device-side only).
NO_REAL = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default, aten.new_empty_strided.default}


def leaves(obj: Any) -> list:
    """The leaves of an operator's arguments or outputs, in order: what is nested in the tuples,
    lists and dicts ATen's schemas use (a ``torch.Size`` stays one leaf, as in torch's pytree).
    The recorder asks this of every operator; torch's ``tree_flatten``, which handles every
    registered container and builds a spec, is the larger part of the recorder's own time."""
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        out: list = []
        for x in obj:
            if isinstance(x, (list, tuple, dict)) and not isinstance(x, torch.Size):
                out.extend(leaves(x))
            else:
                out.append(x)
        return out
    if isinstance(obj, dict):
        return leaves(list(obj.values()))
    return [obj]


class DataDependentError(RuntimeError):
    """A data-dependent operator on a tensor whose contents the recorder cannot know."""


class UnsupportedOpError(RuntimeError):
    """An operator that cannot run under fake tensors (no fake kernel, no attention backend)."""


ATTR = "_stepalloc_fit_value"


class _Table:
    """Fake tensor -> its real value, kept as an attribute of the tensor object (no weak
    reference: ``Module.cuda()`` / ``.to()`` swap a fake parameter with ``swap_tensors``, which
    refuses tensors that have one; the swap carries the attribute with the data)."""

    def get(self, t: Any) -> torch.Tensor | None:
        return getattr(t, ATTR, None)

    def __setitem__(self, t: Any, value: torch.Tensor) -> None:
        setattr(t, ATTR, value)

    def pop(self, t: Any, default: Any = None) -> Any:
        value = getattr(t, ATTR, default)
        if hasattr(t, ATTR):
            delattr(t, ATTR)
        return value


class RealValues:
    def __init__(self) -> None:
        self.values = _Table()  # fake tensor -> CPU tensor
        self.served = 0  # data-dependent operators answered
        self.computed = 0  # operators computed on the CPU
        self.picked = 0  # token ids drawn for pickers
        self._picks = torch.Generator().manual_seed(0)

    def attach(self, fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Gives ``fake`` its real value (a CPU tensor of the same shape and dtype)."""
        if isinstance(real, FakeTensor):
            raise TypeError("a real value must be a real (CPU) tensor, not a fake one")
        with _disable_current_modes():
            self.values[fake] = real.detach().to("cpu")
        return fake

    def value(self, t: Any) -> torch.Tensor | None:
        if isinstance(t, FakeTensor):
            return self.values.get(t)
        if isinstance(t, torch.Tensor):
            return t  # a real (CPU) tensor, e.g. a constant from torch.tensor([...])
        return None

    # ---- the dispatch hook ----

    def run(self, func, args: tuple, kwargs: dict, where: str, fake_call) -> Any:
        """Runs ``func`` (``fake_call(func, args, kwargs)`` runs it under fake mode), serving
        data-dependent operators from real values and computing real results beside fakes."""
        if func in SCALAR_OPS:
            real = self.value(args[0])
            if real is None:
                raise self._error(func, where, "reads a tensor's contents (.item(), .tolist(), bool(), int())")
            self.served += 1
            with _disable_current_modes():
                return real.item()
        try:
            out = fake_call(func, args, kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException) as exc:
            return self._dynamic(func, args, kwargs, where, exc, fake_call)
        self._propagate(func, args, kwargs, out)
        return out

    def _propagate(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        if func in NO_REAL:
            return
        mutated = _mutated_args(func, args, kwargs)
        # Most operators take an activation or a weight, which has no value: seen without
        # building the arguments' spec.
        if all(self.value(x) is not None for x in leaves((args, kwargs)) if isinstance(x, torch.Tensor)):
            flat, spec = tree_flatten((args, kwargs))
            real = [
                self.value(x) if isinstance(x, torch.Tensor) else torch.device("cpu") if isinstance(x, torch.device) else x
                for x in flat
            ]
            fakes = leaves(out)
            outs = [t for t in fakes if isinstance(t, torch.Tensor)]
            if (outs or mutated) and all(t.numel() <= MAX_REAL_NUMEL for t in outs + mutated):
                real_args, real_kwargs = tree_unflatten(real, spec)
                if "pin_memory" in real_kwargs:
                    real_kwargs["pin_memory"] = False
                try:
                    with _disable_current_modes():
                        real_out = func(*real_args, **real_kwargs)
                except Exception:  # noqa: BLE001 - a CPU kernel may be missing; then no value
                    pass
                else:
                    self.computed += 1
                    reals = leaves(real_out)
                    if len(fakes) == len(reals):
                        for f, r in zip(fakes, reals):
                            if isinstance(f, FakeTensor) and isinstance(r, torch.Tensor) and f.shape == r.shape:
                                self.values[f] = r
                    return
        if func in PICKERS and isinstance(out, FakeTensor) and out.numel() <= MAX_REAL_NUMEL:
            self._pick(func, args, out)
            return
        # Not computed: a mutated argument's value is stale now (a fresh output has none).
        for t in mutated:
            if isinstance(t, FakeTensor):
                self.values.pop(t, None)

    def _pick(self, func, args: tuple, out: FakeTensor) -> None:
        logits = args[0]
        dim = args[1] if func is aten.argmax.default and len(args) > 1 and args[1] is not None else -1
        high = int(logits.shape[dim]) if logits.dim() else 1
        with _disable_current_modes():
            self.values[out] = torch.randint(0, max(high, 1), tuple(out.shape), generator=self._picks, dtype=out.dtype)
        self.picked += 1

    def _dynamic(self, func, args, kwargs, where: str, exc: Exception, fake_call) -> Any:
        """An operator whose output shape depends on contents (nonzero, boolean indexing, ...):
        compute it on the CPU with the values there are (tensors without one stand in as
        uninitialised memory; only integer and boolean tensors may decide a shape), then make
        fake outputs of the real shapes."""
        flat, spec = tree_flatten((args, kwargs))
        stand_in, complete = [], True
        for x in flat:
            if isinstance(x, torch.Tensor):
                v = self.value(x)
                if v is None:
                    if not x.dtype.is_floating_point and not x.dtype.is_complex:
                        raise self._error(func, where, "has an output shape that depends on a tensor's contents") from exc
                    complete = False
                    with _disable_current_modes():
                        v = torch.empty(x.shape, dtype=x.dtype)
                stand_in.append(v)
            elif isinstance(x, torch.device):
                stand_in.append(torch.device("cpu"))
            else:
                stand_in.append(x)
        real_args, real_kwargs = tree_unflatten(stand_in, spec)
        with _disable_current_modes():
            real_out = func(*real_args, **real_kwargs)
        self.served += 1
        device = next(x.device for x in flat if isinstance(x, FakeTensor))

        def make(r):
            if not isinstance(r, torch.Tensor):
                return r
            fake = fake_call(aten.empty_strided.default, (r.shape, r.stride()), {"dtype": r.dtype, "device": device})
            if complete and r.numel() <= MAX_REAL_NUMEL:
                self.values[fake] = r
            return fake

        return tree_map(make, real_out)

    def _error(self, func, where: str, what: str) -> DataDependentError:
        return DataDependentError(
            f"{func} in {where or 'code outside any module'} {what}, and that tensor's contents are not known "
            "under fake tensors (it was computed from values the recorder does not have, e.g. float activations "
            "or weights). What to do: give the tensors that decide it real values (stepalloc.fit.real(tensor) "
            "for inputs built in your function; token ids, masks, position ids and grids are served "
            "automatically), or move the data-dependent step out of the recorded function."
        )


_WRITES: dict = {}  # operator -> [(position, name)] of the arguments it writes


def _mutated_args(func, args: tuple, kwargs: dict) -> list:
    writes = _WRITES.get(func)
    if writes is None:
        writes = _WRITES[func] = [
            (i, arg.name)
            for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        ]
    out = []
    for i, name in writes:
        v = args[i] if i < len(args) else kwargs.get(name)
        out.extend(t for t in leaves(v) if isinstance(t, torch.Tensor))
    return out


def _has_fake(data: Any) -> bool:
    if isinstance(data, FakeTensor):
        return True
    if isinstance(data, (list, tuple)):
        return any(_has_fake(x) for x in data)
    return False


@contextlib.contextmanager
def serving(values: RealValues, where):
    """``torch.tensor([t0, t1, ...])`` of fake tensors reads their memory directly (no operator
    in between): give it their real values instead (Qwen2-VL's ``get_rope_index`` builds its
    position deltas so). ``where()`` names the running module for errors."""
    original = torch.tensor

    def plain(x):
        if isinstance(x, FakeTensor):
            real = values.values.get(x)
            if real is None:
                raise values._error("torch.tensor", where(), "copies a fake tensor's contents")
            with _disable_current_modes():
                return real.tolist()
        if isinstance(x, (list, tuple)):
            return type(x)(plain(y) for y in x)
        return x

    @functools.wraps(original)
    def tensor(data, *args, **kwargs):
        if _has_fake(data):
            data = plain(data)
        return original(data, *args, **kwargs)

    with mock.patch.object(torch, "tensor", tensor):
        yield
