"""Errors found before the first step, each naming the values: a run config that cannot work,
or a checkpoint written for another model. (Otherwise they surface deep inside a forward pass,
or after hours of training.)"""

from pathlib import Path

from attnlab.checkpoint import is_complete, resumable_checkpoint
from attnlab.training.config import RunConfig
from attnlab.training.distributed import resolve_device

TASK_ARCH = {
    "clm": "decoder",
    "prefix_lm": "decoder",
    "permutation_lm": "decoder",
    "mlm": "encoder",
    "seq2seq": "encoder_decoder",
    "vqa": "vlm",
    "vla": "vlm",
    "sft": "decoder",  # attnlab finetune (finetune/tasks.py, finetune/heads_tasks.py)
    "dpo": "decoder",
    "reward": "decoder",  # a one-output sequence head on a decoder (finetune/reward.py)
    "grpo": "decoder",
    "classify": ("encoder", "decoder"),  # a task head: any of these families
    "tag": ("encoder",),
}


def check_run(run: RunConfig, task) -> None:
    """ValueError for the first thing in `run` (with `task`'s data) that cannot work."""
    m, t, d = run.model, run.train, run.data
    arches = TASK_ARCH[d.task]
    if m.arch not in ((arches,) if isinstance(arches, str) else arches):
        need = repr(arches) if isinstance(arches, str) else f"one of {list(arches)}"
        raise ValueError(f"task {d.task!r} needs model.arch={need}, but model.arch is {m.arch!r}")
    if d.task != "seq2seq" and t.context > m.max_seq_len:
        raise ValueError(
            f"train.context={t.context} is longer than the model's positions "
            f"(model.max_seq_len={m.max_seq_len})"
        )
    if d.task == "seq2seq" and d.synthetic_max_len + 1 > m.max_seq_len:  # + <bos> or <eos>
        raise ValueError(
            f"data.synthetic_max_len={d.synthetic_max_len} makes sequences of up to "
            f"{d.synthetic_max_len + 1} tokens, longer than model.max_seq_len={m.max_seq_len}"
        )
    if task.tokenizer.vocab_size > m.vocab_size:
        raise ValueError(
            f"the tokenizer has {task.tokenizer.vocab_size} tokens but the model's "
            f"vocab_size is {m.vocab_size}"
        )
    if t.precision == "fp16" and resolve_device(t.device).type != "cuda":
        raise ValueError("precision='fp16' needs CUDA (a grad scaler); use 'bf16' on CPU")
    if t.precision == "fp16" and t.distributed == "fsdp":
        # GradScaler's inf check would see only this rank's gradient shard, and ranks could
        # disagree on skipping a step.
        raise ValueError("precision='fp16' is not supported with distributed='fsdp'; use 'bf16'")
    data = getattr(task, "data", None)  # the token streams of LM / MLM tasks
    if data is not None:  # checked now, not at the first evaluation after all the steps
        for split, tokens in (("train", data.train), ("validation", data.val)):
            if len(tokens) < t.context + 1:
                raise ValueError(
                    f"the {split} split has {len(tokens)} tokens, too short for context "
                    f"{t.context} (needs at least {t.context + 1}); use more text or a "
                    "shorter train.context"
                )


def check_new_run(out_dir: str | Path) -> None:
    """ValueError when `out_dir` already holds a run (checkpoints or metrics) that a new run
    would overwrite: the error says to pass --resume or --overwrite."""
    out = Path(out_dir)
    checkpoints, metrics = out / "checkpoints", out / "metrics.jsonl"
    held = []
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        held.append("checkpoints/")
    if metrics.is_file() and metrics.stat().st_size > 0:
        held.append("metrics.jsonl")
    if held and _resumable(checkpoints) is None:  # stopped before its first save
        raise ValueError(
            f"out_dir {str(out)!r} holds a run that stopped before its first checkpoint "
            f"({' and '.join(held)}): there is nothing to resume; pass --overwrite to start "
            "it afresh, or another --train.out_dir"
        )
    if held:
        raise ValueError(
            f"out_dir {str(out)!r} already holds a run ({' and '.join(held)}); pass --resume to "
            "continue it, --overwrite to replace it, or another --train.out_dir"
        )


def check_resumable(out_dir: str | Path) -> None:
    """ValueError when `out_dir` holds no checkpoint that --resume could continue from (nothing
    to resume), read before anything is written: it creates nothing."""
    out = Path(out_dir)
    checkpoints = out / "checkpoints"
    if _resumable(checkpoints) is not None:
        return
    if not out.exists():
        why, fix = "it does not exist", "start the run without --resume"
    elif any(checkpoints.glob("*")) or (out / "metrics.jsonl").is_file():
        why, fix = "its run stopped before its first checkpoint", "pass --overwrite instead"
    else:
        why, fix = "it holds no run", "start the run without --resume"
    raise ValueError(
        f"--resume: nothing to resume in out_dir {str(out)!r} ({why}); {fix}, or give the "
        "--train.out_dir of a run that saved a checkpoint"
    )


def _resumable(checkpoints: Path) -> Path | None:
    """What --resume would continue from in `checkpoints`, read only: `resumable_checkpoint`,
    or a complete `X.old` that opening the directory renames back (a save killed mid-way)."""
    found = resumable_checkpoint(checkpoints)
    if found is None and checkpoints.is_dir():
        found = next((p for p in checkpoints.glob("*.old") if is_complete(p)), None)
    return found


def check_same_model(saved: dict, current: dict, where) -> None:
    """ValueError listing every model field (dotted, e.g. attention.n_kv_heads) that differs."""
    saved, current = _flatten(saved), _flatten(current)
    diff = {
        k: (saved.get(k), current.get(k))
        for k in saved.keys() | current.keys()
        if saved.get(k) != current.get(k)
    }
    if diff:
        lines = ", ".join(
            f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in sorted(diff.items())
        )
        raise ValueError(
            f"checkpoint {str(where)!r} was written for another model config ({lines})"
        )


def _flatten(data: dict, prefix: str = "") -> dict:
    """{"attention": {"n_heads": 4}} -> {"attention.n_heads": 4}; tuples compare as JSON lists."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = list(value) if isinstance(value, tuple) else value
    return out
