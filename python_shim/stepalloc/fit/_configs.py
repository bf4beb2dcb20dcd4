"""Model configurations: the ones the package ships and a user's local ``config.json``.

Layer: reads JSON and builds transformers configurations and (under the recorder's fake mode)
models; never reads weights, never downloads. Shipped configurations live in ``configs/`` beside
this file, written from the published ``config.json`` of each model (their ``_source`` key says
which).

Invariants: a bad configuration is a ``ConfigError`` that names the file and what is wrong
(the key, its value, the bound); ``load`` bounds what a configuration can make the recorder build
on the host (``check``: the file's size and nesting, every size a whole number within ``SIZES``,
the MoE expert blocks), so a hostile file cannot fill the host's memory with modules;
``tiny`` shrinks widths and depths (for tests) but keeps every token id and the vocabulary, so
the data-dependent code paths are the same as at full size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# Shipped configurations by name, with the names people also use for them.
ALIASES = {
    "llava-1.5-7b": "llava-1.5-7b",
    "llava-hf/llava-1.5-7b-hf": "llava-1.5-7b",
    "llava": "llava-1.5-7b",
    "qwen2-vl-7b": "qwen2-vl-7b",
    "qwen/qwen2-vl-7b-instruct": "qwen2-vl-7b",
    "qwen2-vl": "qwen2-vl-7b",
}


class ConfigError(ValueError):
    """A model configuration that cannot be used."""


# A config.json is a few KiB (a label table can make it tens); the nesting of the published ones
# is 3 deep at most.
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 16
# The sizes that decide how many modules and parameters the recorder builds, wherever they sit in
# the configuration (top level, text_config, vision_config): key -> the largest value taken. Each
# is a whole number >= 1 (or null: transformers' default). The bounds sit far above every
# published model (126 layers, hidden 25,600, a vocabulary of 262,144, 256 experts) and far below
# what fills a host with Python modules.
SIZES = {
    "num_hidden_layers": 1024, "num_layers": 1024, "n_layer": 1024, "depth": 1024,
    "hidden_size": 1 << 20, "n_embd": 1 << 20, "d_model": 1 << 20, "embed_dim": 1 << 20, "intermediate_size": 1 << 22,
    "moe_intermediate_size": 1 << 22, "projection_dim": 1 << 20, "head_dim": 1 << 16,
    "num_attention_heads": 1 << 16, "n_head": 1 << 16, "num_heads": 1 << 16, "num_key_value_heads": 1 << 16,
    "vocab_size": 1 << 24, "max_position_embeddings": 1 << 24,
    "num_local_experts": 4096, "num_experts": 4096, "n_routed_experts": 4096, "num_experts_per_tok": 4096,
    "image_size": 1 << 16, "patch_size": 1 << 16, "spatial_merge_size": 1 << 10, "temporal_patch_size": 1 << 10,
}
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer")
# Layers x experts: DeepSeek-V3 has 61 x 256 = 15,616 expert MLPs, each a few modules.
MAX_EXPERT_BLOCKS = 1 << 16


def shipped() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load(model: str | Path | dict) -> dict[str, Any]:
    """The configuration dict of a shipped name, a ``config.json`` path or a folder holding one."""
    if isinstance(model, dict):
        check(model, str(model.get("_path", "configuration")))
        return dict(model)
    text = str(model)
    name = ALIASES.get(text.lower())
    if name is not None:
        path = CONFIG_DIR / f"{name}.json"
    else:
        path = Path(text).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"model {text!r}: not a shipped configuration ({', '.join(shipped())}) and no config.json at "
                f"{path}. Give a shipped name, a config.json, or a folder holding one (no weights are read)."
            )
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: not a readable JSON configuration ({exc})") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: more than {MAX_FILE_BYTES:,} bytes; a model configuration is a few KiB (is this "
                          "the weights, or another file?)")
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError as exc:
        raise ConfigError(f"{path}: its JSON is nested too deeply (a model configuration is nested "
                          f"{MAX_DEPTH} deep at most)") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable JSON configuration ({exc})") from exc
    check(data, str(path))
    data.setdefault("_path", str(path))
    return data


def check(data: Any, where: str) -> None:
    """Refuses a configuration that could not describe a model (``where`` names it): not an object
    with a 'model_type', nested deeper than ``MAX_DEPTH``, a sub-configuration ('..._config') that
    is not an object, a size of ``SIZES`` that is not a whole number within its bound, more MoE
    expert blocks (layers x experts) than ``MAX_EXPERT_BLOCKS``."""
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(f"{where}: a model configuration is a JSON object with a 'model_type' (e.g. 'llava')")
    _check_node(data, where, "", 1)


def _check_node(node: Any, where: str, at: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ConfigError(f"{where}: {at or 'the configuration'} is nested deeper than {MAX_DEPTH} (a model "
                          "configuration is 3 deep at most)")
    inside = f"{at}: " if at else ""
    if isinstance(node, list):
        for i, item in enumerate(node):
            if isinstance(item, (dict, list)):
                _check_node(item, where, f"{at}[{i}]", depth + 1)
        return
    for key, value in node.items():
        name = f"{at}.{key}" if at else str(key)
        if key.endswith("_config") and value is not None and not isinstance(value, dict):
            raise ConfigError(f"{where}: {inside}{key!r} must be a JSON object (a sub-configuration), not {value!r:.80}")
        bound = SIZES.get(key)
        if bound is not None and value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
                raise ConfigError(f"{where}: {inside}{key!r} is {value!r:.80}: a whole number from 1 to {bound:,} "
                                  "(the recorder builds what it sizes on the host)")
        if isinstance(value, (dict, list)):
            _check_node(value, where, name, depth + 1)
    layers = next((node[k] for k in LAYER_KEYS if isinstance(node.get(k), int)), None)
    experts = next((node[k] for k in EXPERT_KEYS if isinstance(node.get(k), int)), None)
    if layers is not None and experts is not None and layers * experts > MAX_EXPERT_BLOCKS:
        raise ConfigError(f"{where}: {inside}{layers:,} layers x {experts:,} experts = {layers * experts:,} expert "
                          f"blocks; at most {MAX_EXPERT_BLOCKS:,} (the largest published models have about 16,000)")


def tiny(config: dict[str, Any]) -> dict[str, Any]:
    """The same architecture, two layers deep and a few dozen wide (for tests)."""
    c = json.loads(json.dumps(config))
    text = c.get("text_config", c)
    text.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    if "num_key_value_heads" in text:
        text["num_key_value_heads"] = 2 if text.get("num_key_value_heads", 4) < text.get("num_attention_heads", 4) else 4
    if c.get("model_type") == "qwen2_vl":
        c.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        c["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}  # head dim 16
        c["vision_config"].update(depth=2, embed_dim=32, num_heads=2, hidden_size=64)
        c["max_window_layers"] = 2
    vision = c.get("vision_config")
    if vision is not None and vision.get("model_type") == "clip_vision_model":
        vision.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    return c


def transformers_config(config: dict[str, Any]):
    """The transformers configuration object of ``config``."""
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise ConfigError("recipes need transformers (pip install transformers)") from exc
    data = {k: v for k, v in config.items() if not k.startswith("_")}
    model_type = data.pop("model_type")
    try:
        cfg = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{config.get('_path', 'configuration')}: transformers cannot read it: {exc}") from exc
    return cfg


def unusable(where: str, cfg: Any, why: str) -> str:
    return (f"{where}: model_type {cfg.model_type!r} is not a configuration the recipes can use ({why}): they train "
            "a causal language model or an image-text-to-text model (llava, qwen2_vl, llama, ...)")


def model_class(cfg, where: str = "configuration"):
    """The transformers class that the configuration's ``architectures`` names (else the
    image-text-to-text or causal-LM auto class); ``where`` names the file in errors."""
    import transformers

    for name in getattr(cfg, "architectures", None) or []:
        cls = getattr(transformers, str(name), None)
        # Only a model class: 'architectures' must not name any other attribute to be called.
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    for auto in ("AutoModelForImageTextToText", "AutoModelForCausalLM"):
        mapping = getattr(transformers, auto)._model_mapping
        if type(cfg) in mapping:
            return mapping[type(cfg)]
    raise ConfigError(unusable(where, cfg, f"no transformers model class for it, architectures: {cfg.architectures}"))
