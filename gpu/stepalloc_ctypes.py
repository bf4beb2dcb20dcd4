"""libstepalloc.so through ctypes, for the GPU validation scripts: the C functions with their
header's types, and text/stats helpers. Load it by absolute path, before torch uses CUDA."""

import ctypes
import json
from ctypes import POINTER, c_char, c_char_p, c_double, c_int, c_size_t, c_void_p

STATUS = {0: "OK", 1: "OUT_OF_MEMORY", 2: "UNKNOWN_POINTER", 3: "INVALID_ARGUMENT", 4: "CONFIG", 5: "DRIVER",
          6: "UNAVAILABLE", 7: "PANIC"}

_SIGNATURES = {
    "stepalloc_configure": (c_int, [c_char_p]),
    "stepalloc_malloc": (c_void_p, [c_size_t, c_int, c_void_p]),
    "stepalloc_free": (None, [c_void_p, c_size_t, c_int, c_void_p]),
    "stepalloc_init": (None, [c_int]),
    "stepalloc_empty_cache": (None, []),
    "stepalloc_set_memory_fraction": (None, [c_double, c_int]),
    "stepalloc_base_alloc": (c_void_p, [c_void_p, POINTER(c_size_t)]),
    "stepalloc_record_stream": (None, [c_void_p, c_void_p]),
    "stepalloc_step_begin": (c_int, [c_char_p]),
    "stepalloc_step_end": (c_int, []),
    "stepalloc_device_count": (c_int, []),
    "stepalloc_last_status": (c_int, []),
    "stepalloc_version": (c_char_p, []),
    "stepalloc_stats_json": (c_size_t, [c_int, POINTER(c_char), c_size_t]),
    "stepalloc_snapshot_json": (c_size_t, [POINTER(c_char), c_size_t]),
    "stepalloc_metrics_text": (c_size_t, [POINTER(c_char), c_size_t]),
    "stepalloc_last_error": (c_size_t, [POINTER(c_char), c_size_t]),
}

# Every symbol PyTorch or the Python package looks up by name.
EXPORTS = sorted(set(_SIGNATURES) | {
    "stepalloc_torch_malloc", "stepalloc_begin_allocate_to_pool", "stepalloc_end_allocate_to_pool",
    "stepalloc_release_pool", "stepalloc_reset_peak_stats", "stepalloc_reset_accumulated_stats",
    "stepalloc_trace_jsonl", "stepalloc_config_help", "stepalloc_metrics_serve",
    "stepalloc_ipc_share", "stepalloc_ipc_open", "stepalloc_ipc_close", "stepalloc_ipc_unshare",
    "stepalloc_pool_checkpoint", "stepalloc_pool_restore", "stepalloc_pool_register_segments",
})


class Stepalloc:
    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name.removeprefix("stepalloc_"), fn)

    def address(self, name):
        """A function's address, for CUDAPluggableAllocator's set_*_fn hooks."""
        return ctypes.cast(getattr(self.lib, name), c_void_p).value

    @staticmethod
    def _text(fn, *args):
        n = fn(*args, None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        fn(*args, buf, n + 1)
        return buf.value.decode()

    def error(self):
        return self._text(self.last_error)

    def status(self):
        return STATUS.get(self.last_status(), str(self.last_status()))

    def stats(self, device=0):
        text = self._text(self.stats_json, device)
        if not text:
            raise RuntimeError(f"stats_json({device}) failed: {self.error()}")
        return json.loads(text)

    def snapshot(self):
        return json.loads(self._text(self.snapshot_json))
