"""Engine: continuous batching over a paged KV cache (Yu et al. 2022, Orca; Kwon et al. 2023).

One loop, on a daemon thread, repeats one step for as long as there is work:

    submit ─> waiting (bounded) ─admit─> running ─┬─ prefill a chunk of a new prompt
                                                  ├─ choose each running sequence's next token
                                                  │  (sample; events out; finished ones retire)
                                                  └─ one batched decode step for the rest:
                                                     every row its own length and position

A request never waits for another to finish: it joins the batch at the next step where the
scheduler (scheduler.py, whose docstring states the policy) admits it, and leaves it in the step
where it finishes, giving its KV blocks back at once. Each row's keys live in its own blocks of
the pool (components/paged_kv_cache.py), so rows of very different lengths decode together.

Tokens are chosen by the same sampler as `attnlab.inference.generate`: every running row's
logits go through its own request's settings (top-k, top-p, min-p, penalties, logit bias, the
stop tokens banned before min_tokens) in one batched call (`SamplingRows`, inference/sampling.py),
then each row draws with the request's own generator: a seeded request draws the same tokens
batched or alone.
Log-probabilities are those of the model itself (log-softmax of its logits), whatever the
temperature or top-p the token was drawn with: what a scorer such as lm-eval asks for.

The last token's event carries the finish reason: a stop token is sent (with "stop"), and so is
the token that completes a stop string; cutting the matched text out of the reply is the
caller's, who holds the text.

Faults stay with their request: an exception (or a non-finite logit) while prefilling or
sampling one sequence ends it with finish_reason "error"; a batched decode step that raises is
re-run one row at a time, so only the rows that raise alone fail. A failed sequence's blocks are
zeroed before they go back to the pool.

LoRA adapters served beside the base (`attnlab serve --lora NAME=DIR`) are chosen per request
(`Request.adapter`): every forward runs row b through its sequence's adapter
(adapters/multi_lora.py), so requests for different adapters share one decode step, and the
prefix cache keeps their blocks apart (the same tokens have other keys under another adapter).
A prefix- or prompt-tuned model (adapters/prompt_learning.py) has its learned prefix written
into each sequence's first positions before its prompt (`Sequence.offset`).

Work that must not run beside a forward (`run_job`, types.py's Jobs: app.py's /v1/attention
captures attention maps on the shared model) runs on the engine's thread between two steps.

Shapes: B running sequences, T tokens per row of a step, V vocab_size.
"""

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from attnlab.accel.paged_attention import use_compiled_decode
from attnlab.accel.paged_step import CompiledPagedDecode
from attnlab.adapters.multi_lora import adapter_rows, multi_lora_modules
from attnlab.adapters.prompt_learning import PromptLearningLM
from attnlab.components.paged_kv_cache import PagedKVCache
from attnlab.inference.constraints import Matcher, banned_by
from attnlab.inference.generate import context_window
from attnlab.inference.sampling import SamplingRows, TokenCounts, draw, filter_logits
from attnlab.inference.steps import decoder_of
from attnlab.serve.scheduler import Scheduler, Sequence
from attnlab.serve.types import (
    DEFAULT_ENGINE,
    EngineConfig,
    EngineStopped,
    Jobs,
    Request,
    TokenEvent,
    check_params,
    default_kv_memory,
    prompt_scores,
)

OnEvent = Callable[[TokenEvent], None]


class Engine:
    """Continuous batching of decoder-only generation (see the module docstring).

    Args:
        model: a decoder-only model (eval mode).
        tokenizer: attnlab.tokenizer.Tokenizer, to match stop strings (None: no stop strings).
        config: the engine's settings (types.py's EngineConfig).

    Threads: the engine's steps should be the process's only OpenMP work. When two threads
    each run parallel regions, libgomp keeps a team per thread; with more team threads than
    cores it stops spinning between regions, so every small op then waits for its workers to
    be woken by the kernel (a decode step then takes markedly longer: benchmarks/README.md).
    So `start` runs everything of the engine, the compile included, on its own thread with
    `threads` threads, and a server keeps its other threads to one (cli/serve.py).
    """

    def __init__(self, model: nn.Module, tokenizer, config: EngineConfig = DEFAULT_ENGINE):
        self.decoder = decoder_of(model)
        # a prefix- or prompt-tuned model: its learned prefix first in every sequence's blocks
        self.prefixed = model if isinstance(model, PromptLearningLM) else None
        self.n_prefix = 0 if self.prefixed is None else model.num_virtual_tokens
        if self.decoder is not model and self.prefixed is None:
            raise ValueError(f"the engine serves decoder-only models, got a {type(model).__name__}")
        self.model, self.tokenizer, c = model, tokenizer, config
        self.context, _ = context_window(model, c.max_context)  # None: no limit but the pool's
        n_blocks = c.n_blocks
        if n_blocks is None:
            device = self.decoder.head.weight.device
            budget = c.kv_cache_memory or default_kv_memory(device)
            per_block = c.block_size * PagedKVCache.token_bytes(self.decoder, c.kv_cache_dtype)
            n_blocks = budget // per_block
            if n_blocks < 1:
                raise ValueError(
                    f"a KV pool of {budget} bytes holds no block of {c.block_size} tokens "
                    f"({per_block} bytes): give it more memory"
                )
        if c.compile_attention and c.kv_cache_dtype is not None:
            raise ValueError(
                "the compiled attention reads a float KV pool in place: serve a quantized "
                "KV cache without --compile-attention"
            )
        self.cache = PagedKVCache(self.decoder, n_blocks, c.block_size, c.kv_cache_dtype)
        self.compile_attention, self._prepared = c.compile_attention, False
        self.threads = torch.get_num_threads() if c.threads is None else c.threads
        self.scheduler = Scheduler(
            self.cache, c.max_batch, c.max_queue, c.prefill_chunk, c.prefix_caching
        )
        self.max_queue = c.max_queue  # the server refuses a request that needs more
        self.vocab_size = self.decoder.head.out_features
        self.device = self.decoder.head.weight.device
        # LoRA adapters chosen per request (adapters/multi_lora.py): how many there are
        stacks = multi_lora_modules(model)
        self.n_adapters = stacks[0].A.shape[0] - 1 if stacks else 0
        if c.compile_decode and (self.n_adapters or self.prefixed is not None):
            raise ValueError(
                "the compiled decode step runs the base model alone: serve LoRA adapters or a "
                "prefix-tuned model without it"
            )
        # the whole decode step as one graph (accel/paged_step.py), compiled by _prepare
        self.compiled_decode = (
            CompiledPagedDecode(self.decoder, self.cache) if c.compile_decode else None
        )
        self._active: dict[str, Sequence] = {}  # waiting or running, by request id
        self._cancels: set[str] = set()
        self._cond = threading.Condition()
        self._jobs = Jobs(self._cond, model)  # run_job's, run between two steps
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._counters = dict.fromkeys(
            (
                "prompt_tokens_total",
                "generation_tokens_total",
                "requests_finished_total",
                "prefix_cache_hits_total",
                "preemptions_total",
                "time_to_first_token_seconds_sum",
                "time_to_first_token_seconds_count",
            ),
            0.0,
        )

    # --- the interface ----------------------------------------------------------------------
    def start(self) -> None:
        """Run the engine loop in a daemon thread, once it has prepared itself there (threads,
        compiled attention); a failure to prepare is raised here. A second call does nothing."""
        if self._thread is not None:
            return
        failure: list[BaseException] = []
        prepared = threading.Event()

        def run():
            try:
                self._prepare()
            except BaseException as err:
                failure.append(err)
            prepared.set()
            if not failure:
                self._loop()

        self._thread = threading.Thread(target=run, name="attnlab-engine", daemon=True)
        self._thread.start()
        prepared.wait()
        if failure:
            self._thread = None
            raise failure[0]

    def _prepare(self) -> None:
        """On the thread that runs the steps: its thread count, then what is compiled."""
        torch.set_num_threads(self.threads)
        if self.compile_attention:
            attn = self.decoder.blocks[0].self_attn
            use_compiled_decode(self.cache, attn.n_heads, attn.scale)
        if self.compiled_decode is not None:
            self.compiled_decode.warm_up()
        self._prepared = True

    def submit(self, request: Request, on_event: OnEvent) -> None:
        """Queue `request`; `on_event` gets each token, the last event with finish_reason.

        Raises:
            ValueError: a request no engine could run (one line).  QueueFull: the queue is at
            its bound.  EngineStopped: stop() has begun.
        """
        self._check(request)
        p = request.params
        sampling = p.sampling()
        gen = None if p.seed is None else torch.Generator(self.device).manual_seed(p.seed)
        counts = None
        if sampling.needs_counts:
            prompt = torch.tensor([request.prompt_ids], device=self.device)
            counts = TokenCounts.of_prompts(prompt, self.vocab_size)
        seq = Sequence(
            request,
            on_event,
            sampling,
            gen,
            list(request.prompt_ids),
            len(request.prompt_ids),
            time.perf_counter(),
            counts=counts,
            offset=self.n_prefix,
        )
        if p.constraint is not None:
            seq.matcher = Matcher(p.constraint, self.tokenizer, p.stop_token_ids, self.vocab_size)
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            if request.request_id in self._active:
                raise ValueError(f"request id {request.request_id!r} is already in the engine")
            self.scheduler.add(seq)  # QueueFull at the bound
            self._active[seq.id] = seq
            self._cond.notify()

    def cancel(self, request_id: str) -> None:
        """End `request_id` at the next step with finish_reason "cancelled" (freeing its
        blocks); unknown or finished ids are ignored."""
        with self._cond:
            if request_id in self._active:
                self._cancels.add(request_id)
                self._cond.notify()

    def run_job(self, fn: Callable[[], Any]) -> Future:
        """Run fn() on the engine's thread between two steps, while no forward runs (types.py's
        Jobs: e.g. a forward with capture hooks on the shared model, app.py's /v1/attention).

        Returns:
            a Future of fn's value (or of the exception it raised); an engine never started
            runs fn at once on the caller's thread (the one that drives `step`).

        Raises:
            EngineStopped: stop() has begun (and fails the jobs still waiting).
        """
        future = self._jobs.add(fn)
        if self._thread is None:
            self._jobs.run()
        return future

    def stop(self, timeout: float) -> None:
        """Stop admitting; let the running requests finish for up to `timeout` seconds, cancel
        the rest (and every waiting one), and join the loop. Waiting jobs fail at once."""
        with self._cond:
            self._stopping = True
            self._cancels.update(s.id for s in self.scheduler.waiting)
            self._cond.notify()
        self._jobs.close()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:
            self._cancels.update(self._active)
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        else:  # never started: the caller's thread finishes the work
            self.step()

    def stats(self) -> dict[str, float]:
        """Gauges and counters for /metrics: running, waiting, kv_blocks_used,
        kv_blocks_total, prompt/generation tokens, finished requests, prefix-cache hits
        (prompt tokens whose keys/values were shared, not computed), preemptions (scheduler.py,
        rule 2), time-to-first-token sum and count."""
        with self._cond:
            return {
                "running": float(len(self.scheduler.running)),
                "waiting": float(len(self.scheduler.waiting)),
                "kv_blocks_used": float(self.cache.n_blocks - self.cache.n_free),
                "kv_blocks_total": float(self.cache.n_blocks),
                **self._counters,
            }

    # --- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._active and not self._jobs and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._active:
                    return
            self._jobs.run()  # run_job's work, between two steps
            try:
                self.step()
            except Exception as err:  # a fault of the engine itself: fail what runs, go on
                line = f"{type(err).__name__}: {err}".splitlines()[0]
                with self._cond:
                    for seq in list(self.scheduler.running):
                        self._finish(seq, "error", error=line)

    @torch.no_grad()
    def step(self) -> bool:
        """One engine step: cancellations, admissions, a prefill chunk, the next token of every
        running sequence, one batched decode step. The loop thread calls it; a test may drive an
        engine that was never started by calling it until it returns False.

        Returns:
            whether any request is still waiting or running.
        """
        if not self._prepared:
            self._prepare()
        with self._cond:
            cancels, self._cancels = self._cancels, set()
            for rid in cancels:
                if rid in self._active:
                    self._finish(self._active[rid], "cancelled")
            if not self._stopping:
                for seq in self.scheduler.admit():
                    if not seq.resume_at:
                        self._counters["prompt_tokens_total"] += seq.n_prompt
                        self._counters["prefix_cache_hits_total"] += seq.prefix_hits
            self._counters["preemptions_total"] += len(self.scheduler.make_room())
        for seq, n in self.scheduler.prefill_work():
            self._guarded(seq, self._prefill, seq, n)
        ready = []
        decoding = self.scheduler.decoding()
        for seq, row in zip(decoding, self._filtered(decoding)):
            if self._guarded(seq, self._choose, seq, row):
                ready.append(seq)
        if ready:
            self._decode(ready)
        with self._cond:
            return bool(self._active)

    def _guarded(self, seq: Sequence, fn, *args) -> bool:
        """Run fn(*args) for one sequence; an exception ends that sequence with "error".
        Returns whether the sequence is still running."""
        try:
            return fn(*args) is not False
        except Exception as err:  # the request fails; the engine and the others go on
            line = f"{type(err).__name__}: {err}".splitlines()[0]
            with self._cond:
                self._finish(seq, "error", error=line)
            return False

    def _prefill(self, seq: Sequence, n: int) -> None:
        """Write tokens seq.cached .. seq.cached + n - 1 into the cache (the prompt's, or a
        preempted sequence's tokens so far)."""
        start = seq.cached
        if start == 0 and self.prefixed is not None:  # the learned prefix, before the prompt
            first = self.cache.step([seq.id], [0], self.n_prefix)
            self.prefixed.write_prefix(first, first.slots)
        ids = torch.tensor([seq.tokens[start : start + n]], device=self.device)  # (1, n)
        step = self.cache.step([seq.id], [seq.offset + start], n)
        want_all = seq.request.params.prompt_logprobs and not seq.resume_at  # scored once
        with self._adapters([seq]):
            logits = self.decoder(ids, cache=step, slots=step.slots, last_only=not want_all)[0]
        if want_all:  # logits[i] scores token start + i + 1 of the prompt
            if start == 0:
                seq.prompt_logprobs.append(None)
                seq.prompt_top.append(None)
            m = min(n, seq.n_prompt - 1 - start)  # positions whose next token is in the prompt
            targets = ids.new_tensor(seq.tokens[start + 1 : start + 1 + m])  # (m,)
            lps, tops = prompt_scores(logits[:m], targets, seq.request.params.logprobs)
            seq.prompt_logprobs += lps
            seq.prompt_top += tops
        seq.cached += n
        if self.scheduler.prefix_caching and not seq.offset:
            self.cache.register_prefix(seq.id, seq.tokens, seq.cached, seq.salt)
        if not seq.prefilling:
            seq.logits = logits[-1]  # (V,)

    def _filtered(self, seqs: list[Sequence]) -> list:
        """Each sequence's logits through its own sampler settings, all in one batched call:
        (V,) rows; all None if that call raises (each row is then filtered alone, in its own
        guard, so a fault stays with its request)."""
        if not seqs:
            return []
        try:
            return list(self._filter_rows(seqs))
        except Exception:
            return [None] * len(seqs)

    def _filter_rows(self, seqs: list[Sequence]) -> torch.Tensor:
        """filter_logits over the sequences' logits (B, V), each row with its own settings,
        penalty counts, stop tokens banned until its min_tokens, and constraint's mask."""
        logits = torch.stack([s.logits for s in seqs]).float()  # (B, V)
        rows = SamplingRows.stack([s.sampling for s in seqs], self.vocab_size, self.device)
        counts = None
        if rows.needs_counts:  # a row without penalties reads zeros, which change nothing
            empty = TokenCounts.empty(1, self.vocab_size, self.device)
            counts = TokenCounts.cat([s.counts or empty for s in seqs])
        at = [
            (b, t)
            for b, s in enumerate(seqs)
            if s.n_generated < s.request.params.min_tokens
            for t in s.request.params.stop_token_ids
        ]
        banned = None
        if at:
            banned = torch.zeros_like(logits, dtype=torch.bool)
            banned[tuple(torch.tensor(at, device=self.device).T)] = True
        constrained = banned_by([s.matcher for s in seqs], self.device)  # (B, V) or None
        if constrained is not None:
            banned = constrained if banned is None else banned | constrained
        return filter_logits(logits, rows, counts, banned)

    def _choose(self, seq: Sequence, filtered: torch.Tensor | None) -> bool:
        """Choose seq's next token from its filtered logits (V,) (None: filter them here) and
        send it. Returns whether seq goes on."""
        p = seq.request.params
        first = seq.n_generated == 0
        scored = first and p.prompt_logprobs
        prompt_lp = tuple(seq.prompt_logprobs) if scored else None
        prompt_top = tuple(seq.prompt_top) if scored else None
        if p.max_tokens == 0:  # only the prompt's log-probabilities were asked for
            event = TokenEvent(seq.id, None, None, None, "length", prompt_lp, prompt_top=prompt_top)
            with self._cond:
                self._finish(seq, "length", event=event)
            return False
        logits = seq.logits
        if not bool(torch.isfinite(logits).all()):
            raise FloatingPointError("the model's logits are not finite (NaN or inf)")
        if filtered is None:
            filtered = self._filter_rows([seq])[0]
        token = int(draw(filtered[None], seq.sampling.temperature == 0, seq.generator))
        if seq.counts is not None:
            seq.counts.add(torch.tensor([token], device=self.device))
        if seq.matcher is not None:
            seq.matcher.advance(token)
        # log p(v) = logit(v) - logsumexp(logits): the whole (V,) log-softmax only for top-k.
        logits = logits.float()
        log_z = torch.logsumexp(logits, dim=-1)
        top = None
        if p.logprobs is not None:
            top = {}
            if p.logprobs > 0:
                values, ids = (logits - log_z).topk(min(p.logprobs, logits.shape[0]))
                top = dict(zip(ids.tolist(), values.tolist()))
        seq.tokens.append(token)
        seq.logits = None
        reason = self._finish_reason(seq)
        if first:
            seq.first_token = time.perf_counter()
            self._counters["time_to_first_token_seconds_sum"] += seq.first_token - seq.submitted
            self._counters["time_to_first_token_seconds_count"] += 1
        self._counters["generation_tokens_total"] += 1
        lp = float(logits[token] - log_z)
        event = TokenEvent(seq.id, token, lp, top, reason, prompt_lp, prompt_top=prompt_top)
        if reason is not None:
            with self._cond:
                self._finish(seq, reason, event=event)
            return False
        if not self._send(seq, event):
            with self._cond:
                self._finish(seq, "cancelled")
            return False
        return True

    def _finish_reason(self, seq: Sequence) -> str | None:
        """Why a sequence whose last token was just chosen ends ("stop", "length"), or None."""
        p, token = seq.request.params, seq.tokens[-1]
        if token in p.stop_token_ids:
            return "stop"
        if p.stop:
            text = self.tokenizer.decode(seq.tokens[seq.n_prompt :])
            if any(s in text for s in p.stop):
                return "stop"
        return "length" if seq.n_generated >= p.max_tokens else None

    def _decode(self, seqs: list[Sequence]) -> None:
        """One batched decode step: each sequence's last token in, its next logits out. If the
        batch raises, each row is re-run alone (re-writing a row's slot writes the same keys)."""
        try:
            self._forward(seqs)
        except Exception:
            for seq in seqs:
                self._guarded(seq, self._forward, [seq])

    def _forward(self, seqs: list[Sequence]) -> None:
        """Feed each sequence's last token at its own position; keep the next logits."""
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device)  # (B, 1)
        step = self.cache.step([s.id for s in seqs], [s.offset + s.cached for s in seqs], 1)
        if self.compiled_decode is not None:  # the same forward as one graph (accel/)
            logits = self.compiled_decode(ids, step)  # (B, V)
        else:
            with self._adapters(seqs):  # one step for all rows, each through its own adapter
                logits = self.decoder(ids, cache=step, slots=step.slots)[:, -1]  # (B, V)
        for seq, row in zip(seqs, logits):
            seq.cached += 1
            seq.logits = row  # (V,)

    def _adapters(self, seqs: list[Sequence]):
        """The block in which row b of a forward runs through seqs[b]'s LoRA adapter."""
        if not self.n_adapters:
            return contextlib.nullcontext()
        rows = torch.tensor([s.request.adapter for s in seqs], device=self.device)  # (B,)
        return adapter_rows(self.model, rows)

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        event: TokenEvent | None = None,
        error: str | None = None,
        prompt_logprobs=None,
    ) -> None:
        """Retire seq (under the lock): free its blocks, count it, send its last event."""
        if self._active.pop(seq.id, None) is None:
            return  # already finished
        self.scheduler.remove(seq, clear=reason == "error")
        self._counters["requests_finished_total"] += 1
        if event is None:
            event = TokenEvent(seq.id, None, None, None, reason, prompt_logprobs, error)
        self._send(seq, event)

    def _send(self, seq: Sequence, event: TokenEvent) -> bool:
        """Call the request's on_event; False if it raised (the client is gone)."""
        try:
            seq.on_event(event)
            return True
        except Exception:
            return False

    def _check(self, request: Request) -> None:
        """A one-line ValueError for a request this engine can never run."""
        p, n = request.params, len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if not 0 <= request.adapter <= self.n_adapters:
            raise ValueError(
                f"adapter {request.adapter} is not one of the {self.n_adapters} served"
            )
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if p.max_tokens < 0 or (p.max_tokens == 0 and not p.prompt_logprobs):
            raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
        if self.context is not None and n + p.max_tokens > self.context:
            raise ValueError(
                f"the prompt ({n} tokens) + max_tokens ({p.max_tokens}) exceeds the model's "
                f"context of {self.context} tokens: shorten the prompt or lower max_tokens"
            )
        need = self.n_prefix + n + p.max_tokens
        if self.cache.blocks_for(need) > self.cache.n_blocks:
            raise ValueError(
                f"the prompt ({n} tokens) + max_tokens ({p.max_tokens}) needs room for {need} "
                f"tokens, more than the whole KV pool holds ({self.cache.capacity}): lower "
                "max_tokens, or give the pool more memory (attnlab serve --kv-cache-memory)"
            )
        check_params(p, self.vocab_size)
        if p.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: give the engine one")
