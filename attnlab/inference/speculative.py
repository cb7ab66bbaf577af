"""Speculative decoding: a cheap drafter guesses K tokens, the model checks all K in one forward.

    history x (n tokens; the model's cache holds x[:n-1])
      drafter ─propose─> d1..dK and q1..qK (the drafter's distributions; one-hot for n-grams)
      model([x[n-1], d1..dK]) at slots n-1 .. n+K-1 ─> p1..p(K+1)       one forward, K+1 tokens
      keep d1..da, then one token more: a correction drawn from p(a+1) - q(a+1), or (a = K) a
      bonus drawn from p(K+1);  x <- x + d1..da + [token]

A round costs one forward of K+1 tokens (on a CPU at batch 1 about the price of one token: the
weights are read once either way) plus the drafter's work, and emits between 1 and K+1 tokens.

Rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling"): keep d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first
rejection draw from norm(max(0, p_j - q_j)). Each emitted token is then distributed exactly as
the model's own sample would be (Leviathan et al., Appendix A.1), whatever the drafter proposes.
p and q are `sampling.token_distribution` (`Processors`): the logit bias, penalties,
temperature, top-k, top-p and min-p apply to both, each position counting the drafts before
it. At temperature 0 both are one-hot, and the rule becomes: keep the drafts while each equals
the model's argmax, then emit the argmax. Greedy output is the plain loop's
(up to float rounding: a (K+1)-token forward sums in another order than K+1 one-token ones, which
can only matter at an exact near-tie of two logits).

Rolling back the cache costs nothing: a ModelCache (components/kv_cache.py) hides every slot
after a query's own (causality) and takes positions from slots, so after a rejection the next
round simply writes from the first rejected slot on; the stale keys there are never read.

Drafters (each `begin(prompt, room)` once, then `propose(history, k, processors, generator)`):
- `NgramDrafter`, prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-
  decoding): find the last n tokens earlier in the text and propose what followed them there.
  No second model; it pays off where the output repeats its context (code, edits, quotes).
- `ModelDrafter`: a smaller model with the same tokenizer, or the model's own int4 copy
  (`open_draft_model`), with a cache of its own, drafting one token per decode step.

Batch 1 only: the rows of a batch would accept different numbers of tokens and leave the batch
ragged; `attnlab serve --speculative` runs its one-request-at-a-time engine for this reason.

Shapes: N rounds, K draft tokens, V vocab_size, n tokens of history.
"""

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.checkpoint import open_checkpoint
from attnlab.components.embedding import check_token_ids
from attnlab.inference.config import GenerationConfig
from attnlab.inference.sampling import SamplingRows, TokenCounts, sample, token_distribution
from attnlab.inference.steps import decode_step, decoder_of, fill_cache
from attnlab.quantize.handler import quantize_model

DEFAULT_DRAFT_TOKENS = 4  # K, drafts per round (Leviathan et al. measure gamma = 3 to 7)


def accept_drafts(
    p: Tensor, q: Tensor, drafts: Tensor, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Leviathan et al.'s acceptance rule, for N independent rounds at once.

    Args:
        p: (N, K+1, V) the model's distribution at each draft's position and the one after.
        q: (N, K, V) the drafter's distribution each draft was drawn from.
        drafts: (N, K) the drafted tokens.

    Returns:
        accepted (N,): how many leading drafts are kept; token (N,): the token after them.
    """
    N, K = drafts.shape
    u = torch.rand(N, K, generator=generator, device=p.device)
    p_d = p[:, :K].gather(2, drafts[..., None])[..., 0]  # (N, K)
    q_d = q.gather(2, drafts[..., None])[..., 0]
    keep = u * q_d < p_d  # u < p/q: kept with probability min(1, p/q)
    accepted = keep.long().cumprod(1).sum(1)  # (N,) leading run of kept drafts
    rows = torch.arange(N, device=p.device)
    p_next = p[rows, accepted]  # (N, V)
    q_next = torch.cat([q, q.new_zeros(N, 1, q.shape[-1])], 1)[rows, accepted]  # 0: the bonus
    residual = (p_next - q_next).clamp(min=0)
    # p == q up to rounding leaves no residual: a rejection had probability ~0 there.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    return accepted, torch.multinomial(residual, 1, generator=generator)[:, 0]


@dataclass
class Processors:
    """The sampling processors at the end of the text (the settings' rows, the tokens counted
    so far, the stop tokens banned until min_new_tokens), asked for the next token's
    distribution a few tokens further on: drafts and their verification score tokens the text
    does not hold yet."""

    rows: SamplingRows
    counts: TokenCounts | None  # None: no penalty reads them
    stop_mask: Tensor  # (V,) bool
    min_new_tokens: int
    done: int = 0  # new tokens in the text

    def distribution(self, logits: Tensor, ahead: Tensor) -> Tensor:
        """(1, V) logits of the token after the text + `ahead` (j,) -> its (1, V) probabilities."""
        counts = self.counts
        if counts is not None and len(ahead):
            counts = TokenCounts(counts.in_prompt, counts.generated.clone())
            _count(counts, ahead)
        banned = self.stop_mask if self.done + len(ahead) < self.min_new_tokens else None
        return token_distribution(logits, self.rows, counts, banned)

    def banned(self) -> Tensor | None:
        """The tokens the text's next token may not be (stop tokens before min_new_tokens)."""
        return self.stop_mask if self.done < self.min_new_tokens else None

    def advance(self, tokens: Tensor) -> None:
        """The text gained `tokens` (n,)."""
        if self.counts is not None:
            _count(self.counts, tokens)
        self.done += len(tokens)


def _count(counts: TokenCounts, tokens: Tensor) -> None:
    """Add the one row's new tokens (n,) to its counts."""
    counts.generated[0].index_add_(0, tokens, counts.generated.new_ones(len(tokens)))


class NgramDrafter:
    """Prompt lookup: the most recent earlier occurrence of the text's last n tokens (n from
    max_ngram down to min_ngram) proposes the up to k tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def begin(self, prompt: Tensor, room: int) -> None:
        """Nothing to prepare: the text itself is the draft table."""

    def propose(
        self, history: Tensor, k: int, processors: Processors, generator=None
    ) -> tuple[Tensor, Tensor | None]:
        """history (1, n) -> (up to k drafts (k',), None: each draft is certain, q one-hot)."""
        text = history[0]
        for n in range(min(self.max_ngram, len(text) - 1), self.min_ngram - 1, -1):
            grams = text[:-1].unfold(0, n, 1)  # (len - n, n): every n-gram with a successor
            hits = (grams == text[-n:]).all(1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n
                return text[start : start + k], None
        return text[:0], None


class ModelDrafter:
    """A draft model with the target's tokenizer: k decode steps of its own per round, in a
    cache of its own; after a rejection it re-reads only the tokens it has not seen."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.vocab_size = decoder_of(model).head.out_features
        self.cache, self.seen = None, None  # its cache holds `seen` (n,) at slots 0..n-1

    def begin(self, prompt: Tensor, room: int) -> None:
        """Prefill the prompt (1, T0), leaving `room` slots."""
        _, self.cache, _ = fill_cache(self.model, prompt, torch.ones_like(prompt, dtype=bool), room)
        self.seen = prompt[0]

    def propose(
        self, history: Tensor, k: int, processors: Processors, generator=None
    ) -> tuple[Tensor, Tensor | None]:
        """history (1, n) -> k drafts (k,) and the distributions they were drawn from (k, V)."""
        if k == 0:
            return history[0, :0], None
        n = history.shape[1]
        m = min(len(self.seen), n - 1)
        same = (self.seen[:m] == history[0, :m]).long().cumprod(0).sum()  # common prefix
        known = int(same)
        slots = torch.arange(known, n, device=history.device)
        decoder = decoder_of(self.model)
        logits = decoder(history[:, known:], cache=self.cache, slots=slots, last_only=True)[:, -1]
        text, qs = history, []
        for j in range(k):
            q = processors.distribution(logits, text[0, n:])  # (1, V)
            draft = torch.multinomial(q, 1, generator=generator)  # (1, 1)
            text, qs = torch.cat([text, draft], 1), qs + [q]
            if j < k - 1:
                at = torch.tensor([n + j], device=history.device)
                logits = decode_step(self.model, draft, at, self.cache)
        self.seen = text[0, :-1]  # the last draft was never fed
        return text[0, n:], torch.cat(qs)


@dataclass
class SpeculativeStats:
    """Counts of one or more speculative generations (acceptance = accepted / drafted)."""

    rounds: int = 0  # verification forwards of the model
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0  # emitted, the first (from the prefill) included
    seconds: float = 0.0  # prefill to last token

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def line(self) -> str:
        return (
            f"speculative: {self.tokens} tokens in {self.rounds} verification forwards, "
            f"{self.accepted}/{self.drafted} drafts accepted ({self.acceptance_rate:.1%}), "
            f"{self.tokens_per_second:.1f} tokens/s"
        )


class Speculative:
    """Speculative decoding with `drafter` (NgramDrafter or ModelDrafter), up to
    `num_draft_tokens` drafts per round; `stats` adds up every generation it runs."""

    def __init__(self, drafter, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.drafter, self.k = drafter, num_draft_tokens
        self.stats = SpeculativeStats()

    def stream(
        self, model: nn.Module, prompts: Sequence[Sequence[int]], config: GenerationConfig
    ) -> Iterator[Tensor]:
        """As `generate.stream_tokens` for one prompt: each new token as a (1,) tensor."""
        if len(prompts) != 1:
            raise ValueError(
                f"speculative decoding runs one prompt at a time (batch 1), got {len(prompts)}"
            )
        device = decoder_of(model).head.weight.device
        for token, _ in self.steps(model, prompts[0], config):
            yield torch.tensor([token], device=device)

    @torch.no_grad()
    def steps(
        self, model: nn.Module, prompt: Sequence[int], config: GenerationConfig
    ) -> Iterator[tuple[int, Tensor]]:
        """Yield each new token with the model's logits (V,) it was chosen from; stop after a
        stop token or `config.max_new_tokens` (see the module docstring for a round)."""
        decoder = decoder_of(model)
        if decoder is not model:
            raise ValueError("speculative decoding is for decoder-only models")
        ids = torch.tensor([list(prompt)], device=decoder.head.weight.device)  # (1, T0)
        check_token_ids(ids, decoder.head.out_features)
        n_new = config.new_tokens_for(ids.shape[1])
        self._check_fits(model, ids.shape[1] + n_new, config.max_context)
        start, V = time.perf_counter(), decoder.head.out_features
        gen = None if config.seed is None else torch.Generator(ids.device).manual_seed(config.seed)
        logits, cache, _ = fill_cache(model, ids, torch.ones_like(ids, dtype=bool), n_new)
        processors = self._processors(config, ids, V)
        # the first token, as the plain loop draws it
        token = sample(logits, processors.rows, processors.counts, gen, processors.banned())
        processors.advance(token)
        self.drafter.begin(ids, n_new)
        history, emitted = torch.cat([ids, token[:, None]], 1), [(int(token), logits[0])]
        while True:
            for t, row in emitted:
                self.stats.tokens += 1
                self.stats.seconds += time.perf_counter() - start
                yield t, row
                start = time.perf_counter()
                if t in config.stop_tokens:
                    return
            if processors.done >= n_new:
                return
            k = min(self.k, n_new - processors.done - 1)
            emitted = self._round(decoder, cache, history, k, gen, processors)
            kept = torch.tensor([t for t, _ in emitted], device=ids.device)  # (a + 1,)
            processors.advance(kept)
            history = torch.cat([history, kept[None]], 1)

    @staticmethod
    def _processors(config: GenerationConfig, ids: Tensor, V: int) -> Processors:
        rows = SamplingRows.stack([config.sampling], V, ids.device)
        counts = TokenCounts.of_prompts(ids, V) if rows.needs_counts else None
        stop_mask = torch.zeros(V, dtype=torch.bool, device=ids.device)
        stop_mask[list(config.stop_tokens)] = True
        return Processors(rows, counts, stop_mask, config.min_new_tokens)

    def _round(self, decoder, cache, history: Tensor, k: int, gen, processors: Processors):
        """Draft up to k tokens, verify them in one forward; the tokens kept and their logits."""
        drafts, q = self.drafter.propose(history, k, processors, gen)  # (k',), (k', V) or None
        n, k = history.shape[1], len(drafts)
        fed = torch.cat([history[:, -1:], drafts[None]], 1)  # (1, k+1)
        slots = torch.arange(n - 1, n + k, device=history.device)
        logits = decoder(fed, cache=cache, slots=slots)[0]  # (k+1, V)
        # position j's distribution follows the text and the first j drafts
        p = torch.cat(
            [processors.distribution(logits[j : j + 1], drafts[:j]) for j in range(k + 1)]
        )
        if q is None:  # a certain draft: q is its one-hot
            q = torch.nn.functional.one_hot(drafts, p.shape[-1]).float()
        accepted, token = accept_drafts(p[None], q[None], drafts[None], gen)
        a = int(accepted)
        self.stats.rounds += 1
        self.stats.drafted += k
        self.stats.accepted += a
        kept = drafts[:a].tolist() + [int(token)]
        return [(t, logits[j]) for j, t in enumerate(kept)]

    def _check_fits(self, model: nn.Module, total: int, max_context: int | None) -> None:
        limits = [decoder_of(model).positions.max_positions, max_context]
        window = min((n for n in limits if n is not None), default=None)
        if window is not None and total > window:
            raise ValueError(
                f"prompt + max_new_tokens ({total}) exceeds the {window}-token window, and "
                "speculative decoding does not crop the context: shorten the prompt or "
                "max_new_tokens"
            )
        draft_vocab = getattr(self.drafter, "vocab_size", None)
        vocab = decoder_of(model).head.out_features
        if draft_vocab is not None and draft_vocab != vocab:
            raise ValueError(
                f"the draft model's vocabulary ({draft_vocab}) is not the model's ({vocab}): "
                "a drafter must share the tokenizer"
            )


def open_draft_model(
    path: str | Path, device="cpu", quantize: str | None = None, tokenizer=None
) -> nn.Module:
    """A draft model from a checkpoint (any kind `open_checkpoint` reads), optionally made int4
    or int8 (`quantize`: a GGUF file keeps its own Q4_1 matrices for int4; a float checkpoint
    is quantized in memory, attnlab/quantize). With `tokenizer` (the target's), the draft's
    must have the same vocabulary."""
    gguf = str(path).endswith(".gguf")
    loaded = open_checkpoint(path, device, scheme=quantize if gguf and quantize == "int4" else None)
    if loaded.config.arch != "decoder" or hasattr(loaded.model, "encode"):
        raise ValueError(f"draft checkpoint {str(path)!r} is not a decoder-only language model")
    if tokenizer is not None and loaded.tokenizer is not None:
        ours, theirs = tokenizer.backend.get_vocab(), loaded.tokenizer.backend.get_vocab()
        if ours != theirs:
            raise ValueError(
                f"draft checkpoint {str(path)!r} has another tokenizer than the model: a "
                "drafter must share the tokenizer"
            )
    model = loaded.model
    if quantize is not None and not (gguf and quantize == "int4"):
        found = {type(m).__name__ for m in model.modules()} & {"Int4Linear", "Int8Linear"}
        if found:
            raise ValueError(f"draft checkpoint {str(path)!r} is already quantized ({found})")
        quantize_model(model, quantize)
    return model
