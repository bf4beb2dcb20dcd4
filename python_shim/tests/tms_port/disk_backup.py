"""Ported from fzyzcjy/torch_memory_saver ``test/examples/disk_backup.py`` at 4a43c97.

Changed: ``torch.randn`` / ``torch.full`` on the device are host tensors copied there (testdrv
runs no kernels); the ``occupy`` tensor likewise. The assertions are the original's.
"""

import logging
import os
import shutil
import sys
import tempfile

import torch
from torch_memory_saver import torch_memory_saver

from ._util import fill, randn


def run(hook_mode: str):
    os.environ["TMS_DISK_BACKUP_CHUNK_MB"] = "1"
    torch_memory_saver.hook_mode = hook_mode
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)

    disk_dir = tempfile.mkdtemp(prefix="tms_disk_backup_")
    print(f"disk_backup_dir={disk_dir}")
    torch_memory_saver.set_disk_backup_dir(disk_dir)
    try:
        _run(disk_dir)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)


def _run(disk_dir: str):
    chunk_bytes = 1 * 1024 * 1024
    numel = chunk_bytes * 13 // 4 + 12345

    with torch_memory_saver.region(enable_disk_backup=True):
        big = randn((numel,), dtype=torch.float32, device='cuda')
        small = fill((7,), 10, dtype=torch.uint8, device='cuda')
    big_oracle = big.detach().to('cpu').clone()
    small_oracle = small.detach().to('cpu').clone()

    with torch_memory_saver.region(enable_disk_backup=False):
        no_backup = fill((20_000_000,), 20, dtype=torch.uint8, device='cuda')

    assert torch.equal(big.cpu(), big_oracle)
    assert no_backup[:3].tolist() == [20, 20, 20]

    disk_sizes = set()
    for _ in range(3):
        torch_memory_saver.pause()

        files = os.listdir(disk_dir)
        total = sum(os.path.getsize(os.path.join(disk_dir, f)) for f in files)
        assert len(files) >= 2, f"expected a backup file per disk-backed alloc, got {files}"
        assert total >= big.numel() * 4, f"backup smaller than the paused tensor: {total}"
        disk_sizes.add(total)

        occupy = fill((20_000_000,), 30, dtype=torch.uint8, device='cuda')
        del occupy
        torch.cuda.empty_cache()

        torch_memory_saver.resume()

        assert torch.equal(big.cpu(), big_oracle)
        assert torch.equal(small.cpu(), small_oracle)
        assert no_backup[:3].tolist() != [20, 20, 20]

    assert len(disk_sizes) == 1, f"disk usage grew across cycles: {sorted(disk_sizes)}"
