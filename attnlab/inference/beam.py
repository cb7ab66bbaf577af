"""Beam search over a batch of prompts, for decoder-only and encoder-decoder models: a length
penalty, EOS handling, several returned sequences per prompt.

For each prompt, keep the `num_beams` (W) most likely partial sequences. Each step scores every
(beam, token) extension by its total log-probability and takes the best K = max(2, 1 + n_eos) * W
of them (enough that W of them do not end):

    candidates (best first)   c1  c2  c3 ... cW | cW+1 ... cK
                              ───── may finish ──┘
    an extension that ends (EOS, or the last allowed token) and ranks among the first W becomes
    a finished hypothesis, scored  sum_logprob / n_new_tokens ** length_penalty;
    the W best extensions that do not end are the next step's beams.

Each prompt keeps its W best finished hypotheses. It closes when it cannot improve them: when W
are finished and the best running beam, normalised by the current length (or, with
early_stopping="never" and length_penalty > 0, by the longest possible one), scores no better
than the worst of them; with early_stopping=True it also takes no more once W are finished.
The search ends when every prompt is closed (early_stopping=True: full) or after
`max_new_tokens`, where the running beams finish as they are.

These are HF transformers' rules (generation/utils.py `_beam_search`), so the same settings give
the same ids row for row (tested against `generate(num_beams=..)`).

The steps are steps.py's: one prefill of the left-padded prompts, whose cache rows are then
copied W times, and one decode step per token for all B * W beams, after the cache rows are
reordered to follow their beams' parents.

Shapes: B prompts, W = num_beams, K candidates per prompt, V vocab_size.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnlab.components.embedding import check_token_ids
from attnlab.inference.config import GenerationConfig
from attnlab.inference.sampling import ban_tokens
from attnlab.inference.steps import (
    decode_step,
    decoder_of,
    encode_source,
    fill_cache,
    left_pad,
    prefix_length,
)

# The score of the beams that start empty (every beam but the first holds the same prompt), and
# of extensions that just ended: low enough never to be chosen over a real beam. HF uses the
# same finite value, so the order of such candidates (ties at this score) matches too.
NO_BEAM = -1.0e9


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # new tokens only (EOS included when it ended the hypothesis)
    score: float  # sum of log-probabilities / len(tokens) ** length_penalty


@torch.no_grad()
def beam_search(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    *,
    source: Tensor | None = None,
    source_mask: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """The best `config.num_return_sequences` hypotheses of each prompt, best first.

    Args:
        prompts: token ids per prompt (decoder-only; left-padded together), or the decoder start
            tokens per source (encoder-decoder).
        config: num_beams W >= 1 (1 is greedy), max_new_tokens, stop_tokens (they finish a
            hypothesis), length_penalty (> 0 favours longer outputs), early_stopping (True: stop
            as soon as W hypotheses are finished; False: also once no running beam can beat
            them at its current length; "never": ... at max_new_tokens), num_return_sequences.
            Sampling and the context crop do not apply.
        source, source_mask: (B, M) encoder input and mask, for encoder-decoder models.

    Returns:
        B lists of `num_return_sequences` Hypothesis, highest score first.
    """
    max_new_tokens, length_penalty = config.max_new_tokens, config.length_penalty
    early_stopping = config.early_stopping
    decoder = decoder_of(model)
    device = decoder.head.weight.device
    ids, mask = left_pad(prompts, device=device)  # (B, T0)
    check_token_ids(ids, decoder.head.out_features)
    (B, T0), W = ids.shape, config.num_beams
    limit = decoder.positions.max_positions
    if limit is not None and prefix_length(model) + T0 + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({T0} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's {limit} positions (beam search does not crop the context)"
        )
    memory = encode_source(model, source, source_mask)  # (B, M, C) or None
    logits, cache, slot = fill_cache(
        model, ids, mask, max_new_tokens, memory, source_mask, source, config.kv_cache_dtype
    )
    rows = torch.arange(B, device=device).repeat_interleave(W)  # (B*W,) each prompt W times
    cache.reorder(rows)
    memory_mask = None if source_mask is None else source_mask[rows]  # (B*W, M)
    logits = logits[rows]  # (B*W, V)
    V = logits.shape[-1]
    scores = torch.zeros(B, W, device=device)  # running beams' sums of log-probabilities
    scores[:, 1:] = NO_BEAM  # one live beam per prompt at first: the others would repeat it
    beams = torch.zeros(B, W, 0, dtype=torch.long, device=device)  # (B, W, step) their tokens
    eos = torch.tensor(config.stop_tokens, dtype=torch.long, device=device)
    K = min(max(2, 1 + len(eos)) * W, W * V)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]  # W best per prompt, best first
    is_open = [True] * B
    stop_mask = torch.zeros(V, dtype=torch.bool, device=device).index_fill(0, eos, True)
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)  # (B*W, V)
        if step < config.min_new_tokens:  # no hypothesis ends before min_new_tokens (as HF)
            logp = ban_tokens(logp, stop_mask)
        logp = logp.view(B, W, V) + scores[:, :, None]
        top, flat = torch.topk(logp.view(B, W * V), K)  # (B, K), best first
        parent, token = flat // V, flat % V  # (B, K)
        ends = torch.isin(token, eos) | (step == max_new_tokens - 1)  # (B, K)
        seqs = torch.cat([_gather(beams, parent), token[:, :, None]], dim=-1)  # (B, K, step+1)
        normalised = top / (step + 1) ** length_penalty  # (B, K)
        for b in range(B):
            full = early_stopping is True and len(finished[b]) == W
            if is_open[b] and not full:
                finished[b] = _add(finished[b], seqs[b], normalised[b], ends[b], W)
        # The next beams: the W best extensions that did not end (HF's order, NO_BEAM for ends).
        scores, pick = torch.topk(top + ends.float() * NO_BEAM, W)  # (B, W)
        beams, parent = _gather(seqs, pick), parent.gather(1, pick)  # (B, W, step+1), (B, W)
        longest = early_stopping == "never" and length_penalty > 0
        length = max_new_tokens if longest else step + 1  # HF's guess of a beam's final length
        best_running = (scores[:, 0] / length**length_penalty).tolist()  # (B,)
        for b in range(B):
            if len(finished[b]) == W and best_running[b] <= finished[b][-1].score:
                is_open[b] = False  # no running beam can improve its W finished ones
        all_full = early_stopping is True and all(len(f) == W for f in finished)
        if step == max_new_tokens - 1 or not any(is_open) or all_full:
            break
        cache.reorder((parent + torch.arange(B, device=device)[:, None] * W).flatten())
        token = beams[:, :, -1].reshape(B * W, 1)  # (B*W, 1)
        logits = decode_step(model, token, torch.tensor([slot], device=device), cache, memory_mask)
        slot += 1
    return [f[: config.num_return_sequences] for f in finished]


def _gather(seqs: Tensor, index: Tensor) -> Tensor:
    """Rows `index` (B, K') of each prompt's sequences (B, W', L) -> (B, K', L)."""
    return seqs.gather(1, index[:, :, None].expand(-1, -1, seqs.shape[-1]))


def _add(
    kept: list[Hypothesis], seqs: Tensor, scores: Tensor, ends: Tensor, W: int
) -> list[Hypothesis]:
    """The W best of `kept` and of the first W candidates that end (seqs (K, L), scores (K,))."""
    new = [
        Hypothesis(s, score)
        for s, score, end in zip(seqs[:W].tolist(), scores[:W].tolist(), ends[:W].tolist())
        if end
    ]
    return sorted(kept + new, key=lambda h: h.score, reverse=True)[:W]
