"""Choosing the next token: pure functions, logits in, token ids out, no host syncs.

    repetition penalty -> temperature -> top-k -> top-p -> min-p -> softmax -> draw

- temperature: divide logits by t; t -> 0 is greedy (argmax).
- top-k (Fan et al. 2018): keep the k most likely tokens.
- top-p, nucleus (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
  probability reaches p (the token that crosses p is kept).
- min-p (Nguyen et al. 2024): keep tokens whose probability is at least min_p times the top one's.
- repetition penalty (Keskar et al. 2019, CTRL): a token already generated has its logit divided
  by the penalty if positive, multiplied if negative.

Shapes: B batch, V vocab_size, N tokens so far.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

# Probabilities are float32 sums: 0.5 + 0.2 may come out as 0.69999999 or 0.70000005 depending on
# a constant added to the logits (which softmax ignores). Mass or probability within this of the
# threshold counts as reaching it, so top-p and min-p keep the same set for any logit shift.
ROUNDING_TOL = 1e-6


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick tokens. temperature 0 = greedy; None disables a filter."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


def apply_repetition_penalty(logits: Tensor, previous: Tensor, penalty: float) -> Tensor:
    """logits: (B, V); previous: (B, N) ids already in the sequence -> (B, V)."""
    seen = torch.gather(logits, 1, previous)  # (B, N)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(1, previous, seen)


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Set all but the k largest logits of each row to -inf. (B, V) -> (B, V)."""
    kth = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest most-likely set with total probability >= p. (B, V) -> (B, V)."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # (B, V)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    # Drop a token when the tokens before it already reach p (so the crossing token stays).
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= p - ROUNDING_TOL
    drop_sorted[:, 0] = False  # the most likely token always stays (p below the tolerance)
    drop = drop_sorted.scatter(1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: Tensor, min_p: float) -> Tensor:
    """Drop tokens with probability below min_p * (top probability). (B, V) -> (B, V)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # (B, 1)
    return logits.masked_fill(probs < threshold * (1 - ROUNDING_TOL), float("-inf"))


def filter_logits(logits: Tensor, cfg: SamplingConfig, previous: Tensor | None = None) -> Tensor:
    """All of cfg's adjustments in order, before the softmax. (B, V) fp32 -> (B, V)."""
    if cfg.repetition_penalty != 1.0 and previous is not None:
        logits = apply_repetition_penalty(logits, previous, cfg.repetition_penalty)
    if cfg.temperature > 0:
        logits = logits / cfg.temperature
    if cfg.top_k is not None:
        logits = top_k_filter(logits, cfg.top_k)
    if cfg.top_p is not None and cfg.top_p < 1.0:
        logits = top_p_filter(logits, cfg.top_p)
    if cfg.min_p is not None and cfg.min_p > 0:
        logits = min_p_filter(logits, cfg.min_p)
    return logits


def token_distribution(
    logits: Tensor, cfg: SamplingConfig, previous: Tensor | None = None
) -> Tensor:
    """The distribution `sample` draws from, as probabilities: (B, V) logits -> (B, V) fp32.
    Greedy (temperature 0) is the one-hot of the argmax. Speculative decoding compares two of
    these (speculative.py)."""
    logits = filter_logits(logits.float(), cfg, previous)
    if cfg.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits, dim=-1)


def sample(
    logits: Tensor,
    cfg: SamplingConfig,
    previous: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Pick one token per row. logits: (B, V) -> (B,) int64."""
    logits = filter_logits(logits.float(), cfg, previous)
    if cfg.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
