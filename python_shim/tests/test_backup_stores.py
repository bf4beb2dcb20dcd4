"""torch_memory_saver's disk backup and its ``mmap`` CPU-backup backend under
``stepalloc.memory_saver`` (both hook modes), with real PyTorch over testdrv: the library's
backup stores (src/heap/backup.rs) seen from Python.

- ``cpu_backup_backend="mmap"``: the bytes go to pageable host memory: while paused the pinned
  figures stay 0 (``stepalloc.backup_host_bytes``, the tag's ``host_bytes``, the metric
  ``stepalloc_tag_backup_host_bytes{kind="pinned"}``) and ``kind="mmap"`` holds them;
  ``get_cpu_backup`` reads them; a pinned region beside it is pinned.
- Bad input: a pause whose disk files hit a file-size limit (``RLIMIT_FSIZE`` in the child,
  ``EFBIG``; Python ignores ``SIGXFSZ``) fails naming the tag and the directory, leaves no file,
  and the tag stays resident with its bytes (its mmap-backed part, paused first, is resumed);
  with the limit lifted the same pause works and the resume removes the files. A backup
  directory that cannot be created is refused when set, naming it.
"""

from __future__ import annotations

import pytest
from test_sleep import needs_torch, torch_env

from conftest import check_child, run_python

PRELUDE = """
import os, re, resource, tempfile, torch, stepalloc
from stepalloc.memory_saver import torch_memory_saver as tms
MIB = 1 << 20
tms.hook_mode = {mode!r}
if {mode!r} == "torch":
    torch.zeros(1).cuda()  # CUDA initialised first, as SGLang does
def figures(tag):
    return stepalloc.sleep.tags()[tag]
def pinned_on_device():
    return int(stepalloc.memory_stats(include_stepalloc=True).get("stepalloc.backup_host_bytes", 0))
def metric(name, **labels):
    want = "".join(f'{{k}}="{{v}}"' for k, v in labels.items())
    for line in stepalloc.metrics_text().splitlines():
        if line.startswith(name + "{{") and all(f'{{k}}="{{v}}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {{name}} with {{labels}}")
"""

MMAP = """
with tms.region(tag="ckpt", enable_cpu_backup=True, cpu_backup_backend="mmap"):
    m = torch.arange(6 * MIB // 4, dtype=torch.int32).cuda()
with tms.region(tag="ckpt", enable_cpu_backup=True):
    p = torch.full((2 * MIB,), 9, dtype=torch.uint8).cuda()
m_oracle = m.cpu().clone()
for cycle in range(3):
    tms.pause("ckpt")
    f = figures("ckpt")
    assert f["paused"] and f["mmap_bytes"] >= 6 * MIB, f
    # Each region's bytes in its own kind of buffer (each at least 64 MiB: few, large).
    assert f["host_bytes"] >= 2 * MIB, f
    assert metric("stepalloc_tag_backup_host_bytes", tag="ckpt", kind="mmap") == f["mmap_bytes"]
    assert metric("stepalloc_tag_backup_host_bytes", tag="ckpt", kind="pinned") == f["host_bytes"]
    backup = tms.get_cpu_backup(m)
    assert backup is not None and torch.equal(backup, m_oracle), "get_cpu_backup of an mmap backup"
    tms.resume("ckpt")
    assert torch.equal(m.cpu(), m_oracle) and int(p.cpu()[-1]) == 9
# mmap alone: nothing pinned at all.
with tms.region(tag="only_mmap", enable_cpu_backup=True, cpu_backup_backend="mmap"):
    o = torch.full((4 * MIB,), 5, dtype=torch.uint8).cuda()
stepalloc.release_backup()
tms.pause("only_mmap")
assert pinned_on_device() == 0, pinned_on_device()
assert figures("only_mmap")["host_bytes"] == 0 and figures("only_mmap")["mmap_bytes"] >= 4 * MIB
tms.resume("only_mmap")
assert int(o.cpu()[0]) == 5 and int(o.cpu()[-1]) == 5
assert figures("only_mmap")["mmap_bytes"] == 0, "retain_cpu_backup is False: the buffers go at resume"
print("ok=mmap")
"""

DISK_LIMIT = """
d = tempfile.mkdtemp(prefix="stepalloc_disk_limit_")
tms.set_disk_backup_dir(d)
with tms.region(tag="spill", enable_disk_backup=True):
    big = torch.arange(12 * MIB // 4, dtype=torch.int32).cuda()
with tms.region(tag="spill", enable_cpu_backup=True, cpu_backup_backend="mmap"):
    other = torch.full((3 * MIB,), 7, dtype=torch.uint8).cuda()
oracle = big.cpu().clone()
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (4 * MIB, hard))
try:
    tms.pause("spill")
except Exception as e:
    message = str(e)
else:
    raise AssertionError("a pause past the file-size limit succeeded")
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
assert "spill" in message and d in message, message
assert os.listdir(d) == [], os.listdir(d)
assert not figures("spill")["paused"], figures("spill")
assert torch.equal(big.cpu(), oracle) and int(other.cpu()[-1]) == 7, "the tag lost bytes"
# The limit lifted: the same pause works, a file per disk-backed block, removed at resume.
for cycle in range(2):
    tms.pause("spill")
    files = os.listdir(d)
    assert len(files) >= 1 and sum(os.path.getsize(os.path.join(d, f)) for f in files) >= 12 * MIB, files
    assert figures("spill")["disk_bytes"] >= 12 * MIB
    assert tms.get_cpu_backup(big) is None, "disk-backed memory has no host copy"
    tms.resume("spill")
    assert os.listdir(d) == [], os.listdir(d)
    assert torch.equal(big.cpu(), oracle) and int(other.cpu()[-1]) == 7
print("ok=disk_limit")
"""


@needs_torch
@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_the_mmap_backend_pins_nothing_and_restores(mode: str) -> None:
    out = check_child(run_python(PRELUDE.format(mode=mode) + MMAP, env=torch_env(capacity_mb=1024), timeout=300))
    assert "ok=mmap" in out


@needs_torch
@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_a_disk_backup_past_a_file_size_limit_fails_and_loses_nothing(mode: str) -> None:
    out = check_child(
        run_python(PRELUDE.format(mode=mode) + DISK_LIMIT, env=torch_env(capacity_mb=1024), timeout=300)
    )
    assert "ok=disk_limit" in out


def test_a_backup_directory_that_cannot_exist_is_refused_when_set(tmp_path) -> None:
    from stepalloc import sleep
    from stepalloc.memory_saver import TorchMemorySaver

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    before = sleep.backup_dir()
    with pytest.raises(ValueError, match="a_file/sub"):
        TorchMemorySaver().set_disk_backup_dir(str(blocker / "sub"))
    with pytest.raises(ValueError, match="not a directory|cannot be created"):
        sleep.set_backup_dir(blocker)
    assert sleep.backup_dir() == before, "a refused directory replaced the one in force"
    with pytest.raises(ValueError, match="backup must be"):
        sleep.region("x", backup="tape")
