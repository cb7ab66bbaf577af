"""Count a model's parameters, FLOPs per token and KV-cache bytes (built on meta: no memory)."""

import argparse
import json
from pathlib import Path

from attnlab.configs import from_dict
from attnlab.models.config import ModelConfig
from attnlab.models.inspect import format_stats, inspect_config
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
        help="context length for attention FLOPs (default: the model's max_seq_len)",
    )


def run(args: argparse.Namespace) -> int:
    for i, spec in enumerate(args.model):
        cfg = load_model_config(spec)
        if i:
            print()
        print(format_stats(spec, cfg, inspect_config(cfg, args.context)))
    return 0
