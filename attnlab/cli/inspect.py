"""Count a model's parameters, FLOPs per token and KV-cache bytes (built on meta: no memory)."""

import argparse
import json
import sys
from pathlib import Path

from attnlab.configs import from_dict
from attnlab.models.config import ModelConfig
from attnlab.models.inspect import (
    flops_split,
    format_costs,
    format_stats,
    inspect_config,
    kv_cache_table,
)
from attnlab.models.presets import PRESETS, get_preset


def load_model_config(spec: str) -> ModelConfig:
    """A preset name, or a config.json path: a ModelConfig, or a checkpoint's {"model": ...}."""
    path = Path(spec)
    if spec in PRESETS or (not path.suffix and not path.is_file()):
        return get_preset(spec)
    if not path.is_file():
        raise ValueError(f"no such config file {spec!r} (and not a preset: {sorted(PRESETS)})")
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ValueError(f"{spec!r} must hold a JSON object (a ModelConfig), got a {kind}")
    return from_dict(ModelConfig, data.get("model", data))


def positions_warning(spec: str, cfg: ModelConfig, context: int) -> str:
    """The warning for a context longer than a model's positions (its max_seq_len)."""
    past = (
        "its learned position table has no row past them"
        if cfg.position == "learned"
        else f"{cfg.position} positions past them were never trained"
    )
    return (
        f"warning: {spec} has {cfg.max_seq_len:,} positions and --context is {context:,}: {past} "
        "(the figures below are for the longer context all the same)"
    )


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="*",
        default=["gpt2", "llama2-7b"],
        help="preset names or config.json paths (default: gpt2 llama2-7b)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="context length for attention FLOPs and the KV cache (default: the model's "
        "max_seq_len)",
    )
    p.add_argument(
        "--batch", type=int, default=1, help="batch size the KV-cache table is sized for"
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="also draw the KV cache (MHA/GQA/MQA) and the FLOPs split as bar charts (PNG)",
    )


def run(args: argparse.Namespace) -> int:
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    drawn = []
    for i, spec in enumerate(args.model):
        cfg = load_model_config(spec)
        context = cfg.max_seq_len if args.context is None else args.context
        if i:
            print()
        if context > cfg.max_seq_len:
            print(positions_warning(spec, cfg, context), file=sys.stderr)
        print(format_stats(spec, cfg, inspect_config(cfg, context)))
        print(format_costs(cfg, args.batch, context))
        if args.plot:
            kv = [] if cfg.arch == "encoder" else kv_cache_table(cfg, args.batch, context)
            drawn.append((spec, kv, flops_split(cfg, context), context))
    if args.plot:
        from attnlab.viz.costs import plot_costs  # matplotlib only when drawing

        plot_costs(drawn, args.batch, out=args.plot)
        print(f"\nwrote {args.plot}")
    return 0
