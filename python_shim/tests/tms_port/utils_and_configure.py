"""Ported from fzyzcjy/torch_memory_saver ``test/test_configure_subprocess.py`` and
``test/test_utils.py`` at 4a43c97: the tests of the library's behaviour that a program sees.

Changed: they run in a child through the examples' runner, not in pytest's process (importing
either implementation needs testdrv's environment). ``configure_subprocess``: the original
patches ``torch_memory_saver.hooks.mode_preload.get_binary_path_from_package`` (an internal) to a
fake path; here the real one runs. What a program relies on is asserted under both: an
``LD_PRELOAD`` already set keeps its entries inside the context, and after it ``LD_PRELOAD`` is
as it was (set or unset). The original's "the library comes first" is asserted for the wheel
(its preload library); stepalloc needs no preload, so its ``configure_subprocess`` must leave
``LD_PRELOAD`` unchanged. ``test_utils.py``: only ``test_cpu_backup_backend_requires_enable`` is
the library's behaviour and is ported; the others test the wheel's packaging
(``get_binary_path_from_package``'s ROCm / CUDA binary names), a test helper (``change_env``) or
XPU / ROCm refusals (stepalloc runs on CUDA only).
"""

import os

import torch_memory_saver


def _is_wheel() -> bool:
    return torch_memory_saver.__name__ == "torch_memory_saver"


def _ld_preload_in_context(initial):
    if initial is None:
        os.environ.pop("LD_PRELOAD", None)
    else:
        os.environ["LD_PRELOAD"] = initial
    with torch_memory_saver.configure_subprocess():
        inside = os.environ.get("LD_PRELOAD", "")
    return inside, os.environ.get("LD_PRELOAD")


def run_configure_subprocess(hook_mode: str):
    saved = os.environ.get("LD_PRELOAD")
    try:
        # test_sets_ld_preload_when_unset
        inside, after = _ld_preload_in_context(None)
        if _is_wheel():
            assert inside.endswith(".so") and "torch_memory_saver_hook_mode_preload" in inside, inside
        else:
            assert inside == "", inside
        assert after is None, after

        # test_prepends_without_overwriting_existing
        existing = "/other/lib.so"
        inside, _ = _ld_preload_in_context(existing)
        parts = inside.split(":")
        if _is_wheel():
            assert "torch_memory_saver_hook_mode_preload" in parts[0], "TMS lib must come first"
        assert existing in parts, "Pre-existing LD_PRELOAD entry must not be dropped"

        # test_restores_ld_preload_after_context
        original = "/original/lib.so"
        inside, after = _ld_preload_in_context(original)
        if _is_wheel():
            assert inside != original
        assert after == original, after
    finally:
        if saved is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = saved


def run_backend_requires_enable(hook_mode: str):
    # test_cpu_backup_backend_requires_enable
    tms = torch_memory_saver.TorchMemorySaver()
    tms.hook_mode = hook_mode
    try:
        with tms.region(enable_cpu_backup=False, cpu_backup_backend="mmap"):
            pass
    except ValueError as e:
        assert "requires enable_cpu_backup" in str(e), str(e)
    else:
        raise AssertionError("region(enable_cpu_backup=False, cpu_backup_backend='mmap') did not raise")
