"""The engine interface shared by the continuous-batching `Engine` (engine.py), the one-at-a-time
`SequentialEngine` (sequential.py) and the HTTP server (app.py)."""

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # stop strings (text); the matched text is not returned
    stop_token_ids: tuple[int, ...] = ()  # e.g. the tokenizer's <eos>
    seed: int | None = None  # per-request generator: same seed, same tokens, batched or alone
    logprobs: int | None = None  # top-k alternatives per generated token (0 = just the chosen)
    prompt_logprobs: bool = False  # log p(prompt token i | tokens < i) for i >= 1 (echo + logprobs)


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int | None  # None only on a final event that carries no new token
    logprob: float | None
    top_logprobs: dict[int, float] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "cancelled" | "error"
    prompt_logprobs: tuple[float | None, ...] | None = None  # on the first event only, if asked
    error: str | None = None  # with finish_reason "error": one line
    # With prompt_logprobs: each prompt position's top `logprobs` alternatives and its own token
    # ({id: log p}; None for the first), as vLLM returns them (lm-eval reads is_greedy here).
    prompt_top: tuple[dict[int, float] | None, ...] | None = None


class QueueFull(Exception):
    """submit() when the waiting queue is at its bound -> HTTP 429."""


class EngineStopped(Exception):
    """submit() after stop() began -> HTTP 503."""


def prompt_scores(
    logits: Tensor, targets: Tensor, k: int | None
) -> tuple[list[float], list[dict[int, float]]]:
    """Score prompt tokens: logits (m, V) at the positions before targets (m,).

    Returns:
        each target's log p, and per position {id: log p} of the k most likely tokens and the
        target itself (the model's real alternatives, not the prompt token alone).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (m, V)
    picked = logp.gather(1, targets[:, None])[:, 0].tolist()  # (m,)
    values, ids = logp.topk(min(k or 0, logp.shape[-1]), dim=-1)  # (m, k)
    tops = [
        dict(zip(i, v)) | {t: lp}
        for i, v, t, lp in zip(ids.tolist(), values.tolist(), targets.tolist(), picked)
    ]
    return picked, tops
