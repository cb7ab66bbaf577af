"""Train a model (default: a small Llama on the Python standard library's source), then sample."""

import argparse
from dataclasses import replace

from attnlab.cli.options import (
    add_config_flags,
    apply_config_flags,
    merge_sections,
    read_config_file,
)
from attnlab.models.build import build_model
from attnlab.models.config import ModelConfig
from attnlab.models.presets import get_preset
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from attnlab.training.loop import resolve_device, train
from attnlab.training.tasks import build_task

DEFAULT_PRESET = "llama-char"
SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig}


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default=None,
        help=f"model preset (default {DEFAULT_PRESET}, or the config file's 'preset')",
    )
    p.add_argument("--config", default=None, help="YAML/JSON file: preset and section overrides")
    p.add_argument("--resume", action="store_true", help="continue from train.out_dir's latest")
    add_config_flags(p, SECTIONS)


def run_config_from_args(args: argparse.Namespace):
    """The RunConfig the flags describe, and the task it trains (data prepared and cached)."""
    file = read_config_file(args.config) if args.config else {}
    file_preset = file.pop("preset", None)  # popped even when --preset wins over it
    preset = args.preset or file_preset or DEFAULT_PRESET
    configs = {"model": get_preset(preset), "train": TrainConfig(), "data": DataConfig()}
    configs = merge_sections(configs, file)
    configs, given = apply_config_flags(configs, args)
    run = RunConfig(**configs)
    task = build_task(run)
    if "model.vocab_size" not in given and "vocab_size" not in file.get("model", {}):
        # The preset's vocabulary is a placeholder: size the model to the tokenizer.
        run = replace(run, model=replace(run.model, vocab_size=task.tokenizer.vocab_size))
    return run, task


def run(args: argparse.Namespace) -> int:
    run_cfg, task = run_config_from_args(args)
    model = build_model(run_cfg.model)
    state = train(model, task, run_cfg, resume=args.resume)
    metrics = {k: v for k, v in state.last_eval.items() if k != "sample"}
    print(f"\ntrained {state.step} steps; " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    print(f"checkpoints and metrics in {run_cfg.train.out_dir}")
    n_tokens, device = run_cfg.train.sample_tokens, resolve_device(run_cfg.train.device)
    sample = task.sample(model.eval(), n_tokens, device) if n_tokens else None
    if sample is not None:
        print(f"\n--- sample ---\n{sample}")
    return 0
