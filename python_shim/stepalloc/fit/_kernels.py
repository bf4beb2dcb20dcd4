"""What real CUDA kernels ask PyTorch's caching allocator for beyond what dispatch can see.

Layer: the recorder's model of the target GPU (no torch import at module level; pure data and
arithmetic, so tests can check each figure exactly). Everything here is read from torch 2.15's
sources (file named beside each rule); a GPU run of the kit checks it.

Invariants: sizes are bytes as the caching allocator is asked for them (unrounded); a rule
returns ``[]`` when the real kernel asks for nothing more.

- Targets: the named cards the front end knows, with their memory (as CUDA reports it) and
  compute capability, which decide the cuBLAS workspace size and the attention backend.
- cuBLAS: ``aten/src/ATen/cuda/CublasHandlePool.cpp``. The first BLAS call on a thread makes (or
  reserves) that thread's handle and allocates its workspace from the caching allocator, once per
  (handle, stream), never freed while the process runs: 32 MiB on compute capability 9.0, else
  ``4096 KiB x 2 + 16 KiB x 8`` = 8.125 MiB (``CUBLAS_WORKSPACE_CONFIG`` ``:SIZE_KIB:COUNT``
  pairs override). A cuBLASLt call (``addmm`` with a 1-D bias through ``gemm_and_bias``,
  ``aten/src/ATen/native/cuda/Blas.cpp``, or every GEMM when the preferred BLAS library is
  cuBLASLt) goes through the same handle, then allocates a separate cuBLASLt workspace per
  (handle, stream): ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1,024), at most the cuBLAS one.
  Autograd's device thread has its own handle, hence its own workspaces.
- Attention (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, ``attention.cu``,
  ``attention_backward.cu``, ``flash_attn/flash_api.cpp``, ``mem_eff_attention/``): which
  backend the target picks, and what its kernels allocate that the fake kernels do not (or the
  other way round).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Target:
    """A GPU the prediction is for."""

    name: str
    memory_bytes: int  # total memory as CUDA reports it (nvidia-smi's total)
    capability: tuple[int, int]

    @property
    def capacity_gib(self) -> float:
        return self.memory_bytes / GIB


# Named cards: nvidia-smi's "total" memory (MiB) and the compute capability.
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("rtx4090", 24564 * MIB, (8, 9)),
        Target("l4", 23034 * MIB, (8, 9)),
        Target("a10", 23028 * MIB, (8, 6)),
        Target("a100-40gb", 40960 * MIB, (8, 0)),
        Target("l40s", 46068 * MIB, (8, 9)),
        Target("a6000", 49140 * MIB, (8, 6)),
        Target("a100-80gb", 81920 * MIB, (8, 0)),
        Target("h100", 81559 * MIB, (9, 0)),
        Target("h200", 143771 * MIB, (9, 0)),
    )
}
# The largest device the stress tool replays on (its --capacity-gb takes (0, 16384]).
MAX_DEVICE_GB = 16384
# A bare size in GB names a generic card of that many GiB, Hopper-class unless said otherwise.
DEFAULT_CAPABILITY = (9, 0)


def target(spec: str | float | int | Target, capability: tuple[int, int] | None = None) -> Target:
    """A ``Target`` from a card name ('h100'), a size in GB ('80', 80, '24gb'), or a Target."""
    if isinstance(spec, Target):
        return spec
    text = str(spec).strip().lower()
    if text in TARGETS:
        t = TARGETS[text]
        return Target(t.name, t.memory_bytes, capability or t.capability)
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(gb|gib|g)?", text)
    if not m:
        raise ValueError(
            f"unknown device {spec!r}: give a card ({', '.join(TARGETS)}) or a size in GB such as 24, 40, 48, 80, 141"
        )
    gb = float(m.group(1))
    if not (gb > 0 and math.isfinite(gb)) or gb > MAX_DEVICE_GB:
        raise ValueError(f"device size {spec!r}: more than 0 GB and at most {MAX_DEVICE_GB} GB (the replay's largest device)")
    if gb * GIB < MIB:
        raise ValueError(f"device size {spec!r}: below 1 MiB; give the device's memory in GB (24, 80, 141)")
    return Target(f"{gb:g}GB", int(gb * GIB), capability or DEFAULT_CAPABILITY)


# ---- cuBLAS ---------------------------------------------------------------------------------


def cublas_workspace_bytes(capability: tuple[int, int], env: dict[str, str] | None = None) -> int:
    """The cuBLAS workspace per (handle, stream) (``parseChosenWorkspaceSize``)."""
    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 4096 * 8 * 1024 if capability == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


def cublaslt_workspace_bytes(capability: tuple[int, int], env: dict[str, str] | None = None) -> int:
    """The cuBLASLt workspace per (handle, stream) (``getCUDABlasLtWorkspaceSize``)."""
    env = os.environ if env is None else env
    kib = 1024
    if env.get("CUBLASLT_WORKSPACE_SIZE", "").strip().isdigit():
        kib = int(env["CUBLASLT_WORKSPACE_SIZE"])
    # Unified by default: never more than the cuBLAS workspace.
    return min(kib * 1024, cublas_workspace_bytes(capability, env))


# ATen operators whose CUDA kernels call cuBLAS (and so make the thread's handle and workspace).
BLAS_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::_addmm_activation",
        "aten::bmm",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::mv",
        "aten::addmv",
        "aten::dot",
        "aten::vdot",
        "aten::_scaled_mm",
        "aten::_int_mm",
    }
)


def uses_cublaslt(op: str, args: tuple, preferred_lt: bool) -> bool:
    """Whether this BLAS call goes through cuBLASLt (``isInputCompliesAddmmCudaLt``)."""
    if preferred_lt or op == "aten::_scaled_mm":
        return True
    if op not in ("aten::addmm", "aten::_addmm_activation") or len(args) < 3:
        return False
    bias, mat1, mat2 = args[0], args[1], args[2]
    beta = args[3] if len(args) > 3 and isinstance(args[3], (int, float)) else 1
    try:
        import torch

        dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
        return (
            beta == 1
            and bias.dim() == 1
            and bias.shape[0] == mat2.shape[1]
            and mat1.dtype in dtypes
            and min(mat1.shape[0], mat1.shape[1], mat2.shape[0], mat2.shape[1]) > 1
        )
    except (AttributeError, IndexError, ImportError):
        return False


# ---- attention ------------------------------------------------------------------------------

ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


def attention_order(capability: tuple[int, int], choice: str = "auto") -> list[str]:
    """The SDPA backends the target tries, in order (``priority_order`` in sdp_utils.cpp).

    torch 2.15 puts cuDNN first on compute capability 9.0 / 10.0 / 10.3 with the cuDNN its CUDA
    wheels ship (> 9.15), unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``; else flash, memory-efficient,
    math, cuDNN. A user's choice narrows the list to that backend.
    """
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention={choice!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    if choice != "auto":
        return [choice]
    cudnn_first = capability in ((9, 0), (10, 0), (10, 3)) and os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") != "1"
    if cudnn_first:
        return ["cudnn", "flash", "efficient", "math"]
    return ["flash", "efficient", "math", "cudnn"]


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


# Output positions of the fake kernels that a real run leaves on the host (outside stream
# capture, the philox seed and offset of flash and memory-efficient attention are CPU tensors:
# ``at::empty({}, at::dtype(at::kLong))``); the fake kernels put them on the device.
HOST_OUTPUTS = {
    "aten::_scaled_dot_product_flash_attention": (6, 7),
    "aten::_scaled_dot_product_efficient_attention": (2, 3),
    "aten::_flash_attention_forward": (2, 3),
    "aten::_efficient_attention_forward": (2, 3),
}


def attention_workspaces(op: str, args: tuple) -> list[tuple[str, int]]:
    """(label, bytes) of the scratch a real attention kernel allocates inside itself, freed when it
    returns; ``args`` are the op's arguments (tensors with ``.shape``).

    - flash backward (``mha_bwd``): ``softmax_d`` (B, H, Sq rounded to 128) fp32 and ``dq_accum``
      (B, Sq rounded to 128, H, D rounded to 32 (64 above 128)) fp32; with fewer K/V heads than
      query heads, ``dk_expanded`` and ``dv_expanded`` (B, Sk, H, D) in the input dtype.
    - memory-efficient backward: ``delta`` (B, H, Sq) fp32, and fp32 accumulators for dQ when the
      head dimension exceeds 64 (the kernel's ``kNeedsAccumGradQ``).
    - cuDNN backward: its graph's workspace, modelled as the flash figures (fp32 dQ accumulator and
      softmax statistics); cuDNN's own figure is only known on the GPU (the kit measures it).
    Forward kernels allocate nothing more at training shapes (flash's split-KV accumulators appear
    only for decode-sized queries: at most a few MiB).
    """
    try:
        q, k = args[1], args[2]  # grad_out, query, key, value, ...
        b, h, sq, d = (int(x) for x in q.shape)
        hk, sk = int(k.shape[1]), int(k.shape[2])
        itemsize = q.element_size()
    except (AttributeError, IndexError, TypeError, ValueError):
        return []
    sq128 = _round_up(sq, 128)
    d_round = _round_up(d, 32 if d <= 128 else 64)
    if op in ("aten::_scaled_dot_product_flash_attention_backward", "aten::_scaled_dot_product_cudnn_attention_backward"):
        out = [("softmax_d", b * h * sq128 * 4), ("dq_accum", b * sq128 * h * d_round * 4)]
        if hk != h and op.endswith("flash_attention_backward"):
            out += [("dk_expanded", b * sk * h * d * itemsize), ("dv_expanded", b * sk * h * d * itemsize)]
        return out
    if op == "aten::_scaled_dot_product_efficient_attention_backward":
        out = [("delta", b * h * sq * 4)]
        if d > 64:
            out.append(("grad_q_accum", b * h * sq * d * 4))
        return out
    return []
