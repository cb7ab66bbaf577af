"""Fine-tune a checkpoint: a task head (classify, tag), SFT, DPO, a reward model or GRPO, in
full or with LoRA adapters when --lora.rank is given (QLoRA on an int8 / int4 checkpoint from
attnlab quantize), or a learned prefix with --peft.method prefix|prompt.

    attnlab finetune --ckpt runs/bert --task classify              # built-in: stdlib packages
    attnlab finetune --ckpt runs/bert --task tag --data.source ner.jsonl
    attnlab finetune --ckpt runs/base --task sft --data.source pairs.jsonl
    attnlab finetune --ckpt runs/base --task dpo --lora.rank 8 --dpo.beta 0.1
    attnlab finetune --ckpt runs/base --task reward --data.builtin spec
    attnlab finetune --ckpt runs/sft --task grpo --grpo.reward signature --data.builtin spec
    attnlab finetune --ckpt runs/base --task sft --peft.method prefix --peft.num_virtual_tokens 16

The same machinery as `attnlab train`: YAML/JSON config files and --section.field overrides
(sections train, data, lora, dpo, head, reward, grpo, peft), the training loop with its
progress bar, metrics.jsonl, checkpoints and exact --resume (give the same flags again).

A thin command over attnlab/finetune/run.py (what each task trains, LoRA, DPO's reference).
A new run prints the base's metrics first, so a run reports them before and after. A LoRA
(or prefix) run's checkpoints hold the adapters alone and name the base by path and sha256 (a
base moved or changed since is a one-line error); `open_checkpoint` rebuilds base + adapters
and merges them on opening, as `attnlab eval` (the run's own task metrics) and
`attnlab generate` do; `attnlab convert --from attnlab RUN --to peft DIR` writes them as a
peft adapter.
"""

import argparse
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
from attnlab.finetune.run import (
    DEFAULT_SECTIONS,
    FINETUNE_TASKS,
    FinetuneRun,
    build_finetune,
    evaluate_base,
)
from attnlab.training.loop import train

SECTIONS = {name: type(config) for name, config in DEFAULT_SECTIONS.items()}
SPLITS = ("train", "val")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="the base checkpoint (attnlab or HF directory)")
    p.add_argument(
        "--task", choices=FINETUNE_TASKS, default=None, help="sets data.task (default sft)"
    )
    p.add_argument("--config", metavar="FILE", help="YAML/JSON file of section overrides")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from train.out_dir's newest checkpoint (the latest step one, or "
        "checkpoints/best when it is newer)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a train.out_dir that holds another run (deletes it)",
    )
    freeze_usage(p)
    add_config_flags(p, SECTIONS, DEFAULT_SECTIONS)


def configs_from_args(args: argparse.Namespace) -> dict:
    """{section: config} from the defaults, the config file and the flags (in that order)."""
    file = read_config_file(args.config) if args.config else {}
    configs = merge_sections(dict(DEFAULT_SECTIONS), file, args.config)
    configs, _ = apply_config_flags(configs, args)
    if args.task is not None:
        configs["data"] = replace(configs["data"], task=args.task)
    return configs


def run(args: argparse.Namespace) -> int:
    configs = configs_from_args(args)
    require_device(configs["train"].device, "--train.device")
    model, task, run_cfg = build_finetune(configs, args.ckpt)
    print(run_header(run_cfg, model, task))
    if run_cfg.data.eval_before and not args.resume:
        print("before fine-tuning: " + metrics_line(evaluate_base(model, task, run_cfg.train)))
    state = train(model, task, run_cfg, resume=args.resume, overwrite=args.overwrite)
    print(final_report(state, run_cfg))
    return 0


def metrics_line(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


def run_header(run_cfg: FinetuneRun, model: torch.nn.Module, task) -> str:
    """What is about to run: base, data, trainable parameters, output."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    d, t, lora = run_cfg.data, run_cfg.train, run_cfg.lora
    how = f"LoRA rank {lora.rank} on {lora.targets}" if lora.rank else "all weights"
    if run_cfg.peft.method != "none":  # prefix or prompt tuning: the base frozen
        p = run_cfg.peft
        mlp = f" through an MLP of {p.prefix_projection}" if p.prefix_projection else ""
        how = f"{p.method} tuning, {p.num_virtual_tokens} virtual tokens{mlp}"
    if lora.rank and lora.bias != "none":
        how += f", bias {lora.bias}"
    if lora.rank and lora.save_names:
        how += f", modules_to_save {lora.modules_to_save}"
    if run_cfg.data.task == "classify" and run_cfg.head.pooling != "cls":
        how += f", {run_cfg.head.pooling}-pooled head"
    per_step = f"{t.batch_size}"
    if d.task == "grpo":  # batch_size counts prompts
        g = run_cfg.grpo
        per_step += f" prompts x {g.num_generations} completions, reward {g.reward}, beta {g.beta}"
    skipped = getattr(task, "skipped", 0)  # SFT/DPO leave out what is too long (heads cut it)
    left_out = f", {skipped} longer than the context left out" if skipped else ""
    n_train, n_val = (len(getattr(task, f"{s}_rows", None) or getattr(task, s)) for s in SPLITS)
    return "\n".join(
        [
            f"base: {run_cfg.base} ({run_cfg.model.arch}, {total / 1e6:.2f}M parameters)",
            f"task: {d.task} on {d.source}: {n_train} training, {n_val} "
            f"held-out examples{left_out}",
            f"trained: {how}, {trained:,} parameters ({100 * trained / total:.2f}%)",
            f"train: {t.steps} steps of {per_step} on {t.device}, out_dir {t.out_dir}",
            accelerators_line(t),
        ]
    )
