"""Training runs the plain path unless an accelerator is asked for (attnlab/accel/): no
process-wide allocator change, no parameter storage moved, and each switch does what it says."""

import pytest
import torch

import attnlab.training.loop as loop
from attnlab.accel.flat_adamw import FlatAdamW
from attnlab.cli.report import accelerators_line
from attnlab.models.build import build_model
from attnlab.training.config import TrainConfig
from attnlab.training.loop import train
from attnlab.training.tasks import build_task


def _spy(monkeypatch, name) -> list:
    """Record the calls of loop.<name> (and still make them)."""
    calls, real = [], getattr(loop, name)

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, name, spy)
    return calls


def _run(make_run, **train_kw):
    run = make_run("gpt2-tiny", steps=1, **train_kw)
    task = build_task(run)
    torch.manual_seed(0)
    return train(build_model(run.model), task, run)


def test_defaults_turn_on_no_accelerator(make_run, monkeypatch):
    cfg = TrainConfig()
    assert not (cfg.keep_freed_memory or cfg.flat_adamw or cfg.compile)
    mallopt, optimizers = (
        _spy(monkeypatch, "keep_freed_memory"),
        _spy(monkeypatch, "build_optimizer"),
    )
    _run(make_run)
    assert mallopt == []  # glibc's settings left alone
    assert [kw["flat"] for kw in optimizers] == [False]  # torch.optim.AdamW
    assert accelerators_line(cfg) == "accelerators: none"


def test_each_accelerator_is_one_switch(make_run, monkeypatch):
    mallopt = []
    monkeypatch.setattr(loop, "keep_freed_memory", lambda: mallopt.append(1))  # not for real
    built = []
    real = loop.build_optimizer
    monkeypatch.setattr(
        loop, "build_optimizer", lambda *a, **k: built.append(real(*a, **k)) or built[-1]
    )
    _run(make_run, keep_freed_memory=True, flat_adamw=True)
    assert mallopt == [1]
    assert isinstance(built[0], FlatAdamW)
    line = accelerators_line(TrainConfig(keep_freed_memory=True, flat_adamw=True))
    assert line == "accelerators: flat_adamw, keep_freed_memory"


def test_flat_adamw_needs_one_process():
    with pytest.raises(ValueError, match="flat_adamw works in one process only"):
        TrainConfig(flat_adamw=True, distributed="ddp")
