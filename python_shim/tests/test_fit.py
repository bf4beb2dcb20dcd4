"""stepalloc.fit's recorder: exact allocation streams of small steps under fake CUDA tensors.

The figures that need no torch (workspace sizes, attention order, devices, configurations, the
batch search) run here; the recordings run in one child Python over testdrv's stubs
(``fit_child.run_fit``) whose results the tests below read, so the recorder's checks cost one
torch start-up.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fit_child import needs_torch, run_fit

from conftest import SHIM

sys.path.insert(0, str(SHIM))
from stepalloc.fit import _configs, _kernels, _replay, _trace  # noqa: E402

MIB = 1 << 20

# ---- the target GPU (no torch) ----------------------------------------------------------


def test_cublas_workspace_per_architecture_and_override() -> None:
    assert _kernels.cublas_workspace_bytes((9, 0), env={}) == 32 * MIB
    assert _kernels.cublas_workspace_bytes((8, 0), env={}) == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert _kernels.cublas_workspace_bytes((10, 0), env={}) == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert _kernels.cublas_workspace_bytes((9, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MIB
    assert _kernels.cublas_workspace_bytes((9, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert _kernels.cublaslt_workspace_bytes((9, 0), env={}) == MIB
    # Never more than the cuBLAS workspace (unified by default).
    assert _kernels.cublaslt_workspace_bytes((9, 0), env={"CUBLASLT_WORKSPACE_SIZE": "65536", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024


def test_attention_order_per_target() -> None:
    assert _kernels.attention_order((9, 0)) == ["cudnn", "flash", "efficient", "math"]
    assert _kernels.attention_order((8, 0)) == ["flash", "efficient", "math", "cudnn"]
    assert _kernels.attention_order((8, 9)) == ["flash", "efficient", "math", "cudnn"]
    assert _kernels.attention_order((9, 0), "math") == ["math"]
    with pytest.raises(ValueError, match="attention='fast'"):
        _kernels.attention_order((9, 0), "fast")


def test_devices_by_name_and_size() -> None:
    assert _kernels.target("h100").capability == (9, 0)
    assert _kernels.target("a100-40gb").memory_bytes == 40960 * MIB
    assert _kernels.target("80").memory_bytes == 80 << 30
    assert _kernels.target("24gb").capability == _kernels.DEFAULT_CAPABILITY
    for bad in ("0", "0gb", "-1", "nan", "a big one"):
        with pytest.raises(ValueError, match="device|more than 0"):
            _kernels.target(bad)


def test_attention_backward_scratch() -> None:
    class T:
        def __init__(self, *shape: int, itemsize: int = 2) -> None:
            self.shape = shape
            self._itemsize = itemsize

        def element_size(self) -> int:
            return self._itemsize

    q, k = T(2, 8, 100, 64), T(2, 2, 100, 64)
    flash = dict(_kernels.attention_workspaces("aten::_scaled_dot_product_flash_attention_backward", (T(1), q, k)))
    assert flash == {
        "softmax_d": 2 * 8 * 128 * 4,
        "dq_accum": 2 * 128 * 8 * 64 * 4,
        "dk_expanded": 2 * 100 * 8 * 64 * 2,
        "dv_expanded": 2 * 100 * 8 * 64 * 2,
    }
    assert _kernels.attention_workspaces("aten::mm", (T(1), q, k)) == []


# ---- configurations (no torch) --------------------------------------------------------------


def test_shipped_configurations_hold_the_published_sizes() -> None:
    llava = _configs.load("llava-1.5-7b")
    assert llava["text_config"]["hidden_size"] == 4096 and llava["text_config"]["num_hidden_layers"] == 32
    assert llava["vision_config"]["image_size"] == 336 and llava["vision_config"]["patch_size"] == 14
    qwen = _configs.load("Qwen/Qwen2-VL-7B-Instruct")
    assert (qwen["hidden_size"], qwen["num_key_value_heads"], qwen["vision_config"]["embed_dim"]) == (3584, 4, 1280)


def test_malformed_configurations_are_named(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(_configs.ConfigError, match="not a readable JSON"):
        _configs.load(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(_configs.ConfigError, match="model_type"):
        _configs.load(tmp_path / "config.json")
    with pytest.raises(_configs.ConfigError, match="not a shipped configuration"):
        _configs.load("no-such-model")


def test_cli_rejects_bad_input_before_recording(tmp_path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "stepalloc.fit", *args], cwd=SHIM, capture_output=True, text=True, timeout=60)

    zero = cli("--model", "llava-1.5-7b", "--device", "0")
    assert zero.returncode == 2 and "more than 0 GB" in zero.stderr
    (tmp_path / "config.json").write_text("[1, 2]")
    bad = cli("--model", str(tmp_path))
    assert bad.returncode == 2 and "model_type" in bad.stderr
    rng = cli("--model", "llava-1.5-7b", "--tokens", "9-3")
    assert rng.returncode == 2 and "LOW-HIGH" in rng.stderr


# ---- the trace file and the batch search (no torch) -------------------------------------------


def test_trace_lines_and_root_stripping(tmp_path) -> None:
    t = _trace.Trace()
    w = t.alloc(4096, "LlamaForCausalLM.model.embed_tokens", "parameter")
    t.step_begin("train")
    a = t.alloc(512, "LlamaForCausalLM.model.layers.0.mlp (backward)", "aten::mm")
    t.free(a)
    t.free(a)  # a second free of one allocation is ignored
    t.step_end()
    t.strip_root()
    lines = _trace.read_jsonl(t.write(tmp_path / "t.jsonl"))
    assert lines == [
        {"op": "alloc", "device": 0, "addr": w, "size": 4096, "stream": 0, "module": "model.embed_tokens", "torch_op": "parameter"},
        {"op": "step_begin", "phase": "train"},
        {"op": "alloc", "device": 0, "addr": a, "size": 512, "stream": 0, "module": "model.layers.0.mlp (backward)", "torch_op": "aten::mm"},
        {"op": "free", "device": 0, "addr": a},
        {"op": "step_end"},
    ]
    assert _trace.peak_live(lines) == (4608, 2)


def test_largest_batch_search_doubles_then_bisects() -> None:
    limits = {"pytorch": 5, "stepalloc": 12}
    calls = []

    def fits_at(batch: int) -> dict[str, bool]:
        calls.append(batch)
        return {name: batch <= limit for name, limit in limits.items()}

    search = _replay.largest_batch(fits_at)
    assert search.largest == limits
    assert calls[:5] == [1, 2, 4, 8, 16] and len(calls) == len(set(calls)) <= 10
    none = _replay.largest_batch(lambda b: {"pytorch": False})
    assert none.largest == {"pytorch": 0} and list(none.tried) == [1]


# ---- recordings (one child over the stubs) -----------------------------------------------------

RECORDINGS = """
import torch.nn.functional as F
from stepalloc.fit._trace import read_jsonl

def events(rec):
    out = []
    for kind, p in rec.trace.events:
        if kind == "alloc":
            out.append(["alloc", p.addr, p.size, p.module, p.torch_op])
        elif kind == "free":
            out.append(["free", p])
        else:
            out.append([kind, p])
    return out

R = {}

def linear():
    lin = torch.nn.Linear(64, 32, device="cuda")
    with fit.step("train"):
        x = torch.randn(8, 64, device="cuda")
        lin(x).sum().backward()
        del x
    return lin
R["linear"] = events(fit.record(linear, device="h100"))

def views():
    t = torch.empty(256, device="cuda")
    with fit.step("train"):
        v = t.view(16, 16).t()[2:].unsqueeze(0).expand(3, 14, 16)
        t.add_(1).mul_(2)
        t.copy_(torch.zeros(256, device="cuda"))
        z = torch.empty(0, device="cuda")
        del v, z
R["views"] = events(fit.record(views, device="h100"))

def resize():
    t = torch.empty(100, device="cuda")
    st = t.untyped_storage()
    st.resize_(0)
    st.resize_(800)
    t.resize_(300)
R["resize"] = events(fit.record(resize, device="a100-80gb"))

def optimizer(kind):
    def fn():
        model = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 4, bias=False)).cuda()
        opt = torch.optim.AdamW(model.parameters(), foreach=kind == "foreach" or None, fused=kind == "fused" or None)
        for _ in range(2):
            with fit.step("train"):
                model(torch.randn(2, 16, device="cuda")).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return model
    return fn
for kind in ("foreach", "fused", "default"):
    R["opt_" + kind] = events(fit.record(optimizer(kind), device="h100"))

def attention(backend, grad=True):
    def fn():
        q = torch.randn(2, 8, 100, 64, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        k = torch.randn(2, 2, 100, 64, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        v = torch.randn(2, 2, 100, 64, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        with fit.step("train"):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            if grad:
                o.sum().backward()
    return fn
for backend in ("flash", "efficient", "math"):
    rec = fit.record(attention(backend), device="h100", attention=backend)
    R["attn_" + backend] = [events(rec), dict(rec.attention_used)]

def cudnn():
    q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with fit.step("train"):
        o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        o.sum().backward()
rec = fit.record(cudnn, device="h100")
R["attn_cudnn"] = [events(rec), dict(rec.attention_used)]

def served():
    ids = torch.tensor([[5, 7, 0, 0], [5, 9, 9, 0]], device="cuda")
    mask = ids != 0
    n = int(mask.sum())
    rows = ids[mask].tolist()
    nz = torch.nonzero(ids == 9).shape[0]
    emb = torch.randn(2, 4, 8, device="cuda")
    picked = emb[mask]
    return None if not (n == 5 and rows == [5, 7, 5, 9, 9] and nz == 2 and picked.shape == (5, 8)) else "ok"
R["served"] = fit.record(lambda: R.__setitem__("served_value", served())).summary()["served_data_dependent"]

def errors():
    out = {}
    def item_of_activation():
        x = torch.randn(4, device="cuda")
        torch.nn.Linear(4, 4, device="cuda")(x).sum().item()
    try:
        fit.record(item_of_activation)
    except fit.DataDependentError as e:
        out["data_dependent"] = str(e)
    lib = torch.library.Library("fittest", "DEF")
    lib.define("nofake(Tensor x) -> Tensor")
    lib.impl("nofake", lambda x: x.clone(), "CPU")
    lib.impl("nofake", lambda x: x.clone(), "CUDA")
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.fittest.nofake(x)
    def unsupported():
        M()(torch.randn(4, device="cuda"))
    try:
        fit.record(unsupported)
    except fit.UnsupportedOpError as e:
        out["unsupported"] = str(e)
    return out
R["errors"] = errors()
RESULT = R
"""


@pytest.fixture(scope="module")
def recorded() -> dict:
    return run_fit(RECORDINGS)


@needs_torch
def test_linear_forward_backward_byte_for_byte(recorded) -> None:
    ws = 32 * MIB
    assert recorded["linear"] == [
        # Weights made before the first step, named by module (the root: "").
        ["alloc", 1, 64 * 32 * 4, "", "parameter"],
        ["alloc", 2, 32 * 4, "", "parameter"],
        ["begin", "train"],
        ["alloc", 3, 8 * 64 * 4, "", "aten::randn"],
        # The first BLAS call on the main thread: its handle's cuBLAS workspace, and the cuBLASLt
        # one (addmm with a 1-D bias goes through gemm_and_bias).
        ["alloc", 4, ws, "", "cublas_workspace"],
        ["alloc", 5, MIB, "", "cublaslt_workspace"],
        ["alloc", 6, 8 * 32 * 4, "", "aten::addmm"],
        ["alloc", 7, 4, "", "aten::sum"],
        ["free", 6],
        ["alloc", 8, 4, "", "aten::ones_like"],
        # Autograd's device thread has its own handle, so its own workspace.
        ["alloc", 9, ws, "(backward)", "cublas_workspace"],
        ["alloc", 10, 32 * 64 * 4, "(backward)", "aten::mm"],
        ["alloc", 11, 32 * 4, "(backward)", "aten::sum"],
        ["free", 8],
        ["free", 7],
        ["free", 3],
        ["end", None],
        ["free", 10],
        ["free", 1],
        ["free", 11],
        ["free", 2],
    ]


@needs_torch
def test_views_and_in_place_allocate_nothing(recorded) -> None:
    # The 256-float tensor and the zeros copied into it; nothing for views, in-place operators
    # or the zero-byte tensor (PyTorch's caching allocator is not asked for zero bytes).
    allocs = [e for e in recorded["views"] if e[0] == "alloc"]
    assert [(e[2], e[4]) for e in allocs] == [(1024, "aten::empty"), (1024, "aten::zeros")]


@needs_torch
def test_storage_resizes_count(recorded) -> None:
    assert recorded["resize"] == [
        ["alloc", 1, 400, "", "aten::empty"],
        ["free", 1],  # UntypedStorage.resize_(0): freed
        ["alloc", 2, 800, "", "UntypedStorage.resize_"],
        ["alloc", 3, 1200, "", "aten::resize_"],  # the new buffer first, then the old one goes
        ["free", 2],
        ["free", 3],
    ]


@needs_torch
def test_optimizer_state_and_step_temporaries(recorded) -> None:
    def opt_allocs(ev):
        return [(e[2], e[4]) for e in ev if e[0] == "alloc" and e[3] == "optimizer"]

    weights = [16 * 16 * 4, 4 * 16 * 4]
    foreach = opt_allocs(recorded["opt_foreach"])
    # First step: exp_avg and exp_avg_sq per parameter (the step counts stay on the host), then
    # the sqrt temporaries of the foreach update; the second step only the temporaries.
    state = [(w, "optimizer_state") for w in weights for _ in range(2)]
    assert sorted(foreach[:4]) == sorted(state)
    assert [a for a in foreach[4:] if a[1] == "aten::_foreach_sqrt"] == [(w, "aten::_foreach_sqrt") for w in weights] * 2
    # AdamW's default on CUDA is the foreach implementation, for fake parameters as for real ones.
    assert opt_allocs(recorded["opt_default"]) == foreach
    fused = opt_allocs(recorded["opt_fused"])
    # Fused AdamW keeps its step counts on the device (one float each) and needs no temporaries.
    assert sorted(fused) == sorted(state + [(4, "optimizer_state")] * 2)


@needs_torch
def test_attention_backends_allocate_as_their_kernels(recorded) -> None:
    def op_allocs(ev, op, prefix=False):
        return [e[2] for e in ev if e[0] == "alloc" and (e[4].startswith(op) if prefix else e[4] == op)]

    flash, used = recorded["attn_flash"]
    assert used == {"flash": 1}
    # Output and fp32 logsumexp; no device RNG state (a real run keeps seed and offset on the host).
    assert op_allocs(flash, "aten::_scaled_dot_product_flash_attention") == [2 * 8 * 100 * 64 * 2, 2 * 8 * 100 * 4]
    scratch = op_allocs(flash, "aten::_scaled_dot_product_flash_attention_backward (", prefix=True)
    assert scratch == [2 * 8 * 128 * 4, 2 * 128 * 8 * 64 * 4, 2 * 100 * 8 * 64 * 2, 2 * 100 * 8 * 64 * 2]
    efficient, used = recorded["attn_efficient"]
    assert used == {"efficient": 1}
    assert op_allocs(efficient, "aten::_scaled_dot_product_efficient_attention")[:2] == [2 * 8 * 100 * 64 * 2, 2 * 8 * 128 * 4]
    math, used = recorded["attn_math"]
    assert used == {"math": 1}
    # The math backend materialises the score matrix (fp32 for bf16 inputs).
    assert 2 * 8 * 100 * 100 * 4 in [e[2] for e in math if e[0] == "alloc"]
    cudnn, used = recorded["attn_cudnn"]
    assert used == {"cudnn": 1}
    assert op_allocs(cudnn, "aten::_scaled_dot_product_cudnn_attention")[:1] == [2 * 8 * 128 * 64 * 2]


@needs_torch
def test_data_dependent_operators_served_from_values(recorded) -> None:
    assert recorded["served_value"] == "ok"
    assert recorded["served"] >= 4


@needs_torch
def test_unservable_and_unsupported_ops_are_clear_errors(recorded) -> None:
    errors = recorded["errors"]
    assert "_local_scalar_dense" in errors["data_dependent"] and "What to do" in errors["data_dependent"]
    assert "fittest::nofake" in errors["unsupported"] and "M" in errors["unsupported"]
    assert "register_fake" in errors["unsupported"]


def test_json_dumps_of_kernels_targets() -> None:
    # The CLI's --json carries device names; targets stay plain data.
    assert json.loads(json.dumps({k: v.memory_bytes for k, v in _kernels.TARGETS.items()}))["h200"] == 143771 * MIB


def test_terminal_table_states_fits_and_the_first_oom() -> None:
    from stepalloc.fit import _cli

    oom = {"allocation": 81233, "size": 256 << 20, "step": 2, "phase": "train", "module": "model.layers.17.mlp (backward)",
           "torch_op": "aten::mm", "cached_free_bytes": 2 << 30, "external_fragmentation": 0.89}
    configs = [
        {"name": "pytorch", "fits": False, "peak_reserved_bytes": 23 << 30, "peak_allocated_bytes": 21 << 30, "headroom_bytes": 0,
         "alloc_retries": 3, "first_oom": oom},
        {"name": "stepalloc", "fits": True, "peak_reserved_bytes": 20 << 30, "peak_allocated_bytes": 19 << 30,
         "headroom_bytes": 3 << 30, "alloc_retries": 0, "first_oom": None},
    ]
    report = {
        "recipe": {"model": "llava-1.5-7b", "batch": 2, "images": [0, 3], "tokens": [128, 1024], "finetune": "lora",
                   "checkpointing": True, "optimizer": "adamw", "iterations": 3, "rollout": 0},
        "recordings": {"sm90": {"allocations": 1234, "steps": 3, "peak_live_bytes": 19 << 30, "attention": {"cudnn": 9}}},
        "devices": [{"device": "24GB", "capacity_bytes": 24 << 30, "fit": {"device": {"usable_bytes": 23 << 30}, "configs": configs},
                     "largest_batch": {"largest": {"pytorch": 1, "stepalloc": 2}, "capped": False, "tried": {}}}],
    }
    text = _cli.table(report)
    assert "pytorch              NO" in text and "stepalloc            yes" in text
    assert "out of memory at allocation 81,233 (256.00 MiB, aten::mm in model.layers.17.mlp (backward), train step 2)" in text
    assert "89% fragmented" in text and "largest batch: pytorch 1, stepalloc 2" in text
