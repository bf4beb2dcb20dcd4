"""``stepalloc.memory_saver`` (issue 32): the backup belongs to the allocation, the ``torch``
hook mode after CUDA is initialised, torch_memory_saver's defaults and settings, the alias for
unchanged code, and bad input (no host memory for a backup, a capture, unknown tags).

Each scenario runs in a child Python with real PyTorch over testdrv (kernels do not run there:
values are set with host fills copied to the device and read back with copies).
"""

from __future__ import annotations

import textwrap

import pytest
from test_sleep import needs_torch, torch_env

from conftest import SHIM, check_child, run_python

HELPERS = """
import torch
MIB = 1 << 20
def full(n, value):
    return torch.full((n,), value, dtype=torch.uint8).cuda()
def read(t):
    return int(t.cpu()[0]), int(t.cpu()[-1])
def free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]
"""


def run(code: str, **env: str) -> str:
    full_env = torch_env(capacity_mb=1024)
    full_env.update(env)
    return check_child(run_python(HELPERS + textwrap.dedent(code), env=full_env, timeout=240))


# Task 1: two regions of one tag, with and without backup, in both orders; the backed-up
# tensors keep their bytes, the others are discarded, whichever region came last.
BACKUP_PER_ALLOCATION = """
for order in ("backup first", "backup last"):
    tag = "t_" + order.replace(" ", "_")
    regions = [True, False] if order == "backup first" else [False, True]
    made = {}
    for backup in regions:
        with SAVER.region(tag=tag, enable_cpu_backup=backup):
            made[backup] = full(8 * MIB, 11 if backup else 22)
    SAVER.pause(tag)
    SAVER.resume(tag)
    assert read(made[True]) == (11, 11), (order, read(made[True]))
    print(order, "discarded:", read(made[False]))
# The default tag, as the issue's report: cpu backup first, then a region without.
with SAVER.region(enable_cpu_backup=True):
    a = full(8 * MIB, 33)
with SAVER.region(enable_cpu_backup=False):
    b = full(8 * MIB, 44)
SAVER.pause()
SAVER.resume()
assert read(a) == (33, 33), read(a)
print("ok=per_allocation")
"""


@needs_torch
@pytest.mark.parametrize("hook_mode", ["preload", "torch"])
def test_the_backup_belongs_to_the_allocation_in_both_hook_modes(hook_mode: str) -> None:
    code = f"from stepalloc.memory_saver import torch_memory_saver as SAVER\nSAVER.hook_mode = {hook_mode!r}\n"
    assert "ok=per_allocation" in run(code + BACKUP_PER_ALLOCATION)


@needs_torch
def test_stepalloc_regions_of_one_tag_with_different_backups_keep_their_own() -> None:
    out = run(
        """
        import stepalloc
        stepalloc.install()
        with stepalloc.region("mixed", backup=True):
            kept = full(8 * MIB, 5)
        with stepalloc.region("mixed", backup=False):
            gone = full(4 * MIB, 6)
        r = stepalloc.pause("mixed")
        assert r.copied_bytes == 8 * MIB and r.discarded_bytes == 4 * MIB, r
        assert stepalloc.tags()["mixed"]["backup"] is True
        stepalloc.resume("mixed")
        assert read(kept) == (5, 5), read(kept)
        # The later region without backup did not change the first one's; nor the reverse.
        with stepalloc.region("mixed", backup=True):
            kept2 = full(2 * MIB, 7)
        r = stepalloc.pause("mixed")
        assert r.copied_bytes == 10 * MIB and r.discarded_bytes == 4 * MIB, r
        stepalloc.resume("mixed")
        assert read(kept) == (5, 5) and read(kept2) == (7, 7)
        print("ok=region")
        """
    )
    assert "ok=region" in out


# Task 2: CUDA is initialised (a tensor exists) before the saver is first used.
TORCH_MODE_AFTER_INIT = """
from stepalloc.memory_saver import torch_memory_saver as SAVER
import stepalloc
early = full(4 * MIB, 1)  # CUDA initialised, PyTorch's own allocator
assert torch.cuda.is_initialized() and not stepalloc.is_installed()
SAVER.hook_mode = "torch"
with SAVER.region(tag="weights", enable_cpu_backup=True):
    w = full(64 * MIB, 42)
with SAVER.region(tag="kv"):
    kv = full(96 * MIB, 9)
ptr_w, ptr_kv = w.data_ptr(), kv.data_ptr()
f0 = free()
SAVER.pause("kv")
assert free() >= f0 + 96 * MIB, (f0, free())
SAVER.pause("weights")
assert free() >= f0 + 160 * MIB
host = SAVER.get_cpu_backup(w)
assert host is not None and int(host[0]) == 42 and int(host[-1]) == 42
assert SAVER.get_cpu_backup(kv) is None
SAVER.resume()
assert free() <= f0 + 2 * MIB
assert w.data_ptr() == ptr_w and kv.data_ptr() == ptr_kv
assert read(w) == (42, 42) and read(early) == (1, 1)
assert not stepalloc.is_installed(), "no process-wide install"
# A later region of the same tag without backup keeps the first one's bytes.
with SAVER.region(tag="weights", enable_cpu_backup=False):
    scratch = full(8 * MIB, 3)
SAVER.pause()
SAVER.resume()
assert read(w) == (42, 42)
with SAVER.disable():
    plain = full(8 * MIB, 8)
SAVER.pause()
assert read(plain) == (8, 8)
SAVER.resume()
print("ok=torch_mode")
"""


@needs_torch
def test_torch_hook_mode_works_after_cuda_is_initialised() -> None:
    assert "ok=torch_mode" in run(TORCH_MODE_AFTER_INIT)


@needs_torch
def test_cuda_already_initialised_without_hook_mode_uses_pools_too() -> None:
    out = run(
        """
        from stepalloc.memory_saver import torch_memory_saver as SAVER
        early = full(MIB, 1)
        with SAVER.region(enable_cpu_backup=True):
            w = full(16 * MIB, 4)
        SAVER.pause(); SAVER.resume()
        assert read(w) == (4, 4)
        print("ok=after_init")
        """
    )
    assert "ok=after_init" in out


# Task 3: torch_memory_saver's defaults; settings before the first region are accepted.
@needs_torch
@pytest.mark.parametrize("retain_env", [None, "1"])
def test_defaults_and_settings_before_the_first_region(retain_env: str | None) -> None:
    env = {} if retain_env is None else {"TMS_RETAIN_CPU_BACKUP": retain_env}
    expected = retain_env == "1"
    out = run(
        f"""
        from stepalloc.memory_saver import torch_memory_saver as SAVER
        import stepalloc
        assert SAVER.retain_cpu_backup is {expected}
        SAVER.retain_cpu_backup = {expected}   # before any region: accepted
        SAVER.memory_margin_bytes = 0
        SAVER.hook_mode = "preload"
        with SAVER.region(tag="w", enable_cpu_backup=True):
            w = full(8 * MIB, 12)
        SAVER.pause("w"); SAVER.resume("w")
        assert read(w) == (12, 12)
        held = stepalloc.stepalloc_stats()["backup_host_bytes"]
        assert (held > 0) is {expected}, held
        print("ok=settings")
        """,
        **env,
    )
    assert "ok=settings" in out


# Task 4: unchanged code that imports torch_memory_saver gets stepalloc's.
UNCHANGED_SCRIPT = """
import torch
from torch_memory_saver import torch_memory_saver
assert type(torch_memory_saver).__module__ == "stepalloc.memory_saver", type(torch_memory_saver)
with torch_memory_saver.region(enable_cpu_backup=True):
    t = torch.full((4 << 20,), 17, dtype=torch.uint8).cuda()
torch_memory_saver.pause()
torch_memory_saver.resume()
assert int(t.cpu()[-1]) == 17
print("ok=unchanged")
"""


@needs_torch
def test_unchanged_code_importing_torch_memory_saver_gets_stepallocs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "unchanged.py"
    script.write_text(UNCHANGED_SCRIPT)
    runner = f"import runpy, sys\nsys.argv = ['x', {str(script)!r}]\nrunpy.run_module('stepalloc.memory_saver', run_name='__main__')\n"
    out = check_child(run_python(runner, env=torch_env(capacity_mb=1024), timeout=240))
    assert "ok=unchanged" in out
    # The environment variable, with stepalloc imported first (a sitecustomize, a launcher).
    env = torch_env(capacity_mb=1024)
    env["STEPALLOC_AS_TORCH_MEMORY_SAVER"] = "1"
    out = check_child(run_python("import stepalloc\n" + UNCHANGED_SCRIPT, env=env, timeout=240))
    assert "ok=unchanged" in out


# Task 5: bad input.
@needs_torch
@pytest.mark.parametrize("hook_mode", ["preload", "torch"])
def test_no_host_memory_for_the_backup_fails_the_pause_and_loses_nothing(hook_mode: str) -> None:
    out = run(
        f"""
        from stepalloc.memory_saver import torch_memory_saver as SAVER
        import ctypes, stepalloc
        SAVER.hook_mode = {hook_mode!r}
        with SAVER.region(tag="w", enable_cpu_backup=True):
            w = full(32 * MIB, 21)
        with SAVER.region(tag="w"):
            scratch = full(8 * MIB, 22)
        f0 = free()
        # Every pinned host allocation fails from now on (testdrv's failure injection).
        hc = ctypes.CDLL("libcuda.so.1")
        assert hc.hostcuda_set(b"fail", b"cuMemHostAlloc:2") == 0
        try:
            SAVER.pause("w")
            raise AssertionError("pause without host memory succeeded")
        except Exception as e:
            msg = str(e)
            assert "pinned host memory" in msg and "nothing was released" in msg, msg
        assert free() <= f0 + MIB, "nothing released"
        assert not stepalloc.tags()["w"]["paused"]
        assert read(w) == (21, 21) and read(scratch) == (22, 22), "nothing lost"
        hc.hostcuda_set(b"fail", b"")
        SAVER.pause("w"); SAVER.resume("w")
        assert read(w) == (21, 21)
        print("ok=host_oom")
        """,
        HOSTCUDA_TRACE="0",
    )
    assert "ok=host_oom" in out


@needs_torch
def test_unknown_and_repeated_tags_behave_as_torch_memory_savers() -> None:
    out = run(
        """
        from stepalloc.memory_saver import torch_memory_saver as SAVER
        SAVER.pause("never_seen")        # torch_memory_saver: no allocation of it, nothing to do
        SAVER.resume("never_seen")
        with SAVER.region(tag="x", enable_cpu_backup=True):
            x = full(4 * MIB, 3)
        # torch_memory_saver exits the process on these two ("Cannot resume allocation that is
        # not paused", "Cannot pause allocation that is not active"); here they raise, and
        # nothing changes.
        try:
            SAVER.resume("x")
            raise AssertionError("resume of a tag that is not paused")
        except RuntimeError as e:
            assert "not paused" in str(e), e
        SAVER.pause("x")
        try:
            SAVER.pause("x")
            raise AssertionError("pause of a paused tag")
        except RuntimeError as e:
            assert "paused already" in str(e), e
        SAVER.resume("x")
        SAVER.pause(); SAVER.resume()     # without a tag: every tag, whatever its state
        assert read(x) == (3, 3)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            g.capture_begin()
            try:
                SAVER.pause("x")
                raise AssertionError("pause during a capture")
            except RuntimeError as e:
                assert "capture" in str(e), e
            finally:
                g.capture_end()
        print("ok=misuse")
        """
    )
    assert "ok=misuse" in out


def test_alias_refuses_once_the_real_one_is_imported() -> None:
    import sys

    from stepalloc import memory_saver

    saved = sys.modules.get("torch_memory_saver")
    sys.modules["torch_memory_saver"] = object()  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match="imported already"):
            memory_saver.alias_torch_memory_saver()
    finally:
        if saved is None:
            del sys.modules["torch_memory_saver"]
        else:
            sys.modules["torch_memory_saver"] = saved
    assert SHIM.exists()


# torch_memory_saver's retain_cpu_backup: after a resume with retain on, get_cpu_backup still
# gives the last backup, at the same host address across cycles; without retain, None.
@needs_torch
@pytest.mark.parametrize("hook_mode", ["preload", "torch"])
def test_a_retained_backup_stays_readable_after_resume(hook_mode: str) -> None:
    out = run(
        f"""
        from stepalloc.memory_saver import torch_memory_saver as SAVER
        SAVER.hook_mode = {hook_mode!r}
        expected = torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8)
        with SAVER.region(tag="r", enable_cpu_backup=True):
            t = expected.cuda()
        SAVER.pause("r")
        first = SAVER.get_cpu_backup(t, zero_copy=True)
        assert torch.equal(first, expected)
        SAVER.retain_cpu_backup = True
        SAVER.resume("r")
        after = SAVER.get_cpu_backup(t, zero_copy=True)
        assert after is not None and after.data_ptr() == first.data_ptr() and torch.equal(after, expected)
        t.copy_(expected.flip(0))
        SAVER.pause("r")
        second = SAVER.get_cpu_backup(t, zero_copy=True)
        assert second.data_ptr() == first.data_ptr() and torch.equal(second, expected.flip(0))
        SAVER.retain_cpu_backup = False
        SAVER.resume("r")
        assert SAVER.get_cpu_backup(t) is None
        assert torch.equal(t.cpu(), expected.flip(0))
        print("ok=retain")
        """
    )
    assert "ok=retain" in out


@needs_torch
def test_tms_init_enable_tracks_from_import_and_disable_gives_its_memory_back() -> None:
    # torch_memory_saver's preload library tracks from the process's start under
    # TMS_INIT_ENABLE (its training_engine example allocates before any call to the saver);
    # disable() disposes of what it allocated at its exit, and leaves the paused memory paused.
    out = run(
        """
        from stepalloc.memory_saver import torch_memory_saver as SAVER
        import stepalloc
        assert stepalloc.is_installed(), "TMS_INIT_ENABLE=1: process-wide from the import"
        f0 = free()
        w = full(64 * MIB, 42)  # before any call to the saver
        assert free() <= f0 - 64 * MIB
        SAVER.pause()
        f_paused = free()
        assert f_paused >= f0, (f_paused, f0)  # all of it went back
        with SAVER.disable():
            d = full(128 * MIB, 7)
            assert free() <= f_paused - 128 * MIB
            assert read(d) == (7, 7)
            del d
        assert free() == f_paused, (free(), f_paused)  # given back at the exit
        SAVER.resume()
        assert read(w) == (42, 42)  # TMS_INIT_ENABLE_CPU_BACKUP=1
        try:
            SAVER.hook_mode = "torch"
        except RuntimeError as e:
            assert "TMS_INIT_ENABLE" in str(e), str(e)
        else:
            raise AssertionError("hook_mode='torch' accepted after a process-wide start")
        print("ok=init_enable")
        """,
        TMS_INIT_ENABLE="1",
        TMS_INIT_ENABLE_CPU_BACKUP="1",
    )
    assert "ok=init_enable" in out


@needs_torch
def test_the_savers_resume_maps_its_cached_memory_back_and_stepallocs_pause_does_not() -> None:
    # torch_memory_saver remaps PyTorch's whole segments at resume: the memory of tensors freed
    # before the pause (cached) comes back, and the tag's next tensors reuse it. The saver's
    # tags are paused with keep_cached; stepalloc's own pause releases the cache for good.
    out = run(
        """
        from stepalloc.memory_saver import torch_memory_saver as SAVER
        import stepalloc
        from stepalloc import sleep
        f0 = free()
        with SAVER.region(tag="kc", enable_cpu_backup=True):
            keep = full(64 * MIB, 5)
            gone = full(128 * MIB, 6)
        del gone  # cached
        f_cached = free()
        assert f_cached <= f0 - 192 * MIB, (f0, f_cached)
        SAVER.pause("kc")
        f_kc = free()
        assert f_kc >= f_cached + 190 * MIB, (f_kc, f_cached)
        with SAVER.region(tag="kc2"):
            late = full(32 * MIB, 8)
        # Its memory: whole pages of the tag's segment, 32 MiB or more.
        f_late = f_cached - (f_kc - free())
        SAVER.pause("kc2")
        del late  # freed while paused: cached memory at the resume too
        f_paused = free()
        SAVER.resume()
        assert abs(free() - f_late) <= 2 * MIB, (free(), f_late)
        assert read(keep) == (5, 5)
        with SAVER.region(tag="kc", enable_cpu_backup=True):  # the same tag number: its cache
            again = full(128 * MIB, 7)
        with SAVER.region(tag="kc2"):
            again2 = full(32 * MIB, 9)
        assert abs(free() - f_late) <= 2 * MIB, ("the cached memory served them", free(), f_late)
        print("ok=keep_cached")
        """
    )
    assert "ok=keep_cached" in out
    # In a process of its own (after the saver's regions above, stepalloc.region's tensors in
    # that process were counted in no tag: see the report of issue 32's keep_cached work).
    out = run(
        """
        import stepalloc
        from stepalloc import sleep
        stepalloc.install("backend:cuda," + stepalloc.RECOMMENDED)
        with stepalloc.region("plain_kc", backup=True):
            kept = full(64 * MIB, 1)
            dropped = full(128 * MIB, 2)
        del dropped
        f1 = free()
        stepalloc.pause("plain_kc")
        stepalloc.resume("plain_kc")
        assert free() >= f1 + 120 * MIB, (free(), f1)  # the cache went for good
        assert read(kept) == (1, 1)
        try:
            sleep.keep_cached("default")
        except ValueError as e:
            assert "default" in str(e), str(e)
        else:
            raise AssertionError("keep_cached of default accepted")
        print("ok=default_releases")
        """
    )
    assert "ok=default_releases" in out


@needs_torch
def test_a_region_under_pytorchs_own_allocator_is_refused_and_the_rooms_still_work() -> None:
    # CUDA initialised before any install: PyTorch's allocator serves plain tensors, so a bare
    # stepalloc.region would tag nothing and a pause of it would release nothing (it did, before:
    # tags() showed the tag with 0 live bytes and pause() "paused" it). The rooms route their
    # regions through stepalloc's pools and keep working.
    out = run(
        """
        from stepalloc.memory_saver import torch_memory_saver as SAVER
        import stepalloc, torch
        f0 = free()  # CUDA initialised, PyTorch's allocator
        try:
            with stepalloc.region("bare"):
                full(MIB, 1)
        except stepalloc.StepallocError as e:
            assert "install()" in str(e) and "'bare'" in str(e), str(e)
            print("ok=refused")
        with SAVER.region(tag="kc"):
            kept = full(64 * MIB, 3)
        assert stepalloc.tags()["kc"]["live_bytes"] >= 64 * MIB, stepalloc.tags()["kc"]
        SAVER.pause("kc")
        assert free() >= f0 - 8 * MIB, (free(), f0)
        SAVER.resume("kc")
        print("ok=room")
        """
    )
    assert "ok=refused" in out and "ok=room" in out
