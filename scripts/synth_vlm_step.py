#!/usr/bin/env python3
"""Writes a synthetic allocation trace shaped like a recorded training step of a LLaVA-1.5-7B
vision-language model (CLIP ViT-L/14-336 + projector + Llama-2-7B, 7.06 B parameters), in the
JSON lines `stepalloc-stress fit` reads, with `module` and `torch_op` on every allocation.

Not a recording: it stands in for `python -m stepalloc.fit`'s output in the replay's benchmark
(docs/performance.md) and in the picture's tests, with the sizes, counts and order a real step
has: bf16 parameters, the vision tower frozen (its forward under no_grad), the language model
under gradient checkpointing (each layer's forward without saved activations, recomputed in the
backward), RMSNorm in fp32, flash attention (output and log-sum-exp), the loss's fp32 logits,
gradients kept until the optimizer step, and PyTorch's foreach AdamW (states in the parameters'
dtype, made at the first step; one parameter-sized temporary per parameter for the square root
of exp_avg_sq, all at once, as `_foreach_sqrt` makes them); `zero_grad(set_to_none=True)` after.
Each iteration draws its images per sample and tokens per sample from the given ranges (seeded),
one `train` step per iteration.

Usage: synth_vlm_step.py OUT.jsonl [--iterations 4] [--batch 2] [--tokens 128-1024]
       [--images 0-3] [--seed 0] [--layers 32] [--vision-layers 24] [--hidden 4096]
       [--intermediate 11008] [--vision-hidden 1024] [--vocab 32064]
The defaults are the 7B model; `--layers 2 --vision-layers 1 --hidden 256 --intermediate 688
--vision-hidden 64 --vocab 1000` makes a small one for tests.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

BF16, FP32 = 2, 4


class Trace:
    """Allocations and frees with unique addresses, written as JSON lines."""

    def __init__(self, out):
        self.out = out
        self.next_addr = 1 << 20
        self.allocs = 0

    def alloc(self, size: int, module: str, op: str) -> int:
        addr = self.next_addr
        self.next_addr += max(size, 512)
        self.allocs += 1
        self.out.write(json.dumps({"op": "alloc", "addr": addr, "size": size, "module": module, "torch_op": op}))
        self.out.write("\n")
        return addr

    def free(self, *addrs: int) -> None:
        for a in addrs:
            self.out.write(f'{{"op":"free","addr":{a}}}\n')

    def marker(self, op: str, phase: str | None = None) -> None:
        self.out.write(json.dumps({"op": op, **({"phase": phase} if phase else {})}) + "\n")


def parameters(a) -> list[tuple[str, int, bool]]:
    """(module, elements, trainable) of every parameter, in the model's order."""
    h, i, vh, v = a.hidden, a.intermediate, a.vision_hidden, a.vocab
    out = []
    vt = "model.vision_tower.vision_model"
    out.append((f"{vt}.embeddings.patch_embedding", vh * 3 * 14 * 14, False))
    out.append((f"{vt}.embeddings.position_embedding", vh * 577, False))
    for layer in range(a.vision_layers):
        p = f"{vt}.encoder.layers.{layer}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"):
            out += [(f"{p}.{name}", vh * vh, False), (f"{p}.{name}", vh, False)]
        out += [(f"{p}.mlp.fc1", vh * 4 * vh, False), (f"{p}.mlp.fc1", 4 * vh, False)]
        out += [(f"{p}.mlp.fc2", 4 * vh * vh, False), (f"{p}.mlp.fc2", vh, False)]
        out += [(f"{p}.layer_norm1", vh, False), (f"{p}.layer_norm2", vh, False)]
    out += [
        ("model.multi_modal_projector.linear_1", vh * h, True),
        ("model.multi_modal_projector.linear_2", h * h, True),
    ]
    lm = "model.language_model"
    out.append((f"{lm}.embed_tokens", v * h, True))
    for layer in range(a.layers):
        p = f"{lm}.layers.{layer}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
            out.append((f"{p}.{name}", h * h, True))
        for name in ("mlp.gate_proj", "mlp.up_proj"):
            out.append((f"{p}.{name}", h * i, True))
        out.append((f"{p}.mlp.down_proj", i * h, True))
        out += [(f"{p}.input_layernorm", h, True), (f"{p}.post_attention_layernorm", h, True)]
    out += [(f"{lm}.norm", h, True), ("lm_head", v * h, True)]
    return out


def rms_norm(t: Trace, module: str, rows: int, h: int) -> int:
    """RMSNorm in fp32, as Llama computes it; returns the bf16 output."""
    x32 = t.alloc(rows * h * FP32, module, "aten::_to_copy")
    sq = t.alloc(rows * h * FP32, module, "aten::pow")
    mean = t.alloc(rows * FP32, module, "aten::mean")
    t.free(sq)
    rs = t.alloc(rows * FP32, module, "aten::rsqrt")
    t.free(mean)
    y32 = t.alloc(rows * h * FP32, module, "aten::mul")
    t.free(x32, rs)
    y = t.alloc(rows * h * BF16, module, "aten::_to_copy")
    t.free(y32)
    out = t.alloc(rows * h * BF16, module, "aten::mul")
    t.free(y)
    return out


def llama_layer_forward(t: Trace, a, p: str, rows: int, heads: int, suffix: str = "") -> list[int]:
    """One decoder layer's forward; returns what the backward keeps (recompute) or frees."""
    h, i = a.hidden, a.intermediate
    kept = []
    n1 = rms_norm(t, f"{p}.input_layernorm{suffix}", rows, h)
    q = t.alloc(rows * h * BF16, f"{p}.self_attn.q_proj{suffix}", "aten::mm")
    k = t.alloc(rows * h * BF16, f"{p}.self_attn.k_proj{suffix}", "aten::mm")
    v = t.alloc(rows * h * BF16, f"{p}.self_attn.v_proj{suffix}", "aten::mm")
    rot = []
    for x in (q, k):
        half = t.alloc(rows * h * BF16, f"{p}.self_attn{suffix}", "aten::cat")
        m1 = t.alloc(rows * h * BF16, f"{p}.self_attn{suffix}", "aten::mul")
        m2 = t.alloc(rows * h * BF16, f"{p}.self_attn{suffix}", "aten::mul")
        t.free(half)
        e = t.alloc(rows * h * BF16, f"{p}.self_attn{suffix}", "aten::add")
        t.free(m1, m2)
        rot.append(e)
    attn = t.alloc(rows * h * BF16, f"{p}.self_attn{suffix}", "aten::_scaled_dot_product_flash_attention")
    lse = t.alloc(rows * heads * FP32, f"{p}.self_attn{suffix}", "aten::_scaled_dot_product_flash_attention")
    o = t.alloc(rows * h * BF16, f"{p}.self_attn.o_proj{suffix}", "aten::mm")
    r1 = t.alloc(rows * h * BF16, f"{p}{suffix}", "aten::add")
    n2 = rms_norm(t, f"{p}.post_attention_layernorm{suffix}", rows, h)
    g = t.alloc(rows * i * BF16, f"{p}.mlp.gate_proj{suffix}", "aten::mm")
    act = t.alloc(rows * i * BF16, f"{p}.mlp.act_fn{suffix}", "aten::silu")
    u = t.alloc(rows * i * BF16, f"{p}.mlp.up_proj{suffix}", "aten::mm")
    m = t.alloc(rows * i * BF16, f"{p}.mlp{suffix}", "aten::mul")
    d = t.alloc(rows * h * BF16, f"{p}.mlp.down_proj{suffix}", "aten::mm")
    out = t.alloc(rows * h * BF16, f"{p}{suffix}", "aten::add")
    kept = [n1, q, k, v, *rot, attn, lse, o, r1, n2, g, act, u, m, d]
    return kept + [out]


def step(t: Trace, a, rng: random.Random, params: list[tuple[str, int, bool]], weights, grads, states) -> None:
    h, i, vh, v = a.hidden, a.intermediate, a.vision_hidden, a.vocab
    heads = max(1, h // 128)
    images = [rng.randint(a.images[0], a.images[1]) for _ in range(a.batch)]
    tokens = [rng.randint(a.tokens[0], a.tokens[1]) for _ in range(a.batch)]
    seq = max(tok + 576 * img for tok, img in zip(tokens, images))  # padded to the longest
    rows = a.batch * seq
    t.marker("step_begin", "train")
    ids = t.alloc(rows * 8, "", "aten::_to_copy")
    # The vision tower, frozen: its forward under no_grad frees each layer's work as it goes.
    vt = "model.vision_tower.vision_model"
    n_img = sum(images)
    feats = None
    if n_img:
        vrows = n_img * 577
        x = t.alloc(vrows * vh * BF16, f"{vt}.embeddings", "aten::convolution")
        for layer in range(a.vision_layers):
            p = f"{vt}.encoder.layers.{layer}"
            ln = t.alloc(vrows * vh * BF16, f"{p}.layer_norm1", "aten::native_layer_norm")
            qkv = [
                t.alloc(vrows * vh * BF16, f"{p}.self_attn.{n}", "aten::addmm") for n in ("q_proj", "k_proj", "v_proj")
            ]
            t.free(ln)
            at = t.alloc(vrows * vh * BF16, f"{p}.self_attn", "aten::_scaled_dot_product_flash_attention")
            t.free(*qkv)
            ao = t.alloc(vrows * vh * BF16, f"{p}.self_attn.out_proj", "aten::addmm")
            t.free(at)
            r = t.alloc(vrows * vh * BF16, p, "aten::add")
            t.free(ao, x)
            ln2 = t.alloc(vrows * vh * BF16, f"{p}.layer_norm2", "aten::native_layer_norm")
            f1 = t.alloc(vrows * 4 * vh * BF16, f"{p}.mlp.fc1", "aten::addmm")
            t.free(ln2)
            g = t.alloc(vrows * 4 * vh * BF16, f"{p}.mlp.activation_fn", "aten::gelu")
            t.free(f1)
            f2 = t.alloc(vrows * vh * BF16, f"{p}.mlp.fc2", "aten::addmm")
            t.free(g)
            x = t.alloc(vrows * vh * BF16, p, "aten::add")
            t.free(f2, r)
        feats = x
    # Projector (trained) and the merged embeddings.
    proj = []
    if feats is not None:
        prow = n_img * 576
        l1 = t.alloc(prow * h * BF16, "model.multi_modal_projector.linear_1", "aten::addmm")
        act = t.alloc(prow * h * BF16, "model.multi_modal_projector.act", "aten::gelu")
        l2 = t.alloc(prow * h * BF16, "model.multi_modal_projector.linear_2", "aten::addmm")
        t.free(feats)
        proj = [l1, act, l2]
    lm = "model.language_model"
    emb = t.alloc(rows * h * BF16, f"{lm}.embed_tokens", "aten::embedding")
    merged = t.alloc(rows * h * BF16, "model", "aten::masked_scatter")
    # Decoder layers under gradient checkpointing: each keeps its input only.
    inputs = [merged]
    for layer in range(a.layers):
        work = llama_layer_forward(t, a, f"{lm}.layers.{layer}", rows, heads)
        t.free(*work[:-1])
        inputs.append(work[-1])
    norm = rms_norm(t, f"{lm}.norm", rows, h)
    logits = t.alloc(rows * v * BF16, "lm_head", "aten::mm")
    logits32 = t.alloc(rows * v * FP32, "", "aten::_to_copy")
    lsm = t.alloc(rows * v * FP32, "", "aten::_log_softmax")
    loss = t.alloc(4, "", "aten::nll_loss_forward")
    # Backward: the loss's gradients, lm_head, then each layer recomputed and differentiated.
    g_lsm = t.alloc(rows * v * FP32, "(backward)", "aten::_log_softmax_backward_data")
    t.free(lsm, logits32)
    g_logits = t.alloc(rows * v * BF16, "lm_head (backward)", "aten::_to_copy")
    t.free(g_lsm)
    order = {m: k for k, (m, _, _) in enumerate(params)}

    def grad(module: str, elements: int) -> None:
        k = order.get(module)
        if k is not None and grads[k] is None and params[k][2]:
            grads[k] = t.alloc(elements * BF16, f"{module} (backward)", "aten::mm")

    grad("lm_head", v * h)
    g_x = t.alloc(rows * h * BF16, "lm_head (backward)", "aten::mm")
    t.free(g_logits, logits, loss)
    g_n = t.alloc(rows * h * BF16, f"{lm}.norm (backward)", "aten::mul")
    grad(f"{lm}.norm", h)
    t.free(g_x, norm)
    g_x = g_n
    for layer in reversed(range(a.layers)):
        p = f"{lm}.layers.{layer}"
        saved = llama_layer_forward(t, a, p, rows, heads, " (backward)")
        t.free(saved[-1])  # the recomputed output is not needed
        grads_in = []
        for name, fan_in, fan_out in (
            ("mlp.down_proj", i, h), ("mlp.up_proj", h, i), ("mlp.gate_proj", h, i),
            ("self_attn.o_proj", h, h), ("self_attn.v_proj", h, h), ("self_attn.k_proj", h, h),
            ("self_attn.q_proj", h, h),
        ):
            grads_in.append(t.alloc(rows * fan_in * BF16, f"{p}.{name} (backward)", "aten::mm"))
            grad(f"{p}.{name}", fan_in * fan_out)
            if len(grads_in) > 2:  # each consumed by the next op's backward
                t.free(grads_in.pop(0))
        ga = t.alloc(rows * h * BF16, f"{p}.self_attn (backward)", "aten::_scaled_dot_product_flash_attention_backward")
        grad(f"{p}.input_layernorm", h)
        grad(f"{p}.post_attention_layernorm", h)
        g_in = t.alloc(rows * h * BF16, f"{p} (backward)", "aten::add")
        t.free(*saved[:-1], *grads_in, ga, g_x, inputs.pop())
        g_x = g_in
    t.free(inputs.pop(), emb)
    grad(f"{lm}.embed_tokens", v * h)
    for name, n in (("model.multi_modal_projector.linear_2", h * h), ("model.multi_modal_projector.linear_1", vh * h)):
        if proj:
            grad(name, n)
    t.free(g_x, *proj, ids)
    # Foreach AdamW: states at the first step, a parameter-sized temporary per parameter at once.
    trainable = [k for k, p in enumerate(params) if p[2] and grads[k] is not None]
    if not states:
        for k in trainable:
            states[k] = (
                t.alloc(params[k][1] * BF16, "optimizer", "optimizer_state"),
                t.alloc(params[k][1] * BF16, "optimizer", "optimizer_state"),
            )
    temps = [t.alloc(params[k][1] * BF16, "optimizer", "aten::_foreach_sqrt") for k in trainable]
    t.free(*temps)
    for k in trainable:  # zero_grad(set_to_none=True)
        t.free(grads[k])
        grads[k] = None
    t.marker("step_end")


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=span, default=(128, 1024))
    ap.add_argument("--images", type=span, default=(0, 3))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--vision-layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--vision-hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32064)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    params = parameters(a)
    with a.out.open("w") as out:
        t = Trace(out)
        weights = [t.alloc(n * BF16, m, "aten::empty") for m, n, _ in params]
        grads: list[int | None] = [None] * len(params)
        states: dict[int, tuple[int, int]] = {}
        for _ in range(a.iterations):
            step(t, a, rng, params, weights, grads, states)
    total = sum(n for _, n, _ in params)
    print(f"{a.out}: {t.allocs} allocations, {total / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main()
