"""Runs the ported PyTorch tests (cuda_cases.py) in this process under one allocator and prints
one ``RESULT {json}`` line per test as it finishes (a crash keeps the lines before it). The
tests run in one process, in order, as PyTorch's runner runs a test class.

Usage: ``python3 run_cases.py MODE [--cases=MODULE] [Class.test_name ...]`` (no names: every
test; MODULE: one of ``CASES``, by default cuda_cases), with torch over testdrv's stub runtime
(test_torch_port.py sets the environment). MODE:
- ``pytorch``: PyTorch's own caching allocator (``PYTORCH_CUDA_ALLOC_CONF`` empty);
- ``pytorch-expandable``: the same with ``expandable_segments:True``, as PyTorch's
  test_cuda_expandable_segments.py runs these classes;
- ``stepalloc``: ``stepalloc.install(patch_torch=True)`` process-wide with the recommended
  configuration (expandable segments);
- ``stepalloc-plain``: the same with plain segments (``backend:cuda`` only).

Layer: tests (a child process; imports torch and stepalloc).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
import unittest

MODES = ("pytorch", "pytorch-expandable", "stepalloc", "stepalloc-plain")
# The modules of ported tests and the test classes each holds; one process runs one module.
CASES = {
    "cuda_cases": ("TestCuda", "TestMemPool"),
    "cudagraph_tree_cases": ("CudaGraphTreeTests",),
}


# Device memory the process holds outside any allocator, as a CUDA context does on a real GPU
# (hundreds of MiB there): without it testdrv's device is wholly free and two halves of it fit,
# which test_out_of_memory_retry assumes they do not.
CONTEXT_MB = 64


def hold_context_memory(torch) -> None:
    import ctypes

    torch.cuda.init()
    runtime = ctypes.CDLL("libcudart.so.13")  # testdrv's stub runtime, preloaded
    ptr = ctypes.c_void_p()
    status = runtime.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(CONTEXT_MB << 20))
    if status != 0:
        raise SystemExit(f"cudaMalloc of the context's {CONTEXT_MB} MiB failed: {status}")


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    module = "cuda_cases"
    if args and args[0].startswith("--cases="):
        module, args = args[0].removeprefix("--cases="), args[1:]
    if module not in CASES:
        raise SystemExit(f"--cases must be one of {sorted(CASES)}, not {module!r}")
    wanted = set(args)
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, not {mode!r}")
    expected_conf = "expandable_segments:True" if mode == "pytorch-expandable" else ""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") != expected_conf:
        raise SystemExit(f"mode {mode} needs PYTORCH_CUDA_ALLOC_CONF={expected_conf!r}")
    import torch

    if mode.startswith("stepalloc"):
        import stepalloc

        conf = "backend:cuda" if mode == "stepalloc-plain" else "backend:cuda," + stepalloc.RECOMMENDED
        stepalloc.install(conf, patch_torch=True)
    assert torch.cuda.is_available()
    hold_context_memory(torch)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import importlib

    cases = importlib.import_module(module)
    loader = unittest.TestLoader()
    for cls in (getattr(cases, name) for name in CASES[module]):
        for name in loader.getTestCaseNames(cls):
            test_id = f"{cls.__name__}.{name}"
            if wanted and test_id not in wanted:
                continue
            fraction = torch.cuda.get_per_process_memory_fraction()
            result = unittest.TestResult()
            cls(name).run(result)
            # A failure's traceback holds the test's tensors in a reference cycle: collect it so
            # the next test starts with the memory the failed one held given back.
            gc.collect()
            problems = result.failures + result.errors
            if problems and torch.cuda.get_per_process_memory_fraction() != fraction:
                # The limited-memory tests set a fraction and restore it at their end, which a
                # failure skips: restored here, so that one failure does not fail the tests after it.
                torch.cuda.set_per_process_memory_fraction(fraction)
            if problems:  # an assertion or an exception: the test fails either way
                outcome = "fails"
                detail = problems[0][1].strip().splitlines()[-1]
            elif result.skipped:
                outcome, detail = "skipped", result.skipped[0][1]
            else:
                outcome, detail = "passes", ""
            print("RESULT " + json.dumps({"test": test_id, "outcome": outcome, "detail": detail[:600]}), flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        raise
