"""A fine-tuning run as a library: its config, its examples, the model and task it trains, and
its evaluation. `attnlab finetune` (attnlab/cli/finetune.py) is a thin command over it.

    sections = {**DEFAULT_SECTIONS, "data": FinetuneDataConfig(task="sft", source="pairs.jsonl")}
    model, task, run = build_finetune(sections, "runs/base")   # run: a FinetuneRun
    state = training.loop.train(model, task, run)

- classify / tag put a fresh head on the base (`finetune.heads_tasks.build_head_task`: an
  encoder or decoder for classify, an encoder for tag); with LoRA the head trains in full
  beside the adapters (peft's modules_to_save; `save_peft` writes it in the adapter).
- sft / dpo fine-tune a decoder LM through the tokenizer's chat template when it has one.
  DPO's reference is a frozen copy of the base, or under LoRA the policy with its adapters off
  (`adapters.lora.disable_adapters`); dpo.precompute_reference computes its log-probs once.
- reward puts a one-output sequence head on a decoder (finetune/reward.py) and trains it on
  preference pairs; grpo trains a decoder LM on its own samples, scored by grpo.reward
  (finetune/grpo.py, finetune/rewards.py), against the same kind of reference as DPO.

A run on a frozen base (LoRA, prefix or prompt tuning) stores in its checkpoints only what it
trains (the adapters, a prefix, a head, what trains beside them), with its LoRA section
(adapters/config.py) and its base's path and sha256, as peft names its base;
`open_checkpoint` rebuilds base + adapters and merges them on opening. A run's
own task metrics, from its own run config: `evaluate_finetuned`.
"""

import copy
import random
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from attnlab.adapters.config import LoraConfig, PromptLearningConfig
from attnlab.adapters.lora import add_lora
from attnlab.adapters.prompt_learning import PromptLearningLM
from attnlab.checkpoint import Loaded, fingerprint, open_checkpoint, plain_model
from attnlab.configs import from_dict
from attnlab.finetune import data
from attnlab.finetune.config import (
    DPOConfig,
    FinetuneDataConfig,
    GRPOConfig,
    HeadOptions,
    RewardConfig,
)
from attnlab.finetune.grpo import GRPOTask
from attnlab.finetune.heads_tasks import ClassifyTask, TagTask, build_head_task
from attnlab.finetune.reward import RewardTask, reward_model
from attnlab.finetune.rewards import load_reward
from attnlab.finetune.tagging import words_from_spans
from attnlab.finetune.tasks import DPOTask, SFTTask
from attnlab.models.config import ModelConfig
from attnlab.models.heads import head_modules, task_head_kind
from attnlab.training.config import TrainConfig
from attnlab.training.distributed import resolve_device

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
HEAD_TASKS = ("classify", "tag")  # a task head on the base (finetune/heads_tasks.py)
LM_TASKS = ("sft", "dpo", "reward", "grpo")  # on a decoder LM, through its chat format
PAIR_TASKS = ("dpo", "reward")  # preference pairs
FINETUNE_TASKS = (*LM_TASKS, *HEAD_TASKS)
DEFAULT_SECTIONS = {  # the run's sections beside its model, as they start
    "train": FINETUNE_TRAIN,
    "data": FinetuneDataConfig(),
    "lora": LoraConfig(),
    "dpo": DPOConfig(),
    "head": HeadOptions(),
    "reward": RewardConfig(),
    "grpo": GRPOConfig(),
    "peft": PromptLearningConfig(),
}


@dataclass(frozen=True)
class FinetuneRun:
    """A fine-tuning run, saved in each of its checkpoints: the base's model config, the base
    checkpoint it started from, and the sections below. A run on a frozen base (LoRA, prefix
    or prompt tuning) records the base's sha256 (checkpoint.fingerprint) too: its checkpoints
    then hold only the tensors it trains, and opening one rebuilds base + adapters."""

    model: ModelConfig
    base: str = ""
    base_sha256: str = ""
    train: TrainConfig = FINETUNE_TRAIN
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    head: HeadOptions = field(default_factory=HeadOptions)
    reward: RewardConfig = field(default_factory=RewardConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    peft: PromptLearningConfig = field(default_factory=PromptLearningConfig)


def builtin_examples(d: FinetuneDataConfig) -> tuple[list[dict], list[dict]]:
    """The built-in (train, validation) examples, made from the standard library by
    attnlab.finetune.data: a function's package (classify), `tokenize` spans of source
    windows (tag), "write the signature of the function documented as: ..." -> `def
    name(args):` (sft; grpo's prompts), and the right signature preferred to a corrupted one
    (dpo, reward); with data.builtin "spec", the prompts state the name and arguments
    (data.build_spec_instructions). data.max_examples caps the training examples (classify:
    divided among the packages; dpo: the prompts, each giving data.pairs_per_prompt training
    pairs)."""
    n = d.max_examples
    if d.task == "classify":
        per_class = max(1, n // len(data.CLASSIFY_PACKAGES)) if n else None
        built = data.build_classification(**({"max_per_class": per_class} if n else {}))
    elif d.task == "tag":
        built = data.build_tagging(**({"max_examples": n} if n else {}))
    else:
        built = data.build_instructions(**({"max_examples": n} if n else {}))
        spec = d.builtin == "spec"
        if spec:
            built = data.build_spec_instructions(built)
        if d.task in PAIR_TASKS and spec:
            built = data.build_spec_preferences(built)
        elif d.task in PAIR_TASKS:
            built = data.build_preferences(built, pairs_per_prompt=d.pairs_per_prompt)
    return built.splits["train"], built.splits["val"]


def load_examples(d: FinetuneDataConfig, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, validation) examples: built in, or a JSONL file (`data.load_jsonl`, which names
    the line and field of a bad one) with val_fraction of it held out (`hold_out`, seeded by
    the run's `seed`), or its own val_source file; a user's held-out set too small or of one
    class draws a warning (`check_held_out`). Tagging examples come as {"tokens", "tags"}
    words (`tagging.words_from_spans`); held-out classification examples in a seeded random
    order (built-in ones come grouped by label)."""
    if d.pairs_per_prompt > 1 and (
        d.task not in PAIR_TASKS or d.source != "builtin" or d.builtin != "docstring"
    ):
        raise ValueError(
            "data.pairs_per_prompt draws more corruptions of the built-in signatures: it "
            "applies to --task dpo or reward on the built-in docstring pairs only"
        )
    if d.source == "builtin":
        train_ex, val_ex = builtin_examples(d)
    else:
        train_ex = data.load_jsonl(d.source, d.task)
        if d.val_source:
            val_ex = data.load_jsonl(d.val_source, d.task)
        else:
            train_ex, val_ex = hold_out(train_ex, d, seed)
        check_held_out(val_ex, d)
        if d.max_examples:
            train_ex = train_ex[: d.max_examples]
    if d.task == "tag":
        train_ex, val_ex = ([as_words(ex) for ex in split] for split in (train_ex, val_ex))
    if d.task == "classify":  # a seeded order: the first eval_examples are not one class
        val_ex = random.Random(0).sample(val_ex, len(val_ex))
    return train_ex, val_ex


def hold_out(
    examples: list[dict], d: FinetuneDataConfig, seed: int
) -> tuple[list[dict], list[dict]]:
    """(train, validation) of a JSONL file's examples: val_fraction of them (at least one,
    never all) drawn at random with `seed`, so that a file sorted by label or by source does
    not hold out its last kind only. The same seed gives the same split (`attnlab eval`
    rebuilds it from the run config); the training examples keep the file's order."""
    if len(examples) < 2:
        raise ValueError(
            f"{d.source!r} holds {len(examples)} example: too few to hold some out; "
            "add examples or give --data.val_source"
        )
    n_val = min(max(1, round(len(examples) * d.val_fraction)), len(examples) - 1)
    held = set(random.Random(seed).sample(range(len(examples)), n_val))
    train = [ex for i, ex in enumerate(examples) if i not in held]
    return train, [ex for i, ex in enumerate(examples) if i in held]


SMALL_HELD_OUT = 10  # fewer held-out examples than this give metrics too noisy to compare


def check_held_out(val_ex: list[dict], d: FinetuneDataConfig) -> None:
    """One warning line on stderr when a user's held-out set is too small to measure with, or
    (classify) holds one label only, so that its accuracy says nothing about the others."""
    where = d.val_source or f"{d.val_fraction:.0%} of {d.source}"
    problems = []
    if len(val_ex) < SMALL_HELD_OUT:
        problems.append(f"has {len(val_ex)} examples (fewer than {SMALL_HELD_OUT})")
    labels = {ex["label"] for ex in val_ex} if d.task == "classify" else set()
    if len(labels) == 1:
        problems.append(f"holds one label only ({next(iter(labels))!r})")
    if problems:
        print(
            f"warning: the held-out set ({where}) {' and '.join(problems)}: its metrics will "
            "say little; give more examples, a larger --data.val_fraction or a "
            "--data.val_source with every label",
            file=sys.stderr,
        )


def as_words(example: dict) -> dict:
    """A {"text", "spans"} tagging example as the {"tokens", "tags"} words TagTask reads."""
    tokens, tags = words_from_spans(example["text"], example["spans"])
    return {"tokens": tokens, "tags": tags}


def open_base(path: str | Path, task: str) -> Loaded:
    """The base checkpoint, checked: a decoder LM for sft, dpo, reward and grpo, and a
    tokenizer. A LoRA fine-tuning run (say, the SFT run that DPO starts from) opens with its
    adapters merged."""
    loaded = plain_model(open_checkpoint(path), "fine-tune its base (run.base) instead")
    head = task_head_kind(loaded.config)
    if task in LM_TASKS and (loaded.config.arch != "decoder" or head is not None):
        kind = head or f"an {loaded.config.arch} model"
        raise ValueError(
            f"--ckpt {path!r} is {kind}; --task {task} fine-tunes a decoder LM (a GPT-2 or "
            "Llama-family checkpoint)"
        )
    if loaded.tokenizer is None:
        raise ValueError(f"--ckpt {path!r} has no tokenizer.json beside its weights")
    return loaded


def add_adapters(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """LoRA adapters on lora.targets; the rest of the model frozen but a task head, which
    trains in full (as peft's `modules_to_save`)."""
    names = add_lora(
        model,
        targets=lora.target_names,
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        bias=lora.bias,
        modules_to_save=lora.save_names,
        rslora=lora.rslora,
    )
    if has_task_head(model):
        for name in head_modules(model):
            model.get_submodule(name).requires_grad_(True)
    return names


def has_task_head(model: torch.nn.Module) -> bool:
    """Whether `model` has a task head (which trains beside the adapters)."""
    try:
        head_modules(model)
    except ValueError:
        return False
    return True


def build_task(
    run: FinetuneRun,
    tokenizer,
    reference: torch.nn.Module | None = None,
    eval_only=False,
    policy: torch.nn.Module | None = None,
):
    """The SFTTask, DPOTask, RewardTask, GRPOTask, ClassifyTask or TagTask of `run` (its
    examples read or built here; a head task's labels are those of run.model.head). eval_only:
    for `evaluate` alone (the LM tasks then encode one training example, not all of them).
    policy: the model GRPO samples from (the one being trained)."""
    t, d = run.train, run.data
    train_ex, val_ex = load_examples(d, t.seed)
    if eval_only and d.task in LM_TASKS:
        train_ex = train_ex[:1]
    if d.task in HEAD_TASKS:
        task_cls = ClassifyTask if d.task == "classify" else TagTask
        extra = {"word_sep": ""} if d.task == "tag" else {}
        val_ex = val_ex[: d.eval_examples]
        return task_cls(tokenizer, run.model, train_ex, val_ex, t.batch_size, t.context, **extra)
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
    if d.task == "reward":
        return RewardTask(train_ex, val_ex, center=run.reward.center_coefficient, **common)
    if d.task == "grpo":
        reward = load_reward(run.grpo.reward, d.chat_template, resolve_device(t.device))
        return GRPOTask(
            train_ex,
            val_ex,
            policy=policy,
            reward=reward,
            grpo=run.grpo,
            reference=reference,
            **common,
        )
    dpo = run.dpo
    return DPOTask(
        train_ex,
        val_ex,
        beta=dpo.beta,
        reference=reference,
        rpo_alpha=dpo.rpo_alpha,
        loss=dpo.loss,
        label_smoothing=dpo.label_smoothing,
        **common,
    )


def build_finetune(configs: dict, ckpt: str | Path):
    """(model, task, run) to give `training.loop.train`: the base checkpoint `ckpt` with what
    {section: config} (DEFAULT_SECTIONS' keys) ask for: a task head, LoRA adapters, DPO's
    reference."""
    t, d, lora = configs["train"], configs["data"], configs["lora"]
    if t.compile and d.task in ("dpo", "grpo"):
        raise ValueError(f"--train.compile is not supported with --task {d.task}; leave it off")
    if configs["peft"].method != "none" and d.task not in ("sft", "dpo", "grpo"):
        raise ValueError(
            f"--peft.method {configs['peft'].method} trains a language model's prefix (--task "
            f"sft, dpo or grpo); --task {d.task} trains a head: use LoRA or full fine-tuning"
        )
    loaded = open_base(ckpt, d.task)
    frozen = lora.rank or configs["peft"].method != "none"  # checkpoints store the adapters
    base = loaded.path.resolve()
    run = FinetuneRun(
        model=loaded.config,
        base=str(base),
        base_sha256=fingerprint(base) if frozen else "",
        **configs,
    )
    torch.manual_seed(t.seed)  # the same head and adapter initialisation on every run
    if d.task in HEAD_TASKS:  # a fresh head on the base's body; run.model gains the head
        codes = [k for k, t in loaded.model.state_dict().items() if not t.is_floating_point()]
        if codes and not lora.rank:
            raise ValueError(
                f"the base checkpoint {str(loaded.path)!r} is quantized ({codes[0]} is "
                f"{loaded.model.state_dict()[codes[0]].dtype}), and its weights cannot train: "
                "give --lora.rank to train adapters on it (QLoRA), or use the float checkpoint"
            )
        train_ex, val_ex = load_examples(d, t.seed)
        extra = {"word_sep": ""} if d.task == "tag" else {}
        model, task, run = build_head_task(
            d.task,
            loaded,
            train_ex,
            val_ex[: d.eval_examples],
            run,
            pooling=run.head.pooling,
            **extra,
        )
        if lora.rank:
            add_adapters(model, lora)
        return model, task, run
    if d.task == "reward":  # a fresh one-output head on the base's body
        model, cfg = reward_model(loaded)
        run = replace(run, model=cfg)
        if lora.rank:
            add_adapters(model, lora)
        return model, build_task(run, loaded.tokenizer), run
    model = loaded.model
    if configs["peft"].method != "none":
        return _prompt_learning(configs, loaded, run)
    # DPO's and GRPO's reference, the model before: the policy with its adapters off under
    # LoRA (objectives.reference_model), else (or when base weights train too) a frozen copy
    copied = not lora.rank or lora.trains_base
    wants = d.task == "dpo" or (d.task == "grpo" and run.grpo.beta > 0)
    reference = copy.deepcopy(model) if wants and copied else None
    if lora.rank:
        add_adapters(model, lora)
    task = build_task(run, loaded.tokenizer, reference, policy=model)
    if d.task == "dpo" and run.dpo.precompute_reference:
        task.precompute_reference(model, resolve_device(t.device))
    return model, task, run


def _prompt_learning(configs: dict, loaded: Loaded, run: FinetuneRun):
    """(model, task, run) of a prefix- or prompt-tuning run (`--peft.method prefix|prompt`):
    the base frozen inside a PromptLearningLM; DPO's and GRPO's reference is a frozen copy of
    the base."""
    p, d = configs["peft"], configs["data"]
    if configs["lora"].rank:
        raise ValueError("--peft.method trains a prefix instead of LoRA: leave out --lora.rank")
    if d.packing or configs["train"].compile:
        flag = "--data.packing" if d.packing else "--train.compile"
        raise ValueError(f"{flag} is not supported with --peft.method; leave it off")
    wants = d.task == "dpo" or (d.task == "grpo" and run.grpo.beta > 0)
    reference = copy.deepcopy(loaded.model) if wants else None
    model = PromptLearningLM(loaded.model, p.method, p.num_virtual_tokens, p.prefix_projection)
    task = build_task(run, loaded.tokenizer, reference, policy=model)
    if d.task == "dpo" and run.dpo.precompute_reference:
        task.precompute_reference(model, resolve_device(configs["train"].device))
    return model, task, run


def is_finetune_run(run: dict) -> bool:
    """Whether a checkpoint's run config is one `attnlab finetune` wrote."""
    return isinstance(run.get("data"), dict) and run["data"].get("task") in FINETUNE_TASKS


def evaluate_finetuned(loaded, device) -> dict:
    """The task metrics of a checkpoint `attnlab finetune` wrote (`open_checkpoint`'s Loaded),
    on the held-out examples of its own run config; DPO's reference is its base checkpoint."""
    run = from_dict(FinetuneRun, loaded.run)
    reference = open_checkpoint(run.base, device).model if run.data.task == "dpo" else None
    task = build_task(run, loaded.tokenizer, reference, eval_only=True, policy=loaded.model)
    return task.evaluate(loaded.model, run.train.eval_batches, device)


def evaluate_base(model: torch.nn.Module, task, t: TrainConfig) -> dict:
    """The task's metrics for the model as it starts (on the device it will train on)."""
    device = resolve_device(t.device)
    metrics = task.evaluate(model.to(device).eval(), t.eval_batches, device)
    model.train()
    return metrics
