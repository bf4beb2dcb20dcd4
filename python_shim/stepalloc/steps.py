"""Layer: step and phase hooks (``with stepalloc.step("rollout"):``) over the library's
``stepalloc_step_begin`` / ``stepalloc_step_end``.

Invariants:
- A step always ends: the context manager and the decorator call ``step_end`` on the way out,
  also when the body raises (the body's exception wins over an error from ``step_end``).
- Steps do not nest: a ``step`` entered inside another raises ``RuntimeError`` (the library
  would end the outer step silently).
- Phases are a small, bounded label set (they become metric labels): use a few fixed names
  such as ``rollout``, ``train``, ``eval``, never per-step names.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Literal

from . import _lib

# The phase of the `step` context now open (steps are process-wide in the library).
_active: str | None = None
_active_lock = threading.Lock()


def step_begin(phase: str = "step") -> None:
    """Marks the start of a step of ``phase`` on every device.

    A step of another phase than the previous one is a phase switch: with ``phase_trim:True``
    the cache is trimmed to what this phase needed before.
    """
    if not isinstance(phase, str):
        raise TypeError(f"phase must be a str, not {type(phase).__name__}")
    _lib.check(_lib.lib().stepalloc_step_begin(phase.encode()))


def step_end() -> None:
    """Marks the end of the current step; runs the step-end release policies
    (``release_idle_steps``, ``cache_limit_mb``) and records the step's figures."""
    _lib.check(_lib.lib().stepalloc_step_end())


class step(contextlib.ContextDecorator):
    """A step of ``phase``, as a context manager or a decorator::

    with stepalloc.step("rollout"):
        ...

    @stepalloc.step("train")
    def train_step(batch): ...
    """

    def __init__(self, phase: str = "step") -> None:
        if not isinstance(phase, str):
            raise TypeError(f"phase must be a str, not {type(phase).__name__}")
        self.phase = phase

    def __enter__(self) -> step:
        global _active
        with _active_lock:
            if _active is not None:
                raise RuntimeError(
                    f"stepalloc steps do not nest: step({self.phase!r}) began inside step({_active!r}); "
                    "end one phase before the next begins"
                )
            step_begin(self.phase)
            _active = self.phase
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> Literal[False]:
        global _active
        with _active_lock:
            _active = None
            try:
                step_end()
            except _lib.StepallocError:
                if exc is None:
                    raise
        return False

    def __repr__(self) -> str:
        return f"stepalloc.step({self.phase!r})"
