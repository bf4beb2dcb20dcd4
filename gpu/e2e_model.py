"""The end-to-end comparison's model and workload (e2e_compare.py): the sizes (the full 1.4 B
LLaVA-style model and the dry run's tiny one), the model built from transformers
configurations with random weights, the seeded shapes of every iteration, and the agent loop
(a rollout under no_grad with a growing KV cache, then a training step)."""

from __future__ import annotations

import dataclasses
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


SIZES = {
    # CLIP ViT-L/14-336 (0.30 B) + projector + a 1.1 B Llama (TinyLlama's shape): 1.4 B params.
    "full": Size(1024, 24, 16, 4096, 336, 14, 2048, 22, 16, 4, 5632, 32064, 4, 3, (128, 768), (8, 32), 2, 6),
    "tiny": Size(64, 2, 4, 128, 56, 14, 64, 2, 4, 2, 176, 1024, 2, 2, (8, 32), (2, 6), 1, 2),
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
        max_position_embeddings=8192,
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
    """The shapes of every iteration, the same in every configuration (seeded)."""
    rng = random.Random(seed)
    return [
        {
            "images": rng.randint(0, size.max_images),
            "prompt": rng.randint(*size.prompt),
            "new": rng.randint(*size.new_tokens),
        }
        for _ in range(count)
    ]


def largest(size: Size) -> dict:
    return {"images": size.max_images, "prompt": size.prompt[1], "new": size.new_tokens[1]}


class Loop:
    """The agent loop: rollout (no grad, growing KV cache), then a training step."""

    def __init__(self, torch, model, size: Size, device: str, step_marker):
        self.torch, self.model, self.size, self.device = torch, model, size, device
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.step_marker = step_marker
        import inspect

        from transformers import DynamicCache

        self.cache_cls = DynamicCache
        # transformers renamed past_key_values to cache (5.2x); use whichever forward takes.
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.gen = torch.Generator(device="cpu").manual_seed(0)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def inputs(self, shape: dict, batch: int):
        torch, size = self.torch, self.size
        n_img = shape["images"]
        text = torch.randint(0, size.vocab - 1, (batch, shape["prompt"]), generator=self.gen)
        img = torch.full((batch, n_img * image_tokens(size)), size.vocab - 1)
        ids = torch.cat([img, text], 1).to(self.device)
        pixels = None
        if n_img:
            pixels = torch.randn(batch * n_img, 3, size.image, size.image, generator=self.gen).to(
                self.device, torch.bfloat16
            )
        return ids, pixels

    def rollout(self, shape: dict, batch: int):
        torch = self.torch
        ids, pixels = self.inputs(shape, batch)
        self.model.eval()
        with self.step_marker("rollout"), torch.no_grad():
            cache = self.cache_cls()
            out = self.model(
                input_ids=ids, pixel_values=pixels, use_cache=True, logits_to_keep=1, **{self.cache_kw: cache}
            )
            tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
            del out
            for _ in range(shape["new"] - 1):
                out = self.model(input_ids=tokens[-1], use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
                tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
                del out
            del cache
            episode = torch.cat([ids, *tokens], 1)
        return episode, pixels

    def train(self, episode, pixels, shape: dict) -> float:
        self.model.train()
        with self.step_marker("train"):
            labels = episode.clone()
            labels[:, : shape["images"] * image_tokens(self.size)] = -100
            loss = self.model(input_ids=episode, pixel_values=pixels, labels=labels).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return float(loss.detach())

    def iteration(self, shape: dict, batch: int) -> dict:
        self.sync()
        t0 = time.perf_counter()
        episode, pixels = self.rollout(shape, batch)
        self.sync()
        t1 = time.perf_counter()
        loss = self.train(episode, pixels, shape)
        del episode, pixels
        self.sync()
        t2 = time.perf_counter()
        return {**shape, "batch": batch, "rollout_s": t1 - t0, "train_s": t2 - t1, "step_s": t2 - t0, "loss": loss}
