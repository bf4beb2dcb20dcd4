"""The end-to-end comparison's model and workload (e2e_compare.py): the sizes (the 1.4 B
LLaVA-style model, the 7 B one, and for the CPU dry run a tiny one of each's structure), the
model built from transformers configurations with random weights, the training variant (full
fine-tuning or LoRA on the frozen base, picked for the device), the seeded shapes of every
iteration, and the agent loop (a rollout under no_grad with a growing KV cache, then a training
step).

Shapes: an iteration's shape gives each sample of the batch its own number of images and
prompt length (sizes with ``per_sample``; the others draw one per iteration, the same for every
sample, as the 1.4 B runs on record did); samples are left-padded to the longest, with an
attention mask only when lengths differ."""

from __future__ import annotations

import dataclasses
import math
import random
import time


@dataclasses.dataclass(frozen=True)
class Size:
    """The model and the workload: vision tower, language model, batch, shapes, iterations."""

    v_hidden: int
    v_layers: int
    v_heads: int
    v_inter: int
    image: int
    patch: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int
    batch: int
    max_images: int
    prompt: tuple[int, int]
    new_tokens: tuple[int, int]
    warmup: int
    iters: int
    # Each sample its own images and prompt length (else one draw per iteration for all).
    per_sample: bool = False
    # Headroom: "cap" (the largest batch under native peak x factor) or "device" (the whole device).
    headroom: str = "cap"
    max_positions: int = 8192
    # Training: "full" (every parameter, AdamW), "lora" (adapters on the frozen base) or "auto"
    # (full where its state fits the device, see pick_variant).
    train: str = "full"
    lora_rank: int = 16
    fused_adamw: bool = False


SIZES = {
    # CLIP ViT-L/14-336 (0.30 B) + projector + a 1.1 B Llama (TinyLlama's shape): 1.4 B params.
    "full": Size(1024, 24, 16, 4096, 336, 14, 2048, 22, 16, 4, 5632, 32064, 4, 3, (128, 768), (8, 32), 2, 6),
    "tiny": Size(64, 2, 4, 128, 56, 14, 64, 2, 4, 2, 176, 1024, 2, 2, (8, 32), (2, 6), 1, 2),
    # LLaVA-1.5-7B's shape: CLIP ViT-L/14-336 + projector + Llama-2-7B (32 layers, 4096 wide,
    # 32 heads without grouped KV, 11008 MLP, 4096 positions): 7.06 B params, 13.2 GiB in bf16.
    # Batch 2, 0-3 images (576 tokens each) and 128-1024 prompt tokens per sample, 8-32 new.
    "7b": Size(
        1024, 24, 16, 4096, 336, 14, 4096, 32, 32, 32, 11008, 32064, 2, 3, (128, 1024), (8, 32), 1, 3,
        per_sample=True, headroom="device", max_positions=4096, train="auto", fused_adamw=True,
    ),
    # The 7 B size's structure (per-sample shapes, no grouped KV, the device headroom, the
    # variant picked by pick_variant) at the dry run's scale.
    "tiny7b": Size(
        64, 2, 4, 128, 56, 14, 64, 2, 4, 4, 176, 1024, 2, 3, (8, 32), (2, 6), 1, 2,
        per_sample=True, headroom="device", max_positions=4096, train="auto", fused_adamw=True,
    ),
}  # fmt: skip

# The tiny size that stands for each size in a CPU dry run.
DRY = {"full": "tiny", "tiny": "tiny", "7b": "tiny7b", "tiny7b": "tiny7b"}

# Full fine-tuning's device state per parameter: bf16 weights, bf16 gradients and AdamW's two
# states in the parameters' dtype (fused AdamW keeps them so and needs no temporaries).
FULL_BYTES_PER_PARAM = 8
# Full fine-tuning is picked when that state is at most this share of the device: the rest is
# for activations (checkpointed), logits, the rollout's KV cache, the allocator's slack and the
# headroom search's larger batches.
FULL_SHARE = 0.75


def pick_variant(size: Size, params: int, total_bytes: int, forced: str | None = None) -> dict:
    """The training variant for a model of `params` parameters on a device of `total_bytes`:
    full fine-tuning where its state fits FULL_SHARE of the device, else LoRA on the frozen base.
    `forced` (or a size's fixed variant) overrides the choice. Returns the variant and why."""
    state = params * FULL_BYTES_PER_PARAM
    share = state / total_bytes if total_bytes > 0 else float("inf")
    said = (
        f"full fine-tuning's state (bf16 weights, gradients and AdamW's two states: "
        f"{FULL_BYTES_PER_PARAM} bytes x {params / 1e9:.2f} B = {state / (1 << 30):.1f} GiB) is "
        f"{share:.0%} of the device's {total_bytes / (1 << 30):.1f} GiB"
    )
    if forced is not None:
        return {"variant": forced, "why": f"asked for ({said})", "state_bytes": state}
    if size.train != "auto":
        return {"variant": size.train, "why": f"this size's own ({said})", "state_bytes": state}
    if share <= FULL_SHARE:
        return {"variant": "full", "why": f"{said}: at most {FULL_SHARE:.0%}, so it fits", "state_bytes": state}
    return {
        "variant": "lora",
        "why": f"{said}: above {FULL_SHARE:.0%}, so LoRA (rank {size.lora_rank}) on the frozen base",
        "state_bytes": state,
    }


def build_model(torch, size: Size, device: str):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=size.v_hidden,
        intermediate_size=size.v_inter,
        num_hidden_layers=size.v_layers,
        num_attention_heads=size.v_heads,
        image_size=size.image,
        patch_size=size.patch,
        projection_dim=size.v_hidden,
    )
    text = LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.inter,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.max_positions,
        pad_token_id=0,
    )
    # The image token is the last id of the vocabulary; text tokens are drawn below it.
    cfg = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=size.vocab - 1, image_seq_length=image_tokens(size)
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # weights created in place, in bf16
            model = LlavaForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(old)
    return model


def image_tokens(size: Size) -> int:
    return (size.image // size.patch) ** 2  # "default" feature selection drops CLS


def iteration_plan(size: Size, seed: int, count: int) -> list[dict]:
    """The shapes of every iteration, the same in every configuration (seeded): per sample its
    images and prompt length (lists of the batch's length), and the new tokens of the rollout."""
    rng = random.Random(seed)
    plan = []
    for _ in range(count):
        if size.per_sample:
            images = [rng.randint(0, size.max_images) for _ in range(size.batch)]
            prompt = [rng.randint(*size.prompt) for _ in range(size.batch)]
        else:  # one draw for the whole batch (the order of draws of the runs on record)
            images = [rng.randint(0, size.max_images)] * size.batch
            prompt = [rng.randint(*size.prompt)] * size.batch
        plan.append({"images": images, "prompt": prompt, "new": rng.randint(*size.new_tokens)})
    return plan


def largest(size: Size) -> dict:
    return {
        "images": [size.max_images] * size.batch,
        "prompt": [size.prompt[1]] * size.batch,
        "new": size.new_tokens[1],
    }


def per_sample(values: list[int], batch: int) -> list[int]:
    """A shape's per-sample values for `batch` samples (cycled: the headroom's larger batches)."""
    return [values[i % len(values)] for i in range(batch)]


def apply_lora(torch, model, rank: int) -> int:
    """LoRA adapters on every projection of the language model's layers (attention and MLP), the
    rest frozen but the multimodal projector, which LLaVA's fine-tuning trains. Returns the
    trainable parameters' count."""
    nn = torch.nn

    class Lora(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            w = base.weight
            self.a = nn.Parameter(torch.randn(rank, w.shape[1], dtype=w.dtype, device=w.device) / rank)
            self.b = nn.Parameter(torch.zeros(w.shape[0], rank, dtype=w.dtype, device=w.device))
            self.scale = 2.0  # alpha = 2 x rank

        def forward(self, x):
            return self.base(x) + (x @ self.a.t() @ self.b.t()) * self.scale

    for p in model.parameters():
        p.requires_grad_(False)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    language = model.get_decoder() if hasattr(model, "get_decoder") else model
    for parent in list(language.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(parent, name, Lora(child))
    for name, p in model.named_parameters():
        if "multi_modal_projector" in name:
            p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class Loop:
    """The agent loop: rollout (no grad, growing KV cache), then a training step."""

    def __init__(self, torch, model, size: Size, device: str, step_marker, variant: str = "full"):
        self.torch, self.model, self.size, self.device = torch, model, size, device
        self.variant = variant
        self.trainable = sum(p.numel() for p in model.parameters())
        if variant == "lora":
            self.trainable = apply_lora(torch, model, size.lora_rank)
        elif variant != "full":
            raise ValueError(f"training variant {variant!r}: expected full or lora")
        params = [p for p in model.parameters() if p.requires_grad]
        # Fused AdamW where the size says: its states in the parameters' dtype and no foreach
        # temporaries (for a 7 B model those would be another 13 GiB during the step); the 1.4 B
        # runs on record used the default.
        self.opt = torch.optim.AdamW(params, lr=1e-5, **({"fused": True} if size.fused_adamw else {}))
        self.step_marker = step_marker
        import inspect

        from transformers import DynamicCache

        self.cache_cls = DynamicCache
        # transformers renamed past_key_values to cache (5.2x); use whichever forward takes.
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.gen = torch.Generator(device="cpu").manual_seed(0)
        # False while stepalloc.fit records the loop under fake tensors: no synchronisation
        # and no loss read (a fake tensor has no value).
        self.measure = True

    def sync(self) -> None:
        if self.device == "cuda" and self.measure:
            self.torch.cuda.synchronize()

    def inputs(self, shape: dict, batch: int):
        """Token ids (left-padded), the attention mask (None when every sample has the same
        length) and the images of every sample, in order."""
        torch, size = self.torch, self.size
        images, prompts = per_sample(shape["images"], batch), per_sample(shape["prompt"], batch)
        seqs = []
        for k, p in zip(images, prompts):
            text = torch.randint(1, size.vocab - 1, (p,), generator=self.gen)
            seqs.append(torch.cat([torch.full((k * image_tokens(size),), size.vocab - 1), text]))
        width = max(len(q) for q in seqs)
        ids = torch.zeros((batch, width), dtype=torch.long)  # 0: the pad token
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, q in enumerate(seqs):
            ids[i, width - len(q) :] = q
            mask[i, width - len(q) :] = 1
        pixels = None
        if sum(images):
            pixels = torch.randn(sum(images), 3, size.image, size.image, generator=self.gen).to(
                self.device, torch.bfloat16
            )
        uneven = any(len(q) != width for q in seqs)
        return ids.to(self.device), (mask.to(self.device) if uneven else None), pixels

    def next_token(self, out):
        # Greedy, never the image token (an episode with more image tokens than images would
        # not train).
        return out.logits[:, -1, : self.size.vocab - 1].argmax(-1, keepdim=True)

    def rollout(self, shape: dict, batch: int):
        torch = self.torch
        ids, mask, pixels = self.inputs(shape, batch)
        self.model.eval()
        with self.step_marker("rollout"), torch.no_grad():
            cache = self.cache_cls()
            out = self.model(
                input_ids=ids,
                pixel_values=pixels,
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_kw: cache},
            )
            tokens = [self.next_token(out)]
            del out
            for _ in range(shape["new"] - 1):
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones((batch, 1))], 1)
                out = self.model(
                    input_ids=tokens[-1],
                    attention_mask=mask,
                    use_cache=True,
                    logits_to_keep=1,
                    **{self.cache_kw: cache},
                )
                tokens.append(self.next_token(out))
                del out
            del cache
            episode = torch.cat([ids, *tokens], 1)
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones((batch, 1))], 1)
        return episode, mask, pixels

    def train(self, episode, mask, pixels) -> float:
        self.model.train()
        with self.step_marker("train"):
            labels = episode.clone()
            labels[episode == self.size.vocab - 1] = -100  # image tokens
            if mask is not None:
                labels[mask == 0] = -100  # padding
            loss = self.model(input_ids=episode, pixel_values=pixels, attention_mask=mask, labels=labels).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return float(loss.detach()) if self.measure else math.nan

    def iteration(self, shape: dict, batch: int) -> dict:
        self.sync()
        t0 = time.perf_counter()
        episode, mask, pixels = self.rollout(shape, batch)
        self.sync()
        t1 = time.perf_counter()
        loss = self.train(episode, mask, pixels)
        del episode, mask, pixels
        self.sync()
        t2 = time.perf_counter()
        return {**shape, "batch": batch, "rollout_s": t1 - t0, "train_s": t2 - t1, "step_s": t2 - t0, "loss": loss}
