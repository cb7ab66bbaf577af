"""Fine-tune a decoder checkpoint: SFT or DPO, with LoRA adapters when --lora.rank is given.

    attnlab finetune --ckpt runs/base --task sft --data.source pairs.jsonl
    attnlab finetune --ckpt runs/base --task dpo --lora.rank 8 --dpo.beta 0.1

The same machinery as `attnlab train`: YAML/JSON config files and --section.field overrides
(sections train, data, lora, dpo), the training loop with its progress bar, metrics.jsonl,
checkpoints and exact --resume (give the same flags again). DPO's reference is a frozen copy of
the base model, or the policy with its adapters off when the LoRA model offers
`disable_adapters()`; --dpo.precompute_reference computes its log-probs once, before training.
A new run prints the base's metrics first, so a run reports them before and after.
`attnlab eval --ckpt` on a fine-tuning checkpoint reports the same metrics
(`evaluate_finetuned`).
"""

import argparse
import copy
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from attnlab.checkpoint import open_checkpoint
from attnlab.cli.options import (
    add_config_flags,
    apply_config_flags,
    merge_sections,
    read_config_file,
    require_device,
)
from attnlab.cli.train import accelerators_line, final_report
from attnlab.configs import from_dict
from attnlab.finetune.config import DPOConfig, FinetuneDataConfig, LoraConfig
from attnlab.finetune.sequences import DPO_FIELDS, SFT_FIELDS, check_example
from attnlab.finetune.tasks import DPOTask, SFTTask
from attnlab.models.config import ModelConfig
from attnlab.training.config import TrainConfig
from attnlab.training.distributed import resolve_device
from attnlab.training.loop import train

# Fine-tuning starts from trained weights: fewer steps, a smaller learning rate than pre-training.
FINETUNE_TRAIN = replace(
    TrainConfig(),
    steps=300,
    lr=3e-4,
    min_lr=3e-5,
    warmup=20,
    batch_size=8,
    context=128,
    weight_decay=0.0,
    eval_every=50,
    ckpt_every=100,
    sample_tokens=48,
    out_dir="runs/finetune",
)
SECTIONS = {"train": TrainConfig, "data": FinetuneDataConfig, "lora": LoraConfig, "dpo": DPOConfig}


@dataclass(frozen=True)
class FinetuneRun:
    """A fine-tuning run, saved in each of its checkpoints: the base's model config, the base
    checkpoint it started from, and the sections below."""

    model: ModelConfig
    base: str = ""
    train: TrainConfig = FINETUNE_TRAIN
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)


def add_parser(p: argparse.ArgumentParser) -> None:
    p.usage = "%(prog)s --ckpt BASE --task sft|dpo [--config FILE] [--resume] [--SECTION.FIELD=V]"
    p.add_argument("--ckpt", required=True, help="the base checkpoint (attnlab or HF directory)")
    p.add_argument(
        "--task", choices=("sft", "dpo"), default=None, help="sets data.task (default sft)"
    )
    p.add_argument("--config", default=None, help="YAML/JSON file of section overrides")
    p.add_argument("--resume", action="store_true", help="continue from train.out_dir's latest")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a train.out_dir that holds another run (deletes it)",
    )
    defaults = {
        "train": FINETUNE_TRAIN,
        "data": FinetuneDataConfig(),
        "lora": LoraConfig(),
        "dpo": DPOConfig(),
    }
    add_config_flags(p, SECTIONS, defaults)


def configs_from_args(args: argparse.Namespace) -> dict:
    """{section: config} from the defaults, the config file and the flags (in that order)."""
    file = read_config_file(args.config) if args.config else {}
    configs = {
        "train": FINETUNE_TRAIN,
        "data": FinetuneDataConfig(),
        "lora": LoraConfig(),
        "dpo": DPOConfig(),
    }
    configs = merge_sections(configs, file, args.config)
    configs, _ = apply_config_flags(configs, args)
    if args.task is not None:
        configs["data"] = replace(configs["data"], task=args.task)
    return configs


def read_jsonl(path: str | Path, fields: tuple[str, ...]) -> list[dict]:
    """The examples of a JSONL file, one object per line (blank lines skipped); a line that is
    not JSON or lacks a field is a ValueError naming the file, the line and the field. (The
    reader where attnlab.finetune.data is not installed; see `read_examples`.)"""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such data file {str(path)!r} (--data.source)")
    examples = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            example = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg}); fix that line") from None
        check_example(example, fields, f"{path}:{i}")
        examples.append(example)
    if not examples:
        raise ValueError(f"{str(path)!r} holds no examples")
    return examples


def read_examples(path: str, task: str) -> list[dict]:
    """A user's JSONL file of `task` examples, through attnlab.finetune.data.load_jsonl (which
    names the line and field of a bad one); `read_jsonl` where that module is not installed."""
    try:
        from attnlab.finetune.data import load_jsonl
    except ImportError:
        return read_jsonl(path, SFT_FIELDS if task == "sft" else DPO_FIELDS)
    return load_jsonl(path, task)


def builtin_examples(task: str, max_examples: int = 0) -> tuple[list[dict], list[dict]]:
    """The built-in (train, validation) examples made from the standard library by
    attnlab.finetune.data: "write the signature of the function documented as: ..." ->
    `def name(args):` (sft), and the right signature preferred to a corrupted one (dpo)."""
    try:
        from attnlab.finetune import data
    except ImportError:
        raise ValueError(
            "--data.source builtin needs attnlab.finetune.data, which this installation lacks; "
            "give a JSONL file (--data.source FILE.jsonl)"
        ) from None
    sizes = {"max_examples": max_examples} if max_examples else {}
    built = data.build_instructions(**sizes)
    if task == "dpo":
        built = data.build_preferences(built)
    return built.splits["train"], built.splits["val"]


def load_examples(d: FinetuneDataConfig) -> tuple[list[dict], list[dict]]:
    """(train, validation) examples: built in, or a JSONL file split at 1 - val_fraction (or
    its own val_source file)."""
    if d.source == "builtin":
        train_ex, val_ex = builtin_examples(d.task, d.max_examples)
    else:
        train_ex = read_examples(d.source, d.task)
        if d.val_source:
            val_ex = read_examples(d.val_source, d.task)
        else:
            if len(train_ex) < 2:
                raise ValueError(
                    f"{d.source!r} holds {len(train_ex)} example: too few to hold some out; "
                    "add examples or give --data.val_source"
                )
            n_val = min(max(1, round(len(train_ex) * d.val_fraction)), len(train_ex) - 1)
            train_ex, val_ex = train_ex[:-n_val], train_ex[-n_val:]
    if d.max_examples:
        train_ex = train_ex[: d.max_examples]
    return train_ex, val_ex


def open_base(path: str, task: str):
    """The base checkpoint, checked: a decoder with a tokenizer."""
    loaded = open_checkpoint(path)
    if loaded.config.arch != "decoder" or "n_labels" in loaded.run:
        kind = "a classifier" if "n_labels" in loaded.run else f"an {loaded.config.arch} model"
        raise ValueError(
            f"--ckpt {path!r} is {kind}; --task {task} fine-tunes a decoder LM (a GPT-2 or "
            "Llama-family checkpoint)"
        )
    if loaded.tokenizer is None:
        raise ValueError(f"--ckpt {path!r} has no tokenizer.json beside its weights")
    return loaded


def add_adapters(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """LoRA adapters on lora.targets (attnlab.finetune.lora); the rest of the model frozen."""
    try:
        from attnlab.finetune.lora import add_lora
    except ImportError:
        raise ValueError(
            "--lora.rank needs attnlab.finetune.lora, which this installation lacks; "
            "fine-tune all weights (--lora.rank 0)"
        ) from None

    return add_lora(
        model, targets=lora.target_names, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout
    )


def build_task(run: FinetuneRun, tokenizer, reference: torch.nn.Module | None = None):
    """The SFTTask or DPOTask of `run` (its examples read or built here)."""
    t, d = run.train, run.data
    train_ex, val_ex = load_examples(d)
    common = dict(
        tokenizer=tokenizer,
        batch_size=t.batch_size,
        context=t.context,
        chat_template=d.chat_template,
        eval_examples=d.eval_examples,
    )
    if d.task == "sft":
        return SFTTask(
            train_ex, val_ex, packing=d.packing, max_new_tokens=d.max_new_tokens, **common
        )
    return DPOTask(train_ex, val_ex, beta=run.dpo.beta, reference=reference, **common)


def build_finetune(args: argparse.Namespace):
    """(model, task, run) that `attnlab finetune` trains, as the flags describe."""
    configs = configs_from_args(args)
    t, d, lora = configs["train"], configs["data"], configs["lora"]
    require_device(t.device, "--train.device")
    if t.compile and d.task == "dpo":
        raise ValueError("--train.compile is not supported with --task dpo; leave it off")
    loaded = open_base(args.ckpt, d.task)
    run = FinetuneRun(model=loaded.config, base=str(loaded.path.resolve()), **configs)
    model = loaded.model
    torch.manual_seed(t.seed)  # the same adapter initialisation on every run (and on --resume)
    reference = None
    if d.task == "dpo":  # the model before DPO: a frozen copy, unless the adapters can go off
        reference = copy.deepcopy(model)
    if lora.rank:
        add_adapters(model, lora)
        if reference is not None and hasattr(model, "disable_adapters"):
            reference = None
    task = build_task(run, loaded.tokenizer, reference)
    if d.task == "dpo" and run.dpo.precompute_reference:
        task.precompute_reference(model, resolve_device(t.device))
    return model, task, run


def is_finetune_run(run: dict) -> bool:
    """Whether a checkpoint's run config is one `attnlab finetune` wrote."""
    return isinstance(run.get("data"), dict) and run["data"].get("task") in ("sft", "dpo")


def evaluate_finetuned(loaded, device) -> dict:
    """The task metrics of a checkpoint `attnlab finetune` wrote (opened by open_checkpoint),
    on the held-out examples of its own run config; DPO's reference is its base checkpoint."""
    run = from_dict(FinetuneRun, loaded.run)
    reference = open_checkpoint(run.base, device).model if run.data.task == "dpo" else None
    task = build_task(run, loaded.tokenizer, reference)
    return task.evaluate(loaded.model, run.train.eval_batches, device)


def run(args: argparse.Namespace) -> int:
    model, task, run_cfg = build_finetune(args)
    print(run_header(run_cfg, model, task))
    if run_cfg.data.eval_before and not args.resume:
        print("before fine-tuning: " + metrics_line(evaluate_base(model, task, run_cfg.train)))
    state = train(model, task, run_cfg, resume=args.resume, overwrite=args.overwrite)
    print(final_report(state, run_cfg))
    return 0


def evaluate_base(model: torch.nn.Module, task, t: TrainConfig) -> dict:
    """The task's metrics for the model as it starts (on the device it will train on)."""
    device = resolve_device(t.device)
    metrics = task.evaluate(model.to(device).eval(), t.eval_batches, device)
    model.train()
    return metrics


def metrics_line(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


def run_header(run_cfg: FinetuneRun, model: torch.nn.Module, task) -> str:
    """What is about to run: base, data, trainable parameters, output."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    d, t, lora = run_cfg.data, run_cfg.train, run_cfg.lora
    how = f"LoRA rank {lora.rank} on {lora.targets}" if lora.rank else "all weights"
    left_out = f", {task.skipped} longer than the context left out" if task.skipped else ""
    return "\n".join(
        [
            f"base: {run_cfg.base} ({run_cfg.model.arch}, {total / 1e6:.2f}M parameters)",
            f"task: {d.task} on {d.source}: {len(task.train)} training, {len(task.val)} "
            f"held-out examples{left_out}",
            f"trained: {how}, {trained:,} parameters ({100 * trained / total:.2f}%)",
            f"train: {t.steps} steps of {t.batch_size} on {t.device}, out_dir {t.out_dir}",
            accelerators_line(t),
        ]
    )
