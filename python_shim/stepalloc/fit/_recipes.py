"""Recipes: a training loop built from a model's configuration alone, recorded.

Layer: uses ``_configs`` (the model), ``_recorder`` (the recording) and transformers / peft
(imported when a recipe runs). A recipe is plain data (``Recipe``); ``record_recipe`` builds the
model and optimizer under fake tensors and runs ``iterations`` iterations, each an optional
rollout (generation with a growing KV cache under no_grad: a prefill, then one token at a time,
the tokens drawn from a seeded generator, not from the logits) and a training step (forward,
backward, optimizer step) on the episode, with the numbers of images and tokens of every sample
drawn from the recipe's ranges by a seeded generator: the variation that fragments the cache.

Invariants: the same recipe and seed record the same trace; nothing is downloaded and no weight
is read; the model runs as transformers writes it (data-dependent code served by ``_values``).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from . import _configs
from ._recorder import Recording

FINETUNE = ("full", "lora")
OPTIMIZERS = ("adamw", "adamw-fused", "sgd")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
# The most tokens a batch (or any one input size) may hold: the recorder builds each batch's
# inputs as real tensors (and Python lists) on the host, about 30 bytes a token.
MAX_TOKENS = 1 << 24
# Linear layers of the language model that LoRA adapts (the vision tower stays frozen).
LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@dataclass
class Recipe:
    """A training loop to record. Ranges are inclusive (low, high)."""

    model: Any = "llava-1.5-7b"  # a shipped name, a config.json path or folder, or a dict
    batch: int = 2
    images: tuple[int, int] = (0, 3)  # images per sample
    tokens: tuple[int, int] = (128, 1024)  # text tokens per sample (images add theirs)
    iterations: int = 3
    finetune: str = "full"  # "full" or "lora"
    lora_rank: int = 16
    checkpointing: bool = True
    optimizer: str = "adamw"
    dtype: str = "bfloat16"
    rollout: int = 0  # tokens generated per sample before each training step (0: no rollout)
    train_vision: bool = False
    image_size: int = 448  # Qwen2-VL: pixels a side (LLaVA's is its config's, 336)
    seed: int = 0
    tiny: bool = False  # two layers, narrow (tests)
    extra: dict = field(default_factory=dict)

    def check(self) -> Recipe:
        def bad(what: str) -> ValueError:
            return ValueError(f"recipe: {what}")

        if self.batch < 1:
            raise bad(f"batch {self.batch}: at least 1")
        for name in ("images", "tokens"):
            lo, hi = getattr(self, name)
            if not (0 <= lo <= hi) or (name == "tokens" and lo < 1):
                raise bad(f"{name} {lo}-{hi}: a range low-high with 0 <= low <= high (tokens at least 1)")
        if self.iterations < 1:
            raise bad("iterations: at least 1")
        if not 0 <= self.seed < 1 << 63:
            raise bad(f"seed {self.seed}: from 0 to 2**63-1")
        if self.finetune not in FINETUNE:
            raise bad(f"finetune {self.finetune!r}: one of {', '.join(FINETUNE)}")
        if self.optimizer not in OPTIMIZERS:
            raise bad(f"optimizer {self.optimizer!r}: one of {', '.join(OPTIMIZERS)}")
        if self.dtype not in DTYPES:
            raise bad(f"dtype {self.dtype!r}: one of {', '.join(DTYPES)}")
        if self.rollout < 0 or self.image_size < 28 or self.lora_rank < 1:
            raise bad("rollout >= 0, image_size >= 28 and lora_rank >= 1")
        for name, value in (("batch", self.batch), ("tokens", self.tokens[1]), ("images", self.images[1]),
                            ("rollout", self.rollout), ("image_size", self.image_size), ("lora_rank", self.lora_rank),
                            ("iterations", self.iterations)):
            if value > MAX_TOKENS:
                raise bad(f"{name} {value}: takes at most {MAX_TOKENS:,} (the recorder builds its inputs on the host)")
        check_tokens(self, self.tokens[1] + self.rollout)
        return self

    def with_batch(self, batch: int) -> Recipe:
        return replace(self, batch=batch)


def check_tokens(recipe: Recipe, per_sample: int) -> None:
    """Refuses a batch of more than ``MAX_TOKENS`` tokens (``per_sample``: the most a sample holds)."""
    total = recipe.batch * per_sample
    if total > MAX_TOKENS:
        raise ValueError(
            f"recipe: batch {recipe.batch} x {per_sample:,} tokens a sample (text, rollout and images at their most) "
            f"= {total:,} tokens a batch; the recorder takes at most {MAX_TOKENS:,} (it builds each batch's inputs "
            "on the host): lower the batch, --tokens, --rollout, --images or --image-size"
        )


# ---- the model ---------------------------------------------------------------------------


class _Model:
    """The model of a recipe and what its inputs look like."""

    def __init__(self, recipe: Recipe) -> None:
        raw = _configs.load(recipe.model)
        self.raw = _configs.tiny(raw) if recipe.tiny else raw
        self.path = self.raw.get("_path", "configuration")
        self.cfg = _configs.transformers_config(self.raw)
        self.cls = _configs.model_class(self.cfg, self.path)
        self.kind = self.cfg.model_type
        text = self.cfg.get_text_config()
        if not isinstance(getattr(text, "vocab_size", None), int):
            raise _configs.ConfigError(_configs.unusable(self.path, self.cfg, "it has no vocabulary (vocab_size)"))
        self.vocab = int(text.vocab_size)
        self.pad = _first_int(getattr(self.cfg, "pad_token_id", None), getattr(text, "pad_token_id", None), 0)
        if self.kind == "llava":
            vc = self.cfg.vision_config
            side = vc.image_size // vc.patch_size
            self.image_token = int(self.cfg.image_token_index)
            self.tokens_per_image = side * side + (1 if self.cfg.vision_feature_select_strategy == "full" else 0)
            self.image_side = vc.image_size
        elif self.kind == "qwen2_vl":
            vc = self.cfg.vision_config
            self.image_token = int(self.cfg.image_token_id)
            self.patch = vc.patch_size
            self.merge = vc.spatial_merge_size
            self.temporal = vc.temporal_patch_size
            self.image_side = recipe.image_size // (self.patch * self.merge) * (self.patch * self.merge)
            grid = self.image_side // self.patch
            self.tokens_per_image = grid * grid // (self.merge * self.merge)
        else:
            self.image_token = None
            self.tokens_per_image = 0
        # The most tokens a sample holds (Qwen2-VL wraps each image's in a start and an end token).
        self.sample_tokens = recipe.tokens[1] + recipe.rollout + recipe.images[1] * (self.tokens_per_image + 2)
        check_tokens(recipe, self.sample_tokens)


def check_model(recipe: Recipe) -> None:
    """Refuses (``ValueError``) a recipe whose model transformers cannot read or the recipes
    cannot train, or whose batch holds too many tokens once images count, before recording."""
    _Model(recipe.check())


def largest_batch_taken(recipe: Recipe) -> int:
    """The largest batch of ``recipe`` whose inputs the recorder takes (``MAX_TOKENS``): where the
    largest-batch search stops."""
    return max(1, MAX_TOKENS // _Model(recipe.with_batch(1).check()).sample_tokens)


def _first_int(*values) -> int:
    for v in values:
        if isinstance(v, int):
            return v
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], int):
            return v[0]
    return 0


def build(rec: Recording, recipe: Recipe, m: _Model):
    """The model (fake CUDA weights, recorded) and its optimizer."""
    dtype = DTYPES[recipe.dtype]
    cls = m.cls
    m.cfg._attn_implementation = "sdpa"
    for sub in ("text_config", "vision_config"):
        if getattr(m.cfg, sub, None) is not None:
            getattr(m.cfg, sub)._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(rec.device_type):
            model = cls(m.cfg)
    except (KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError) as exc:
        # What transformers raises on a configuration it reads but cannot build (an unknown
        # activation, a width that heads do not divide); the recorder's own errors are RuntimeErrors.
        raise _configs.ConfigError(f"{m.path}: transformers cannot build {cls.__name__} from it: "
                                   f"{type(exc).__name__}: {exc}") from exc
    except ValueError as exc:
        if isinstance(exc, _configs.ConfigError):
            raise
        raise _configs.ConfigError(f"{m.path}: transformers cannot build {cls.__name__} from it: {exc}") from exc
    finally:
        torch.set_default_dtype(old)
    if recipe.finetune == "lora":
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as exc:
            raise RuntimeError("finetune='lora' needs peft (pip install peft)") from exc
        with torch.device(rec.device_type):
            model = get_peft_model(model, LoraConfig(r=recipe.lora_rank, lora_alpha=2 * recipe.lora_rank,
                                                     target_modules=LORA_TARGETS, lora_dropout=0.0))
    elif not recipe.train_vision:
        for name, p in model.named_parameters():
            if _is_vision(name):
                p.requires_grad_(False)
    if recipe.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rec.name_parameters(model)
    params = [p for p in model.parameters() if p.requires_grad]
    if recipe.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=1e-5, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=1e-5, fused=True if recipe.optimizer == "adamw-fused" else None)
    return model, opt


def _is_vision(name: str) -> bool:
    return ".vision_tower." in f".{name}" or ".visual." in f".{name}"


# ---- inputs ------------------------------------------------------------------------------


def sample(rng: random.Random, recipe: Recipe, m: _Model) -> dict[str, Any]:
    """Real CPU inputs of one batch: per sample, its images' tokens then its text, right-padded."""
    rows, images = [], []
    for _ in range(recipe.batch):
        n_img = rng.randint(*recipe.images) if m.image_token is not None else 0
        n_txt = rng.randint(*recipe.tokens)
        ids: list[int] = []
        for _ in range(n_img):
            ids += _image_ids(m)
        ids += [rng.randrange(10, min(m.vocab, 30000)) for _ in range(n_txt)]
        rows.append(ids)
        images.append(n_img)
    width = max(len(r) for r in rows)
    input_ids = torch.full((recipe.batch, width), m.pad, dtype=torch.long)
    mask = torch.zeros((recipe.batch, width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    labels = input_ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "images": sum(images)}
    if m.image_token is not None:
        batch["labels"] = labels.masked_fill(input_ids == m.image_token, -100)
    return _with_token_types(batch, m)


def _with_token_types(batch: dict[str, Any], m: _Model) -> dict[str, Any]:
    """Qwen2-VL's processor also returns each token's modality (1: image), for M-RoPE."""
    if m.kind == "qwen2_vl":
        batch["mm_token_type_ids"] = (batch["input_ids"] == m.image_token).long()
    return batch


def extend(batch: dict[str, Any], new_tokens: int, gen: torch.Generator) -> dict[str, Any]:
    """The episode a rollout made: the prompt and the generated tokens (trained on)."""
    b = batch["input_ids"].shape[0]
    new = torch.randint(10, 30000, (b, new_tokens), generator=gen)
    ones = torch.ones_like(new)
    out = {
        "input_ids": torch.cat([batch["input_ids"], new], dim=1),
        "attention_mask": torch.cat([batch["attention_mask"], ones], dim=1),
        "labels": torch.cat([batch["labels"], new], dim=1),
        "images": batch["images"],
    }
    if "mm_token_type_ids" in batch:
        out["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(new)], dim=1)
    return out


def _image_ids(m: _Model) -> list[int]:
    if m.kind == "qwen2_vl":
        return [m.cfg.vision_start_token_id] + [m.image_token] * m.tokens_per_image + [m.cfg.vision_end_token_id]
    return [m.image_token] * m.tokens_per_image


def to_device(rec: Recording, batch: dict[str, Any], m: _Model, labels: bool = True) -> dict[str, Any]:
    """The batch as device tensors carrying their values, with pixel inputs (no values: their
    contents never decide a shape)."""
    out = {k: rec.tensor(batch[k]) for k in ("input_ids", "attention_mask", "mm_token_type_ids") if k in batch}
    if labels:
        out["labels"] = rec.tensor(batch["labels"])
    n = batch["images"]
    if n and m.kind == "llava":
        out["pixel_values"] = torch.randn(n, 3, m.image_side, m.image_side, device=rec.device_type)
    elif n and m.kind == "qwen2_vl":
        grid = m.image_side // m.patch
        patches = m.temporal * grid * grid // m.temporal  # one frame, repeated over the temporal patch
        out["pixel_values"] = torch.randn(n * patches, 3 * m.temporal * m.patch * m.patch, device=rec.device_type)
        with rec.host():
            thw = torch.tensor([[1, grid, grid]] * n, dtype=torch.long)
        out["image_grid_thw"] = rec.tensor(thw)
    return out


# ---- the loop ----------------------------------------------------------------------------


def rollout(rec: Recording, model, m: _Model, batch: dict[str, Any], new_tokens: int, gen: torch.Generator) -> None:
    """Generation under no_grad with transformers' own ``generate`` (its KV cache, its input
    preparation, logits of the last position only), greedy over scores that a logits processor
    replaces with a one-hot of a token drawn from the seeded generator: the tokens are real
    values, so generate's stopping checks are served, and no token depends on the fake logits."""
    from transformers import LogitsProcessor, LogitsProcessorList

    vocab = m.vocab

    class Forced(LogitsProcessor):
        def __call__(self, input_ids, scores):
            with rec.host():
                token = torch.randint(10, min(vocab, 30000), (scores.shape[0],), generator=gen)
                forced = torch.full(scores.shape, float("-inf"), dtype=scores.dtype)
                forced[torch.arange(scores.shape[0]), token] = 0
            return rec.tensor(forced)

    inputs = to_device(rec, batch, m, labels=False)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([Forced()]),
            pad_token_id=m.pad,
        )
    del out, inputs


def train_step(rec: Recording, model, opt, m: _Model, batch: dict[str, Any]) -> None:
    inputs = to_device(rec, batch, m)
    out = model(**inputs)
    loss = out.loss
    del out
    loss.backward()
    del loss, inputs
    opt.step()
    opt.zero_grad(set_to_none=True)


def record_recipe(recipe: Recipe, target: Any = "h100", attention: str = "auto") -> Recording:
    """Records ``recipe`` for ``target`` and returns the recording (``.trace`` holds the stream)."""
    recipe.check()
    m = _Model(recipe)
    rng = random.Random(recipe.seed)
    gen = torch.Generator().manual_seed(recipe.seed)
    rec = Recording(target=target, attention=attention)
    with rec, _training_env():
        model, opt = build(rec, recipe, m)
        for _ in range(recipe.iterations):
            if recipe.rollout:
                with rec.host():
                    prompt = sample(rng, recipe, m)
                with rec.step("rollout"):
                    model.eval()
                    rollout(rec, model, m, prompt, recipe.rollout, gen)
                    model.train()
                with rec.host():
                    batch = extend(prompt, recipe.rollout, gen)
            else:
                with rec.host():
                    batch = sample(rng, recipe, m)
            with rec.step("train"):
                model.train()
                train_step(rec, model, opt, m, batch)
        del model, opt
    rec.trace.strip_root()
    return rec


@contextlib.contextmanager
def _training_env():
    """Quiet transformers' advice about checkpointing and caches while recording."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
