"""Model configurations: the ones the package ships and a user's local ``config.json``.

Layer: reads JSON and builds transformers configurations and (under the recorder's fake mode)
models; never reads weights, never downloads. Shipped configurations live in ``configs/`` beside
this file, written from the published ``config.json`` of each model (their ``_source`` key says
which).

Invariants: a bad configuration is a ``ConfigError`` that names the file and what is wrong;
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


def shipped() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load(model: str | Path | dict) -> dict[str, Any]:
    """The configuration dict of a shipped name, a ``config.json`` path or a folder holding one."""
    if isinstance(model, dict):
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
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable JSON configuration ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(f"{path}: a model configuration is a JSON object with a 'model_type' (e.g. 'llava')")
    data.setdefault("_path", str(path))
    return data


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


def model_class(cfg):
    """The transformers class that the configuration's ``architectures`` names (else the
    image-text-to-text or causal-LM auto class)."""
    import transformers

    for name in getattr(cfg, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    for auto in ("AutoModelForImageTextToText", "AutoModelForCausalLM"):
        mapping = getattr(transformers, auto)._model_mapping
        if type(cfg) in mapping:
            return mapping[type(cfg)]
    raise ConfigError(f"no transformers model class for model_type {cfg.model_type!r} (architectures: {cfg.architectures})")
