"""Layer: integrations — a vLLM sleep-mode backend over ``stepalloc.cumem`` (vLLM 0.34's
``SleepModeBackend``, RFC #34303), selected by name: ``LLM(..., enable_sleep_mode=True,
sleep_mode_backend="stepalloc")`` or ``vllm serve ... --sleep-mode-backend stepalloc``.

vLLM finds it through the ``vllm.general_plugins`` entry point ``stepalloc =
stepalloc.vllm_backend:register`` (python_shim/pyproject.toml), which vLLM runs in each of its
processes before a model loads; nothing is patched by the user.

Invariants:
- ``register()`` registers ``StepallocBackend`` under ``"stepalloc"`` with vLLM's
  ``SleepModeBackendFactory`` (lazily: the factory imports this module when the backend is
  chosen), once per process however often vLLM loads its plugins.
- vLLM 0.34's worker allocates its sleep-mode pools (weights, kv_cache, runtime, workspace, the
  CUDA-graph pool) through ``vllm.device_allocator.get_mem_allocator_instance()``, that is vLLM's
  ``CuMemAllocator`` singleton, whichever backend is chosen, and a backend can only suspend what
  its allocator holds. So ``register()`` also puts a selector in that singleton's slot, when the
  slot is still empty: at its first use (the worker's model load, under
  ``set_current_vllm_config``) it becomes stepalloc's allocator (``stepalloc.cumem``, the same
  surface) if the current vLLM config chose ``"stepalloc"``, and vLLM's own ``CuMemAllocator``
  otherwise, so installing stepalloc changes nothing for a user who chose another backend.
- The backend's calls are the default ``cumem`` backend's, on stepalloc's allocator: suspend
  offloads ``("weights", "runtime", "cudagraph")`` and discards the rest and the
  ``discardable`` storage; resume wakes ``tags`` and every tag that cannot be deferred.
- Capability flags say only what is tested (tests/test_vllm_backend.py): communicators are
  preserved (a suspend touches the pools' memory only); compiled artifacts and graphs with
  communicators are not claimed, nor durable storage (backups live in this process).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection
from typing import Any

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

NAME = "stepalloc"
# What a suspend offloads (the default cumem backend's tags, vLLM 0.34).
SUSPEND_TAGS: tuple[str, ...] = ("weights", "runtime", "cudagraph")

logger = logging.getLogger(__name__)


def _allocator() -> Any:
    from .cumem import CuMemAllocator

    return CuMemAllocator.get_instance()


class StepallocBackend(SleepModeBackend):
    """vLLM's sleep-mode backend over stepalloc: the pools' memory is paused with its addresses
    kept (backups copied in large asynchronous pieces into buffers kept across cycles, the
    device synchronized before the first unmap) and resumed in place."""

    def suspend(self, discardable: Collection[int] = ()) -> None:
        _check_routing()
        self._state = "SUSPENDED"
        _allocator().sleep(SUSPEND_TAGS, discardable)

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        _allocator().wake_up(tags)
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        _allocator().discard(tags)
        self._state = "SUSPENDED"

    @classmethod
    def is_supported(cls) -> bool:
        """stepalloc's library loads and CUDA is available."""
        from . import _lib

        try:
            _lib.lib()
        except _lib.LibraryNotFoundError:
            return False
        import torch

        return torch.cuda.is_available()

    @classmethod
    def preserves_communicators(cls) -> bool:
        # A suspend pauses the pools' memory only: communicators and their buffers, outside
        # the pools, stay as they are.
        return True


class _Selector:
    """What ``register()`` puts in vLLM's ``CuMemAllocator`` singleton slot: at its first use it
    becomes stepalloc's allocator when the current vLLM config chose this backend, else vLLM's
    own (see the module docstring); every attribute is the chosen allocator's."""

    def __init__(self, vllm_class: type) -> None:
        self._vllm_class = vllm_class
        self._chosen: Any = None

    def _target(self) -> Any:
        if self._chosen is None:
            self._chosen = _allocator() if chosen_in_current_config() else self._vllm_class()
            logger.info("vLLM's sleep-mode allocator is %s", type(self._chosen).__module__)
        return self._chosen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)


def _check_routing() -> None:
    """Refuses to suspend when vLLM's own allocator holds the pools (the selector was not in
    its slot, or chose vLLM's allocator): a suspend would free none of the worker's memory."""
    cumem = sys.modules.get("vllm.device_allocator.cumem")
    instance = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
    if instance is None:
        return
    vllm_own = instance._chosen if isinstance(instance, _Selector) else instance
    if vllm_own is None or type(vllm_own).__module__ == "stepalloc.cumem":
        return
    held = len(getattr(vllm_own, "pointer_to_data", {}))
    if held:
        raise RuntimeError(
            f"sleep-mode backend {NAME!r}: vLLM's own CuMemAllocator holds the worker's pools ({held} "
            "allocations), so stepalloc would free none of them. Choose the backend in the engine's "
            f"config (sleep_mode_backend={NAME!r}) with stepalloc installed in the worker's environment, "
            "so that its vllm.general_plugins entry point runs before the model loads"
        )


def chosen_in_current_config() -> bool:
    """Whether the vLLM config current now (``set_current_vllm_config``) chose this backend.
    vLLM's config module is read only if vLLM imported it (it is not imported here)."""
    config_module = sys.modules.get("vllm.config.vllm")
    current = getattr(config_module, "get_current_vllm_config_or_none", None)
    config = current() if current is not None else None
    return getattr(getattr(config, "model_config", None), "sleep_mode_backend", None) == NAME


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the backend and the allocator
    selector (idempotent: vLLM may load its plugins several times in one process)."""
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    try:
        SleepModeBackendFactory.register_backend(NAME, __name__, StepallocBackend.__name__)
    except ValueError:
        return  # registered already in this process: so is the selector
    try:
        from vllm.device_allocator import cumem
    except Exception as e:  # noqa: BLE001 - a vLLM without its cumem allocator: nothing to route
        logger.debug("stepalloc: vLLM's cumem allocator is not importable (%s): no selector", e)
        return
    if cumem.cumem_available and cumem.CuMemAllocator.instance is None:
        import atexit

        cumem.CuMemAllocator.instance = _Selector(cumem.CuMemAllocator)
        # vLLM registers its teardown when it creates the singleton; the slot is filled here.
        atexit.register(cumem.CuMemAllocator._shutdown_singleton)
