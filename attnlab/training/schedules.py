"""Learning-rate schedules as pure functions of the step (no state to save or restore).

- cosine: linear warm-up to `lr`, then a half cosine down to `min_lr` at `steps` (Loshchilov &
  Hutter 2017; the GPT-3 / nanoGPT schedule).
- noam: lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (Vaswani et al. 2017, eq. 3), with
  steps counted from 1.
- constant: linear warm-up, then `lr`.

Two warm-up conventions (`TrainConfig.warmup_convention`), for cosine and constant; step s is
0-based and W is `warmup`:
- "attnlab": lr * (s + 1) / W, so the first step already trains (at lr / W) and step W - 1
  reaches lr.
- "transformers": lr * s / W, as transformers' get_cosine_schedule_with_warmup and
  get_constant_schedule_with_warmup: step 0 runs at lr 0 (an update that changes nothing but
  AdamW's moments) and step W reaches lr. Use it to reproduce a run trained with HF's Trainer.
"""

import math

from attnlab.training.config import TrainConfig

WARMUP_OFFSET = {"attnlab": 1, "transformers": 0}  # step s warms up as (s + offset) / W


def warmup_fraction(step: int, warmup: int, convention: str = "attnlab") -> float:
    """The fraction of `lr` at `step` (0-based) of a linear warm-up over `warmup` steps."""
    return min(1.0, (step + WARMUP_OFFSET[convention]) / warmup) if warmup else 1.0


def cosine_lr(
    step: int, lr: float, min_lr: float, warmup: int, steps: int, convention: str = "attnlab"
) -> float:
    if step < warmup:
        return lr * warmup_fraction(step, warmup, convention)
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    n = step + 1  # the paper counts from step 1
    return factor * d_model**-0.5 * min(n**-0.5, n * warmup**-1.5)


def constant_lr(step: int, lr: float, warmup: int, convention: str = "attnlab") -> float:
    return lr * warmup_fraction(step, warmup, convention)


def lr_at(step: int, cfg: TrainConfig, d_model: int) -> float:
    """The learning rate of `step` (0-based) under `cfg.schedule` (noam: cfg.lr is its factor)
    and, for cosine and constant, `cfg.warmup_convention`."""
    if cfg.schedule == "cosine":
        return cosine_lr(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps, cfg.warmup_convention)
    if cfg.schedule == "noam":
        return noam_lr(step, d_model, max(1, cfg.warmup), cfg.lr)
    return constant_lr(step, cfg.lr, cfg.warmup, cfg.warmup_convention)
