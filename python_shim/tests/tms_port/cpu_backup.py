"""Ported from fzyzcjy/torch_memory_saver ``test/examples/cpu_backup.py`` at 4a43c97.

Changed: ``torch.full`` / ``torch.randn`` on the device are host tensors copied there, and
comparisons on device tensors are made after a copy to the host (testdrv runs no kernels); ROCm
and XPU branches dropped (CUDA only). Left out, because they reach into torch_memory_saver's
internals (``_impl._binary_wrapper.cdll``, ``_impl._mem_pools``, ``_with_region_config``,
``cudaHostGetFlags`` through its library): ``_assert_cpu_backup_released_on_allocation_free``
and ``run_backend_from_env``'s reads of the library's current backend; the rest of
``run_backend_from_env`` is kept. ``run_rss`` and ``run_preload_backend_from_env`` (process RSS
with 2 GiB tensors) are not ported. Every other assertion is the original's.
"""

import logging
import os
import sys

import torch
from torch_memory_saver import torch_memory_saver

from ._util import empty_cache, fill, get_device, randn


def run(hook_mode: str):
    torch_memory_saver.hook_mode = hook_mode
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)
    assert torch_memory_saver.retain_cpu_backup is False
    device = get_device()

    backends = ["mmap", "pinned"]
    for backend in backends:
        print(f"Allocate tensor_with_backup backend={backend or 'default'}")
        region_kwargs = dict(enable_cpu_backup=True)
        if backend is not None:
            region_kwargs["cpu_backup_backend"] = backend
        with torch_memory_saver.region(**region_kwargs):
            tensor_with_backup = fill((20_000_000,), 10, device=device)
            typed_tensor_with_backup = randn((10, 20, 30), dtype=torch.float32, device=device)
            typed_tensor_with_backup_cpu_expected = typed_tensor_with_backup.cpu()

        print("Allocate tensor_without_backup")
        with torch_memory_saver.region(enable_cpu_backup=False):
            tensor_without_backup = fill((20_000_000,), 20, device=device)

        assert tensor_with_backup[:3].tolist() == [10, 10, 10]
        assert tensor_without_backup[:3].tolist() == [20, 20, 20]

        torch_memory_saver.pause()
        typed_actual = torch_memory_saver.get_cpu_backup(typed_tensor_with_backup)
        assert typed_actual is not None
        assert torch.all(typed_tensor_with_backup_cpu_expected == typed_actual)

        # occupy some space
        tensor_unrelated = fill((20_000_000,), 30, device=device)
        torch_memory_saver.resume()

        assert tensor_with_backup[:3].tolist() == [10, 10, 10]
        assert tensor_without_backup[:3].tolist() != [20, 20, 20]
        assert torch_memory_saver.get_cpu_backup(typed_tensor_with_backup) is None

        del tensor_with_backup, typed_tensor_with_backup, tensor_without_backup, tensor_unrelated
        empty_cache()

    # Pageable H2D must finish before resume returns (non-default stream).
    n = 64 * 1024 * 1024
    with torch_memory_saver.region(enable_cpu_backup=True, cpu_backup_backend="mmap"):
        restored = fill((n,), 7, device=device)
    torch_memory_saver.pause()
    torch_memory_saver.resume()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = restored.clone()
    stream.synchronize()
    assert int(out[0].item()) == 7
    assert torch.all(out.cpu() == 7)
    del restored, out
    empty_cache()

    # mmap + retain: same host pointer across resume; released after non-retain resume.
    expected = torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8)
    with torch_memory_saver.region(enable_cpu_backup=True, cpu_backup_backend="mmap"):
        retained = expected.to(device)
    torch_memory_saver.pause()
    first = torch_memory_saver.get_cpu_backup(retained, zero_copy=True)
    first_ptr = first.data_ptr()
    assert torch.equal(first, expected)
    torch_memory_saver.retain_cpu_backup = True
    del first
    torch_memory_saver.resume()
    after = torch_memory_saver.get_cpu_backup(retained, zero_copy=True)
    assert after.data_ptr() == first_ptr
    assert torch.equal(after, expected)
    assert torch.equal(retained.cpu(), expected)
    del after
    torch_memory_saver.retain_cpu_backup = False
    torch_memory_saver.pause()
    torch_memory_saver.resume()
    assert torch_memory_saver.get_cpu_backup(retained) is None
    assert torch.equal(retained.cpu(), expected)
    del retained
    empty_cache()

    # Tags remain independent, and retained host storage is reused at the same
    # address while its bytes are refreshed. Exercise every visible device.
    for device_id in range(torch.cuda.device_count()):
        with torch.cuda.device(device_id):
            selected_expected = _make_pattern(size=1024, offset=40 + device_id)
            other_expected = _make_pattern(size=1024, offset=80 + device_id)

            with torch_memory_saver.region(tag=f"retained_{device_id}", enable_cpu_backup=True):
                selected = selected_expected.to(device_id)
            with torch_memory_saver.region(tag=f"other_{device_id}", enable_cpu_backup=True):
                other = other_expected.to(device_id)

            torch_memory_saver.pause(tag=f"retained_{device_id}")
            first_backup = torch_memory_saver.get_cpu_backup(selected, zero_copy=True)
            first_pointer = first_backup.data_ptr()
            assert torch.equal(first_backup, selected_expected)
            assert torch.equal(other.cpu(), other_expected)

            torch_memory_saver.retain_cpu_backup = True
            assert torch_memory_saver.retain_cpu_backup is True
            del first_backup
            torch_memory_saver.resume(tag=f"retained_{device_id}")
            retained_backup = torch_memory_saver.get_cpu_backup(selected, zero_copy=True)
            assert retained_backup.data_ptr() == first_pointer
            assert torch.equal(retained_backup, selected_expected)
            assert torch.equal(selected.cpu(), selected_expected)
            del retained_backup

            torch_memory_saver.retain_cpu_backup = False
            assert torch_memory_saver.retain_cpu_backup is False
            retained_backup = torch_memory_saver.get_cpu_backup(selected, zero_copy=True)
            assert retained_backup.data_ptr() == first_pointer
            assert torch.equal(retained_backup, selected_expected)
            del retained_backup

            selected_expected = _make_pattern(size=1024, offset=50 + device_id)
            selected.copy_(selected_expected)
            torch_memory_saver.pause(tag=f"retained_{device_id}")
            second_backup = torch_memory_saver.get_cpu_backup(selected, zero_copy=True)
            assert second_backup.data_ptr() == first_pointer
            assert torch.equal(second_backup, selected_expected)

            torch_memory_saver.retain_cpu_backup = True
            del second_backup
            torch_memory_saver.resume(tag=f"retained_{device_id}")
            retained_backup = torch_memory_saver.get_cpu_backup(selected, zero_copy=True)
            assert retained_backup.data_ptr() == first_pointer
            assert torch.equal(retained_backup, selected_expected)
            assert torch.equal(selected.cpu(), selected_expected)
            del retained_backup

            selected_expected = _make_pattern(size=1024, offset=60 + device_id)
            selected.copy_(selected_expected)
            torch_memory_saver.pause(tag=f"retained_{device_id}")
            third_backup = torch_memory_saver.get_cpu_backup(selected, zero_copy=True)
            assert third_backup.data_ptr() == first_pointer
            assert torch.equal(third_backup, selected_expected)

            torch_memory_saver.retain_cpu_backup = False
            del third_backup
            torch_memory_saver.resume(tag=f"retained_{device_id}")
            assert torch.equal(selected.cpu(), selected_expected)
            assert torch_memory_saver.get_cpu_backup(selected) is None


def run_retain_from_env(hook_mode: str):
    torch_memory_saver.hook_mode = hook_mode
    assert torch_memory_saver.retain_cpu_backup is True


def run_multi_device_mmap_restore(hook_mode: str):
    torch_memory_saver.hook_mode = hook_mode
    tensor_size = 64 * 1024 * 1024
    tensors = []

    for device_id, value in enumerate((7, 13)):
        torch.cuda.set_device(device_id)
        with torch_memory_saver.region(
            tag=f"mmap_restore_{device_id}",
            enable_cpu_backup=True,
            cpu_backup_backend="mmap",
        ):
            tensors.append(fill((tensor_size,), value, device=f"cuda:{device_id}"))

    for device_id in range(2):
        torch.cuda.set_device(device_id)
        torch_memory_saver.pause(tag=f"mmap_restore_{device_id}")

    torch.cuda.set_device(0)
    torch_memory_saver.resume()
    assert torch.cuda.current_device() == 0

    restored = []
    for device_id, (tensor, value) in enumerate(zip(tensors, (7, 13), strict=True)):
        stream = torch.cuda.Stream(device=device_id)
        with torch.cuda.stream(stream):
            restored.append(tensor.clone())
        stream.synchronize()
        assert bool(torch.all(restored[-1].cpu() == value).item())

    del tensors, restored
    for device_id in range(2):
        with torch.cuda.device(device_id):
            torch.cuda.empty_cache()


def run_backend_from_env(hook_mode: str):
    # TMS_INIT_CPU_BACKUP_BACKEND is set by the test harness (not here).
    torch_memory_saver.hook_mode = hook_mode
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)
    assert os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND") == "mmap"
    device = get_device()

    with torch_memory_saver.region(enable_cpu_backup=True):
        tensor = fill((20_000_000,), 10, device=device)

    torch_memory_saver.pause()
    assert torch_memory_saver.get_cpu_backup(tensor) is not None
    torch_memory_saver.resume()
    assert tensor[:3].tolist() == [10, 10, 10]
    assert torch_memory_saver.get_cpu_backup(tensor) is None

    del tensor
    empty_cache()


def _make_pattern(size: int, offset: int) -> torch.Tensor:
    return torch.arange(size, dtype=torch.int64).add(offset).remainder(251).to(torch.uint8)
