"""The training loop: exact resume, divergence, gradient accumulation, bf16 autocast."""

import json
import math
from pathlib import Path

import pytest
import torch

from attnlab.checkpoint import CheckpointDir, load_checkpoint
from attnlab.models.build import build_model
from attnlab.training.divergence import (
    BLOW_UP,
    MARGIN,
    TRAIN_PATIENCE,
    VAL_PATIENCE,
    divergence_limit,
)
from attnlab.training.loop import TrainingDiverged, train
from attnlab.training.tasks import build_task
from tests.compile_helpers import needs_compiler


class Interrupt(Exception):
    """Raised by a callback to stop a run part-way, as a crash would."""


def stop_at(step: int):
    def callback(state, record):
        if state.step == step:
            raise Interrupt(step)

    return callback


def fresh(run, seed: int = 0):
    """A freshly initialised model and a freshly built task, as a new process would have."""
    torch.manual_seed(seed)
    return build_model(run.model), build_task(run)


def metric_steps(run) -> list[int]:
    lines = (Path(run.train.out_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.parametrize(
    "preset",
    ["llama-tiny", "bert-tiny", "transformer-tiny"],  # clm, mlm (masking RNG), seq2seq
)
def test_resume_gives_bit_identical_losses_and_weights(make_run, preset):
    kw = dict(model={"dropout": 0.1}, steps=12, ckpt_every=6, schedule="cosine")
    full_run, cut_run = make_run(preset, out="full", **kw), make_run(preset, out="cut", **kw)

    model, task = fresh(full_run)
    x = task.train_batch(torch.Generator().manual_seed(0))
    with torch.no_grad():  # dropout is active, so the RNG state matters for resuming
        assert not torch.equal(task.loss_sum(model, x), task.loss_sum(model, x))
    full = train(model, task, full_run)

    # Crash right after step 7 (past the step-6 checkpoint), then resume in a "new process".
    cut_model, cut_task = fresh(cut_run)
    with pytest.raises(Interrupt):
        train(cut_model, cut_task, cut_run, callbacks=(stop_at(7),))
    resumed_model, resumed_task = fresh(cut_run, seed=99)
    resumed = train(resumed_model, resumed_task, cut_run, resume=True)

    assert len(full.losses) == 12 and len(resumed.losses) == 6
    assert resumed.losses == full.losses[6:]  # exact float equality, steps 7..12
    final, final_resumed = model.state_dict(), resumed_model.state_dict()
    assert final.keys() == final_resumed.keys()
    for name in final:
        assert torch.equal(final[name], final_resumed[name]), name
    # The metrics of the abandoned step 7 were dropped: every step is logged exactly once.
    assert metric_steps(cut_run) == list(range(1, 13))


SIGKILL_SCRIPT = """
import json, os, signal, sys
import torch
torch.set_num_threads(1)
import attnlab.checkpoint as ckpt
from attnlab.configs import from_dict
from attnlab.models.build import build_model
from attnlab.training.config import RunConfig
from attnlab.training.loop import train
from attnlab.training.tasks import build_task

real_save_file, calls = ckpt.save_file, []

def dying_save_file(weights, filename, *args, **kwargs):
    calls.append(filename)
    if len(calls) == 2:  # the second checkpoint: write half a file, then die mid-save
        with open(filename, "wb") as f:
            f.write(b"partial safetensors header")
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save_file(weights, filename, *args, **kwargs)

ckpt.save_file = dying_save_file
run = from_dict(RunConfig, json.loads(open(sys.argv[1]).read()))
torch.manual_seed(0)
train(build_model(run.model), build_task(run), run)
print("not killed")
"""


@pytest.mark.slow
def test_sigkill_during_checkpoint_leaves_previous_loadable(make_run, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from attnlab.configs import to_dict

    run = make_run("llama-tiny", out="killed", model={"dropout": 0.1}, steps=6, ckpt_every=2)
    (tmp_path / "run.json").write_text(json.dumps(to_dict(run)))
    (tmp_path / "train.py").write_text(SIGKILL_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "train.py"), str(tmp_path / "run.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr

    root = tmp_path / "killed" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000002"
    assert (root / "step_000004.tmp").is_dir()  # the interrupted save, never renamed
    assert not (root / "step_000004").exists()
    model, _ = fresh(run, seed=5)
    _, trainer, rng = load_checkpoint(root / "step_000002", model)
    assert trainer["step"] == 2 and set(rng) == {"torch", "data"}

    # Resuming continues from step 2 and matches a run that was never interrupted.
    resumed_model, resumed_task = fresh(run, seed=7)
    resumed = train(resumed_model, resumed_task, run, resume=True)
    assert resumed.step == 6 and len(resumed.losses) == 4
    assert not (root / "step_000004.tmp").exists()
    assert CheckpointDir(root).latest() == root / "step_000006"
    reference_run = make_run("llama-tiny", out="whole", model={"dropout": 0.1}, steps=6)
    reference = train(*fresh(reference_run), reference_run)
    assert resumed.losses == reference.losses[2:]


class DivergingTask:
    """Wraps a task; its loss becomes `bad` from the `at`-th training step on (1-based)."""

    def __init__(self, task, at: int, bad: float):
        self.task, self.at, self.bad, self.calls = task, at, bad, 0
        self.tokenizer = task.tokenizer

    def train_batch(self, gen, rank=0, world=1):
        return self.task.train_batch(gen, rank, world)

    def n_targets(self, batch):
        return self.task.n_targets(batch)

    def loss_sum(self, model, batch):
        self.calls += 1
        loss = self.task.loss_sum(model, batch)
        return loss * self.bad if self.calls >= self.at else loss

    def evaluate(self, *args):
        return self.task.evaluate(*args)

    def sample(self, *args, **kwargs):
        return self.task.sample(*args, **kwargs)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_loss_raises_naming_the_step_and_keeps_last_checkpoint(make_run, bad):
    run = make_run("llama-tiny", steps=10, ckpt_every=3)
    model, task = fresh(run)
    with pytest.raises(TrainingDiverged, match=r"at step 5\b") as info:
        train(model, DivergingTask(task, at=5, bad=bad), run)
    root = run.train.out_dir + "/checkpoints"
    assert "step_000003" in str(info.value)
    latest = CheckpointDir(root).latest()
    assert latest is not None and latest.name == "step_000003"
    _, trainer, _ = load_checkpoint(latest, fresh(run)[0])
    assert trainer["step"] == 3
    # The bad step never reached the optimizer.
    assert all(torch.isfinite(p).all() for p in model.parameters())


class BlowingUpTask(DivergingTask):
    """A DivergingTask whose validation loss (a finite one) is `val_losses[i]` at eval i+1."""

    def __init__(self, task, at: int, val_losses: list):
        super().__init__(task, at, math.nan)
        self.val_losses = list(val_losses)

    def evaluate(self, *args):
        metrics = self.task.evaluate(*args)
        return dict(metrics, val_loss=self.val_losses.pop(0))


def test_a_finite_blow_up_warns_naming_the_step_and_losses(make_run, capsys):
    """Val 4.6 -> 212 is no NaN but a run gone bad: a warning line says so (issue 31)."""
    run = make_run("llama-tiny", steps=4, eval_every=1, sample_tokens=0)
    model, task = fresh(run)
    train(model, BlowingUpTask(task, at=10**9, val_losses=[4.6, 4.5, 212.0, 4.4]), run)
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning")]
    assert len(warnings) == 1, warnings
    assert "val loss 212 at step 3" in warnings[0] and "its best, 4.5" in warnings[0]


def test_after_a_nan_the_last_good_checkpoint_is_one_that_passed_the_divergence_rule(make_run):
    """The checkpoint the error calls last good is named with its step and val loss; one saved
    while the val loss was above the divergence limit (550 after a best of 4.5) is not it: the
    best one is (issue 42)."""
    run = make_run("llama-tiny", steps=10, eval_every=1, ckpt_every=3, sample_tokens=0)
    model, task = fresh(run)
    val_losses = [4.6, 4.5, 550.0, 600.0]
    with pytest.raises(TrainingDiverged) as info:
        train(model, BlowingUpTask(task, at=5, val_losses=val_losses), run)
    root = Path(run.train.out_dir) / "checkpoints"
    message = str(info.value)
    assert "loss is nan at step 5" in message
    assert f"last good checkpoint is {root / 'best'} (step 2, val loss 4.5)" in message
    assert (root / "step_000003").is_dir()  # saved, but marked as diverging
    assert CheckpointDir(root).last_good() == root / "best"


def test_a_finite_train_loss_above_the_limit_stops_the_run(make_run):
    """Train losses a thousand times too high (finite; the clipped updates keep the weights
    finite) stop the run after TRAIN_PATIENCE steps in a row, and the last good checkpoint
    named is the newest one saved before them (issue 42: lr 10 went on at train loss 4877)."""
    run = make_run("llama-tiny", steps=30, ckpt_every=3, keep_last=10, sample_tokens=0)
    model, task = fresh(run)
    first_bad = 5  # steps 5, 6, ... have a loss 1000 times their own
    stop = first_bad + TRAIN_PATIENCE - 1
    with pytest.raises(TrainingDiverged, match=rf"for {TRAIN_PATIENCE} steps in a row") as info:
        train(model, DivergingTask(task, at=first_bad, bad=1000.0), run)
    root = Path(run.train.out_dir) / "checkpoints"
    message = str(info.value)
    assert f"at step {stop}; stopped before applying it" in message
    assert "above" in message and "ln V" in message and "--train.lr" in message
    assert f"last good checkpoint is {root / 'step_000003'} (step 3, " in message
    assert "\n" not in message
    # Saved while the loss was above the limit: on disk, but never the last good one.
    for step in (6, 9, 12):
        trainer = json.loads((root / f"step_{step:06d}" / "trainer_state.json").read_text())
        assert trainer["diverging"] is True, step
    trainer = json.loads((root / "step_000003" / "trainer_state.json").read_text())
    assert trainer["diverging"] is False


def test_finite_val_losses_above_the_limit_stop_the_run_and_are_never_the_best(make_run, capsys):
    """One evaluation above the limit warns; VAL_PATIENCE in a row stop the run before that
    step is saved; none of them is kept as the best, not even the first evaluation's."""
    run = make_run("llama-tiny", steps=10, eval_every=1, ckpt_every=1, sample_tokens=0)
    model, task = fresh(run)
    val_losses = [531.0, 4.5, 4.4, 110.0, 531.0, 600.0, 4.0]
    with pytest.raises(TrainingDiverged) as info:
        train(model, BlowingUpTask(task, at=10**9, val_losses=val_losses), run)
    root = Path(run.train.out_dir) / "checkpoints"
    message = str(info.value)
    assert "val loss 600 has been above" in message and "4x its best, 4.4" in message
    assert f"for {VAL_PATIENCE} evaluations in a row" in message
    assert "at step 6; stopped before saving it" in message
    assert f"last good checkpoint is {root / 'best'} (step 3, val loss 4.4)" in message
    assert not (root / "step_000006").exists()
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning")]
    assert len(warnings) == 3, warnings  # steps 1, 4 and 5
    assert "val loss 531 at step 1 is above" in warnings[0]
    best = json.loads((root / "best" / "trainer_state.json").read_text())
    assert best["step"] == 3 and best["best_val"] == 4.4


def test_the_divergence_limit_is_ln_v_or_blow_up_times_the_best_plus_a_margin():
    assert divergence_limit(math.inf, 100) == pytest.approx(math.log(100) + MARGIN)
    assert divergence_limit(4.5, 100) == pytest.approx(math.log(100) + MARGIN)  # ln V is lower
    assert divergence_limit(0.5, 100) == pytest.approx(BLOW_UP * 0.5 + MARGIN)
    # An untrained model scores about ln V: it is within the limit, as a healthy run is.
    assert math.log(100) + 0.1 < divergence_limit(math.inf, 100)


def test_grad_accumulation_equals_one_big_batch(make_run):
    """k micro-batches of b, each loss sum / the k*b batch's targets as the loop does, equal
    one batch of k*b."""
    k, b = 4, 3
    run = make_run("llama-tiny", batch_size=k * b)
    model, task = fresh(run)
    batch = task.train_batch(torch.Generator().manual_seed(3))  # (k*b, T)
    params = list(model.parameters())

    big = task.loss_sum(model, batch) / task.n_targets(batch)
    big_grads = torch.autograd.grad(big, params)
    acc_loss = torch.zeros(())
    for i in range(k):
        micro = {key: v[i * b : (i + 1) * b] for key, v in batch.items()}
        loss = task.loss_sum(model, micro) / task.n_targets(batch)
        loss.backward()
        acc_loss += loss.detach()

    torch.testing.assert_close(acc_loss, big.detach(), rtol=1e-6, atol=0)
    # Relative to each gradient's norm: single elements near zero carry fp32 rounding noise.
    for (name, p), g in zip(model.named_parameters(), big_grads):
        assert g.norm() > 0, name
        assert (p.grad - g).norm() / g.norm() < 1e-6, name


def test_loop_grad_accumulation_sees_the_same_global_batch(make_run):
    """In the loop, batch_size=b x grad_accum=k draws the same windows as one batch of k*b."""
    accumulated = make_run("llama-tiny", out="acc", steps=1, batch_size=3, grad_accum=4)
    single = make_run("llama-tiny", out="one", steps=1, batch_size=12, grad_accum=1)
    loss_acc = train(*fresh(accumulated), accumulated).losses[0]
    loss_one = train(*fresh(single), single).losses[0]
    assert loss_acc == pytest.approx(loss_one, rel=1e-6)


class AutocastProbe:
    """Wraps a task and records whether autocast was on (and in which dtype) inside loss_sum()."""

    def __init__(self, task):
        self.task, self.tokenizer, self.seen = task, task.tokenizer, set()

    def train_batch(self, gen, rank=0, world=1):
        return self.task.train_batch(gen, rank, world)

    def n_targets(self, batch):
        return self.task.n_targets(batch)

    def loss_sum(self, model, batch):
        on = torch.is_autocast_enabled("cpu")
        self.seen.add((on, torch.get_autocast_dtype("cpu") if on else None))
        return self.task.loss_sum(model, batch)

    def evaluate(self, *args):
        return self.task.evaluate(*args)

    def sample(self, *args, **kwargs):
        return self.task.sample(*args, **kwargs)


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_bf16_autocast_tracks_fp32(make_run):
    kw = dict(steps=50, batch_size=4, context=16, lr=3e-3, warmup=5, schedule="constant")
    fp32_run = make_run("llama-tiny", out="fp32", precision="fp32", **kw)
    bf16_run = make_run("llama-tiny", out="bf16", precision="bf16", **kw)
    fp32 = train(*fresh(fp32_run), fp32_run).losses
    model, task = fresh(bf16_run)
    probe = AutocastProbe(task)
    bf16 = train(model, probe, bf16_run).losses
    assert probe.seen == {(True, torch.bfloat16)}
    assert fp32[-1] < fp32[0] - 0.5  # it did learn something, so the comparison means something
    mean32, mean16 = sum(fp32[-10:]) / 10, sum(bf16[-10:]) / 10
    assert abs(mean16 - mean32) / mean32 < 0.02, (mean32, mean16)
    assert bf16 != fp32  # bf16 really ran in lower precision


def test_grad_clip_zero_turns_clipping_off(make_run):
    """grad_clip=0 means "no clipping" (nanoGPT's convention), not "clip every gradient to 0"."""
    records = []
    run = make_run("llama-tiny", steps=1, grad_clip=0.0, weight_decay=0.0, lr=1e-2, warmup=1)
    model, task = fresh(run)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, task, run, callbacks=(lambda state, record: records.append(record),))
    assert records[0]["grad_norm"] > 0
    for name, p in model.named_parameters():  # AdamW's first step moves every weight by ~lr
        assert not torch.equal(p, before[name]), name


def test_logged_grad_norm_is_measured_before_clipping(make_run):
    records = []
    run = make_run("llama-tiny", steps=1, grad_clip=1e-3, lr=1e-2, warmup=1)
    train(*fresh(run), run, callbacks=(lambda state, record: records.append(record),))
    assert records[0]["grad_norm"] > 1e-3


def test_sample_tokens_zero_draws_no_sample(make_run):
    records = []
    run = make_run("llama-tiny", steps=2, sample_tokens=0)
    train(*fresh(run), run, callbacks=(lambda state, record: records.append(record),))
    assert "val_loss" in records[-1] and "sample" not in records[-1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_mixed_precision_tracks_fp32(make_run, precision):
    kw = dict(steps=50, lr=3e-3, warmup=5, schedule="constant", device="cuda")
    fp32_run = make_run("llama-tiny", out="fp32", precision="fp32", **kw)
    low_run = make_run("llama-tiny", out=precision, precision=precision, **kw)
    fp32 = train(*fresh(fp32_run), fp32_run).losses
    low = train(*fresh(low_run), low_run).losses
    mean32, mean_low = sum(fp32[-10:]) / 10, sum(low[-10:]) / 10
    assert abs(mean_low - mean32) / mean32 < 0.02, (mean32, mean_low)


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("preset", ["gpt2-tiny", "bert-tiny", "transformer-tiny"])
def test_compiled_training_tracks_eager(make_run, preset):
    # compile=True as the loop runs it on CPU (compile_loss: model and task loss in one graph,
    # inductor's C++ wrapper), for each family's objective (CLM, MLM, seq2seq with label
    # smoothing), with the accelerators a compiled step turns on (accel/sigmoid_gelu.py: GPT-2's
    # gelu_tanh in sigmoid form; accel/short_attention.py: attention over <= 64 keys written
    # out). FlatAdamW in both.
    kw = dict(model={"dropout": 0.0}, steps=4, flat_adamw=True)
    if preset == "transformer-tiny":  # one source/target length: one compile, not one per shape
        kw["data"] = {"synthetic_min_len": 8, "synthetic_max_len": 8}
    eager_run = make_run(preset, out="eager", **kw)
    compiled_run = make_run(preset, out="compiled", compile=True, **kw)
    eager = train(*fresh(eager_run), eager_run).losses
    compiled = train(*fresh(compiled_run), compiled_run).losses
    assert compiled == pytest.approx(eager, rel=1e-5)
