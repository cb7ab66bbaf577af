"""The training loop: one readable `train()` from the first step to the last checkpoint.

Per step: set the learning rate from the schedule, draw the `grad_accum` micro-batches of the
global batch and count their target tokens, accumulate gradients (each micro-batch's loss summed
over its tokens and divided by the global batch's count, so the sum is the global batch's mean
loss however the tokens fall into micro-batches), clip the global gradient norm, step AdamW. Every `eval_every` steps: validation metrics, a text
sample, and the best checkpoint; every `ckpt_every` steps: a checkpoint that `resume=True`
continues from exactly (same weights, optimizer state, RNG and data position -> same losses).

Under torchrun (train.distributed "ddp" or "fsdp", see distributed.py) the same loop runs on
every rank: each rank takes its slice of the global batch, gradients are averaged across ranks
on the last micro-batch only, the logged loss is the global batch's, and rank 0 alone logs and
writes files while the others wait for it.
"""

import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from attnlab.configs import to_dict
from attnlab.training import distributed
from attnlab.checkpoint import CheckpointDir, read_checkpoint
from attnlab.training.checks import check_run, check_same_model
from attnlab.training.config import RunConfig
from attnlab.training.distributed import Ranks, clip_grad_norm_, resolve_device
from attnlab.training.host_memory import keep_freed_memory
from attnlab.training.optim import build_optimizer
from attnlab.training.schedules import lr_at
from attnlab.viz.loss import load_metrics, plot_loss


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


@dataclass
class TrainState:
    """Where a run is: the next step to take and what it has measured."""

    step: int = 0
    best_val: float = math.inf
    last_eval: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)  # train loss of every step taken in this process


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
        callbacks: callables f(state, record) called after every logged step (on rank 0).
    """
    cfg = run.train
    check_run(run, task)
    ranks = distributed.start(cfg.distributed, cfg.device)  # one process: rank 0 of 1
    device, out = ranks.device, Path(cfg.out_dir)
    if device.type == "cpu" and cfg.keep_freed_memory:
        keep_freed_memory()  # for the whole process, from here on
    torch.manual_seed(cfg.seed + ranks.rank)  # dropout masks differ across ranks
    model = ranks.wrap(model.to(device).train())  # DDP, FSDP2 or the model itself
    betas, one_process = (cfg.beta1, cfg.beta2), ranks.kind == "none"
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, betas, flat=one_process)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    data_gen = torch.Generator().manual_seed(cfg.seed)  # the same on every rank: one global batch
    ckpts = CheckpointDir(out / "checkpoints", cfg.keep_last) if ranks.main else None
    state = _resume(ckpts, model, optimizer, data_gen, run, ranks) if resume else TrainState()
    if ranks.main:
        _truncate_metrics(out / "metrics.jsonl", state.step)
    loss_sum_of = partial(task.loss_sum, model)
    if cfg.compile:
        loss_sum_of = compile_loss(task.loss_sum, model, device)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * ranks.world * cfg.context

    def save(best: bool = False) -> None:  # called on every rank: FSDP gathers the shards
        weights, optim_state = ranks.checkpoint_state(model, optimizer)
        rng = ranks.rng_state(data_gen)
        trainer = {"step": state.step, "best_val": state.best_val, "last_eval": state.last_eval}
        if best and ranks.main:
            ckpts.save_best(weights, optim_state, run, trainer, rng, task.tokenizer)
        elif ranks.main:
            ckpts.save(state.step, weights, optim_state, run, trainer, rng, task.tokenizer)
        ranks.barrier()  # the others wait until the checkpoint is complete

    bar = tqdm(
        range(state.step, cfg.steps),
        initial=state.step,
        total=cfg.steps,
        disable=not (cfg.progress and ranks.main),
        dynamic_ncols=True,
    )
    for step in bar:
        t0 = time.perf_counter()
        lr = lr_at(step, cfg, run.model.d_model)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # This rank's slices of the global batch's micro-batches, and the global target count.
        batches = [
            task.train_batch(data_gen, ranks.rank, ranks.world) for _ in range(cfg.grad_accum)
        ]
        batches = [{k: v.to(device) for k, v in batch.items()} for batch in batches]
        count = torch.tensor(sum(map(task.n_targets, batches)), dtype=torch.float64)
        n_targets = max(ranks.sum(count.to(device)).item(), 1.0)
        loss_sum = torch.zeros((), device=device)
        for i, batch in enumerate(batches):
            with ranks.gradient_sync(model, sync=i == cfg.grad_accum - 1):
                with _autocast(cfg.precision, device):
                    summed = loss_sum_of(batch)  # over this micro-batch's target tokens
                # The ranks average their gradients; times world, that is their sum.
                scaler.scale(summed * (ranks.world / n_targets)).backward()
            loss_sum += summed.detach()
        loss_value = ranks.sum(loss_sum).item() / n_targets  # the same on all ranks
        if not math.isfinite(loss_value):  # so every rank stops here
            last = ranks.broadcast(ckpts.latest() if ranks.main else None)
            raise TrainingDiverged(
                f"loss is {loss_value} at step {step + 1}; stopping. The last good "
                f"checkpoint is {str(last) if last else 'none (none saved yet)'}"
            )
        scaler.unscale_(optimizer)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf  # 0: measure, don't clip
        grad_norm = clip_grad_norm_(trained_tensors(optimizer), max_norm)
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
            record.update(_evaluate(model, task, cfg, ranks, state, save))
        if ranks.main and (state.step % cfg.log_every == 0 or "val_loss" in record):
            _append(out / "metrics.jsonl", record)
            bar.set_postfix(
                loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:,.0f}"
            )
            for callback in callbacks:
                callback(state, record)
        if state.step % cfg.ckpt_every == 0 or state.step == cfg.steps:
            save()
    if ranks.main and (out / "metrics.jsonl").is_file():
        plot_loss(load_metrics(out / "metrics.jsonl"), out / "loss.png", title=str(out))
    return state


def _evaluate(model, task, cfg, ranks: Ranks, state: TrainState, save) -> dict:
    """Validation metrics and a sample, computed alike on every rank; rank 0 reports them."""
    with ranks.evaluating(model) as net:
        metrics = task.evaluate(net, cfg.eval_batches, ranks.device)
        n = cfg.sample_tokens
        sample = task.sample(net, n, ranks.device) if n else None
    state.last_eval = metrics
    if metrics["val_loss"] < state.best_val:
        state.best_val = metrics["val_loss"]
        save(best=True)
    if sample is not None:
        metrics["sample"] = sample
        if cfg.progress and ranks.main:
            tqdm.write(f"--- step {state.step} sample ---\n{sample}\n---")
    return metrics


def compile_loss(loss, model: nn.Module, device: torch.device):
    """`torch.compile` of batch -> loss(model, batch): the model and the task's loss in one
    graph, so the loss (log-softmax, gather, mean) and its backward are fused kernels too, not
    a dozen eager ops after the compiled model (recipe (a)'s step: ~1% less). On CPU with
    inductor's C++ wrapper: the compiled forward and backward then call their kernels (about
    100 per step for a small GPT) from generated C++ instead of Python (~4% less)."""
    options = {"cpp_wrapper": True} if device.type == "cpu" else None
    return torch.compile(partial(loss, model), options=options)


def trained_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The tensors the optimizer steps, whose gradients the clip measures: the model's
    parameters, or FlatAdamW's flat buffers (the same gradients, in one tensor per group)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _resume(ckpts, model, optimizer, data_gen, run: RunConfig, ranks: Ranks) -> TrainState:
    """Rank 0 reads the latest checkpoint; every rank loads it (weights and optimizer broadcast
    from rank 0, so the number of ranks may differ from the run that wrote it)."""
    path = ranks.broadcast(ckpts.latest() if ranks.main else None)
    if path is None:
        where = Path(run.train.out_dir) / "checkpoints"
        raise ValueError(f"--resume: no checkpoint in {str(where)!r}")
    files = read_checkpoint(path) if ranks.main else {}
    saved, trainer, rng = ranks.broadcast([files.get(k) for k in ("run", "trainer", "rng")])
    check_same_model(saved["model"], to_dict(run.model), path)
    ranks.load_checkpoint_state(model, optimizer, files.get("weights"), files.get("optimizer"))
    ranks.set_rng_state(rng, data_gen, run.train.seed)
    return TrainState(
        step=trainer["step"], best_val=trainer["best_val"], last_eval=trainer["last_eval"]
    )


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records after `step` (left by a run that went on past its last checkpoint)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


# resolve_device lives in distributed.py; re-exported for older imports (cli/eval.py).
__all__ = ["train", "TrainState", "TrainingDiverged", "resolve_device"]
