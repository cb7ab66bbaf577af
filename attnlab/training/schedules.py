"""Learning-rate schedules as pure functions of the step (no state to save or restore).

- cosine: linear warm-up to `lr`, then a half cosine down to `min_lr` at `steps` (Loshchilov &
  Hutter 2017; the GPT-3 / nanoGPT schedule).
- noam: lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (Vaswani et al. 2017, eq. 3), with
  steps counted from 1.
- constant: linear warm-up, then `lr`.
"""

import math

from attnlab.training.config import TrainConfig


def cosine_lr(step: int, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    n = step + 1  # the paper counts from step 1
    return factor * d_model**-0.5 * min(n**-0.5, n * warmup**-1.5)


def constant_lr(step: int, lr: float, warmup: int) -> float:
    return lr * min(1.0, (step + 1) / warmup) if warmup else lr


def lr_at(step: int, cfg: TrainConfig, d_model: int) -> float:
    """The learning rate of `step` (0-based) under `cfg.schedule` (noam: cfg.lr is its factor)."""
    if cfg.schedule == "cosine":
        return cosine_lr(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
    if cfg.schedule == "noam":
        return noam_lr(step, d_model, max(1, cfg.warmup), cfg.lr)
    return constant_lr(step, cfg.lr, cfg.warmup)
