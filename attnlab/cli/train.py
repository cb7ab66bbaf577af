"""Train a model (default: a small Llama on the Python standard library's source), then sample.

On several processes: `torchrun --nproc_per_node N -m attnlab train --train.distributed ddp ...`,
or `attnlab train --nproc N ...`, which re-launches itself that way (DDP unless told otherwise).
"""

import argparse
import os
from dataclasses import replace

import torch

from attnlab.cli.options import (
    add_config_flags,
    apply_config_flags,
    freeze_usage,
    merge_sections,
    read_config_file,
    require_device,
)
from attnlab.cli.report import accelerators_line, final_report
from attnlab.models.build import build_model
from attnlab.models.config import ModelConfig
from attnlab.models.presets import PRESETS, get_preset
from attnlab.training import distributed
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from attnlab.training.loop import sigterm_as_ctrl_c, train
from attnlab.training.tasks import build_task

DEFAULT_PRESET = "llama-char"
SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig}


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help=f"model preset (default {DEFAULT_PRESET}, or the config file's 'preset'), one of: "
        + ", ".join(PRESETS),
    )
    p.add_argument("--config", metavar="FILE", help="YAML/JSON file: preset and section overrides")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from train.out_dir's newest checkpoint (the latest step one, or "
        "checkpoints/best when it is newer)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a train.out_dir that holds another run (deletes its checkpoints "
        "and metrics)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="train on N processes of this machine: re-launch through torchrun (--standalone)",
    )
    freeze_usage(p)
    defaults = {"model": get_preset(DEFAULT_PRESET), "train": TrainConfig(), "data": DataConfig()}
    add_config_flags(p, SECTIONS, defaults, {"model": f"(preset {DEFAULT_PRESET})"})


def run_config_from_args(args: argparse.Namespace):
    """The RunConfig the flags describe, and the task it trains (data prepared and cached)."""
    file = read_config_file(args.config) if args.config else {}
    file_preset = file.pop("preset", None)  # popped even when --preset wins over it
    preset = args.preset or file_preset or DEFAULT_PRESET
    configs = {"model": get_preset(preset), "train": TrainConfig(), "data": DataConfig()}
    configs = merge_sections(configs, file, args.config)
    configs, given = apply_config_flags(configs, args)
    run = RunConfig(**configs)
    task = build_task(run)
    if "model.vocab_size" not in given and "vocab_size" not in file.get("model", {}):
        # The preset's vocabulary is a placeholder: size the model to the tokenizer.
        run = replace(run, model=replace(run.model, vocab_size=task.tokenizer.vocab_size))
    return run, task


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """`torchrun` arguments that re-run this command in `args.nproc` processes (one machine)."""
    argv = ["--standalone", f"--nproc_per_node={args.nproc}", "-m", "attnlab", args.command]
    for name, value in vars(args).items():
        if name in ("command", "nproc", "thread_choice") or value is None or value is False:
            continue
        argv.append(f"--{name}" if value is True else f"--{name}={value}")
    if getattr(args, "train.distributed") is None:
        argv.append("--train.distributed=ddp")
    return argv


def run(args: argparse.Namespace) -> int:
    if args.nproc is not None:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun

        try:
            torchrun(torchrun_argv(args))
        except ChildFailedError:  # torchrun has printed which rank failed and why
            return 1
        return 0
    run_cfg, task = run_config_from_args(args)
    require_device(run_cfg.train.device, "--train.device")
    main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun, rank 0 reports
    torch.manual_seed(run_cfg.train.seed)  # the same initial weights on every run and every rank
    model = build_model(run_cfg.model)
    if main_rank:
        print(run_header(run_cfg, model, args))
    with sigterm_as_ctrl_c():  # SIGTERM saves the last step, as Ctrl-C does
        state = train(model, task, run_cfg, resume=args.resume, overwrite=args.overwrite)
    distributed.stop()  # leave torchrun's process group (nothing to do for one process)
    if not main_rank:
        return 0
    print(final_report(state, run_cfg))
    return 0


def run_header(run_cfg: RunConfig, model: torch.nn.Module, args: argparse.Namespace) -> str:
    """What is about to run: model, data, output, and the threads chosen (cli/threads.py)."""
    n_params = sum(p.numel() for p in model.parameters())
    d, t = run_cfg.data, run_cfg.train
    lines = [
        f"model: {run_cfg.model.arch}, {run_cfg.model.n_layers} layers, d_model "
        f"{run_cfg.model.d_model}, {n_params / 1e6:.2f}M parameters",
        f"data: {d.source} ({d.task}, tokenizer {d.tokenizer}, vocab {run_cfg.model.vocab_size})",
        f"train: {t.steps} steps of {t.batch_size}x{t.context} tokens on {t.device}, "
        f"out_dir {t.out_dir}",
    ]
    lines.append(accelerators_line(t))  # each one is a flag: --train.<name>=false
    choice = getattr(args, "thread_choice", None)
    if choice is not None:
        lines.append(choice.describe())
    return "\n".join(lines)
