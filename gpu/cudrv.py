"""The CUDA driver API through ctypes, for the GPU validation scripts (no CUDA headers, no
compiler, no torch needed). Only the calls the probes use; every call returns the CUresult."""

import ctypes
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_ubyte, c_uint, c_uint64, c_void_p

CAPTURE_MODES = {0: "global", 1: "thread_local", 2: "relaxed"}
CAPTURE_STATUS = {0: "NONE", 1: "ACTIVE", 2: "INVALIDATED"}
STREAM_NON_BLOCKING = 1
EVENT_DISABLE_TIMING = 2


class Driver:
    def __init__(self):
        self.lib = None
        errors = []
        for name in ("libcuda.so.1", "libcuda.so"):
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError as e:
                errors.append(str(e))
        if self.lib is None:
            raise RuntimeError("no CUDA driver library: " + "; ".join(errors))
        f = self._fn
        self.cuInit = f("cuInit", c_uint)
        self.cuDriverGetVersion = f("cuDriverGetVersion", POINTER(c_int))
        self.cuDeviceGetCount = f("cuDeviceGetCount", POINTER(c_int))
        self.cuDeviceGet = f("cuDeviceGet", POINTER(c_int), c_int)
        self.cuDevicePrimaryCtxRetain = f("cuDevicePrimaryCtxRetain", POINTER(c_void_p), c_int)
        self.cuDevicePrimaryCtxGetState = f("cuDevicePrimaryCtxGetState", c_int, POINTER(c_uint), POINTER(c_int))
        self.cuCtxSetCurrent = f("cuCtxSetCurrent", c_void_p)
        self.cuCtxGetCurrent = f("cuCtxGetCurrent", POINTER(c_void_p))
        self.cuCtxSynchronize = f("cuCtxSynchronize")
        self.cuStreamCreate = f("cuStreamCreate", POINTER(c_void_p), c_uint)
        self.cuStreamDestroy = f("cuStreamDestroy_v2", c_void_p)
        self.cuStreamQuery = f("cuStreamQuery", c_void_p)
        self.cuStreamSynchronize = f("cuStreamSynchronize", c_void_p)
        self.cuStreamBeginCapture = f("cuStreamBeginCapture_v2", c_void_p, c_int)
        self.cuStreamEndCapture = f("cuStreamEndCapture", c_void_p, POINTER(c_void_p))
        self.cuStreamIsCapturing = f("cuStreamIsCapturing", c_void_p, POINTER(c_int))
        self.cuThreadExchangeStreamCaptureMode = f("cuThreadExchangeStreamCaptureMode", POINTER(c_int))
        self.cuGraphDestroy = f("cuGraphDestroy", c_void_p)
        self.cuMemAlloc = f("cuMemAlloc_v2", POINTER(c_uint64), c_size_t)
        self.cuMemFree = f("cuMemFree_v2", c_uint64)
        self.cuMemGetInfo = f("cuMemGetInfo_v2", POINTER(c_size_t), POINTER(c_size_t))
        self.cuMemsetD8 = f("cuMemsetD8_v2", c_uint64, c_ubyte, c_size_t)
        self.cuMemsetD8Async = f("cuMemsetD8Async", c_uint64, c_ubyte, c_size_t, c_void_p)
        self.cuMemcpyDtoH = f("cuMemcpyDtoH_v2", c_void_p, c_uint64, c_size_t)
        self.cuEventCreate = f("cuEventCreate", POINTER(c_void_p), c_uint)
        self.cuEventDestroy = f("cuEventDestroy_v2", c_void_p)
        self.cuEventRecord = f("cuEventRecord", c_void_p, c_void_p)
        self.cuEventQuery = f("cuEventQuery", c_void_p)
        self.cuEventSynchronize = f("cuEventSynchronize", c_void_p)
        self._error_name = f("cuGetErrorName", c_int, POINTER(c_char_p))

    def _fn(self, name, *argtypes):
        fn = getattr(self.lib, name)
        fn.restype = c_int
        fn.argtypes = list(argtypes)
        return fn

    def name(self, rc):
        if rc == 0:
            return "CUDA_SUCCESS"
        text = c_char_p()
        if self._error_name(rc, byref(text)) == 0 and text.value:
            return text.value.decode()
        return f"CUresult({rc})"

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed: {self.name(rc)}")

    # Small helpers that raise on failure.
    def init(self):
        self.check(self.cuInit(0), "cuInit")
        n = c_int()
        self.check(self.cuDeviceGetCount(byref(n)), "cuDeviceGetCount")
        return n.value

    def primary_context(self, ordinal):
        dev = c_int()
        self.check(self.cuDeviceGet(byref(dev), ordinal), "cuDeviceGet")
        ctx = c_void_p()
        self.check(self.cuDevicePrimaryCtxRetain(byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        return ctx.value

    def primary_context_active(self, ordinal):
        dev = c_int()
        self.check(self.cuDeviceGet(byref(dev), ordinal), "cuDeviceGet")
        flags, active = c_uint(), c_int()
        self.check(self.cuDevicePrimaryCtxGetState(dev, byref(flags), byref(active)), "cuDevicePrimaryCtxGetState")
        return bool(active.value)

    def current_context(self):
        ctx = c_void_p()
        self.check(self.cuCtxGetCurrent(byref(ctx)), "cuCtxGetCurrent")
        return ctx.value

    def stream(self):
        s = c_void_p()
        self.check(self.cuStreamCreate(byref(s), STREAM_NON_BLOCKING), "cuStreamCreate")
        return s.value

    def event(self):
        e = c_void_p()
        self.check(self.cuEventCreate(byref(e), EVENT_DISABLE_TIMING), "cuEventCreate")
        return e.value

    def alloc(self, size):
        p = c_uint64()
        self.check(self.cuMemAlloc(byref(p), size), "cuMemAlloc")
        return p.value

    def mem_info(self):
        free, total = c_size_t(), c_size_t()
        self.check(self.cuMemGetInfo(byref(free), byref(total)), "cuMemGetInfo")
        return free.value, total.value

    def exchange_capture_mode(self, mode):
        m = c_int(mode)
        self.check(self.cuThreadExchangeStreamCaptureMode(byref(m)), "cuThreadExchangeStreamCaptureMode")
        return m.value
