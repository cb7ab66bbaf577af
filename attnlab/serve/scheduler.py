"""The scheduler of the continuous-batching engine: who waits, who runs, what each step computes.

Policy, applied at every engine step:

1. **Admission, first come first served.** The oldest waiting request joins the running batch
   while the batch has fewer than `max_batch` sequences and the pool's free blocks hold what it
   must compute now (its tokens and the first new one), with one block left over for every
   sequence already running (so that their next tokens do not at once push it out again). If
   the oldest cannot be admitted, nobody behind it is (no overtaking: a long request is never
   starved by short ones).
2. **Preemption when the pool is full** (Kwon et al. 2023, vLLM's recompute mode). Sequences
   take blocks one at a time as they grow, and nothing reserves a request's worst case, so a
   pool far smaller than max_batch full contexts serves that many short requests. When a step
   needs more blocks than are free, the newest running sequence is preempted: its blocks go
   back to the pool (its full prompt blocks stay in the prefix cache while nobody needs them),
   and it goes back to the front of the queue with its tokens so far. Readmitted, it computes
   the keys of all of them again (a prefill, sharing what the prefix cache still holds) and
   goes on where it stopped: its stream continues, with the tokens it would have had (its
   sampler state, generator and constraint are kept). The oldest sequence is never preempted
   for a newer one, so it always finishes; a request that could not fit even alone is refused
   when it is submitted (the engine's `_check`).
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
from attnlab.inference.constraints import Matcher
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
        matcher: its constraint's state (inference/constraints.py), when it has one.
        offset: cache positions before the prompt's (a prefix- or prompt-tuned model's learned
            prefix, adapters/prompt_learning.py): token i sits at position offset + i.
        resume_at: for a preempted sequence, how many of `tokens` go back into the cache before
            it decodes again (0: it was never preempted; its prompt is what it prefills).
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
    matcher: Matcher | None = None
    offset: int = 0
    resume_at: int = 0

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
    def to_prefill(self) -> int:
        """How many of `tokens` the cache must hold before the next token is chosen."""
        return self.resume_at or self.n_prompt

    @property
    def prefilling(self) -> bool:
        return self.cached < self.to_prefill


class Scheduler:
    """FCFS admission, preemption when the pool is full, a bounded queue, chunked prefill (see
    the module docstring).

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

    def admit(self) -> list[Sequence]:
        """Move waiting requests into the batch, oldest first, while they fit (rule 1)."""
        admitted, cache = [], self.cache
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            need = cache.blocks_for(seq.offset + seq.to_prefill + 1) + len(self.running)
            if need > cache.n_free:
                break
            self.waiting.popleft()
            cache.add(seq.id)
            if self.prefix_caching and not (seq.request.params.prompt_logprobs or seq.offset):
                # Whole blocks of a prompt prefix seen before are shared, not recomputed
                # (prompt log-probabilities need every position computed, so they skip this;
                # so does a learned prefix, which shifts the prompt off the block boundaries).
                tokens = seq.tokens[: seq.to_prefill]
                seq.cached = cache.match_prefix(seq.id, tokens, seq.salt)
                if not seq.resume_at:
                    seq.prefix_hits = seq.cached
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def make_room(self) -> list[Sequence]:
        """Preempt the newest running sequences until the pool holds this step's new blocks:
        the prefill chunk's and one new position for each decoding sequence (rule 2).

        Returns:
            the preempted sequences (back at the front of the queue, oldest first).
        """
        preempted, cache = [], self.cache
        while self.running:
            grows = [(seq, n) for seq, n in self.prefill_work()]
            grows += [(seq, 1) for seq in self.decoding()]
            need = sum(
                max(0, cache.blocks_for(s.offset + s.cached + n) - len(cache.tables[s.id]))
                for s, n in grows
            )
            if need <= cache.n_free:
                break
            seq = self.running.pop()  # the newest
            cache.free(seq.id)
            seq.cached, seq.logits, seq.resume_at = 0, None, len(seq.tokens)
            preempted.append(seq)
        self.waiting.extendleft(preempted)  # the oldest of them first
        return preempted[::-1]

    def prefill_work(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of prompt tokens) to prefill this step, within `prefill_chunk`."""
        budget, work = self.prefill_chunk, []
        for seq in self.running:
            if budget == 0:
                break
            if seq.prefilling:
                n = min(budget, seq.to_prefill - seq.cached)
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
