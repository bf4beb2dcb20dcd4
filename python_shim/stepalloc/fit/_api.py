"""The Python API of ``stepalloc.fit``: record a user's own callable, mark steps, give values,
and predict (replay at a device's capacity).

Layer: the top of the package beside ``_cli``; uses ``_recorder``, ``_recipes``, ``_replay`` and
``_host``. ``step`` and ``real`` act on the recording in progress and do nothing outside one, so a
training loop can keep them when it runs for real.

Invariants: at most one recording is in progress per process; ``record`` always leaves the fake
mode and every patch it made, also when the callable raises.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

from . import _host, _replay

_current = None  # the Recording in progress


def record(
    fn: Callable[..., Any],
    *args: Any,
    device: Any = "h100",
    attention: str = "auto",
    trace: str | Path | None = None,
    **kwargs: Any,
):
    """Records what ``fn(*args, **kwargs)`` asks the GPU's caching allocator for, without a GPU.

    ``fn`` runs under fake CUDA tensors: build the model and optimizer inside it (as on the GPU:
    ``model = MyModel().cuda()`` or ``torch.device("cuda")``), run the loop, and mark its phases
    with ``stepalloc.fit.step("train")``. ``device`` is the target GPU (a card name such as
    'h100', or a size in GB): it decides the cuBLAS workspace and the attention backend.
    ``attention``: 'auto' (the target's choice) or 'flash' / 'cudnn' / 'efficient' / 'math'.
    Returns the ``Recording`` (``.trace`` the stream, ``.summary()`` its figures); with ``trace``,
    the stream is also written there. When ``fn`` returns a module, its parameters are named by
    module in the trace.
    """
    import torch

    from ._recorder import Recording

    global _current
    if _current is not None:
        raise RuntimeError("stepalloc.fit.record: a recording is already in progress in this process")
    _host.ensure_device()
    rec = Recording(target=device, attention=attention)
    _current = rec
    try:
        with rec:
            result = fn(*args, **kwargs)
            if isinstance(result, torch.nn.Module):
                rec.name_parameters(result)
            del result
    finally:
        _current = None
    rec.trace.strip_root()
    if trace is not None:
        rec.trace.write(trace)
    return rec


@contextlib.contextmanager
def step(phase: str = "train"):
    """Marks one phase of one iteration ('rollout', 'train', ...) in the recording in progress
    (each is a step in the replay's report); outside a recording it does nothing."""
    if _current is None:
        yield
        return
    with _current.step(phase):
        yield


def real(tensor: Any, value: Any) -> Any:
    """Gives a fake tensor its real value (a CPU tensor) for data-dependent code that the
    recorder cannot serve otherwise (``.item()``, ``nonzero``, boolean masks on it); returns
    ``tensor``. Outside a recording it returns ``tensor`` unchanged."""
    if _current is None:
        return tensor
    return _current.real(tensor, value)


def predict(
    source: Any,
    device: Any = "h100",
    outside_mb: float = _replay.DEFAULT_OUTSIDE_MB,
    pytorch_conf: str | None = None,
    html: str | Path | None = None,
    svg: str | Path | None = None,
) -> dict[str, Any]:
    """Replays a recording (or a trace file) on ``device`` under PyTorch's allocator (default,
    ``expandable_segments:True``, ``max_split_size_mb:128``, your ``PYTORCH_CUDA_ALLOC_CONF``) and
    stepalloc's: the stress tool's ``fit`` report (see ``stepalloc-stress fit --help``)."""
    path = Path(source) if isinstance(source, (str, Path)) else None
    temporary = None
    if path is None:
        temporary = path = _replay.temporary_trace()
        source.trace.write(path)
    try:
        return _replay.fit(path, device=device, outside_mb=outside_mb, pytorch_conf=pytorch_conf, html=html, svg=svg)
    finally:
        if temporary is not None:
            temporary.unlink(missing_ok=True)


def record_recipe(recipe: Any = None, device: Any = "h100", attention: str = "auto", **fields: Any):
    """Records a recipe (``stepalloc.fit.Recipe``, or its fields as keywords: model=, batch=,
    images=(0, 3), tokens=(128, 1024), finetune='lora', checkpointing=, optimizer=, rollout=,
    iterations=, seed=)."""
    from ._recipes import Recipe, record_recipe as _record

    _host.ensure_device()
    recipe = recipe if recipe is not None else Recipe(**fields)
    return _record(recipe, target=device, attention=attention)


def largest_batch(recipe: Any, device: Any = "h100", attention: str = "auto", limit: int = 256, **fit_options: Any):
    """The largest batch of ``recipe`` that fits on ``device`` under each allocator (see
    ``_replay.largest_batch`` for the search)."""
    from ._recipes import largest_batch_taken, record_recipe as _record

    _host.ensure_device()
    # The search stops where the recorder stops taking the batch's inputs.
    limit = min(limit, largest_batch_taken(recipe))

    def fits_at(batch: int) -> dict[str, bool]:
        rec = _record(recipe.with_batch(batch), target=device, attention=attention)
        return _replay.fits_by_config(predict(rec, device=device, **fit_options))

    return _replay.largest_batch(fits_at, limit=limit)
