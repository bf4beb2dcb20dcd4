"""Layer: step hooks for training frameworks and hand-written agent loops.

Invariants:
- transformers and lightning are imported only when their callback is asked for
  (``hf_callback()``, ``lightning_callback()``, or the class names through this module's
  ``__getattr__``); ``import stepalloc`` never imports them.
- Every callback keeps at most one step open: a begin while a step is open ends that step
  first, so an exception that skipped an end hook cannot wedge the phase accounting.
- Under torchrun every callback names its rank: ``callback.rank`` and the line it logs (logger
  ``stepalloc``) when training ends, so the ranks' reports can be told apart in a merged log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from . import steps
from .ranks import rank_info
from .stats import _fmt_bytes, device_index, memory_stats, stepalloc_stats

logger = logging.getLogger("stepalloc")


def rank_report(phases: tuple[str, ...], device: Any = None) -> str:
    """One line naming this rank (under torchrun) and its device's peaks and step counts, e.g.
    ``stepalloc rank 1 (local rank 1, node 0), device 1: peak reserved 96 MiB, peak allocated
    80 MiB; steps: train 3``; the callbacks log it when training ends."""
    who = rank_info().describe()
    index = device_index(device)
    stats = memory_stats(index, include_stepalloc=True)
    counts = ", ".join(f"{p} {int(stats.get(f'stepalloc.steps.{p}', 0))}" for p in phases)
    return (
        f"stepalloc {who + ', ' if who else ''}device {index}: "
        f"peak reserved {_fmt_bytes(stats.get('reserved_bytes.all.peak', 0))}, "
        f"peak allocated {_fmt_bytes(stats.get('allocated_bytes.all.peak', 0))}; steps: {counts}"
    )


class _StepTracker:
    """Opens and closes library steps, at most one at a time."""

    def __init__(self) -> None:
        self.open = False

    def begin(self, phase: str) -> None:
        if self.open:
            self.end()
        steps.step_begin(phase)
        self.open = True

    def end(self) -> None:
        if self.open:
            self.open = False
            steps.step_end()


# ----- Hugging Face transformers ---------------------------------------------------------------

_hf_class: type | None = None


def _hf_callback_class() -> type:
    global _hf_class
    if _hf_class is None:
        try:
            from transformers import TrainerCallback
        except ImportError as e:
            raise ImportError("StepallocTrainerCallback needs transformers; `pip install transformers`") from e

        class StepallocTrainerCallback(TrainerCallback):  # type: ignore[misc, valid-type]
            """A ``transformers.TrainerCallback`` that makes each optimizer step a stepalloc step
            of phase ``phase`` (``Trainer(..., callbacks=[StepallocTrainerCallback()])``)."""

            def __init__(self, phase: str = "train") -> None:
                self.phase = phase
                self.rank = rank_info().rank  # None outside torchrun
                self._steps = _StepTracker()

            def report(self) -> str:
                """This rank's peaks and step count (see ``stepalloc.integrations.rank_report``)."""
                return rank_report((self.phase,))

            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self._steps.begin(self.phase)

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self._steps.end()

            def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self._steps.end()
                logger.info("%s", self.report())

        _hf_class = StepallocTrainerCallback
    return _hf_class


def hf_callback(phase: str = "train") -> Any:
    """A Hugging Face ``TrainerCallback`` marking each training step (imports transformers)."""
    return _hf_callback_class()(phase)


# ----- PyTorch Lightning ------------------------------------------------------------------------

_lightning_class: type | None = None


def _lightning_callback_class() -> type:
    global _lightning_class
    if _lightning_class is None:
        try:
            from lightning.pytorch import Callback
        except ImportError:
            try:
                from pytorch_lightning import Callback  # type: ignore[assignment]
            except ImportError as e:
                raise ImportError("StepallocLightningCallback needs lightning; `pip install lightning`") from e

        class StepallocLightningCallback(Callback):  # type: ignore[misc, valid-type]
            """A Lightning ``Callback`` making each training batch a step of ``train_phase`` and
            each validation batch a step of ``eval_phase``."""

            def __init__(self, train_phase: str = "train", eval_phase: str = "eval") -> None:
                super().__init__()
                self.train_phase = train_phase
                self.eval_phase = eval_phase
                self.rank = rank_info().rank  # None outside torchrun
                self._steps = _StepTracker()

            def report(self) -> str:
                """This rank's peaks and step counts (see ``stepalloc.integrations.rank_report``)."""
                return rank_report((self.train_phase, self.eval_phase))

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                self._steps.end()
                logger.info("%s", self.report())

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                self._steps.begin(self.train_phase)

            def on_train_batch_end(
                self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
            ) -> None:
                self._steps.end()

            def on_validation_batch_start(
                self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
            ) -> None:
                self._steps.begin(self.eval_phase)

            def on_validation_batch_end(
                self,
                trainer: Any,
                pl_module: Any,
                outputs: Any,
                batch: Any,
                batch_idx: int,
                dataloader_idx: int = 0,
            ) -> None:
                self._steps.end()

            def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
                self._steps.end()

        _lightning_class = StepallocLightningCallback
    return _lightning_class


def lightning_callback(train_phase: str = "train", eval_phase: str = "eval") -> Any:
    """A Lightning ``Callback`` marking training and validation batches (imports lightning)."""
    return _lightning_callback_class()(train_phase, eval_phase)


def __getattr__(name: str) -> Any:
    # Lazy class access: `from stepalloc.integrations import StepallocTrainerCallback`.
    if name == "StepallocTrainerCallback":
        return _hf_callback_class()
    if name == "StepallocLightningCallback":
        return _lightning_callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----- hand-written agent loops ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PhaseRecord:
    """Figures of one finished phase step, read from the library after it ended."""

    iteration: int
    phase: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_mallocs: int
    step_fragmentation: float
    rank: int | None = None  # under torchrun, the rank that recorded it


class AgentLoop:
    """Phases of an agent loop as stepalloc steps, with each step's figures kept::

        loop = stepalloc.AgentLoop()
        for _ in range(iterations):
            with loop.rollout():          # generation under torch.no_grad(), KV cache grows
                ...
            with loop.train():            # forward + backward + optimizer step
                ...
            loop.next_iteration()
        print(loop.history[-2:])

    ``phase(name)`` opens a step of any phase; keep the set of names small (metric labels).
    ``device`` is the device whose figures ``history`` records (None: torch's current device,
    else under torchrun the rank's device, else device 0, as the statistics read it).
    """

    def __init__(self, device: int | None = None, keep: int = 1000) -> None:
        self.device = device
        self.rank = rank_info().rank
        self.iteration = 0
        self.keep = keep
        self.history: list[PhaseRecord] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A step of phase ``name``; its figures are appended to ``history`` when it ends."""
        with steps.step(name):
            yield
        own = stepalloc_stats(self.device)
        self.history.append(
            PhaseRecord(
                iteration=self.iteration,
                phase=name,
                peak_allocated_bytes=int(own.get("last_step.peak_allocated_bytes", 0)),
                peak_reserved_bytes=int(own.get("last_step.peak_reserved_bytes", 0)),
                device_mallocs=int(own.get("last_step.device_mallocs", 0)),
                step_fragmentation=float(own.get("fragmentation.step", 0.0)),
                rank=self.rank,
            )
        )
        del self.history[: -self.keep]

    def rollout(self) -> contextlib.AbstractContextManager[None]:
        """A step of phase ``rollout``."""
        return self.phase("rollout")

    def train(self) -> contextlib.AbstractContextManager[None]:
        """A step of phase ``train``."""
        return self.phase("train")

    def next_iteration(self) -> int:
        """Counts one loop iteration (rollout + train); returns the new count."""
        self.iteration += 1
        return self.iteration
