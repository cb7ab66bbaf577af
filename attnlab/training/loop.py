"""The training loop: one readable `train()` from the first step to the last checkpoint.

Per step: set the learning rate from the schedule, accumulate gradients over `grad_accum`
micro-batches (each loss divided by grad_accum, so the sum is the mean over the global batch),
clip the global gradient norm, step AdamW. Every `eval_every` steps: validation metrics, a text
sample, and the best checkpoint; every `ckpt_every` steps: a checkpoint that `resume=True`
continues from exactly (same weights, optimizer state, RNG and data position -> same losses).
"""

import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from attnlab.configs import to_dict
from attnlab.training.checkpoint import CheckpointDir, load_checkpoint
from attnlab.training.config import RunConfig
from attnlab.training.optim import build_optimizer
from attnlab.training.schedules import lr_at
from attnlab.viz.loss import load_metrics, plot_loss

TASK_ARCH = {"clm": "decoder", "mlm": "encoder", "seq2seq": "encoder_decoder"}


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


@dataclass
class TrainState:
    """Where a run is: the next step to take and what it has measured."""

    step: int = 0
    best_val: float = math.inf
    last_eval: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)  # train loss of every step taken in this process


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_run(run: RunConfig, task) -> None:
    """Errors that would otherwise surface deep inside a forward pass, each naming the values."""
    m, t, d = run.model, run.train, run.data
    if TASK_ARCH[d.task] != m.arch:
        raise ValueError(
            f"task {d.task!r} needs model.arch={TASK_ARCH[d.task]!r}, but model.arch is {m.arch!r}"
        )
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
    data = getattr(task, "data", None)  # the token streams of LM / MLM tasks
    if data is not None:  # checked now, not at the first evaluation after all the steps
        for split, tokens in (("train", data.train), ("validation", data.val)):
            if len(tokens) < t.context + 1:
                raise ValueError(
                    f"the {split} split has {len(tokens)} tokens, too short for context "
                    f"{t.context} (needs at least {t.context + 1}); use more text or a "
                    "shorter train.context"
                )


def _autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def train(
    model: nn.Module, task, run: RunConfig, resume: bool = False, callbacks: tuple = ()
) -> TrainState:
    """Train `model` on `task` as `run.train` says; returns the final TrainState.

    Args:
        model: built from run.model.  task: LMTask | MLMTask | Seq2SeqTask.
        run: the run config (saved in every checkpoint).
        resume: continue from the latest checkpoint in run.train.out_dir.
        callbacks: callables f(state, record) called after every logged step.
    """
    cfg = run.train
    check_run(run, task)
    device = resolve_device(cfg.device)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model.to(device).train()
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    data_gen = torch.Generator().manual_seed(cfg.seed)
    ckpts, state = CheckpointDir(out / "checkpoints", cfg.keep_last), TrainState()
    if resume:
        state = _resume(ckpts, model, optimizer, data_gen, run)
    _truncate_metrics(out / "metrics.jsonl", state.step)
    forward = torch.compile(model) if cfg.compile else model
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.context

    def save(best: bool = False) -> None:
        rng = {"torch": torch.get_rng_state(), "data": data_gen.get_state()}
        trainer = {"step": state.step, "best_val": state.best_val, "last_eval": state.last_eval}
        if best:
            ckpts.save_best(model, optimizer, run, trainer, rng, task.tokenizer)
        else:
            ckpts.save(state.step, model, optimizer, run, trainer, rng, task.tokenizer)

    bar = tqdm(
        range(state.step, cfg.steps),
        initial=state.step,
        total=cfg.steps,
        disable=not cfg.progress,
        dynamic_ncols=True,
    )
    for step in bar:
        t0 = time.perf_counter()
        lr = lr_at(step, cfg, run.model.d_model)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for _ in range(cfg.grad_accum):
            batch = {k: v.to(device) for k, v in task.train_batch(data_gen).items()}
            with _autocast(cfg.precision, device):
                loss = task.loss(forward, batch) / cfg.grad_accum
            scaler.scale(loss).backward()
            loss_sum += loss.detach()
        loss_value = loss_sum.item()
        if not math.isfinite(loss_value):
            last = ckpts.latest()
            raise TrainingDiverged(
                f"loss is {loss_value} at step {step + 1}; stopping. The last good "
                f"checkpoint is {str(last) if last else 'none (none saved yet)'}"
            )
        scaler.unscale_(optimizer)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf  # 0: measure, don't clip
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        state.step = step + 1
        state.losses.append(loss_value)
        dt = time.perf_counter() - t0
        record = {
            "step": state.step,
            "train_loss": loss_value,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_per_step / dt,
        }
        if state.step % cfg.eval_every == 0 or state.step == cfg.steps:
            record.update(_evaluate(model, task, cfg, device, state, save))
        if state.step % cfg.log_every == 0 or "val_loss" in record:
            _append(out / "metrics.jsonl", record)
            bar.set_postfix(
                loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:,.0f}"
            )
            for callback in callbacks:
                callback(state, record)
        if state.step % cfg.ckpt_every == 0 or state.step == cfg.steps:
            save()
    if (out / "metrics.jsonl").is_file():
        plot_loss(load_metrics(out / "metrics.jsonl"), out / "loss.png", title=str(out))
    return state


def _evaluate(model, task, cfg, device, state: TrainState, save) -> dict:
    model.eval()
    metrics = task.evaluate(model, cfg.eval_batches, device)
    sample = task.sample(model, cfg.sample_tokens, device) if cfg.sample_tokens else None
    model.train()
    state.last_eval = metrics
    if metrics["val_loss"] < state.best_val:
        state.best_val = metrics["val_loss"]
        save(best=True)
    if sample is not None:
        metrics["sample"] = sample
        if cfg.progress:
            tqdm.write(f"--- step {state.step} sample ---\n{sample}\n---")
    return metrics


def _resume(ckpts: CheckpointDir, model, optimizer, data_gen, run: RunConfig) -> TrainState:
    path = ckpts.latest()
    if path is None:
        raise ValueError(f"--resume: no checkpoint in {str(ckpts.root)!r}")
    saved = json.loads((path / "config.json").read_text())
    check_same_model(saved["model"], to_dict(run.model), path)
    _, trainer, rng = load_checkpoint(path, model, optimizer)
    torch.set_rng_state(rng["torch"])
    data_gen.set_state(rng["data"])
    return TrainState(
        step=trainer["step"], best_val=trainer["best_val"], last_eval=trainer["last_eval"]
    )


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


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records after `step` (left by a run that went on past its last checkpoint)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


__all__ = ["train", "TrainState", "TrainingDiverged"]
