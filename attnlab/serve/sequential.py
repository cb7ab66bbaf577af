"""SequentialEngine: the serving interface (types.py) run one request at a time.

It is the baseline the continuous-batching `Engine` is measured against, and the simplest engine
the server can run: a daemon thread takes the oldest waiting request and runs it to the end with
the steps `attnlab.inference.generate` is made of (prefill into a fresh KV cache, then one decode
step per token, `sample` for the choice), reporting each token as it comes.

    submit ─> waiting queue (bounded) ─> thread: prefill ─> sample ─> on_event ─> decode_step ─> ...

With a `Speculative` (`attnlab serve --speculative`), tokens come from drafting and verifying
instead (inference/speculative.py): batch 1, which is what this engine runs anyway.

Log-probabilities are those of the model itself (log-softmax of its logits), whatever the
temperature or top-p the token was drawn with: what a scorer such as lm-eval asks for.
A request may ask for max_tokens=0 when it wants only its prompt's log-probabilities.
Work that must not run beside a forward (`run_job`, types.py's Jobs) runs on the thread between
two tokens of the running request, or between two requests.
"""

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.adapters.multi_lora import adapter_rows, multi_lora_modules
from attnlab.inference.config import GenerationConfig
from attnlab.inference.constraints import Matcher
from attnlab.inference.generate import context_window
from attnlab.inference.sampling import SamplingRows, TokenCounts, sample
from attnlab.inference.speculative import Speculative
from attnlab.inference.steps import decode_step, decoder_of, fill_cache
from attnlab.serve.types import (
    DEFAULT_ENGINE,
    EngineConfig,
    EngineStopped,
    Jobs,
    QueueFull,
    Request,
    TokenEvent,
    check_params,
    prompt_scores,
)

OnEvent = Callable[[TokenEvent], None]


def context_length(model: nn.Module, max_context: int | None = None) -> int:
    """The most prompt + generated tokens a request may hold: `max_context` or the model's
    position table, the smaller (RoPE and ALiBi models have no table: give max_context, e.g.
    the config's max_seq_len, as `attnlab serve` does)."""
    window, _ = context_window(model, max_context)
    if window is None:
        raise ValueError("this model has no position table: give max_context (e.g. max_seq_len)")
    return window


def check_request(request: Request, vocab_size: int, context: int) -> None:
    """Raise a one-line ValueError for a request no engine can run."""
    p, n = request.params, len(request.prompt_ids)
    if n == 0:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if p.max_tokens < 0 or (p.max_tokens == 0 and not p.prompt_logprobs):
        raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
    if n + p.max_tokens > context:
        raise ValueError(
            f"the prompt ({n} tokens) + max_tokens ({p.max_tokens}) exceeds the model's "
            f"context of {context} tokens: shorten the prompt or lower max_tokens"
        )
    check_params(p, vocab_size)


def token_logprobs(logits: Tensor, token: int, k: int | None):
    """(log p(token), {id: log p} of the k most likely) from one row of logits (V,)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (V,)
    top = None
    if k is not None:
        values, ids = logp.topk(k) if k else (logp[:0], logp[:0].long())
        top = dict(zip(ids.tolist(), values.tolist()))
    return logp[token].item(), top


class SequentialEngine:
    """One request at a time, in arrival order, on a daemon thread (see the module docstring).

    Args:
        model: a decoder-only model in eval mode.
        tokenizer: attnlab.tokenizer.Tokenizer (decodes text for stop strings).
        config: the engine's settings (types.py's EngineConfig): max_queue (waiting requests
            beyond it make `submit` raise QueueFull) and max_context (the most prompt +
            generated tokens of a request; default the model's). The others are the batched
            engine's.
        speculative: decode by drafting and verifying (inference/speculative.py, batch 1,
            which is why it lives in this engine); its counts go to `stats`.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        config: EngineConfig = DEFAULT_ENGINE,
        speculative: Speculative | None = None,
    ):
        self.model, self.tokenizer, self.speculative = model, tokenizer, speculative
        self.max_queue, self.kv_dtype = config.max_queue, config.kv_cache_dtype
        self.context = context_length(model, config.max_context)
        self.vocab_size = decoder_of(model).head.out_features
        self.device = decoder_of(model).head.weight.device
        stacks = multi_lora_modules(model)  # LoRA adapters chosen per request
        self.n_adapters = stacks[0].A.shape[0] - 1 if stacks else 0
        self._waiting: deque[tuple[Request, OnEvent, float]] = deque()  # + arrival time
        self._cancelled: set[str] = set()
        self._running: str | None = None
        self._cond = threading.Condition()
        self._jobs = Jobs(self._cond, model)  # run_job's, run between two tokens
        self._stopping = False
        self._deadline_passed = False
        self._thread: threading.Thread | None = None
        self._stats = dict.fromkeys(
            (
                "prompt_tokens_total",
                "generation_tokens_total",
                "requests_finished_total",
                "time_to_first_token_seconds_sum",
                "time_to_first_token_seconds_count",
            ),
            0.0,
        )

    # --- the interface ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop in a daemon thread."""
        self._thread = threading.Thread(target=self._loop, name="attnlab-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, on_event: OnEvent) -> None:
        """Queue `request`; `on_event` gets each token and, last, one event with finish_reason."""
        check_request(request, self.vocab_size, self.context)
        if not 0 <= request.adapter <= self.n_adapters:
            raise ValueError(
                f"adapter {request.adapter} is not one of the {self.n_adapters} served"
            )
        if self.speculative is not None and request.params.constraint is not None:
            raise ValueError("this server decodes speculatively, which takes no constraint")
        with self._cond:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting: try again later")
            self._waiting.append((request, on_event, time.perf_counter()))
            self._cond.notify()

    def cancel(self, request_id: str) -> None:
        """End `request_id` (waiting or running) with finish_reason "cancelled"."""
        with self._cond:
            for item in self._waiting:
                if item[0].request_id == request_id:
                    self._waiting.remove(item)
                    _finish(item, "cancelled")
                    return
            if self._running == request_id:
                self._cancelled.add(request_id)

    def run_job(self, fn: Callable[[], Any]) -> Future:
        """Run fn() on the engine's thread between two tokens (or two requests), while no
        forward runs (types.py's Jobs; app.py's /v1/attention). Returns a Future of fn's value;
        an engine never started runs fn at once on the caller's thread. EngineStopped once
        stop() has begun (which fails the jobs still waiting)."""
        future = self._jobs.add(fn)
        if self._thread is None:
            self._jobs.run()
        return future

    def stop(self, timeout: float) -> None:
        """Stop admitting, let the queue run for up to `timeout` s, cancel the rest, join.
        Waiting jobs fail at once."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._jobs.close()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:
            self._deadline_passed = True
            while self._waiting:
                _finish(self._waiting.popleft(), "cancelled")
            if self._running is not None:
                self._cancelled.add(self._running)
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def stats(self) -> dict[str, float]:
        """Counters and gauges for /metrics (no paged cache here: kv blocks are 0)."""
        with self._cond:
            return {
                "running": float(self._running is not None),
                "waiting": float(len(self._waiting)),
                "kv_blocks_used": 0.0,
                "kv_blocks_total": 0.0,
                "prefix_cache_hits_total": 0.0,
                "preemptions_total": 0.0,
                **self._stats,
                **self._speculative_stats(),
            }

    def _speculative_stats(self) -> dict[str, float]:
        if self.speculative is None:
            return {}
        s = self.speculative.stats
        return {
            "speculative_rounds_total": float(s.rounds),
            "speculative_draft_tokens_total": float(s.drafted),
            "speculative_accepted_tokens_total": float(s.accepted),
            "speculative_acceptance_rate": s.acceptance_rate,
            "speculative_tokens_per_second": s.tokens_per_second,
        }

    # --- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._jobs and not self._stopping:
                    self._cond.wait()
                if self._deadline_passed or not (self._waiting or self._jobs):
                    return
                item = self._waiting.popleft() if self._waiting else None
                self._running = None if item is None else item[0].request_id
            self._jobs.run()  # run_job's work first (and between the request's tokens)
            if item is not None:
                self._serve(*item)

    def _serve(self, request: Request, on_event: OnEvent, arrived: float) -> None:
        """Run one request to its end through its LoRA adapter; a failure ends it alone."""
        try:
            rows = torch.tensor([request.adapter], device=self.device)
            with adapter_rows(self.model, rows if self.n_adapters else None):
                reason = self._run(request, on_event, arrived)
            if reason != _NO_FINAL:
                on_event(TokenEvent(request.request_id, None, None, None, reason))
        except Exception as e:  # the request fails; the engine keeps serving
            line = f"{type(e).__name__}: {e}".splitlines()[0]
            on_event(TokenEvent(request.request_id, None, None, None, "error", error=line))
        with self._cond:
            self._running = None
            self._cancelled.discard(request.request_id)
            self._stats["requests_finished_total"] += 1

    @torch.no_grad()
    def _run(self, request: Request, on_event: OnEvent, arrived: float) -> str:
        """Generate for one request, sending each token; return the finish reason (or
        _NO_FINAL when the last token carried it). Time to first token counts from `arrived`."""
        p, rid = request.params, request.request_id
        ids = torch.tensor([request.prompt_ids], device=self.device)  # (1, T0)
        self._stats["prompt_tokens_total"] += ids.shape[1]
        prompt_lp = prompt_top = None
        if p.prompt_logprobs:  # a full forward (the cached prefill keeps only the last logits)
            logits = self.model(ids)[0]  # (T0, V)
            lps, tops = prompt_scores(logits[:-1], ids[0, 1:], p.logprobs)
            prompt_lp, prompt_top = (None, *lps), (None, *tops)
        if p.max_tokens == 0:
            final = TokenEvent(rid, None, None, None, "length", prompt_lp, prompt_top=prompt_top)
            on_event(final)
            return _NO_FINAL
        text_ids = []
        for i, (t, logits) in enumerate(self._tokens(ids, p)):
            if rid in self._cancelled:
                return "cancelled"
            lp, top = token_logprobs(logits, t, p.logprobs)
            text_ids.append(t)
            reason = self._finish_reason(t, text_ids, p, i)
            if i == 0:
                self._stats["time_to_first_token_seconds_sum"] += time.perf_counter() - arrived
                self._stats["time_to_first_token_seconds_count"] += 1
            self._stats["generation_tokens_total"] += 1
            first = i == 0
            scored = (prompt_lp, prompt_top) if first else (None, None)
            on_event(TokenEvent(rid, t, lp, top, reason, scored[0], prompt_top=scored[1]))
            if reason is not None:
                return _NO_FINAL
            self._jobs.run()  # between this token and the decode step of the next
        return _NO_FINAL  # unreachable: the last token carries "length"

    def _tokens(self, ids: Tensor, p) -> Iterator[tuple[int, Tensor]]:
        """Each new token of prompt ids (1, T0) with the logits (V,) it was chosen from: plain
        decoding, or speculative (drafted and verified: inference/speculative.py). A decode
        step runs only when the caller asks for the token after."""
        if self.speculative is not None:
            config = GenerationConfig(
                p.max_tokens,
                p.sampling(),
                stop_tokens=p.stop_token_ids,
                seed=p.seed,
                min_new_tokens=p.min_tokens,
            )
            yield from self.speculative.steps(self.model, ids[0].tolist(), config)
            return
        rows = SamplingRows.stack([p.sampling()], self.vocab_size, self.device)
        counts = TokenCounts.of_prompts(ids, self.vocab_size) if rows.needs_counts else None
        stop_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        stop_mask[list(p.stop_token_ids)] = True
        gen = None
        if p.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(p.seed)
        mask = torch.ones_like(ids, dtype=torch.bool)
        logits, cache, slot = fill_cache(
            self.model, ids, mask, p.max_tokens, kv_dtype=self.kv_dtype
        )  # (1, V)
        matcher = None
        if p.constraint is not None:
            matcher = Matcher(p.constraint, self.tokenizer, p.stop_token_ids, self.vocab_size)
        for i in range(p.max_tokens):
            banned = stop_mask if i < p.min_tokens else None
            if matcher is not None:
                allowed = matcher.mask().to(self.device)
                banned = ~allowed if banned is None else banned | ~allowed
            token = sample(logits, rows, counts, gen, banned)  # (1,)
            if matcher is not None:
                matcher.advance(int(token))
            if counts is not None:
                counts.add(token)
            yield int(token), logits[0]
            at = torch.tensor([slot], device=self.device)
            logits = decode_step(self.model, token[:, None], at, cache)
            slot += 1

    def _finish_reason(self, token: int, text_ids: list[int], p, i: int) -> str | None:
        if token in p.stop_token_ids:
            return "stop"
        if p.stop and any(s in self.tokenizer.decode(text_ids) for s in p.stop):
            return "stop"
        return "length" if i == p.max_tokens - 1 else None


_NO_FINAL = ""  # _run already sent the event that carries finish_reason


def _finish(item: tuple[Request, OnEvent, float], reason: str) -> None:
    request, on_event, _ = item
    on_event(TokenEvent(request.request_id, None, None, None, reason))
