"""stepalloc.fit: will a training step fit on a GPU? Recorded without one, replayed under
PyTorch's allocator and stepalloc at the device's capacity.

    import stepalloc.fit as fit

    def step():
        model = MyModel().cuda()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(3):
            with fit.step("train"):
                model(torch.randn(8, 1024, device="cuda")).sum().backward()
                opt.step(); opt.zero_grad()
        return model

    rec = fit.record(step, device="h100")     # fake CUDA tensors: no GPU, no memory
    report = fit.predict(rec, device="h100")  # per allocator: fits, peak reserved, first OOM

Or from a configuration alone: ``python -m stepalloc.fit --model llava-1.5-7b --batch 2``.

Layer map: ``_kernels`` (the target GPU: cuBLAS workspaces, attention backends; no torch),
``_trace`` (the allocation stream and its JSON-lines file; no torch), ``_values`` (real values
beside fake tensors for data-dependent code), ``_recorder`` (the fake-mode recorder),
``_configs`` (model configurations: shipped or local), ``_recipes`` (training loops built from a
configuration), ``_replay`` (the stress tool's ``fit``, the largest batch), ``_host`` (a device
context on a machine without a GPU), ``_api`` (this API), ``_cli`` (``python -m stepalloc.fit``).
Importing this package imports no torch.
"""

from __future__ import annotations

from typing import Any

from ._api import largest_batch, predict, real, record, record_recipe, step
from ._configs import ConfigError
from ._host import NoDeviceError
from ._replay import DEFAULT_OUTSIDE_MB, ReplayError

__all__ = [
    "DEFAULT_OUTSIDE_MB",
    "ConfigError",
    "DataDependentError",
    "NoDeviceError",
    "Recipe",
    "Recording",
    "ReplayError",
    "UnsupportedOpError",
    "largest_batch",
    "predict",
    "real",
    "record",
    "record_recipe",
    "step",
]


def __getattr__(name: str) -> Any:
    if name in ("Recording", "DataDependentError", "UnsupportedOpError"):
        from . import _recorder

        return getattr(_recorder, name)
    if name == "Recipe":
        from ._recipes import Recipe

        return Recipe
    raise AttributeError(f"module 'stepalloc.fit' has no attribute {name!r}")
