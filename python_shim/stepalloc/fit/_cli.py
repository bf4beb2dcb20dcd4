"""``python -m stepalloc.fit``: record a recipe from a model's configuration, replay it at each
device's capacity under PyTorch's allocator and stepalloc, and print a table (or ``--json``).

Layer: the command line over ``_api`` / ``_recipes`` / ``_replay``. Without a CUDA device context
it re-runs itself over the host-memory stand-in (``_host``).

Invariants: exit status 0 when the report was made (fitting or not: that is data), 2 on bad
input (named, and before anything is recorded where the input alone shows it: ``check_inputs``,
``_recipes.check_model``), 1 on a failure of the recorder or the replay (with its message).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import _configs, _host, _kernels, _replay

GIB = 1 << 30
MAX_SEED = (1 << 63) - 1


def _range(text: str) -> tuple[int, int]:
    parts = text.split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or hi is None or lo < 0 or hi < lo:
        raise argparse.ArgumentTypeError(f"{text!r}: a count or a range LOW-HIGH, e.g. 0-3 or 128-1024")
    return lo, hi


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m stepalloc.fit",
        description="Will this training step fit? Records a recipe built from a model's configuration under fake "
        "CUDA tensors (no GPU, no weights) and replays it at each device's capacity under PyTorch's allocator "
        "(default, expandable_segments, max_split_size_mb:128, your PYTORCH_CUDA_ALLOC_CONF) and stepalloc.",
    )
    p.add_argument("--model", required=True, help=f"a shipped configuration ({', '.join(_configs.shipped())}), a config.json or a folder holding one")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--images", type=_range, default=(0, 3), help="images per sample, LOW-HIGH (default 0-3)")
    p.add_argument("--tokens", type=_range, default=(128, 1024), help="text tokens per sample, LOW-HIGH (default 128-1024)")
    p.add_argument("--iterations", type=int, default=3, help="iterations, each with shapes drawn from the ranges (default 3)")
    p.add_argument("--lora", action="store_true", help="LoRA (peft) on the language model instead of full fine-tuning")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--no-checkpointing", action="store_true", help="no gradient checkpointing")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw-fused", "sgd"])
    p.add_argument("--dtype", default="bfloat16", help="parameter dtype (bfloat16, float16, float32)")
    p.add_argument("--rollout", type=int, default=0, help="tokens generated per sample (KV cache, no_grad) before each training step")
    p.add_argument("--train-vision", action="store_true", help="full fine-tuning trains the vision tower too")
    p.add_argument("--image-size", type=int, default=448, help="Qwen2-VL image side in pixels (default 448)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="two layers, narrow widths (a quick check of the path)")
    p.add_argument("--device", action="append", help=f"target GPU, repeatable: {', '.join(_kernels.TARGETS)} or a size in GB (24, 40, 48, 80, 141); default h100")
    p.add_argument("--attention", default="auto", choices=list(_kernels.ATTENTION_BACKENDS))
    p.add_argument("--outside-mb", type=float, default=_replay.DEFAULT_OUTSIDE_MB,
                   help=f"device memory that is not PyTorch's (CUDA context, handles), MiB (default {_replay.DEFAULT_OUTSIDE_MB})")
    p.add_argument("--pytorch-conf", default=None, help="PyTorch allocator settings to add as 'yours' (default: $PYTORCH_CUDA_ALLOC_CONF)")
    p.add_argument("--largest-batch", action="store_true", help="also find the largest batch that fits under each allocator (records once per batch tried)")
    p.add_argument("--trace", type=Path, help="keep the recorded trace here (with several capabilities: NAME.<capability>.jsonl)")
    p.add_argument("--record-only", action="store_true", help="record and write --trace; no replay")
    p.add_argument("--html", type=Path, help="the picture: memory over the step per allocator (first device)")
    p.add_argument("--svg", type=Path)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def recipe_of(args: argparse.Namespace):
    from ._recipes import Recipe

    return Recipe(
        model=args.model, batch=args.batch, images=args.images, tokens=args.tokens, iterations=args.iterations,
        finetune="lora" if args.lora else "full", lora_rank=args.lora_rank, checkpointing=not args.no_checkpointing,
        optimizer=args.optimizer, dtype=args.dtype, rollout=args.rollout, train_vision=args.train_vision,
        image_size=args.image_size, seed=args.seed, tiny=args.tiny,
    ).check()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ._recipes import largest_batch_taken, record_recipe

    recipe = recipe_of(args)
    targets = [_kernels.target(d) for d in (args.device or ["h100"])]
    several = len({t.capability for t in targets}) > 1
    # One recording per (capability, batch), shared by every device of that capability.
    recordings: dict[tuple[tuple[int, int], int], tuple[Path, dict]] = {}
    kept: set[Path] = set()

    def recording(t: _kernels.Target, batch: int) -> tuple[Path, dict]:
        key = (t.capability, batch)
        if key not in recordings:
            rec = record_recipe(recipe.with_batch(batch), target=t, attention=args.attention)
            if args.trace and batch == recipe.batch:
                path = args.trace.with_suffix(f".sm{t.capability[0]}{t.capability[1]}.jsonl") if several else args.trace
                kept.add(path)
            else:
                path = _replay.temporary_trace()
            rec.trace.write(path)
            recordings[key] = (path, rec.summary())
        return recordings[key]

    def fit(t: _kernels.Target, batch: int, picture: bool = False) -> dict[str, Any]:
        return _replay.fit(recording(t, batch)[0], device=t, outside_mb=args.outside_mb, pytorch_conf=args.pytorch_conf,
                           html=args.html if picture else None, svg=args.svg if picture else None)

    # The search stops where the recorder stops taking the batch's inputs.
    limit = min(256, largest_batch_taken(recipe)) if args.largest_batch else 256
    report: dict[str, Any] = {"recipe": _recipe_dict(recipe), "recordings": {}, "devices": []}
    try:
        for t in targets:
            path, summary = recording(t, recipe.batch)
            report["recordings"][f"sm{t.capability[0]}{t.capability[1]}"] = dict(summary, trace=str(path) if path in kept else None)
        if args.record_only:
            return report
        for i, t in enumerate(targets):
            entry: dict[str, Any] = {"device": t.name, "capacity_bytes": t.memory_bytes, "fit": fit(t, recipe.batch, picture=i == 0)}
            if args.largest_batch:
                search = _replay.largest_batch(lambda b, t=t: _replay.fits_by_config(fit(t, b)), limit=limit)
                entry["largest_batch"] = {"largest": search.largest, "capped": search.capped,
                                          "tried": {str(b): r for b, r in sorted(search.tried.items())}}
            report["devices"].append(entry)
    finally:
        for path, _ in recordings.values():
            if path not in kept:
                path.unlink(missing_ok=True)
    return report


def _recipe_dict(recipe) -> dict[str, Any]:
    d = dict(vars(recipe))
    d.pop("extra", None)
    d["model"] = str(d["model"])
    return d


def _gib(n: Any) -> str:
    return f"{n / GIB:.2f}" if isinstance(n, (int, float)) else "-"


def table(report: dict[str, Any]) -> str:
    r = report["recipe"]
    lines = [
        f"{r['model']}: batch {r['batch']}, images {r['images'][0]}-{r['images'][1]}, tokens {r['tokens'][0]}-{r['tokens'][1]}, "
        f"{r['finetune']}{' + checkpointing' if r['checkpointing'] else ''}, {r['optimizer']}, {r['iterations']} iterations"
        + (f", rollout {r['rollout']} tokens" if r["rollout"] else "")
    ]
    for cap, s in report["recordings"].items():
        lines.append(f"  recorded for {cap}: {s['allocations']:,} allocations, {s['steps']} steps, peak live "
                     f"{_gib(s['peak_live_bytes'])} GiB, attention {dict(s['attention']) or '-'}")
    for d in report["devices"]:
        dev = d["fit"].get("device", {})
        lines.append("")
        lines.append(f"{d['device']} ({_gib(d['capacity_bytes'])} GiB, usable {_gib(dev.get('usable_bytes'))} GiB):")
        lines.append(f"  {'allocator':<20} {'fits':<5} {'peak reserved':>14} {'peak allocated':>15} {'headroom':>9} {'retries':>8}")
        for c in d["fit"].get("configs", []):
            lines.append(f"  {c['name']:<20} {'yes' if c.get('fits') else 'NO':<5} {_gib(c.get('peak_reserved_bytes')):>14} "
                         f"{_gib(c.get('peak_allocated_bytes')):>15} {_gib(c.get('headroom_bytes')):>9} {c.get('alloc_retries', 0):>8}")
        for c in d["fit"].get("configs", []):
            o = c.get("first_oom")
            if o:
                lines.append(f"  {c['name']}: out of memory at allocation {o.get('allocation', 0):,} ({o.get('size', 0) / (1 << 20):.2f} MiB, "
                             f"{o.get('torch_op') or '?'} in {o.get('module') or '?'}, {o.get('phase', '?')} step {o.get('step', '?')}): "
                             f"{_gib(o.get('cached_free_bytes'))} GiB cached free, "
                             f"{100 * float(o.get('external_fragmentation') or 0):.0f}% fragmented")
        if "largest_batch" in d:
            lb = d["largest_batch"]
            lines.append("  largest batch: " + ", ".join(f"{k} {v}" for k, v in lb["largest"].items())
                         + (" (search limit reached)" if lb["capped"] else ""))
    return "\n".join(lines)


def check_inputs(args: argparse.Namespace) -> None:
    """What can be refused before torch is imported and anything is recorded (``ValueError``,
    named as the user typed it): the devices, the configuration's file, the seed, and what the
    replay would refuse (``--outside-mb``, ``--pytorch-conf`` or ``$PYTORCH_CUDA_ALLOC_CONF``, asked of
    the stress tool)."""
    targets = [_kernels.target(d) for d in (args.device or ["h100"])]
    _configs.load(args.model)
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed {args.seed}: from 0 to 2**63-1 (torch.Generator's seed)")
    for t in targets:
        _replay.check_outside(args.outside_mb, t, "--outside-mb")
    if not args.record_only:
        for t in targets:
            _replay.check(t, args.outside_mb, args.pytorch_conf, "--outside-mb")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    try:
        check_inputs(args)
    except ValueError as exc:  # ConfigError included
        print(f"stepalloc.fit: {exc}", file=sys.stderr)
        return 2
    except _replay.ReplayError as exc:
        print(f"stepalloc.fit: {exc}", file=sys.stderr)
        return 1
    # Before torch is imported here: without a device context the command runs again over the
    # host-memory stand-in, in a child (where torch may load only with it).
    try:
        status = _host.ensure_device(["-m", "stepalloc.fit", *argv])
    except _host.NoDeviceError as exc:
        print(f"stepalloc.fit: {exc}", file=sys.stderr)
        return 2
    if status is not None:
        return status
    try:
        from ._recipes import check_model

        check_model(recipe_of(args))
    except ValueError as exc:  # ConfigError included
        print(f"stepalloc.fit: {exc}", file=sys.stderr)
        return 2
    try:
        report = run(args)
    except _configs.ConfigError as exc:
        print(f"stepalloc.fit: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as exc:
        print(f"stepalloc.fit: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 0
