"""Several tags in one pause or resume: ``stepalloc.pause([...])`` / ``resume([...])`` go to the
library's list calls (``stepalloc_pause_tags`` / ``stepalloc_resume_tags``: one heap call per
device), a bad list changes nothing, and a per-tag backup choice (vLLM's ``offload_tags``)
travels as ``name=0|1``. The library over the simulated device in this process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import stepalloc
from conftest import MIB
from stepalloc import sleep as sleep_mod

DEV = 1


@pytest.fixture(autouse=True)
def _leave_the_session_as_found() -> Iterator[None]:
    yield
    if stepalloc.paused_tags():
        stepalloc.resume()
    stepalloc.empty_cache()
    stepalloc.release_backup()


def test_a_list_pauses_and_resumes_every_tag_in_one_call() -> None:
    with stepalloc.region("several_py_w", backup=True):
        w = stepalloc.raw_alloc(24 * MIB, DEV)
    with stepalloc.region("several_py_kv"):
        kv = stepalloc.raw_alloc(40 * MIB, DEV)
    try:
        r = stepalloc.pause(["several_py_w", "several_py_kv"])
        assert r.op == "pause" and r.tags == ("several_py_w", "several_py_kv")
        assert r.copied_bytes == 24 * MIB and r.discarded_bytes == 40 * MIB
        assert {"several_py_w", "several_py_kv"} <= set(stepalloc.paused_tags())
        r = stepalloc.resume(("several_py_kv", "several_py_w"))
        assert r.op == "resume" and r.copied_bytes == 24 * MIB
        assert not {"several_py_w", "several_py_kv"} & set(stepalloc.paused_tags())
        # A name twice counts once.
        assert stepalloc.pause(["several_py_w", "several_py_w"]).tags == ("several_py_w",)
        stepalloc.resume(["several_py_w"])
    finally:
        stepalloc.raw_free(w, 0, DEV)
        stepalloc.raw_free(kv, 0, DEV)


def test_a_bad_list_changes_nothing() -> None:
    with stepalloc.region("several_py_bad", backup=True):
        p = stepalloc.raw_alloc(8 * MIB, DEV)
    try:
        with pytest.raises(ValueError, match="several_py_never"):
            stepalloc.pause(["several_py_bad", "several_py_never"])
        assert "several_py_bad" not in stepalloc.paused_tags()
        with pytest.raises(ValueError, match="no ',' or '='"):
            stepalloc.pause(["several_py_bad,other"])
        with pytest.raises(ValueError, match="empty list"):
            stepalloc.resume([])
        with pytest.raises(TypeError):
            stepalloc.pause([b"several_py_bad"])  # type: ignore[list-item]
        assert "several_py_bad" not in stepalloc.paused_tags()
    finally:
        stepalloc.raw_free(p, 0, DEV)


def test_a_backup_choice_per_tag_in_one_call() -> None:
    """vLLM's ``sleep(offload_tags=...)``: the offloaded tag backed up, the other discarded,
    whatever their regions asked for."""
    with stepalloc.region("several_py_a"):
        a = stepalloc.raw_alloc(10 * MIB, DEV)
    with stepalloc.region("several_py_b", backup=True):
        b = stepalloc.raw_alloc(12 * MIB, DEV)
    try:
        r = sleep_mod._pause_each({"several_py_a": True, "several_py_b": False})
        assert r.copied_bytes == 10 * MIB and r.discarded_bytes == 12 * MIB
        assert stepalloc.resume(["several_py_a", "several_py_b"]).copied_bytes == 10 * MIB
    finally:
        stepalloc.raw_free(a, 0, DEV)
        stepalloc.raw_free(b, 0, DEV)
