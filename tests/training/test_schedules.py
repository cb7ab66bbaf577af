"""Learning-rate schedules against their formulas, computed by hand here."""

import math
from dataclasses import replace
from functools import partial

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab.training.config import TrainConfig
from attnlab.training.schedules import constant_lr, cosine_lr, lr_at, noam_lr

LR, MIN_LR, WARMUP, STEPS = 1e-3, 1e-4, 10, 110


def test_cosine_warmup_is_linear_from_lr_over_warmup_to_lr():
    assert cosine_lr(0, LR, MIN_LR, WARMUP, STEPS) == pytest.approx(LR / WARMUP)
    assert cosine_lr(4, LR, MIN_LR, WARMUP, STEPS) == pytest.approx(LR * 5 / WARMUP)
    assert cosine_lr(WARMUP - 1, LR, MIN_LR, WARMUP, STEPS) == pytest.approx(LR)
    assert cosine_lr(WARMUP, LR, MIN_LR, WARMUP, STEPS) == pytest.approx(LR)  # cosine starts


def test_cosine_mid_decay_and_end():
    # 30 steps into 100 steps of decay: min + (lr - min) * (1 + cos(pi * 0.3)) / 2.
    want = MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * 0.3)) / 2
    assert cosine_lr(WARMUP + 30, LR, MIN_LR, WARMUP, STEPS) == pytest.approx(want, rel=1e-12)
    halfway = cosine_lr(WARMUP + 50, LR, MIN_LR, WARMUP, STEPS)
    assert halfway == pytest.approx((LR + MIN_LR) / 2, rel=1e-12)
    assert cosine_lr(STEPS, LR, MIN_LR, WARMUP, STEPS) == pytest.approx(MIN_LR, rel=1e-12)
    assert cosine_lr(STEPS + 50, LR, MIN_LR, WARMUP, STEPS) == pytest.approx(MIN_LR, rel=1e-12)


@given(st.integers(0, 500), st.integers(0, 50), st.integers(1, 400))
def test_cosine_stays_between_min_lr_and_lr_and_decays(step, warmup, steps):
    lr = cosine_lr(step, LR, MIN_LR, warmup, steps)
    assert 0 < lr <= LR * (1 + 1e-12)
    if step >= warmup:
        assert MIN_LR * (1 - 1e-12) <= lr
        assert cosine_lr(step + 1, LR, MIN_LR, warmup, steps) <= lr * (1 + 1e-12)


def test_noam_is_vaswani_eq_3():
    """lrate = d_model^-0.5 * min(step_num^-0.5, step_num * warmup_steps^-1.5), step_num from 1."""
    d_model, warmup = 512, 4000
    for step_num in (1, 100, 3999, 4000, 4001, 20000):
        want = d_model**-0.5 * min(step_num**-0.5, step_num * warmup**-1.5)
        assert noam_lr(step_num - 1, d_model, warmup) == pytest.approx(want, rel=1e-12)
    # The peak, at step_num == warmup: d_model^-0.5 * warmup^-0.5 (about 7e-4 for the base model).
    peak = noam_lr(warmup - 1, d_model, warmup)
    assert peak == pytest.approx(d_model**-0.5 * warmup**-0.5, rel=1e-12)
    assert peak == max(noam_lr(s, d_model, warmup) for s in range(10_000))
    assert noam_lr(warmup - 1, d_model, warmup, factor=2.0) == pytest.approx(2 * peak)


def test_constant_lr():
    assert constant_lr(0, LR, WARMUP) == pytest.approx(LR / WARMUP)
    assert constant_lr(WARMUP - 1, LR, WARMUP) == pytest.approx(LR)
    assert constant_lr(10_000, LR, WARMUP) == LR
    assert constant_lr(0, LR, 0) == LR


def test_lr_at_dispatches_on_the_schedule():
    cfg = TrainConfig(lr=LR, min_lr=MIN_LR, warmup=WARMUP, steps=STEPS)
    assert lr_at(40, cfg, 64) == cosine_lr(40, LR, MIN_LR, WARMUP, STEPS)
    noam = TrainConfig(schedule="noam", lr=2.0, min_lr=0.0, warmup=WARMUP)
    assert lr_at(40, noam, 64) == pytest.approx(2.0 * 64**-0.5 * min(41**-0.5, 41 * 10**-1.5))
    constant = TrainConfig(schedule="constant", lr=LR, min_lr=0.0, warmup=WARMUP)
    assert lr_at(3, constant, 64) == pytest.approx(LR * 4 / WARMUP)


def _hf_lrs(make_scheduler, steps: int) -> list[float]:
    """The learning rate transformers' scheduler gives each optimizer step, stepped as HF's
    Trainer steps it: optimizer.step(), then scheduler.step()."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=LR)
    scheduler = make_scheduler(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.hf
@pytest.mark.parametrize("warmup", [0, 1, WARMUP])
def test_transformers_warmup_convention_equals_transformers_schedulers(warmup):
    """warmup_convention="transformers" gives, step by step, the learning rate of transformers'
    get_cosine_schedule_with_warmup (min_lr 0), get_cosine_with_min_lr_schedule_with_warmup
    and get_constant_schedule_with_warmup."""
    optimization = pytest.importorskip("transformers.optimization")
    hf = partial(TrainConfig, lr=LR, warmup=warmup, steps=STEPS, warmup_convention="transformers")
    cases = [
        (
            hf(min_lr=0.0),
            lambda o: optimization.get_cosine_schedule_with_warmup(o, warmup, STEPS),
        ),
        (
            hf(min_lr=MIN_LR),
            lambda o: optimization.get_cosine_with_min_lr_schedule_with_warmup(
                o, warmup, STEPS, min_lr=MIN_LR
            ),
        ),
        (
            hf(schedule="constant", min_lr=0.0),
            lambda o: optimization.get_constant_schedule_with_warmup(o, warmup),
        ),
    ]
    for cfg, make_scheduler in cases:
        ours = [lr_at(step, cfg, 64) for step in range(STEPS)]
        assert ours == pytest.approx(_hf_lrs(make_scheduler, STEPS), rel=1e-12, abs=1e-15)
    if warmup:  # the two conventions differ in the warm-up only: one step apart
        attnlab = replace(cases[0][0], warmup_convention="attnlab")
        assert lr_at(0, cases[0][0], 64) == 0.0
        assert lr_at(0, attnlab, 64) == pytest.approx(LR / warmup)
        for step in range(warmup - 1):
            assert lr_at(step, attnlab, 64) == lr_at(step + 1, cases[0][0], 64)


def test_noam_refuses_the_transformers_warmup_convention():
    with pytest.raises(ValueError, match="warmup_convention='transformers' applies to the cosine"):
        TrainConfig(schedule="noam", min_lr=0.0, warmup_convention="transformers")
