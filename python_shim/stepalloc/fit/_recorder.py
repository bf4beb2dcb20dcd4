"""The recorder: a training step's allocation stream, taken under ``FakeTensorMode``.

Layer: the core of ``stepalloc.fit`` (imports torch). ``Recording`` enters the fake mode (CUDA
fake tensors: shapes, no memory), then ``_Recorder`` (a dispatch mode above the fake mode that
sees every ATen operator, serves data-dependent ones from real values (``_values.py``), and
writes the trace (``_trace.py``)), ModTracker, and the patches of ``_patches.py`` (the target's
attention backend, storage resizes, fake parameters' conversion, transformers' tracing check).

What counts as an allocation (PyTorch's own tracker, ``torch/distributed/_tools/mem_tracker.py``,
does the same): a storage an operator returns that no tensor had before, of ``nbytes`` > 0 on
the recorded device; it is freed when the storage object dies (a ``weakref`` callback, so at the
moment CPython frees it, as the caching allocator is called). Views and in-place operators return
known storages, so they allocate nothing. ``UntypedStorage.resize_`` does not go through dispatch,
so it is patched (as MemTracker does); ``aten::resize_`` and ``out=`` kernels that grow a storage
are seen after the operator. Module paths come from PyTorch's ``ModTracker`` (forward and
backward); the optimizer's step is marked by the global optimizer hooks. What real kernels
allocate that dispatch cannot see is added from ``_kernels.py``: cuBLAS / cuBLASLt workspaces per
(thread's handle, stream) and attention backward scratch; what fake kernels allocate that real
ones do not (flash / memory-efficient attention's host-side RNG state) is left out.

Threads started inside the recording run under its modes (``threads_record``); an allocation
carries the stream current when it was made (``streams_seen``: asked only once code has made a
side stream current, so the common path costs nothing).

Invariants: every allocation the trace holds is freed at most once, at the moment its storage
dies; the recorder never keeps a tensor alive (weak references only); errors name the operator
and the module.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, UnsupportedOperatorException
from torch.distributed._tools.mod_tracker import ModTracker
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from . import _kernels
from ._patches import (
    foreach_like_a_real_run,
    module_conversion,
    patched_resize,
    quiet_tracker,
    streams_seen,
    target_attention,
    threads_record,
    transformers_as_real_run,
)
from ._trace import BACKWARD, Trace
from ._values import DataDependentError, RealValues, UnsupportedOpError, leaves, serving

OPTIMIZER = "optimizer"


def _op_name(func) -> str:
    try:
        return func._schema.name
    except AttributeError:
        return str(func)


class _Recorder(TorchDispatchMode):
    def __init__(self, rec: Recording) -> None:
        super().__init__()
        self.rec = rec
        self.storages = WeakIdKeyDictionary()  # storage -> [addr, nbytes, weakref]
        self.host_storages = WeakIdKeyDictionary()  # fake outputs a real run keeps on the host
        self.workspaces: set[tuple[int, int, str]] = set()  # (thread, stream, "cublas" | "cublaslt")
        self.lock = threading.RLock()
        # Set by ``streams_seen`` when code makes a stream current; until then every allocation
        # is on the default stream and none asks torch which stream is current.
        self.side_streams = False
        self.stream_ids: dict[int, int] = {0: 0}  # torch's stream id -> the trace's (0, 1, 2, ...)

    # ---- storages ----

    def _counts(self, t: torch.Tensor) -> bool:
        return t.device.type == self.rec.device_type

    def _stream(self) -> int:
        """The current stream of this thread, as the trace numbers it (0: the default)."""
        if not self.side_streams or self.rec.device_type != "cuda":
            return 0
        sid = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())[0]
        return self.stream_ids.setdefault(sid, len(self.stream_ids))

    def _track(self, st, op: str, module: str, prefix: bool = False) -> None:
        """A new storage: an allocation now (or before everything, for one made before recording)."""
        nbytes = st.nbytes()
        addr = 0
        if nbytes > 0:
            trace = self.rec.trace
            if prefix:
                addr = trace.alloc_before(nbytes, module, op)
            else:
                addr = trace.alloc(nbytes, module, op, self._stream() if self.side_streams else 0)
        entry = [addr, nbytes, None]
        entry[2] = weakref.ref(st, functools.partial(self._died, entry))
        self.storages[st] = entry

    def _died(self, entry: list, _ref) -> None:
        with self.lock:
            if entry[0]:
                self.rec.trace.free(entry[0])
                entry[0] = 0

    def _resized(self, st, op: str, module: str) -> None:
        """A storage whose size changed: a real resize allocates the new buffer, copies, then
        frees the old one (zero bytes: only the free)."""
        entry = self.storages[st]
        nbytes = st.nbytes()
        if nbytes == entry[1]:
            return
        old = entry[0]
        entry[0] = self.rec.trace.alloc(nbytes, module, op, self._stream()) if nbytes > 0 else 0
        entry[1] = nbytes
        if old:
            self.rec.trace.free(old)

    def known(self, t: torch.Tensor) -> None:
        """Registers a tensor made before recording (a weight built outside): an allocation
        at the start of the trace."""
        if isinstance(t, torch.Tensor) and self._counts(t):
            st = t.untyped_storage()
            if st not in self.storages:
                self._track(st, "", "", prefix=True)

    # ---- the dispatch hook ----

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _op_name(func)
        module = self.rec.module()
        with self.lock:
            for t in leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    self.known(t)
            if op in _kernels.BLAS_OPS:
                self._blas(op, args)
        scratch = []
        if self.rec.device_type == "cuda" and op.endswith("_attention_backward"):
            with self.lock:
                for label, nbytes in _kernels.attention_workspaces(op, args):
                    if nbytes > 0:
                        scratch.append(self.rec.trace.alloc(nbytes, module, f"{op} ({label})", self._stream()))
        try:
            out = self.rec.values.run(func, args, kwargs, module, _fake_call)
        except UnsupportedOperatorException as exc:
            raise UnsupportedOpError(
                f"{op} cannot run under fake tensors (it has no fake/meta kernel); it was called in "
                f"{module or 'code outside any module'}. What to do: record on a PyTorch that has one, replace the "
                "call in your function with operators that do, or register a fake kernel for it "
                "(torch.library.register_fake)."
            ) from exc
        with self.lock:
            for addr in scratch:
                self.rec.trace.free(addr)
            host = _kernels.HOST_OUTPUTS.get(op, ()) if self.rec.device_type == "cuda" else ()
            flat = leaves(out)
            for i, t in enumerate(flat):
                if not isinstance(t, torch.Tensor) or not self._counts(t):
                    continue
                st = t.untyped_storage()
                if i in host and isinstance(out, tuple):
                    self.host_storages[st] = True
                    self.storages[st] = [0, 0, None]
                    continue
                if st not in self.storages:
                    self._track(st, op, module)
                elif st not in self.host_storages:
                    self._resized(st, op, module)
            self.rec.ops[op] += 1
        return out

    def _blas(self, op: str, args: tuple) -> None:
        rec = self.rec
        if rec.device_type != "cuda":
            return
        # One workspace per (thread's handle, stream).
        thread, stream = threading.get_ident(), self._stream()
        if (thread, stream, "cublas") not in self.workspaces:
            self.workspaces.add((thread, stream, "cublas"))
            size = _kernels.cublas_workspace_bytes(rec.target.capability)
            rec.trace.alloc(size, rec.module(), "cublas_workspace", stream)
        if _kernels.uses_cublaslt(op, args, rec.preferred_lt) and (thread, stream, "cublaslt") not in self.workspaces:
            self.workspaces.add((thread, stream, "cublaslt"))
            size = _kernels.cublaslt_workspace_bytes(rec.target.capability)
            rec.trace.alloc(size, rec.module(), "cublaslt_workspace", stream)


def _fake_call(func, args, kwargs):
    return func(*args, **kwargs)


class _Parents(dict):
    """ModTracker's set of running modules, remembering the order they were entered."""

    def add(self, name: str) -> None:
        self[name] = None

    def remove(self, name: str) -> None:
        del self[name]


class _Tracker(ModTracker):
    """PyTorch's ModTracker whose running modules keep their order: the innermost module is the
    one entered last (in the backward, a module whose gradient hooks never fire, e.g. a frozen
    one, stays in the set; the deepest name would pick it)."""

    @property
    def parents(self) -> _Parents:
        return self._ordered

    @parents.setter
    def parents(self, value) -> None:
        self._ordered = _Parents.fromkeys(value)

    def innermost(self) -> str:
        """The module entered last; a module that is no model's child (transformers' kernelized
        functions, e.g. ``apply_rotary_pos_emb`` as a ``Func`` module) is named inside the module
        that called it."""
        names = [n for n in self._ordered if n != "Global"]
        if not names:
            return ""
        inner = names[-1]
        if "." not in inner and len(names) > 1:
            return f"{names[-2]}.{inner}"
        return inner


class _FakeMode(FakeTensorMode):
    """A fake mode that never puts a real tensor on the device: as on a machine without CUDA,
    ``torch.tensor(..., device="cuda")`` stays fake and constants are not computed on the device
    (over a stand-in driver with no kernels, they could not be)."""

    @property
    def avoid_device_init(self) -> bool:
        return True


class Recording:
    """Records what a block of code asks the caching allocator for.

    Usage::

        rec = Recording(target="h100")
        with rec:
            model = build()               # fake CUDA tensors: no memory, no GPU
            with rec.step("train"):
                loss = model(**batch).loss
                loss.backward()
                opt.step(); opt.zero_grad()
        rec.trace.write("step.jsonl")
    """

    def __init__(
        self,
        target: str | float | _kernels.Target = "h100",
        attention: str = "auto",
        device: str = "cuda",
        preferred_blas: str | None = None,
        fake: bool = True,
    ) -> None:
        self.target = _kernels.target(target)
        self.device_type = device
        self.attention_order = _kernels.attention_order(self.target.capability, attention)
        self.preferred_lt = (preferred_blas or "cublas").lower() == "cublaslt"
        self.trace = Trace()
        self.values = RealValues()
        self.ops: Counter = Counter()
        self.attention_used: Counter = Counter()
        # device="cpu" records CPU storages (the fidelity benchmark compares them with a real CPU
        # run's); fake=False records a real execution (what dispatch sees of it).
        self.fake_mode = _FakeMode(allow_non_fake_inputs=True) if fake else None
        self._tracker = _Tracker()
        self._recorder = _Recorder(self)
        self._in_optimizer = 0
        self._stack = contextlib.ExitStack()
        self._optimizers: list = []

    # ---- context ----

    def __enter__(self) -> Recording:
        stack = self._stack
        if self.fake_mode is not None:
            stack.enter_context(self.fake_mode)
            stack.enter_context(foreach_like_a_real_run())
        if self.device_type == "cuda":
            stack.enter_context(target_attention(self))
        stack.enter_context(self._recorder)
        stack.enter_context(self._tracker)
        stack.enter_context(quiet_tracker())
        stack.enter_context(patched_resize(self._recorder))
        stack.enter_context(module_conversion())
        stack.enter_context(transformers_as_real_run())
        stack.enter_context(serving(self.values, self.module))
        stack.enter_context(threads_record(self._recorder))
        if self.device_type == "cuda":
            stack.enter_context(streams_seen(self._recorder))
        pre = register_optimizer_step_pre_hook(self._opt_pre)
        post = register_optimizer_step_post_hook(self._opt_post)
        stack.callback(pre.remove)
        stack.callback(post.remove)
        return self

    def __exit__(self, *exc) -> None:
        self.trace.step_end()
        self._stack.close()

    @contextlib.contextmanager
    def step(self, phase: str):
        """Marks a step (one phase of one iteration: 'rollout', 'train', ...)."""
        self.trace.step_begin(phase)
        try:
            yield
        finally:
            self.trace.step_end()

    @contextlib.contextmanager
    def host(self):
        """Real tensors inside the recording: code in this block runs without the fake mode and
        the recorder (building a batch's token ids on the CPU)."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            yield

    def real(self, fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Gives a fake tensor its real value (for data-dependent code)."""
        return self.values.attach(fake, real)

    def tensor(self, real: torch.Tensor, device: str | None = None) -> torch.Tensor:
        """A device tensor of ``real``'s contents (recorded as an allocation), carrying its value."""
        fake = real.to(device or self.device_type)
        return self.values.attach(fake, real)

    # ---- module and optimizer ----

    def name_parameters(self, model: torch.nn.Module) -> None:
        """Names each parameter's allocation after the module that holds it (torch_op
        "parameter"), so that weights show by module in the peak's attribution."""
        root = type(model).__name__
        # ModTracker names a module by the first forward it sees: a submodule called on its own
        # first (generate computing image features, say) would keep its class name as a root.
        # Name the whole tree from this model now (ModTracker's own naming, with its root).
        self._tracker._get_mod_name(model)
        for name, p in model.named_parameters():
            entry = self._recorder.storages.get(p.untyped_storage())
            alloc = self.trace.allocs.get(entry[0]) if entry else None
            if alloc is not None and alloc.torch_op != "parameter":
                alloc.module = f"{root}.{name.rsplit('.', 1)[0]}" if "." in name else root
                alloc.torch_op = "parameter"

    def module(self) -> str:
        if self._in_optimizer:
            return OPTIMIZER
        inner = self._tracker.innermost()
        if not inner:
            return ""
        return inner + BACKWARD if self._tracker.is_bw else inner

    def _opt_pre(self, optimizer, args, kwargs) -> None:
        self._in_optimizer += 1

    def _opt_post(self, optimizer, args, kwargs) -> None:
        self._in_optimizer -= 1
        # What the optimizer keeps between steps is its state.
        for state in optimizer.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor):
                    entry = self._recorder.storages.get(t.untyped_storage())
                    alloc = self.trace.allocs.get(entry[0]) if entry else None
                    if alloc is not None and alloc.module == OPTIMIZER:
                        alloc.torch_op = "optimizer_state"

    def summary(self) -> dict:
        counts = self.trace.counts()
        counts["attention"] = dict(self.attention_used)
        counts["attention_order"] = list(self.attention_order)
        counts["served_data_dependent"] = self.values.served
        return counts


__all__ = ["DataDependentError", "Recording", "UnsupportedOpError"]
