"""The engine interface shared by the continuous-batching `Engine` (engine.py), the one-at-a-time
`SequentialEngine` (sequential.py) and the HTTP server (app.py)."""

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.adapters.multi_lora import adapter_rows
from attnlab.inference.constraints import Constraint
from attnlab.inference.sampling import SamplingConfig


@dataclass(frozen=True)
class EngineConfig:
    """The settings of an engine, the one home of their defaults, passed whole to `Engine` and
    `SequentialEngine` (which reads max_queue, max_context and kv_cache_dtype only: one request
    runs at a time, in a cache of its own).

    Args:
        max_batch: most sequences decoded together.
        block_size: tokens per KV block.
        kv_cache_memory: bytes of the batched engine's KV pool (default `default_kv_memory`:
            KV_MEMORY, or KV_SHARE of the memory available at start, whichever is smaller).
            Its blocks are touched as they are first used, so a quiet server holds less.
        n_blocks: blocks in the pool, instead of kv_cache_memory.
        max_queue: waiting requests beyond this make `submit` raise QueueFull.
        prefill_chunk: most prompt tokens prefilled per step (longer prompts take several).
        max_context: most prompt + generated tokens per request (default: the model's position
            table; a model without one needs max_context or n_blocks).
        prefix_caching: share the KV blocks of prompt prefixes seen before (scheduler.py).
        compile_attention: decode steps attend through a compiled kernel that reads the pool in
            place (accel/paged_attention.py; compiled by `start`, or by the first `step`).
        compile_decode: each decode step is one compiled graph of the whole model over the pool
            (accel/paged_step.py, its attention included; compiled by `start`, or the first
            `step`); not with LoRA adapters, a prefix-tuned model or a quantized KV cache.
        threads: intra-op threads of the engine's steps (default: torch.get_num_threads() then).
        kv_cache_dtype: of the KV cache (None: the model's; torch.int8 or torch.float8_e4m3fn:
            8-bit codes and scales, components/kv_cache.py; not with compile_attention).
    """

    max_batch: int = 16
    block_size: int = 16
    kv_cache_memory: int | None = None
    n_blocks: int | None = None
    max_queue: int = 64
    prefill_chunk: int = 256
    max_context: int | None = None
    prefix_caching: bool = True
    compile_attention: bool = False
    compile_decode: bool = False
    threads: int | None = None
    kv_cache_dtype: torch.dtype | None = None


DEFAULT_ENGINE = EngineConfig()  # frozen, so one shared default instance is safe

KV_MEMORY = 1 << 30  # the KV pool's default: 1 GiB (SmolLM2-135M, fp32: 23,296 tokens) ...
KV_SHARE = 0.1  # ... or a tenth of the memory available at start, if that is less


def available_memory(device: torch.device) -> int | None:
    """Bytes the machine can still give a new allocation on `device`: the GPU's free memory,
    Linux's MemAvailable (free memory plus the page cache it can drop); None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # in kB
    except OSError:
        pass
    return None


def default_kv_memory(device: torch.device) -> int:
    """The KV pool's budget when none is given: KV_MEMORY, or KV_SHARE of the available memory
    if that is smaller."""
    available = available_memory(device)
    return KV_MEMORY if available is None else min(KV_MEMORY, int(KV_SHARE * available))


@dataclass(frozen=True)
class SamplingParams:
    """One request's parameters, as the API names them (the sampler's are SamplingConfig's:
    `sampling()`)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # stop strings (text); the matched text is not returned
    stop_token_ids: tuple[int, ...] = ()  # e.g. the tokenizer's <eos>
    seed: int | None = None  # per-request generator: same seed, same tokens, batched or alone
    logprobs: int | None = None  # top-k alternatives per generated token (0 = just the chosen)
    prompt_logprobs: bool = False  # log p(prompt token i | tokens < i) for i >= 1 (echo + logprobs)
    top_k: int = -1  # -1 or 0: off (vLLM's)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0  # stop_token_ids cannot be chosen before this many tokens (vLLM's)
    ignore_eos: bool = False  # the server adds no <eos> (or end of turn) to stop_token_ids
    constraint: Constraint | None = None  # JSON schema / regex / choices (inference/constraints.py)

    def sampling(self) -> SamplingConfig:
        """The sampler these parameters ask for; a one-line ValueError names a bad value."""
        return SamplingConfig(
            temperature=self.temperature,
            top_k=self.top_k if self.top_k > 0 else None,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
        )


def check_params(p: SamplingParams, vocab_size: int) -> None:
    """A one-line ValueError for sampling parameters no engine can run (both engines' check)."""
    p.sampling()
    if p.top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 0, got {p.top_k}")
    if p.logprobs is not None and not 0 <= p.logprobs <= vocab_size:
        raise ValueError(f"logprobs must be in [0, {vocab_size}], got {p.logprobs}")
    if not 0 <= p.min_tokens <= p.max_tokens:
        raise ValueError(
            f"min_tokens must be in [0, max_tokens={p.max_tokens}], got {p.min_tokens}"
        )
    if p.constraint is not None and not p.stop_token_ids:
        raise ValueError("a constrained reply needs a stop token to end on: leave out ignore_eos")
    for name, ids in (
        ("logit_bias", [t for t, _ in p.logit_bias]),
        ("stop_token_ids", p.stop_token_ids),
    ):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    adapter: int = 0  # the LoRA adapter of the request (adapters/multi_lora.py); 0: the base


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


class Jobs:
    """Work handed to an engine's thread, run there between two of its steps (`run_job`).

    The model is shared: the engine's thread runs its forwards, and anything else that runs the
    model, or changes it for a while, must not do so beside a step. Capture hooks installed from
    an HTTP handler's thread, say, would fire inside the live batch's forwards (wrong maps, a
    slower step) and race with them. A job runs on the engine's thread instead, where no step
    runs at the same time, with the engine's thread count, and sees the base model: no LoRA
    adapter rows set (adapters/multi_lora.py), whatever request it runs between.

        future = engine.run_job(fn)     # any thread: queued under the engine's lock
        ...                             # engine thread, between two steps: fn() runs
        future.result()                 # fn's value, or the exception it raised

    `close` (the engine's stop) fails the jobs still waiting with EngineStopped and refuses
    new ones, so no caller waits for a job that will never run.
    """

    def __init__(self, lock: threading.Condition, model: nn.Module):
        self.lock, self.model = lock, model  # the engine's condition (an RLock inside)
        self._waiting: deque[tuple[Callable[[], Any], Future]] = deque()
        self._closed = False

    def __bool__(self) -> bool:
        """Whether jobs are waiting (read it under the lock)."""
        return bool(self._waiting)

    def add(self, fn: Callable[[], Any]) -> Future:
        """Queue fn and wake the engine; EngineStopped once the engine is stopping."""
        future: Future = Future()
        with self.lock:
            if self._closed:
                raise EngineStopped("the engine is shutting down: it runs no more jobs")
            self._waiting.append((fn, future))
            self.lock.notify()
        return future

    def run(self) -> None:
        """Run every waiting job, in order, on this thread (the engine's), each on the base."""
        with self.lock:
            jobs, self._waiting = list(self._waiting), deque()
        for fn, future in jobs:
            if not future.set_running_or_notify_cancel():
                continue  # the caller cancelled it before it ran
            try:
                with adapter_rows(self.model, None):
                    result = fn()
            except Exception as err:  # the caller's to handle, not the engine's
                future.set_exception(err)
            else:
                future.set_result(result)

    def close(self) -> None:
        """Fail the waiting jobs (EngineStopped) and refuse new ones."""
        with self.lock:
            self._closed = True
            jobs, self._waiting = list(self._waiting), deque()
        for _, future in jobs:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStopped("the engine stopped before the job ran"))


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
