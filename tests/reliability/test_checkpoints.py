"""Checkpoints that cannot lie: fault injection into training runs.

Each case breaks a run the way the world does (a kill at any write of a save, NaN gradients, a
second run into the same out_dir, a torn metrics line, a dangling `latest`, a full disk, a
read-only directory, Ctrl-C) and checks that what is left is an intact last good checkpoint that
resumes bit-exactly (the same losses and weights as a run never interrupted), and that the error
is one line. Tiny models, a few steps, one thread: they run in the fast tier.
"""

import errno
import json
import math
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import attnlab.checkpoint as ckpt
from attnlab.checkpoint import CheckpointDir, is_complete, read_checkpoint
from attnlab.cli.__main__ import main
from attnlab.models.build import build_model
from attnlab.training.loop import TrainingDiverged, _interrupts_deferred, sigterm_as_ctrl_c, train
from attnlab.training.tasks import build_task

SMALL = dict(model={"dropout": 0.1}, sample_tokens=0)  # dropout: the RNG state matters


class Killed(BaseException):
    """A kill -9 at this instant: nothing in the library catches it or cleans up after it."""


def fresh(run, seed: int = 0):
    """A freshly initialised model and task, as a new process would have (seed 0: the run's
    initial weights; any other seed: weights that resuming must overwrite)."""
    torch.manual_seed(seed)
    return build_model(run.model), build_task(run)


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def uninterrupted(run):
    """The losses and final weights of `run` trained from start to end without a fault."""
    model, task = fresh(run)
    return train(model, task, run).losses, weights(model)


def assert_resumes_exactly(run, reference) -> None:
    """Open the run as a new process would and resume it (or start it over when no checkpoint
    survived): the losses and the final weights are those of the uninterrupted run."""
    losses, final = reference
    root = Path(run.train.out_dir) / "checkpoints"
    latest = CheckpointDir(root).latest()
    model, task = fresh(run, seed=0 if latest is None else 99)
    if latest is None:
        state = train(model, task, run, overwrite=True)
    else:
        assert_good_checkpoint(latest)
        state = train(model, task, run, resume=True)
    done = len(losses) - len(state.losses)
    assert state.losses == losses[done:]  # exact float equality
    got = weights(model)
    assert all(torch.equal(got[k], final[k]) for k in final)
    assert metric_steps(run) == list(range(1, run.train.steps + 1))


def assert_good_checkpoint(path: Path) -> None:
    assert is_complete(path), sorted(p.name for p in path.iterdir())
    files = read_checkpoint(path)
    assert all(torch.isfinite(w).all() for w in files["weights"].values())


def assert_tidy(root: Path) -> None:
    """After recovery: only complete checkpoints and the pointer; no leftovers of a save."""
    CheckpointDir(root)
    for path in root.iterdir():
        assert path.suffix not in (".tmp", ".old", ".trash"), path.name
        if path.is_dir():
            assert_good_checkpoint(path)


def metric_steps(run) -> list[int]:
    lines = (Path(run.train.out_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def one_line(error: BaseException) -> str:
    text = str(error)
    assert text and "\n" not in text, text
    return text


def inject(monkeypatch, fault):
    """Route every write, rename and delete of a save through `fault(name, args)` first."""
    for name in ("_write_file", "_rename", "_remove"):
        real = getattr(ckpt, name)

        def wrapped(*args, _real=real, _name=name):
            fault(_name, args)
            return _real(*args)

        monkeypatch.setattr(ckpt, name, wrapped)


class Stop(Exception):
    """A crash after a step (raised from a callback)."""


def crash_after(step: int):
    def callback(state, record):
        if state.step == step:
            raise Stop(step)

    return callback


# --- a kill at every write of a save ------------------------------------------------------------


def kill_at(n: int):
    """A fault that kills the process at the n-th write, rename or delete (1-based)."""
    seen = []

    def fault(name, args):
        seen.append(name)
        if len(seen) == n:
            raise Killed(n)

    return fault


@pytest.mark.slow
def test_a_kill_at_any_write_of_any_save_leaves_a_run_that_resumes_exactly(make_run, monkeypatch):
    # Two steps with a checkpoint and an evaluation each: a new step checkpoint, `latest`
    # written and replaced, keep_last pruning, `best/` created and then replaced.
    kw = dict(SMALL, steps=2, ckpt_every=1, eval_every=1, keep_last=1, lr=3e-3, warmup=1)
    calls = []
    with monkeypatch.context() as m:
        inject(m, lambda name, args: calls.append((name, Path(args[0]).name)))
        reference = uninterrupted(make_run(out="reference", **kw))
    assert ("_rename", "best") in calls  # best/ was replaced: renamed aside, and the new in
    assert ("_remove", "step_000001") in calls  # pruned

    for n in range(1, len(calls) + 1):
        run = make_run(out=f"killed_at_{n}", **kw)
        with monkeypatch.context() as m:
            inject(m, kill_at(n))
            with pytest.raises(Killed):
                train(*fresh(run), run)
        assert_tidy(Path(run.train.out_dir) / "checkpoints")
        assert_resumes_exactly(run, reference)


# --- NaN gradients ------------------------------------------------------------------------------


class NaNGradient(torch.autograd.Function):
    """The identity forward; NaN backward: a finite loss whose gradients are all NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.nan


class NaNGradientsAt:
    """Wraps a task: from training step `at` (1-based) on, its gradients are NaN."""

    def __init__(self, task, at: int, grad_accum: int = 1):
        self.task, self.tokenizer, self.at, self.calls = task, task.tokenizer, at, 0
        self.grad_accum = grad_accum

    def __getattr__(self, name):  # train_batch, n_targets, evaluate, sample
        return getattr(self.task, name)

    def loss_sum(self, model, batch):
        self.calls += 1
        loss = self.task.loss_sum(model, batch)
        step = (self.calls - 1) // self.grad_accum + 1
        return NaNGradient.apply(loss) if step >= self.at else loss


def test_nan_gradients_are_never_applied_nor_saved(make_run):
    run = make_run(**SMALL, steps=6, ckpt_every=1)
    reference = uninterrupted(make_run(out="reference", **SMALL, steps=6, ckpt_every=1))
    model, task = fresh(run)
    with pytest.raises(TrainingDiverged, match=r"gradient norm is nan at step 4\b") as info:
        train(model, NaNGradientsAt(task, at=4), run)
    root = Path(run.train.out_dir) / "checkpoints"
    assert str(root / "step_000003") in one_line(info.value)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # not applied
    assert CheckpointDir(root).latest() == root / "step_000003"  # not saved
    assert_tidy(root)
    assert metric_steps(run) == [1, 2, 3]
    assert_resumes_exactly(run, reference)


def test_a_huge_learning_rate_leaves_only_finite_checkpoints(make_run):
    """lr=1000: the run may diverge, but whatever is on disk, and whatever the error names as
    the last good checkpoint, holds finite weights."""
    run = make_run(steps=8, ckpt_every=1, lr=1000.0, min_lr=0.0, warmup=1, grad_clip=0.0)
    try:
        train(*fresh(run), run)
    except TrainingDiverged as e:
        named = one_line(e).rsplit("checkpoint is ", 1)[1].split(" (step ")[0]
        if not named.startswith("none"):
            assert_good_checkpoint(Path(named))
    assert_tidy(Path(run.train.out_dir) / "checkpoints")


def test_the_last_good_checkpoint_is_the_newest_finite_one(make_run, tmp_path):
    run = make_run(**SMALL, steps=3, ckpt_every=1, keep_last=3)
    train(*fresh(run), run)
    root = Path(run.train.out_dir) / "checkpoints"
    for name in ("step_000003", "best"):  # both of step 3, as an older version could leave
        poisoned = root / name / "model.safetensors"
        ckpt.save_file({k: v * math.nan for k, v in ckpt.load_file(poisoned).items()}, poisoned)
    assert CheckpointDir(root).last_good() == root / "step_000002"


# --- a second run into the same out_dir ---------------------------------------------------------


def test_a_new_run_refuses_an_out_dir_that_holds_a_run(make_run):
    run = make_run(**SMALL, steps=6, ckpt_every=2)
    reference = uninterrupted(make_run(out="reference", **SMALL, steps=6, ckpt_every=2))
    with pytest.raises(Stop):
        train(*fresh(run), run, callbacks=(crash_after(4),))
    out = Path(run.train.out_dir)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    with pytest.raises(ValueError, match=r"already holds a run.*--resume.*--overwrite") as info:
        train(*fresh(run), run)
    one_line(info.value)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # untouched
    assert_resumes_exactly(run, reference)

    # --overwrite starts afresh: the old run's checkpoints and metrics are gone.
    again = make_run(**SMALL, steps=2, ckpt_every=1)
    state = train(*fresh(again), again, overwrite=True)
    assert state.losses == reference[0][:2]
    assert metric_steps(again) == [1, 2]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [
        "step_000001",
        "step_000002",
    ]
    with pytest.raises(ValueError, match="pass one"):
        train(*fresh(again), again, resume=True, overwrite=True)


# --- a torn metrics line, a dangling `latest` ---------------------------------------------------


def test_a_torn_last_metrics_line_is_dropped_on_resume(make_run):
    run = make_run(**SMALL, steps=6, ckpt_every=2)
    reference = uninterrupted(make_run(out="reference", **SMALL, steps=6, ckpt_every=2))
    with pytest.raises(Stop):
        train(*fresh(run), run, callbacks=(crash_after(3),))
    metrics = Path(run.train.out_dir) / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 4, "train_loss": 3.1')  # the write a kill cut short
    assert_resumes_exactly(run, reference)
    assert metrics.read_text().endswith("}\n")


def test_a_damaged_metrics_line_before_the_last_is_named(make_run):
    run = make_run(**SMALL, steps=2, ckpt_every=1)
    train(*fresh(run), run)
    metrics = Path(run.train.out_dir) / "metrics.jsonl"
    metrics.write_text("garbage\n" + metrics.read_text())
    longer = make_run(**SMALL, steps=3, ckpt_every=1)
    with pytest.raises(ValueError, match=r"metrics\.jsonl' line 1 is not a metrics record"):
        train(*fresh(longer, 99), longer, resume=True)


@pytest.mark.parametrize("pointer", ["missing", "empty", "dangling", "incomplete"])
def test_resume_falls_back_to_the_newest_complete_checkpoint(make_run, pointer):
    run = make_run(**SMALL, steps=6, ckpt_every=2, keep_last=3)
    reference = uninterrupted(make_run(out="reference", **SMALL, steps=6, ckpt_every=2))
    with pytest.raises(Stop):
        train(*fresh(run), run, callbacks=(crash_after(5),))
    root = Path(run.train.out_dir) / "checkpoints"
    latest = root / "latest"
    if pointer == "missing":
        latest.unlink()
    elif pointer == "empty":
        latest.write_text("")
    elif pointer == "dangling":
        latest.write_text("step_000009")
    else:  # names a directory that is no checkpoint
        (root / "step_000004" / "trainer_state.json").unlink()
    expected = "step_000002" if pointer == "incomplete" else "step_000004"
    assert CheckpointDir(root).latest() == root / expected
    assert_resumes_exactly(run, reference)


def test_keep_last_orders_by_step_number(make_run):
    run = make_run(**SMALL, steps=1)
    model, task = fresh(run)
    root = Path(run.train.out_dir) / "checkpoints"
    ckpts = CheckpointDir(root, keep_last=1)
    for step in (999_999, 1_000_000):  # "step_1000000" sorts before "step_999999" by name
        ckpts.save(step, model, None, run, {"step": step})
    assert [p.name for p in root.glob("step_*")] == ["step_1000000"]
    assert ckpts.latest() == root / "step_1000000"


# --- a full disk, a read-only directory ---------------------------------------------------------


def full_disk_at_step_4(file: str):
    """A `_write_file` that fails with ENOSPC on `file` of the step-4 save."""
    real = ckpt._write_file

    def write_file(path, write):
        path = Path(path)
        step_4 = path.parent.name == "step_000004.tmp" or (path.parent / "step_000004").is_dir()
        if path.name == file and step_4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, write)

    return write_file


@pytest.mark.parametrize(
    "file", ["config.json", "model.safetensors", "tokenizer.json", "latest.tmp"]
)
def test_a_full_disk_keeps_the_last_good_checkpoint(make_run, monkeypatch, file):
    run = make_run(**SMALL, steps=6, ckpt_every=2)
    reference = uninterrupted(make_run(out="reference", **SMALL, steps=6, ckpt_every=2))
    root = Path(run.train.out_dir) / "checkpoints"
    with monkeypatch.context() as m:
        m.setattr(ckpt, "_write_file", full_disk_at_step_4(file))
        with pytest.raises(OSError, match="No space left") as info:
            train(*fresh(run), run)
    assert info.value.errno == errno.ENOSPC
    # The pointer still names step 2 when its update fails (step_000004 is complete too).
    assert f"last good checkpoint is {root / 'step_000002'}" in one_line(info.value)
    assert not list(root.glob("*.tmp"))  # the unfinished save gave its space back
    assert_tidy(root)
    assert_resumes_exactly(run, reference)


def full_disk_in_steps(path, write):
    """A `_write_file` on a disk with room for best/ alone: every step checkpoint fails."""
    path = Path(path)
    if path.parent.name.startswith("step_"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return REAL_WRITE_FILE(path, write)


REAL_WRITE_FILE = ckpt._write_file


def test_a_full_disk_at_the_first_save_leaves_nothing_and_says_so(make_run, monkeypatch):
    """Step 2 is evaluated and saved, and its step save fails on a full disk (issue 42: a 5 MB
    tmpfs). best/ is written after the step checkpoint, so nothing is left, and the error, a
    new run and --resume all say there is nothing to resume."""
    run = make_run(**SMALL, steps=4, ckpt_every=2, eval_every=2)
    root = Path(run.train.out_dir) / "checkpoints"
    with monkeypatch.context() as m:
        m.setattr(ckpt, "_write_file", full_disk_in_steps)
        with pytest.raises(OSError) as info:
            train(*fresh(run), run)
    line = one_line(info.value)
    assert "could not save the step-2 checkpoint" in line, line
    assert line.endswith("the last good checkpoint is none (none saved yet): nothing to resume")
    assert not (root / "best").exists()
    with pytest.raises(ValueError, match="nothing to resume.*first checkpoint.*--overwrite"):
        train(*fresh(run), run, resume=True)
    with pytest.raises(ValueError, match="stopped before its first checkpoint"):
        train(*fresh(run), run)


def test_a_full_disk_after_a_best_save_names_it_and_resumes_from_it(make_run, monkeypatch):
    """best/ of step 2 is on disk when the step-4 save fails (ckpt_every 4): the error, a new
    run's refusal and --resume agree on best/, and the resumed run is the uninterrupted one."""
    kw = dict(SMALL, steps=4, ckpt_every=4, eval_every=2)
    run = make_run(**kw)
    reference = uninterrupted(make_run(out="reference", **kw))
    root = Path(run.train.out_dir) / "checkpoints"
    with monkeypatch.context() as m:
        m.setattr(ckpt, "_write_file", full_disk_in_steps)
        with pytest.raises(OSError) as info:
            train(*fresh(run), run)
    line = one_line(info.value)
    assert info.value.errno == errno.ENOSPC
    assert "could not save the step-4 checkpoint" in line, line
    assert f"last good checkpoint is {root / 'best'} (step 2, val loss " in line, line
    assert line.endswith("--resume continues from it"), line
    assert not list(root.glob("step_*"))
    with pytest.raises(ValueError, match="already holds a run.*--resume") as refused:
        train(*fresh(run), run)  # not "stopped before its first checkpoint"
    one_line(refused.value)
    model, task = fresh(run, seed=99)
    state = train(model, task, run, resume=True)
    assert state.losses == reference[0][2:]  # exact float equality
    assert all(torch.equal(v, reference[1][k]) for k, v in weights(model).items())
    assert metric_steps(run) == [1, 2, 3, 4]


def test_resume_of_an_out_dir_without_a_run_says_nothing_to_resume_and_creates_nothing(
    make_run, tmp_path
):
    run = make_run(**SMALL, out="never")
    with pytest.raises(ValueError) as info:
        train(*fresh(run), run, resume=True)
    line = one_line(info.value)
    assert line.startswith(f"--resume: nothing to resume in out_dir {run.train.out_dir!r}")
    assert "does not exist" in line and "without --resume" in line
    assert not Path(run.train.out_dir).exists()
    (tmp_path / "empty").mkdir()
    run = make_run(**SMALL, out="empty")
    with pytest.raises(ValueError, match="nothing to resume.*holds no run"):
        train(*fresh(run), run, resume=True)
    assert not list((tmp_path / "empty").iterdir())


def full_disk_in_best(file: str, error: Exception):
    """A `_write_file` that fails with `error` on `file` of the first best save (step 4), as
    the writer itself reports a full disk: torch.save a RuntimeError, safetensors its own
    error, Python's open() an OSError (issue 31)."""
    real = ckpt._write_file

    def write_file(path, write):
        path = Path(path)
        if path.name == file and path.parent.name == "best.tmp":
            path.write_bytes(b"partial")  # what the writer got onto the disk before it failed
            raise error
        return real(path, write)

    return write_file


TORCH_FULL = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
SAFETENSORS_FULL = ckpt.SafetensorError(
    "Error while serializing: I/O error: No space left on device"
)


@pytest.mark.parametrize(
    "file, error",
    [
        ("optimizer.pt", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))),
        ("optimizer.pt", TORCH_FULL),
        ("model.safetensors", SAFETENSORS_FULL),
    ],
    ids=["oserror", "torch-runtimeerror", "safetensors-error"],
)
def test_a_full_disk_in_a_writer_is_one_line_naming_the_file(make_run, monkeypatch, file, error):
    kw = dict(SMALL, steps=6, ckpt_every=2, eval_every=4)  # step 4: step_000004/, then best/
    run = make_run(**kw)
    reference = uninterrupted(make_run(out="reference", **kw))
    root = Path(run.train.out_dir) / "checkpoints"
    with monkeypatch.context() as m:
        m.setattr(ckpt, "_write_file", full_disk_in_best(file, error))
        m.setattr(ckpt, "_free_bytes", lambda path: 0, raising=False)  # the file system is full
        with pytest.raises(OSError) as info:
            train(*fresh(run), run)
    line = one_line(info.value)
    assert info.value.errno == errno.ENOSPC
    assert "no space left" in line.lower(), line
    assert f"{file} in {root / 'best'}" in line, line
    assert f"last good checkpoint is {root / 'step_000004'}" in line, line
    assert "cannot read" not in line
    assert not list(root.glob("*.tmp"))  # the partial best.tmp gave its space back
    assert_tidy(root)
    assert_resumes_exactly(run, reference)


def test_a_writer_bug_is_not_called_a_full_disk(make_run, monkeypatch):
    """A RuntimeError of a writer on a disk with room is a bug: raised as it is (tmp removed)."""
    run = make_run(**SMALL, steps=4, ckpt_every=2, eval_every=4)
    root = Path(run.train.out_dir) / "checkpoints"
    with monkeypatch.context() as m:
        m.setattr(ckpt, "_write_file", full_disk_in_best("optimizer.pt", RuntimeError("a bug")))
        with pytest.raises(RuntimeError, match="a bug"):
            train(*fresh(run), run)
    assert not list(root.glob("*.tmp"))


def tmpfs(path: Path, size: str) -> Path:
    """A `size` tmpfs mounted at `path` (root only), or skip."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("size, d_model", [("5m", 64), ("3m", 48)])
def test_a_real_full_disk_keeps_the_last_good_checkpoint(make_run, tmp_path, size, d_model):
    """A run whose checkpoints outgrow a tiny file system: one line naming the file and the
    directory, no partial save left, the last good checkpoint resumes exactly (issue 31)."""
    disk = tmpfs(tmp_path / "disk", size)
    model = {"dropout": 0.1, "d_model": d_model}  # a step checkpoint fits, not every save
    kw = dict(SMALL, model=model, steps=8, ckpt_every=2, eval_every=2)
    run = make_run(out="disk/run", **kw)
    reference = uninterrupted(make_run(out="reference", **kw))
    try:
        with pytest.raises(OSError) as info:
            train(*fresh(run), run)
        line = one_line(info.value)
        assert info.value.errno == errno.ENOSPC, line
        assert "no space left" in line.lower() and str(disk / "run" / "checkpoints") in line, line
        assert "cannot read" not in line
        root = Path(run.train.out_dir) / "checkpoints"
        assert not list(root.glob("*.tmp")), sorted(p.name for p in root.iterdir())
        latest = CheckpointDir(root).latest()
        assert latest is not None, line
        assert_good_checkpoint(latest)
        copy = make_run(out="copy", **kw)  # resumed where there is room
        shutil.copytree(disk / "run", copy.train.out_dir)
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)
    assert_resumes_exactly(copy, reference)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_out_dir_fails_at_once_and_keeps_the_run(make_run):
    run = make_run(**SMALL, steps=4, ckpt_every=2)
    reference = uninterrupted(make_run(out="reference", **SMALL, steps=4, ckpt_every=2))
    short = make_run(**SMALL, steps=2, ckpt_every=2)
    train(*fresh(short), short)
    out = Path(run.train.out_dir)
    paths = [out, *out.rglob("*")]
    modes = {p: p.stat().st_mode for p in paths}
    for p in paths:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        with pytest.raises(PermissionError, match="cannot write in out_dir") as info:
            train(*fresh(run, 99), run, resume=True)
        one_line(info.value)
    finally:
        for p in reversed(paths):
            p.chmod(modes[p])
    assert_resumes_exactly(run, reference)


@pytest.mark.parametrize("where", ["out_dir", "checkpoint"])
def test_a_read_only_file_system_keeps_the_run(make_run, monkeypatch, where):
    """As above, where the permission bits cannot say no (root): the writes fail with EROFS."""
    run = make_run(**SMALL, steps=4, ckpt_every=2)
    reference = uninterrupted(make_run(out="reference", **SMALL, steps=4, ckpt_every=2))
    short = make_run(**SMALL, steps=2, ckpt_every=2)
    train(*fresh(short), short)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(args[0]))

    with monkeypatch.context() as m:
        if where == "out_dir":
            m.setattr(Path, "write_text", read_only)
            match = "cannot write in out_dir"
        else:
            m.setattr(ckpt, "_write_file", read_only)
            match = "could not save the step-4 checkpoint"
        with pytest.raises(OSError, match=match) as info:
            train(*fresh(run, 99), run, resume=True)
    assert "Read-only file system" in one_line(info.value)
    assert_resumes_exactly(run, reference)


# --- Ctrl-C -------------------------------------------------------------------------------------


def interrupt_after(step: int):
    def callback(state, record):
        if state.step == step:
            raise KeyboardInterrupt

    return callback


class InterruptedMidStep:
    """Wraps a task: Ctrl-C arrives in the middle of training step `at` (its last micro-batch)."""

    def __init__(self, task, at: int, grad_accum: int):
        self.task, self.tokenizer, self.calls = task, task.tokenizer, 0
        self.when = (at - 1) * grad_accum + grad_accum

    def __getattr__(self, name):
        return getattr(self.task, name)

    def loss_sum(self, model, batch):
        self.calls += 1
        if self.calls == self.when:
            raise KeyboardInterrupt
        return self.task.loss_sum(model, batch)


@pytest.mark.parametrize("when", ["after step 3", "during step 4"])
def test_ctrl_c_saves_the_last_completed_step(make_run, when):
    kw = dict(SMALL, steps=6, ckpt_every=1000, grad_accum=2)
    run = make_run(**kw)
    reference = uninterrupted(make_run(out="reference", **kw))
    model, task = fresh(run)
    with pytest.raises(KeyboardInterrupt):
        if when == "after step 3":
            train(model, task, run, callbacks=(interrupt_after(3),))
        else:
            train(model, InterruptedMidStep(task, at=4, grad_accum=2), run)
    root = Path(run.train.out_dir) / "checkpoints"
    assert CheckpointDir(root).latest() == root / "step_000003"
    assert_tidy(root)
    assert_resumes_exactly(run, reference)


def sigterm_after(step: int):
    def callback(state, record):
        if state.step == step:
            os.kill(os.getpid(), signal.SIGTERM)

    return callback


def test_sigterm_saves_the_last_completed_step_and_says_so(make_run, capsys):
    """SIGTERM (schedulers, containers) stops a run as Ctrl-C does: step 3 is saved, the run
    says where, and --resume says which step it continues from (issue 31)."""
    kw = dict(SMALL, steps=6, ckpt_every=1000)
    run = make_run(**kw)
    reference = uninterrupted(make_run(out="reference", **kw))
    model, task = fresh(run)
    with pytest.raises(KeyboardInterrupt), sigterm_as_ctrl_c():
        train(model, task, run, callbacks=(sigterm_after(3),))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back
    root = Path(run.train.out_dir) / "checkpoints"
    assert CheckpointDir(root).latest() == root / "step_000003"
    assert f"saved step 3 in {root}: continue with --resume" in capsys.readouterr().out
    assert_resumes_exactly(run, reference)
    assert "resuming from step 3" in capsys.readouterr().out


def small_cli_run(tmp_path, tiny_text, *extra) -> list[str]:
    """`attnlab train` arguments of a 3-step run of a one-layer llama-tiny."""
    return [
        *("train", "--preset", "llama-tiny", "--data.source", str(tiny_text)),
        *("--data.cache_dir", str(tmp_path / "c"), "--train.out_dir", str(tmp_path / "run")),
        *("--train.steps", "3", "--train.context", "16", "--train.device", "cpu"),
        *("--train.progress", "false", "--train.sample_tokens", "0", "--model.n_layers", "1"),
        *("--train.eval_batches", "1", "--train.log_every", "1"),
        *extra,
    ]


def test_the_cli_reports_a_full_disk_in_torch_save_in_one_line(
    tmp_path, tiny_text, monkeypatch, capsys
):
    """torch.save's RuntimeError on a full disk reached the user as a traceback (issue 31)."""
    monkeypatch.setattr(ckpt, "_write_file", full_disk_in_best("optimizer.pt", TORCH_FULL))
    monkeypatch.setattr(ckpt, "_free_bytes", lambda path: 0, raising=False)
    assert main(small_cli_run(tmp_path, tiny_text, "--train.eval_every", "1")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    best = tmp_path / "run" / "checkpoints" / "best"
    assert f"No space left on device writing optimizer.pt in {best}" in err, err
    assert "free some space" in err


def test_the_cli_says_sigterm_not_ctrl_c(tmp_path, tiny_text, monkeypatch, capsys):
    """`attnlab train` stopped by a real SIGTERM: it saves, says where, and reports SIGTERM
    (exit 143), not Ctrl-C (issue 31)."""
    import attnlab.cli.train as cli_train

    real = cli_train.train
    monkeypatch.setattr(
        cli_train, "train", lambda *a, **kw: real(*a, **kw, callbacks=(sigterm_after(1),))
    )
    assert main(small_cli_run(tmp_path, tiny_text)) == 143
    captured = capsys.readouterr()
    assert captured.err.strip() == "attnlab train: interrupted (SIGTERM)", captured.err
    assert "Ctrl-C" not in captured.err + captured.out
    assert "saved step 1 in" in captured.out
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_during_the_update_waits_and_is_still_sigterm():
    """A real SIGTERM inside the optimizer step: the step finishes, then a KeyboardInterrupt
    that says SIGTERM (loop.Terminated)."""
    done = []
    with sigterm_as_ctrl_c(), pytest.raises(KeyboardInterrupt) as info:
        with _interrupts_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("the rest of the update")
    assert done == ["the rest of the update"]
    assert getattr(info.value, "how", None) == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_ctrl_c_during_the_update_waits_until_it_is_applied():
    """A real SIGINT inside the optimizer step: the step finishes, then KeyboardInterrupt."""
    # Python's own handler, as in a terminal: a process started in the background by a shell
    # without job control (`cmd &` in a script) inherits SIGINT ignored and has no handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    done = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with _interrupts_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("the rest of the update")
        assert done == ["the rest of the update"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


# --- the command line ---------------------------------------------------------------------------


@pytest.mark.slow
def test_the_cli_refuses_a_second_run_unless_overwrite_or_resume(tmp_path, tiny_text, capsys):
    def train_args(steps: int) -> list[str]:
        return [
            *("train", "--preset", "llama-tiny", "--data.source", str(tiny_text)),
            *("--data.cache_dir", str(tmp_path / "c"), "--train.out_dir", str(tmp_path / "run")),
            *("--train.steps", str(steps), "--train.context", "16", "--train.device", "cpu"),
            *("--train.progress", "false", "--train.sample_tokens", "0"),
            *("--train.eval_batches", "1", "--train.schedule", "constant"),
        ]

    assert main(train_args(2)) == 0
    capsys.readouterr()
    assert main(train_args(2)) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--resume" in err and "--overwrite" in err, err
    assert main([*train_args(2), "--overwrite"]) == 0
    assert main([*train_args(3), "--resume"]) == 0
