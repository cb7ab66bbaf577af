"""The scheduler of the continuous-batching engine: who waits, who runs, what each step computes.

Policy, applied at every engine step:

1. **Admission, first come first served.** The oldest waiting request joins the running batch
   while the batch has fewer than `max_batch` sequences and the pool can promise it every block
   it may ever need: blocks for its prompt plus a reserve of blocks for its `max_tokens` new
   tokens, counted against the free blocks that the running sequences have not already been
   promised. If the oldest cannot be admitted, nobody behind it is (no overtaking: a long
   request is never starved by short ones).
2. **No preemption: requests wait instead.** Blocks are still taken from the pool one at a time
   as a sequence grows (and its unused reserve goes back the moment it stops early), but since
   every running sequence's worst case is covered, a running sequence never finds the pool empty,
   and nothing is ever evicted or recomputed. The price is admitting fewer requests when many
   ask for long outputs they do not use.
3. **Bounded queue.** At most `max_queue` requests wait; one more raises QueueFull (the server
   answers 429) instead of letting memory grow.
4. **Chunked prefill interleaved with decoding.** A step prefills at most `prefill_chunk` prompt
   tokens, oldest admitted sequence first (a long prompt takes several steps), and then runs one
   batched decode step for every sequence whose prompt is in the cache. A long prompt thus
   delays the running sequences' next token by one chunk, not by the whole prompt.
5. **Prefix caching** (on unless the engine is told otherwise): the full blocks of a prompt,
   once computed, stay indexed by the tokens up to their end; an admitted prompt that starts
   with the same tokens shares those blocks (reference counted) and prefills only the rest.
   Cached blocks nobody owns count as free; the least recently released is reused first.
6. **Retire at once.** A sequence that finished (stop, length, cancelled, error) leaves the batch
   and frees its blocks in the step where it finished; a waiting request can take its place in
   the next one.

The scheduler only keeps the books; the engine (engine.py) runs the model and the sampling.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnlab.components.paged_kv_cache import PagedKVCache
from attnlab.inference.sampling import SamplingConfig, TokenCounts
from attnlab.serve.types import QueueFull, Request, TokenEvent


@dataclass(eq=False)
class Sequence:
    """One request's state inside the engine.

    Attributes:
        request: what was asked.  on_event: where its tokens go.
        sampling: the request's SamplingConfig.  generator: its seeded generator, or None.
        tokens: prompt + generated token ids.  n_prompt: prompt length.
        cached: how many of `tokens` are in the KV cache.
        prefix_hits: how many prompt tokens were found in the prefix cache at admission.
        prompt_logprobs: collected while the prompt is prefilled (when asked for).
        logits: (V,) logits of the next token, once the prompt is in the cache.
        submitted, first_token: times (time.perf_counter) for the time to first token.
        counts: its prompt's and output's tokens, when its sampler has penalties.
        offset: cache positions before the prompt's (a prefix- or prompt-tuned model's learned
            prefix, adapters/prompt_learning.py): token i sits at position offset + i.
    """

    request: Request
    on_event: Callable[[TokenEvent], None]
    sampling: SamplingConfig
    generator: torch.Generator | None
    tokens: list[int]
    n_prompt: int
    submitted: float
    cached: int = 0
    prefix_hits: int = 0
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top: list[dict[int, float] | None] = field(default_factory=list)
    logits: torch.Tensor | None = None
    first_token: float | None = None
    counts: TokenCounts | None = None
    offset: int = 0

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def salt(self) -> tuple:
        """What keeps this prompt's cached blocks apart from the same tokens' under another
        LoRA adapter (the prefix cache's key; none for the base)."""
        adapter = self.request.adapter
        return (("adapter", adapter),) if adapter else ()

    @property
    def prompt(self) -> list[int]:
        return self.tokens[: self.n_prompt]

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def max_len(self) -> int:
        """The most cache positions this sequence can take: offset + prompt + max_tokens."""
        return self.offset + self.n_prompt + self.request.params.max_tokens

    @property
    def prefilling(self) -> bool:
        return self.cached < self.n_prompt


class Scheduler:
    """FCFS admission with a per-request block reserve, a bounded queue, chunked prefill (see the
    module docstring).

    Args:
        cache: the paged KV cache whose blocks are handed out.
        max_batch: most sequences running at once.
        max_queue: most requests waiting.
        prefill_chunk: most prompt tokens prefilled per step.
        prefix_caching: an admitted prompt shares the cached blocks of a prefix seen before.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        max_batch: int,
        max_queue: int,
        prefill_chunk: int,
        prefix_caching: bool = False,
    ):
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.cache = cache
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq: Sequence) -> None:
        """Queue a new request (QueueFull at the bound)."""
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are waiting: try again later")
        self.waiting.append(seq)

    def promised(self) -> int:
        """Blocks the running sequences may still take: each one's worst case minus what it
        holds."""
        cache = self.cache
        return sum(cache.blocks_for(s.max_len) - len(cache.tables[s.id]) for s in self.running)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into the batch, oldest first, while they fit (rule 1)."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if self.cache.blocks_for(seq.max_len) > self.cache.n_free - self.promised():
                break
            self.waiting.popleft()
            self.cache.add(seq.id)
            if self.prefix_caching and not (seq.request.params.prompt_logprobs or seq.offset):
                # Whole blocks of a prompt prefix seen before are shared, not recomputed
                # (prompt log-probabilities need every position computed, so they skip this;
                # so does a learned prefix, which shifts the prompt off the block boundaries).
                seq.cached = seq.prefix_hits = self.cache.match_prefix(seq.id, seq.prompt, seq.salt)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def prefill_work(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of prompt tokens) to prefill this step, within `prefill_chunk`."""
        budget, work = self.prefill_chunk, []
        for seq in self.running:
            if budget == 0:
                break
            if seq.prefilling:
                n = min(budget, seq.n_prompt - seq.cached)
                work.append((seq, n))
                budget -= n
        return work

    def decoding(self) -> list[Sequence]:
        """The sequences with a next token to choose (their prompt is in the cache)."""
        return [s for s in self.running if s.logits is not None]

    def remove(self, seq: Sequence, clear: bool = False) -> None:
        """Take `seq` out (waiting or running) and free its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq.id, clear=clear)
