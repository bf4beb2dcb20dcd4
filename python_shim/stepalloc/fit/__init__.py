"""stepalloc.fit: will a training step fit on a GPU? Recorded without one, replayed under
PyTorch's allocator and stepalloc at the device's capacity.

Layer map: ``_kernels`` (the target GPU: cuBLAS workspaces, attention backends; no torch),
``_trace`` (the allocation stream and its JSON-lines file; no torch), ``_values`` (real values
beside fake tensors for data-dependent code), ``_recorder`` (the fake-mode recorder),
``_configs`` (model configurations: shipped or local), ``_recipes`` (training steps built from a
configuration), ``_replay`` (the stress tool's ``fit``, the largest batch), ``_cli``
(``python -m stepalloc.fit``). Importing this package imports no torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DataDependentError", "Recording", "UnsupportedOpError", "record"]


def __getattr__(name: str) -> Any:
    if name in ("Recording", "DataDependentError", "UnsupportedOpError"):
        from . import _recorder

        return getattr(_recorder, name)
    raise AttributeError(f"module 'stepalloc.fit' has no attribute {name!r}")
