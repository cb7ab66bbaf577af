"""Beam search (for decoder-only and encoder-decoder models) with a length penalty and EOS handling.

Keep the `num_beams` most likely partial sequences. Each step scores every (beam, token)
extension by its total log-probability and walks the best (1 + n_eos) * num_beams of them (enough
that num_beams of them do not end in EOS): an extension ending in EOS becomes a finished
hypothesis (scored sum_logprob / length ** length_penalty) if it ranks among the best num_beams,
the others fill the next beams. It stops when `num_beams` hypotheses are finished and (unless
`early_stopping`) no running beam can still beat the worst of them. If it stops at
`max_new_tokens` instead, the running beams compete with the finished hypotheses as they are.

These are HF transformers' rules (generation/utils.py `_beam_search`), so the same settings give
the same ids, including its estimate of "can still beat": the best running score normalised
by the current length, or with early_stopping="never" and length_penalty > 0 by the longest
possible length (max_new_tokens), which never stops before a running beam could win.

Shapes: W = num_beams, V vocab_size.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from attnlab.inference.generate import decode_step, decoder_of, prefill
from attnlab.components.kv_cache import ModelCache


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # new tokens only (EOS included when it ended the hypothesis)
    score: float  # sum of log-probabilities / len(tokens) ** length_penalty


def _normalised(logprob: float, length: int, length_penalty: float) -> float:
    return logprob / max(length, 1) ** length_penalty


@torch.no_grad()
def beam_search(
    model: nn.Module,
    prompt: Sequence[int],
    num_beams: int,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    length_penalty: float = 1.0,
    early_stopping: bool | Literal["never"] = False,
    source: Tensor | None = None,
    source_mask: Tensor | None = None,
) -> Hypothesis:
    """The best hypothesis for one prompt.

    Args:
        prompt: token ids (decoder-only), or the decoder start tokens (encoder-decoder).
        num_beams: W >= 1 (1 is greedy).  eos_ids: tokens that finish a hypothesis.
        length_penalty: exponent of the length in the score (> 0 favours longer outputs).
        early_stopping: True: stop as soon as W hypotheses are finished; False: also once no
            running beam can beat them at its current length; "never": ... at max_new_tokens.
        source, source_mask: (1, M) encoder input and mask, for encoder-decoder models.
    """
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    if len(prompt) == 0:
        raise ValueError("beam search needs a non-empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    decoder = decoder_of(model)
    device = decoder.head.weight.device
    ids = torch.tensor([list(prompt)], device=device)  # (1, T0)
    T0, W = ids.shape[1], num_beams
    memory = None if source is None else model.encode(source, source_mask)
    key_valid = torch.ones(1, T0 + max_new_tokens, dtype=torch.bool, device=device)
    cache = ModelCache.for_decoder(decoder, key_valid, cross=memory is not None)
    logits = prefill(model, ids, cache, memory, source_mask, last_only=True)[:, -1]  # (1, V)
    cache.reorder(torch.zeros(W, dtype=torch.long, device=device))  # W copies of the prompt
    mask = None if source_mask is None else source_mask.expand(W, -1)
    logits = logits.expand(W, -1)
    # Start with one live beam: the others would only duplicate it.
    scores = torch.full((W,), float("-inf"), device=device)
    scores[0] = 0.0
    beams: list[list[int]] = [[] for _ in range(W)]
    finished: list[Hypothesis] = []
    eos = set(eos_ids)
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1) + scores[:, None]  # (W, V)
        V = logp.shape[-1]
        # Up to W of each EOS id can be among the candidates; past them there are W others.
        top, flat = torch.topk(logp.flatten(), min((1 + len(eos)) * W, logp.numel()))
        next_beams, parents, tokens, next_scores = [], [], [], []
        for rank, (s, f) in enumerate(zip(top.tolist(), flat.tolist())):
            parent, token = divmod(f, V)
            if token in eos:
                if rank < W:  # only an extension good enough to be a beam may finish
                    seq = beams[parent] + [token]
                    finished.append(Hypothesis(seq, _normalised(s, len(seq), length_penalty)))
                continue
            next_beams.append(beams[parent] + [token])
            parents.append(parent)
            tokens.append(token)
            next_scores.append(s)
            if len(next_beams) == W:
                break
        beams = next_beams
        scores = torch.tensor(next_scores, device=device)
        # HF's guess of a running beam's best final length ("never": the longest possible).
        longest = early_stopping == "never" and length_penalty > 0
        length = max_new_tokens if longest else step + 1
        done = _done(finished, W, scores, length, length_penalty, early_stopping)
        if done or step == max_new_tokens - 1:
            break
        cache.reorder(torch.tensor(parents, device=device))
        token = torch.tensor(tokens, device=device)[:, None]  # (W, 1)
        logits = decode_step(model, token, torch.tensor([T0 + step], device=device), cache, mask)
    if not done:  # out of tokens: unfinished beams compete as they are
        finished += [
            Hypothesis(b, _normalised(s, len(b), length_penalty))
            for b, s in zip(beams, scores.tolist())
        ]
    return max(finished, key=lambda h: h.score)


def _done(
    finished: list[Hypothesis],
    W: int,
    scores: Tensor,
    length: int,
    length_penalty: float,
    early_stopping: bool | str,
) -> bool:
    if len(finished) < W:
        return False
    if early_stopping is True:
        return True
    worst = sorted(h.score for h in finished)[-W]  # the W-th best finished score
    best_running = _normalised(float(scores.max()), length, length_penalty)
    return best_running < worst
