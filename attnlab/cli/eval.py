"""Evaluate a checkpoint: loss and perplexity (LM), masked-token accuracy (MLM), exact match
(seq2seq); a fine-tuning checkpoint reports its task's metrics (accuracy, entity F1, exact
match, reward margin and preference accuracy), a LoRA one with its adapters merged."""

import argparse

from attnlab.checkpoint import open_checkpoint
from attnlab.configs import from_dict
from attnlab.finetune.run import evaluate_finetuned, is_finetune_run
from attnlab.models.heads import task_head_kind
from attnlab.training.config import RunConfig
from attnlab.training.distributed import resolve_device
from attnlab.training.tasks import build_task


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ckpt",
        required=True,
        help="checkpoint directory (e.g. runs/x/checkpoints/best), or a run's out_dir (its latest)",
    )
    p.add_argument(
        "--batches",
        type=int,
        default=None,
        help="validation batches (default: the run's train.eval_batches)",
    )
    p.add_argument("--device", default="auto")


def evaluate_checkpoint(path: str, batches: int | None = None, device: str = "auto") -> dict:
    """Load a checkpoint, rebuild its task from the saved run config and evaluate on validation."""
    device = resolve_device(device)
    loaded = open_checkpoint(path, str(device))  # a LoRA run's adapters merged
    if is_finetune_run(loaded.run):  # its own metrics (accuracy, F1, exact match, preferences)
        return evaluate_finetuned(loaded, device)
    if (kind := task_head_kind(loaded.config)) is not None:
        raise ValueError(
            f"checkpoint {str(path)!r} is {kind}; "
            "attnlab eval scores the LM, MLM and seq2seq tasks of a training run and has no "
            "labelled data for it"
        )
    if "data" not in loaded.run:
        raise ValueError(
            f"checkpoint {str(path)!r} holds no training run to evaluate (its config.json has "
            "a model and no data section: an HF directory or a model-only save); attnlab eval "
            "rebuilds the validation data of the run that wrote a checkpoint"
        )
    model, run = loaded.model, from_dict(RunConfig, loaded.run)
    task = build_task(run)
    return task.evaluate(model, batches or run.train.eval_batches, device)


def run(args: argparse.Namespace) -> int:
    metrics = evaluate_checkpoint(args.ckpt, args.batches, args.device)
    for key, value in metrics.items():
        print(f"{key:20s} {value:.4f}")
    return 0
