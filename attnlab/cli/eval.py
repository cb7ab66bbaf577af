"""Evaluate a checkpoint: loss and perplexity (LM), masked-token accuracy (MLM), exact match
(seq2seq); a fine-tuning checkpoint reports its task's metrics (accuracy, entity F1, exact
match, reward margin and preference accuracy), a LoRA one with its adapters merged.

--text FILE scores any decoder checkpoint (a GGUF file or an HF directory too) on a text of
the user's: the loss and perplexity of its tokens (training.perplexity):

    attnlab eval --ckpt SmolLM2-135M-Instruct.Q4_1.gguf --text held_out.txt --context 512
"""

import argparse

from attnlab.checkpoint import open_checkpoint
from attnlab.cli.kinds import require
from attnlab.cli.options import add_ckpt_flag
from attnlab.configs import from_dict
from attnlab.finetune.run import evaluate_finetuned, is_finetune_run
from attnlab.models.heads import task_head_kind
from attnlab.training.config import RunConfig
from attnlab.training.distributed import resolve_device
from attnlab.training.perplexity import text_perplexity
from attnlab.training.tasks import build_task


def add_parser(p: argparse.ArgumentParser) -> None:
    add_ckpt_flag(p, "what to evaluate (e.g. runs/x/checkpoints/best)")
    p.add_argument(
        "--batches",
        type=int,
        default=None,
        help="validation batches (default: the run's train.eval_batches)",
    )
    p.add_argument(
        "--text",
        metavar="FILE",
        help="score a decoder LM on this UTF-8 text file: loss and perplexity of its tokens",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help="--text: tokens per forward (default: the model's max_seq_len, at most 2048)",
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
            "rebuilds the validation data of the run that wrote a checkpoint; --text FILE scores "
            "it on a text of yours"
        )
    model, run = loaded.model, from_dict(RunConfig, loaded.run)
    task = build_task(run)
    return task.evaluate(model, batches or run.train.eval_batches, device)


def evaluate_text(path: str, text: str, context: int | None = None, device: str = "auto") -> dict:
    """A decoder checkpoint's loss and perplexity on the text file `text`."""
    device = resolve_device(device)
    loaded = open_checkpoint(path, str(device))  # a LoRA run's adapters merged
    needs = "a decoder LM (a next-token perplexity means nothing for another kind)"
    require(str(path), loaded, "attnlab eval --text", ("decoder",), needs)
    if loaded.tokenizer is None:
        raise ValueError(f"--text needs a tokenizer; {str(path)!r} has no tokenizer.json")
    context = context or min(loaded.config.max_seq_len, 2048)
    return text_perplexity(loaded.model, loaded.tokenizer, text, context, device)


def run(args: argparse.Namespace) -> int:
    if args.text is not None:
        metrics = evaluate_text(args.ckpt, args.text, args.context, args.device)
    else:
        metrics = evaluate_checkpoint(args.ckpt, args.batches, args.device)
    for key, value in metrics.items():
        print(f"{key:20s} {value:.4f}")
    return 0
