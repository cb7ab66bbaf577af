"""The training loop: one readable `train()` from the first step to the last checkpoint.

Per step: set the learning rate from the schedule, draw the `grad_accum` micro-batches of the
global batch and count their target tokens, accumulate gradients (each micro-batch's loss summed
over its tokens and divided by the global batch's count, so the sum is the global batch's mean
loss however the tokens fall into micro-batches), stop if the loss or the gradient norm is not
finite, clip the global gradient norm, step AdamW. A Mixture-of-Experts model adds its
load-balancing loss (weighted by `moe_aux_weight`) to each micro-batch's loss, logs it as
aux_loss beside the task's train_loss, logs the step's tokens per expert of every MoE layer as
expert_load, and moves DeepSeek-V3-style router biases towards balance after the update
(components/moe.py). Every `eval_every` steps: validation
metrics, a text sample, and the best checkpoint; every `ckpt_every` steps: a checkpoint that
`resume=True` continues from exactly (same weights, optimizer state, RNG and data position ->
same losses).

What cannot go wrong silently: a diverged step (NaN or inf in the loss or any gradient) is never
applied nor saved; a finite loss that stays above the divergence limit (worse than guessing
uniformly, or far above the best: the rule in divergence.py) for a few steps or evaluations
stops the run too, and one evaluation above it prints a warning; the error names the newest
checkpoint whose weights are finite and whose losses passed that rule (its step and val loss),
a step one or the best; a new run refuses an out_dir that
holds another run unless told to resume it or overwrite it; Ctrl-C (and SIGTERM, under
`sigterm_as_ctrl_c`) saves the last completed step before it stops the run; a full disk during
a save leaves the last good checkpoint as it was; a torn last line of metrics.jsonl (a run
killed while writing it) is dropped on resume.

Under torchrun (train.distributed "ddp" or "fsdp", see distributed.py) the same loop runs on
every rank: each rank takes its slice of the global batch, gradients are averaged across ranks
on the last micro-batch only, the logged loss is the global batch's, and rank 0 alone logs and
writes files while the others wait for it.
"""

import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from attnlab.accel.host_memory import keep_freed_memory
from attnlab.accel.short_attention import use_short_attention
from attnlab.accel.sigmoid_gelu import use_sigmoid_gelu
from attnlab.checkpoint import CheckpointDir, read_checkpoint
from attnlab.components.moe import router_aux_loss, take_expert_load, update_router_bias
from attnlab.configs import to_dict
from attnlab.training import distributed
from attnlab.training.checks import check_new_run, check_resumable, check_run, check_same_model
from attnlab.training.config import RunConfig
from attnlab.training.distributed import Ranks, clip_grad_norm_
from attnlab.training.divergence import CE_TASKS, VAL_PATIENCE, DivergenceWatch
from attnlab.training.optim import build_optimizer
from attnlab.training.schedules import lr_at

RUN_FILES = ("checkpoints", "metrics.jsonl", "loss.png")  # what --overwrite removes
LOWER_LR = "try a lower --train.lr or --train.grad_clip"  # what to do about a divergence


class TrainingDiverged(RuntimeError):
    """The loss or a gradient became NaN or infinite, or a finite loss stayed above the
    divergence limit (divergence.py); that step was not applied nor saved."""


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
    model: nn.Module,
    task,
    run: RunConfig,
    resume: bool = False,
    callbacks: tuple = (),
    overwrite: bool = False,
) -> TrainState:
    """Train `model` on `task` as `run.train` says; returns the final TrainState.

    Reads top to bottom: `_start` builds the run (or resumes it), then each step is `_step`,
    every `eval_every` steps `_evaluate`, every `ckpt_every` steps a `Saver.save`, and last a
    new best as best/: so a step's metrics and its step checkpoint are on disk before best/
    holds it, and a save that fails leaves no best/ newer than what --resume can continue.

    Args:
        model: built from run.model.  task: LMTask | MLMTask | Seq2SeqTask | SceneTask.
        run: the run config (saved in every checkpoint).
        resume: continue from the latest checkpoint in run.train.out_dir (the latest step one,
            or best/ when it is newer: CheckpointDir.resumable).
        callbacks: callables f(state, record) called after every logged step (on rank 0).
        overwrite: start afresh in an out_dir that holds another run, deleting its checkpoints
            and metrics (without it, or resume, that is a ValueError).

    Raises:
        TrainingDiverged: the loss or the gradient norm was NaN or inf, or the train or val loss
            stayed above the divergence limit (divergence.py); the step not applied nor saved.
        KeyboardInterrupt: re-raised after the last completed step was saved (one process).
    """
    cfg = run.train
    r = _start(model, task, run, resume, overwrite)
    state, ranks = r.state, r.ranks
    bar = tqdm(
        range(state.step, cfg.steps),
        initial=state.step,
        total=cfg.steps,
        disable=not (cfg.progress and ranks.main),
        dynamic_ncols=True,
    )
    try:
        for step in bar:
            record, new_best = _step(r, step), False
            if state.step % cfg.eval_every == 0 or state.step == cfg.steps:
                metrics, new_best = _evaluate(r)
                record.update(metrics)
            if ranks.main and (state.step % cfg.log_every == 0 or "val_loss" in record):
                _append(Path(cfg.out_dir) / "metrics.jsonl", record)
                loss, lr, tok_s = record["train_loss"], record["lr"], record["tokens_per_s"]
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}")
                for callback in callbacks:
                    callback(state, record)
            if state.step % cfg.ckpt_every == 0 or state.step == cfg.steps:
                r.saver.save(r)
            if new_best:  # last: the step's metrics and checkpoint are on disk before best/
                r.saver.save(r, best=True)
    except KeyboardInterrupt:
        # Keep the last completed step. With several ranks the others may not have stopped
        # at the same point, so no collective (no save) is attempted.
        if ranks.world == 1 and state.step > r.saver.saved_step:
            if r.unapplied is not None:  # stopped mid-step: the RNG back to where the step began
                _set_rng_state(r.unapplied, r.data_gen)
            r.optimizer.zero_grad(set_to_none=True)
            r.saver.save(r)
        if ranks.main and r.saver.saved_step > 0:
            where = Path(cfg.out_dir) / "checkpoints"
            print(f"saved step {r.saver.saved_step} in {where}: continue with --resume")
        raise
    return state


@dataclass
class _Run:
    """What a run carries from step to step (built by `_start`)."""

    run: RunConfig
    task: object
    model: nn.Module  # wrapped: DDP, FSDP2 or the model itself
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    data_gen: torch.Generator  # the same on every rank: one global batch
    ranks: Ranks
    loss_sum_of: Callable  # batch -> summed loss over its target tokens (compiled or not)
    saver: "Saver"
    state: TrainState
    watch: DivergenceWatch  # the finite-divergence rule's counts
    unapplied: dict | None = None  # the RNG as the current step found it, until it is applied


def _start(model: nn.Module, task, run: RunConfig, resume: bool, overwrite: bool) -> _Run:
    """Check the run and its out_dir, start the ranks, build the optimizer, resume if asked."""
    cfg = run.train
    check_run(run, task)
    out = Path(cfg.out_dir)
    if resume and overwrite:
        raise ValueError("--resume continues the run in out_dir, --overwrite deletes it: pass one")
    if not (resume or overwrite):  # read before any rank writes (start() waits for all of them)
        check_new_run(out)
    if resume:  # nothing to resume: say so, and create nothing
        check_resumable(out)
    ranks = distributed.start(cfg.distributed, cfg.device)  # one process: rank 0 of 1
    device = ranks.device
    if ranks.main:
        _check_writable(out)
        if overwrite:
            _remove_run(out)
    if device.type == "cpu" and cfg.keep_freed_memory:
        keep_freed_memory()  # for the whole process, from here on
    torch.manual_seed(cfg.seed + ranks.rank)  # dropout masks differ across ranks
    model = ranks.wrap(model.to(device).train())  # DDP, FSDP2 or the model itself
    betas = (cfg.beta1, cfg.beta2)
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, betas, flat=cfg.flat_adamw)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    data_gen = torch.Generator().manual_seed(cfg.seed)
    ckpts = CheckpointDir(out / "checkpoints", cfg.keep_last) if ranks.main else None
    stored = stored_names(ranks.unwrap(model), run)
    state = TrainState()
    if resume:
        state = _resume(ckpts, model, optimizer, data_gen, run, ranks, stored)
    if ranks.main:
        _truncate_metrics(out / "metrics.jsonl", state.step)
    loss_sum_of = partial(task.loss_sum, model)
    if cfg.compile:
        loss_sum_of = compile_loss(task.loss_sum, model, device)
    saver = Saver(ckpts, ranks, saved_step=state.step, stored=stored)
    vocab_size = run.model.vocab_size if run.data.task in CE_TASKS else None
    watch = DivergenceWatch(vocab_size)  # None: a loss the rule does not hold for
    return _Run(
        run, task, model, optimizer, scaler, data_gen, ranks, loss_sum_of, saver, state, watch
    )


def _step(r: _Run, step: int) -> dict:
    """Take step `step` (0-based): the learning rate, the global batch's gradients, the clip and
    the update, applied whole or not at all. Returns the step's metrics record."""
    cfg, ranks, state = r.run.train, r.ranks, r.state
    t0 = time.perf_counter()
    r.unapplied = _rng_state(r.data_gen)
    lr = lr_at(step, cfg, r.run.model.d_model)
    for group in r.optimizer.param_groups:
        group["lr"] = lr
    loss_value, aux_value = _backward(r)
    if not math.isfinite(loss_value):
        raise r.saver.diverged(f"loss is {loss_value}", step + 1)
    if (diverged := r.watch.check("train", loss_value, state.best_val)) is not None:
        raise r.saver.diverged(diverged, step + 1, hint=f"the run diverged: {LOWER_LR}")
    r.scaler.unscale_(r.optimizer)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf  # 0: measure, don't clip
    grad_norm = float(clip_grad_norm_(trained_tensors(r.optimizer), max_norm))
    if not math.isfinite(grad_norm) and not r.scaler.is_enabled():  # fp16: the scaler skips
        raise r.saver.diverged(f"gradient norm is {grad_norm}", step + 1)
    expert_load = take_expert_load(r.model)  # (L, E) tokens per expert; empty for dense
    if expert_load.numel():
        expert_load = ranks.sum(expert_load.to(ranks.device))  # every rank's tokens
    with _interrupts_deferred():  # the update is applied whole, or not at all
        r.scaler.step(r.optimizer)
        r.scaler.update()
        r.optimizer.zero_grad(set_to_none=True)
        update_router_bias(r.model, expert_load)  # DeepSeek-V3's balancing; else a no-op
        state.step, r.unapplied = step + 1, None
        state.losses.append(loss_value)
    tokens = cfg.batch_size * cfg.grad_accum * ranks.world * cfg.context
    record = {
        "step": state.step,
        "train_loss": loss_value,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens / (time.perf_counter() - t0),
    }
    if expert_load.numel():  # a Mixture-of-Experts model
        record.update(aux_loss=aux_value, expert_load=expert_load.tolist())
    return record


def _backward(r: _Run) -> tuple[float, float]:
    """Accumulate the gradients of this rank's slices of the global batch's `grad_accum`
    micro-batches, each scaled so their sum over ranks is the gradient of the global batch's
    mean loss (plus moe_aux_weight times the MoE load-balancing loss, weighted by tokens).
    Returns (that mean task loss, the mean auxiliary loss), the same on every rank."""
    cfg, ranks, device = r.run.train, r.ranks, r.ranks.device
    batches = [
        r.task.train_batch(r.data_gen, ranks.rank, ranks.world) for _ in range(cfg.grad_accum)
    ]
    batches = [{k: v.to(device) for k, v in batch.items()} for batch in batches]
    count = torch.tensor(sum(map(r.task.n_targets, batches)), dtype=torch.float64)
    n_targets = max(ranks.sum(count.to(device)).item(), 1.0)
    loss_sum, aux_sum = torch.zeros((), device=device), torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        with ranks.gradient_sync(r.model, sync=i == cfg.grad_accum - 1):
            with _autocast(cfg.precision, device):
                summed = r.loss_sum_of(batch)  # over this micro-batch's target tokens
            # An MoE model's load-balancing loss of that forward (0 for a dense model), a mean
            # over the batch: times its target count, it sums like the task loss.
            aux = router_aux_loss(r.model).to(device) * r.task.n_targets(batch)
            # The ranks average their gradients; times world, that is their sum.
            loss = summed + cfg.moe_aux_weight * aux
            r.scaler.scale(loss * (ranks.world / n_targets)).backward()
        loss_sum += summed.detach()
        aux_sum += aux.detach()
    loss_total, aux_total = ranks.sum(torch.stack([loss_sum, aux_sum])).tolist()  # one reduce
    return loss_total / n_targets, aux_total / n_targets


def _evaluate(r: _Run) -> tuple[dict, bool]:
    """Validation metrics and a sample, computed alike on every rank; rank 0 reports them.
    Returns (the metrics, whether the validation loss is a new best: to save as best/)."""
    cfg, ranks, state = r.run.train, r.ranks, r.state
    with ranks.evaluating(r.model) as net:
        metrics = r.task.evaluate(net, cfg.eval_batches, ranks.device)
        n = cfg.sample_tokens
        sample = r.task.sample(net, n, ranks.device) if n else None
    state.last_eval, val = metrics, metrics["val_loss"]
    if (diverged := r.watch.check("val", val, state.best_val)) is not None:
        raise r.saver.diverged(
            diverged, state.step, before="saving", hint=f"the run diverged: {LOWER_LR}"
        )
    if ranks.main and r.watch.in_a_row["val"]:
        tqdm.write(
            f"warning: val loss {val:.4g} at step {state.step} is above "
            f"{r.watch.describe_limit(state.best_val)}: the run is diverging (it stops after "
            f"{VAL_PATIENCE} evaluations in a row; {LOWER_LR})",
            file=sys.stderr,
        )
    new_best = val < state.best_val and r.watch.healthy  # a loss above the limit: never best
    if new_best:
        state.best_val = val
    if sample is not None:
        metrics["sample"] = sample
        if cfg.progress and ranks.main:
            tqdm.write(f"--- step {state.step} sample ---\n{sample}\n---")
    return metrics, new_best


def stored_names(model: nn.Module, run: RunConfig) -> set[str] | None:
    """The weights a run's checkpoints store: all of them (None), or, for a fine-tuning run on a
    frozen base (LoRA, prefix or prompt tuning: its config names the base and its sha256), the
    names of the parameters that train; opening the checkpoint takes the rest from the base."""
    if not getattr(run, "base_sha256", ""):
        return None
    return {name for name, p in model.named_parameters() if p.requires_grad}


class Saver:
    """Writes a run's checkpoints (rank 0 writes, every rank takes part: FSDP gathers the
    shards) and remembers the newest step on disk, so Ctrl-C saves only what is newer.
    stored: the names of the weights to write (`stored_names`; None: all)."""

    def __init__(self, ckpts: CheckpointDir | None, ranks: Ranks, saved_step: int, stored=None):
        self.ckpts, self.ranks, self.saved_step = ckpts, ranks, saved_step
        self.stored = stored

    def save(self, r: _Run, best: bool = False) -> None:
        """Save `r`'s state as the step's checkpoint, or as the best one; never one whose
        weights are not finite (TrainingDiverged), and a failed write names what is left."""
        ranks, ckpts, state = self.ranks, self.ckpts, r.state
        weights, optim_state = ranks.checkpoint_state(r.model, r.optimizer)
        if ranks.main and self.stored is not None:  # what trains, not the frozen base
            tensors = weights.state_dict() if isinstance(weights, nn.Module) else weights
            weights = {k: v for k, v in tensors.items() if k in self.stored}
        bad = ranks.broadcast(_first_non_finite(weights) if ranks.main else None)
        if bad is not None:
            raise self.diverged(f"weight {bad} is not finite", state.step, before="saving")
        rng = ranks.rng_state(r.data_gen)
        trainer = {"step": state.step, "best_val": state.best_val, "last_eval": state.last_eval}
        trainer["diverging"] = not r.watch.healthy  # never named as the last good checkpoint
        files = (weights, optim_state, r.run, trainer, rng, r.task.tokenizer)
        if ranks.main:
            try:
                if best:
                    ckpts.save_best(*files)
                else:
                    ckpts.save(state.step, *files)
            except OSError as e:  # a full disk, a read-only directory: say what is still there
                last = ckpts.resumable()  # what --resume continues from
                what = f"the best (step {state.step})" if best else f"the step-{state.step}"
                raise OSError(
                    e.errno,
                    f"could not save {what} checkpoint in {str(ckpts.root)!r} "
                    f"({e.strerror or e}{f': {e.filename}' if e.filename else ''}); the last "
                    "good checkpoint is "
                    + (
                        f"{_describe(last)}: --resume continues from it"
                        if last
                        else "none (none saved yet): nothing to resume"
                    ),
                ) from e
        if not best:
            self.saved_step = state.step
        ranks.barrier()  # the others wait until the checkpoint is complete

    def diverged(
        self, what: str, step: int, before: str = "applying", hint: str = ""
    ) -> TrainingDiverged:
        """The error that stops every rank, naming the last good checkpoint (finite weights,
        losses within the divergence limit: CheckpointDir.last_good), its step and val loss."""
        ranks = self.ranks
        last = ranks.broadcast(self.ckpts.last_good() if ranks.main else None)
        hint = f" ({hint})" if hint else ""
        return TrainingDiverged(
            f"{what} at step {step}; stopped before {before} it{hint}. The last good checkpoint is "
            + (_describe(last) if last else "none (none saved before it went bad)")
        )


def _describe(path: Path) -> str:
    """`path` with its step and validation loss."""
    try:
        trainer = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return str(path)
    val = trainer.get("last_eval", {}).get("val_loss")
    return f"{path} (step {trainer['step']}, " + (
        f"val loss {val:.4g})" if val is not None else "not evaluated yet)"
    )


def compile_loss(loss, model: nn.Module, device: torch.device):
    """`torch.compile` of batch -> loss(model, batch): the model and the task's loss in one
    graph, so the loss (log-softmax, gather, mean) and its backward are fused kernels too, not
    a dozen eager ops after the compiled model. On CPU with inductor's C++ wrapper: the compiled
    forward and backward then call their kernels (about 100 per step for a small GPT) from
    generated C++ instead of Python. Turns on the accelerators written for compiled steps
    (attnlab/accel/short_attention.py, sigmoid_gelu.py): the same numbers, fused better."""
    use_short_attention(model)
    use_sigmoid_gelu(model)
    options = {"cpp_wrapper": True} if device.type == "cpu" else None
    return torch.compile(partial(loss, model), options=options)


def trained_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The tensors the optimizer steps, whose gradients the clip measures: the model's
    parameters, or FlatAdamW's flat buffers (the same gradients, in one tensor per group)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _resume(ckpts, model, optimizer, data_gen, run: RunConfig, ranks: Ranks, stored) -> TrainState:
    """Rank 0 reads the latest checkpoint; every rank loads it (weights and optimizer broadcast
    from rank 0, so the number of ranks may differ from the run that wrote it). stored: the
    names a checkpoint of a run on a frozen base holds (`stored_names`); the model built for
    the resumed run has the base's weights for the rest."""
    path = ranks.broadcast(ckpts.resumable() if ranks.main else None)
    if path is None:  # check_resumable found one; it is gone since
        where = Path(run.train.out_dir) / "checkpoints"
        raise ValueError(f"--resume: nothing to resume in {str(where)!r} (no checkpoint)")
    files = read_checkpoint(path) if ranks.main else {}
    saved, trainer, rng = ranks.broadcast([files.get(k) for k in ("run", "trainer", "rng")])
    check_same_model(saved["model"], to_dict(run.model), path)
    weights, optim_state = files.get("weights"), files.get("optimizer")
    ranks.load_checkpoint_state(model, optimizer, weights, optim_state, only=stored)
    ranks.set_rng_state(rng, data_gen, run.train.seed)
    if ranks.main:
        print(f"resuming from step {trainer['step']} ({path})")
    return TrainState(
        step=trainer["step"], best_val=trainer["best_val"], last_eval=trainer["last_eval"]
    )


def _first_non_finite(weights) -> str | None:
    """The name of the first tensor of `weights` (a module or a state dict) that holds a NaN
    or an inf; None when all are finite."""
    tensors = weights.state_dict() if isinstance(weights, nn.Module) else weights
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None


def _rng_state(data_gen: torch.Generator) -> dict:
    return {"torch": torch.get_rng_state(), "data": data_gen.get_state()}


def _set_rng_state(rng: dict, data_gen: torch.Generator) -> None:
    torch.set_rng_state(rng["torch"])
    data_gen.set_state(rng["data"])


class Terminated(KeyboardInterrupt):
    """SIGTERM under `sigterm_as_ctrl_c`: stops a run as Ctrl-C does (a KeyboardInterrupt),
    and says which signal it was."""

    how = "SIGTERM"  # what the command line reports (Ctrl-C for a plain KeyboardInterrupt)


def _raise_terminated(signum, frame):
    raise Terminated


@contextmanager
def sigterm_as_ctrl_c():
    """SIGTERM (what schedulers and containers send) stops a run as Ctrl-C does: the last
    completed step is saved (raised as Terminated). Only the default handler is replaced, only
    in the main thread."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def _interrupts_deferred():
    """Hold Ctrl-C (SIGINT, and SIGTERM under `sigterm_as_ctrl_c`) until the block is done;
    then raise KeyboardInterrupt (Terminated for SIGTERM). Only Python's own handlers are
    replaced (not one a caller installed), and only in the main thread."""
    main = threading.current_thread() is threading.main_thread()
    ours = (signal.default_int_handler, _raise_terminated)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM) if main}
    held = {s: h for s, h in handlers.items() if h in ours}
    caught = []
    for s in held:
        signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
    if signal.SIGTERM in caught:
        raise Terminated
    if caught:
        raise KeyboardInterrupt


def _check_writable(out: Path) -> None:
    """An OSError now, naming out_dir, rather than after the first steps."""
    probe = out / ".attnlab_write_test"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OSError(
            e.errno,
            f"cannot write in out_dir {str(out)!r} ({e.strerror}); fix its permissions or "
            "choose another --train.out_dir",
        ) from None


def _remove_run(out: Path) -> None:
    """Delete the checkpoints, metrics and loss plot of the run in `out` (--overwrite)."""
    for name in RUN_FILES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the records up to `step`: drop those of steps after the last checkpoint, and a torn
    last line (a run killed while writing it). The file is replaced atomically."""
    if not path.is_file():
        return
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    keep = []
    for i, line in enumerate(lines, 1):
        try:
            record_step = json.loads(line)["step"]
        except (ValueError, TypeError, KeyError):
            if i == len(lines):
                break  # torn by a crash mid-write
            raise ValueError(
                f"{str(path)!r} line {i} is not a metrics record ({line[:40]!r}); delete that "
                "line and resume again"
            ) from None
        if record_step <= step:
            keep.append(line + "\n")
    if "".join(keep) != text:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
