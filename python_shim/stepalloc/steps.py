"""Layer: step and phase hooks (``with stepalloc.step("rollout"):``) over the library's
``stepalloc_step_begin`` / ``stepalloc_step_end``.

Steps are per process, as the library keeps them: one step at a time, for every device.

Invariants:
- A step always ends: the context manager and the decorator call ``step_end`` on the way out,
  also when the body raises (the body's exception wins over an error from ``step_end``).
- ``@step`` covers the body's execution: for a coroutine function until the coroutine
  returns, for a generator or async generator function until it is exhausted or closed.
- Steps do not nest: a ``step`` entered inside another in the same thread or asyncio task
  raises ``RuntimeError`` (the library would end the outer step silently).
- Threads and tasks that enter a ``step`` of the phase already open join that process-wide
  step; it ends when the last of them leaves. A ``step`` of another phase while one is open
  elsewhere raises ``RuntimeError`` naming both phases.
- Before the allocator exists and before ``install()``, a step reaches no library: there is
  nothing to measure or release, and beginning one would create the allocator and fix its
  configuration. Such steps are not counted.
- Phases are a small, bounded label set (they become metric labels): use a few fixed names
  such as ``rollout``, ``train``, ``eval``, never per-step names.
- A phase is checked at every ``step_begin``, also before the allocator exists: its name by the
  library's own rule (``stepalloc_check_phase``, which creates nothing), and the number of
  distinct phases this process used against the library's bound (``MAX_PHASES``), so a name
  that the library would refuse at the first step after the first allocation is refused at the
  first step.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Literal, TypeVar

from . import _lib

F = TypeVar("F", bound=Callable[..., Any])

# The process-wide step opened through `step` (phase, and how many threads or tasks are in
# it), guarded by `_state_lock`; `_inside` is the phase of the step the current thread or task
# entered (a context variable: per thread, and per asyncio task).
_state_lock = threading.Lock()
_open_phase: str | None = None
_holders = 0
_inside: contextvars.ContextVar[str | None] = contextvars.ContextVar("stepalloc_step", default=None)
# Whether the last `step_begin` stopped short of the library (see the invariants).
_begin_skipped = False

# The library's bound on distinct phases (``MAX_PHASES`` in src/step.rs), and the phases this
# process has begun steps of (at most that many), guarded by `_phases_lock`.
MAX_PHASES = 32
_phases_lock = threading.Lock()
_phases: set[str] = set()


def _admit_phase(phase: str) -> bytes:
    """Checks ``phase`` as the library does when a step of it begins, without creating the
    allocator, and counts it among this process's phases; returns its bytes for the C call.
    Raises ``TypeError`` for a non-string, ``ConfigError`` (a ``ValueError``) for a name outside
    the library's rule (1 to 64 letters, digits, ``_``, ``-`` or ``.``) or a phase past the
    ``MAX_PHASES`` distinct ones."""
    data = _lib.c_string(phase, "step phase")
    _lib.check(int(_lib.lib().stepalloc_check_phase(data, len(data))))
    with _phases_lock:
        if phase not in _phases:
            if len(_phases) >= MAX_PHASES:
                raise _lib.ConfigError(
                    f"too many phases (at most {MAX_PHASES}); {phase!r} is one more: phases are a small fixed "
                    "set of labels (rollout, train, eval), never per-step names",
                    _lib.INVALID_ARGUMENT,
                )
            _phases.add(phase)
    return data


def step_begin(phase: str = "step") -> None:
    """Marks the start of a step of ``phase`` on every device (process-wide).

    A step of another phase than the previous one is a phase switch: with ``phase_trim:True``
    the cache is trimmed to what this phase needed before. Before the allocator exists and
    before ``install()`` this only checks the phase (nothing is measured; the configuration
    stays open). Raises ``ConfigError`` (a ``ValueError``) for a name the library refuses or a
    phase past ``MAX_PHASES``, before the allocator exists as after.
    """
    global _begin_skipped
    data = _admit_phase(phase)
    if not _lib.configuration_fixed():
        _begin_skipped = True
        return
    _begin_skipped = False
    _lib.check(_lib.lib().stepalloc_step_begin(data))


def step_end() -> None:
    """Marks the end of the current step; runs the step-end release policies
    (``release_idle_steps``, ``cache_limit_mb``) and records the step's figures. Ends nothing
    when the step began before the allocator existed (see ``step_begin``)."""
    global _begin_skipped
    skipped, _begin_skipped = _begin_skipped, False
    if skipped or not _lib.initialised():
        return
    _lib.check(_lib.lib().stepalloc_step_end())


class step(contextlib.ContextDecorator):
    """A step of ``phase``, as a context manager or a decorator::

    with stepalloc.step("rollout"):
        ...

    @stepalloc.step("train")
    def train_step(batch): ...

    @stepalloc.step("rollout")
    async def rollout(env): ...  # the step lasts until the coroutine returns

    Steps are per process: threads or asyncio tasks inside ``step`` of one phase share one step,
    which ends when the last of them leaves; another phase meanwhile raises ``RuntimeError``.
    """

    def __init__(self, phase: str = "step") -> None:
        _lib.c_string(phase, "step phase")  # a type or NUL error here, not at the first use
        self.phase = phase

    def _recreate_cm(self) -> step:
        # Each decorated call gets its own context manager: calls may overlap (threads, tasks).
        return step(self.phase)

    def __call__(self, func: F) -> F:  # type: ignore[override]
        phase = self.phase
        if inspect.isasyncgenfunction(func):

            @functools.wraps(func)
            async def async_generator(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                with step(phase):
                    inner = func(*args, **kwargs)
                    try:
                        item = await inner.__anext__()
                        while True:
                            try:
                                sent = yield item
                            except GeneratorExit:
                                raise
                            except BaseException as thrown:  # noqa: BLE001 - handed to the body
                                item = await inner.athrow(thrown)
                            else:
                                item = await inner.asend(sent)
                    except StopAsyncIteration:
                        return
                    finally:
                        await inner.aclose()

            return async_generator  # type: ignore[return-value]
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def coroutine(*args: Any, **kwargs: Any) -> Any:
                with step(phase):
                    return await func(*args, **kwargs)

            return coroutine  # type: ignore[return-value]
        if inspect.isgeneratorfunction(func):

            @functools.wraps(func)
            def generator(*args: Any, **kwargs: Any) -> Iterator[Any]:
                with step(phase):
                    return (yield from func(*args, **kwargs))

            return generator  # type: ignore[return-value]
        return super().__call__(func)  # type: ignore[return-value]

    def __enter__(self) -> step:
        global _open_phase, _holders
        with _state_lock:
            mine = _inside.get()
            if mine is not None:
                raise RuntimeError(
                    f"stepalloc steps do not nest: step({self.phase!r}) began inside step({mine!r}) in the "
                    "same thread or task; end one phase before the next begins"
                )
            if _open_phase is None:
                step_begin(self.phase)
                _open_phase, _holders = self.phase, 0
            elif _open_phase != self.phase:
                raise RuntimeError(
                    f"stepalloc steps are process-wide: step({self.phase!r}) cannot begin while "
                    f"step({_open_phase!r}) is open in another thread or task; one phase runs at a time"
                )
            _holders += 1
            _inside.set(self.phase)
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> Literal[False]:
        global _open_phase, _holders
        with _state_lock:
            # Steps do not nest, so this context was in no step before this one.
            _inside.set(None)
            _holders -= 1
            if _holders > 0:
                return False
            _open_phase = None
            try:
                step_end()
            except _lib.StepallocError:
                if exc is None:
                    raise
        return False

    def __repr__(self) -> str:
        return f"stepalloc.step({self.phase!r})"
