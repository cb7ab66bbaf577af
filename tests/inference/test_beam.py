"""Beam search: greedy at one beam, exact search with enough beams, better than greedy where
greedy is trapped, EOS / early stopping / length penalty as documented, encoder-decoder, batches
of prompts of different lengths, and the same ids as transformers' generate(num_beams=..).

Scores are checked against log-probabilities recomputed independently with one full forward
(no cache) over prompt + hypothesis. `BigramLM` is a crafted stand-in decoder whose next-token
distribution depends only on the current token, so every score can be written down by hand.
"""

import itertools
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch import nn

from attnlab.components.positions.base import NoPosition
from attnlab.inference.beam import beam_search
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.inference.steps import left_pad
from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig
from attnlab.models.presets import get_preset

GREEDY = SamplingConfig(temperature=0.0)
P, A, B, C, D, EOS = range(6)
HEAD_SCALE = 8.0  # the crafted vocabulary: P is the prompt


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread: reproducible, and no threads spinning against each other on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class BigramLM(nn.Module):
    """A stand-in decoder: the next-token distribution at every position is table[current token].

    Args:
        table: {token: {next token: probability}}; unnamed tokens share what is left.
    """

    def __init__(self, table: dict[int, dict[int, float]], vocab_size: int = 6):
        super().__init__()
        probs = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
        for tok in range(vocab_size):
            row = table.get(tok, {})
            rest = [t for t in range(vocab_size) if t not in row]
            left = 1.0 - sum(row.values())
            for t in range(vocab_size):
                probs[tok, t] = row.get(t, left / len(rest) if rest else 0.0)
        self.register_buffer("logp", probs.log().float())  # (V, V)
        self.head = nn.Linear(1, vocab_size, bias=False)  # generate reads V and the device here
        self.embed = nn.Embedding(vocab_size, 1)  # the KV cache takes its dtype from here
        self.blocks = nn.ModuleList()
        self.positions = NoPosition()

    def forward(self, ids, attention_mask=None, **_):
        return self.logp[ids]  # (B, T, V)


@torch.no_grad()
def logprob(model, prompt: list[int], tokens: list[int], src=None) -> float:
    """Sum of log p(token | everything before it), from one full forward without a cache."""
    x = torch.tensor([prompt + tokens])
    logits = model(x) if src is None else model(src, x)  # (1, T, V)
    logp = torch.log_softmax(logits[0].double(), dim=-1)  # (T, V)
    T0 = len(prompt)
    return sum(float(logp[T0 - 1 + i, t]) for i, t in enumerate(tokens))


def tiny_decoder(vocab_size: int = 23, position: str = "rope", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        arch="decoder",
        d_model=32,
        n_layers=2,
        vocab_size=vocab_size,
        max_seq_len=12,
        d_ff=32,
        position=position,
        tie_embeddings=False,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2),
    )
    model = build_model(cfg).eval()
    with torch.no_grad():  # a larger head gives peaked, varied distributions (more at stake)
        model.head.weight.mul_(HEAD_SCALE)
    return model


def tiny_t5(vocab_size: int = 23, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = replace(get_preset("t5-tiny"), d_model=32, d_ff=32, vocab_size=vocab_size)
    return build_model(cfg).eval()


# --- one beam is greedy --------------------------------------------------------------------
@pytest.mark.parametrize("position", ["rope", "alibi", "learned"])
def test_one_beam_is_greedy(position):
    model, prompt = tiny_decoder(position=position), [1, 2, 3]
    greedy = generate(model, [prompt], GenerationConfig(6, GREEDY))[0]
    assert beam_search(model, [prompt], GenerationConfig(6, num_beams=1))[0][0].tokens == greedy
    # With an EOS: the first repeated-free token of greedy's output ends both searches there.
    k = next(i for i in range(1, 6) if greedy[i] not in greedy[:i])
    eos = greedy[k]
    assert (
        generate(model, [prompt], GenerationConfig(6, GREEDY, stop_tokens=[eos]))[0]
        == greedy[: k + 1]
    )
    assert (
        beam_search(model, [prompt], GenerationConfig(6, num_beams=1, stop_tokens=[eos]))[0][
            0
        ].tokens
        == greedy[: k + 1]
    )


# --- beam search beats greedy --------------------------------------------------------------
def test_beam_escapes_the_greedy_trap():
    """A is likelier than B, but what follows A is flat: P A C = 0.5 * 0.3 < P B C = 0.4 * 0.9."""
    model = BigramLM({P: {A: 0.5, B: 0.4}, A: {C: 0.3, D: 0.3}, B: {C: 0.9}})
    greedy = generate(model, [[P]], GenerationConfig(2, GREEDY))[0]
    beam = beam_search(model, [[P]], GenerationConfig(2, num_beams=2, length_penalty=0.0))[0][0]
    assert greedy[0] == A and beam.tokens == [B, C]
    assert beam.score == pytest.approx(math.log(0.4 * 0.9), abs=1e-5)
    assert logprob(model, [P], beam.tokens) > logprob(model, [P], greedy)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_score_is_the_recomputed_logprob_and_at_least_greedys(seed):
    model, prompt = tiny_decoder(seed=seed), [4, 5]
    greedy = generate(model, [prompt], GenerationConfig(5, GREEDY))[0]
    beam = beam_search(model, [prompt], GenerationConfig(5, num_beams=4, length_penalty=0.0))[0][0]
    recomputed = logprob(model, prompt, beam.tokens)
    # The beams' cached K/V, reordered at every step, give the scores of a full forward.
    assert beam.score == pytest.approx(recomputed, abs=1e-4)
    assert recomputed >= logprob(model, prompt, greedy) - 1e-6


@pytest.mark.parametrize("family", ["decoder", "encoder_decoder"])
def test_enough_beams_make_the_search_exact(family):
    """W = V ** (N - 1) beams keep every prefix, so the result is the best of all V ** N outputs."""
    V, N = 5, 3
    model = tiny_decoder(vocab_size=V) if family == "decoder" else tiny_t5(vocab_size=V)
    prompt = [1, 2] if family == "decoder" else [0]
    src = None if family == "decoder" else torch.tensor([[1, 2, 3, 4]])
    beam = beam_search(
        model, [prompt], GenerationConfig(N, num_beams=V ** (N - 1), length_penalty=0.0), source=src
    )[0][0]
    with torch.no_grad():
        best = max(
            itertools.product(range(V), repeat=N),
            key=lambda seq: logprob(model, prompt, list(seq), src),
        )
        assert beam.tokens == list(best)
        assert beam.score == pytest.approx(logprob(model, prompt, list(best), src), abs=1e-4)
        greedy = generate(
            model,
            [prompt],
            GenerationConfig(N, GREEDY),
            source=src,
            source_mask=None if src is None else torch.ones_like(src).bool(),
        )[0]
        assert beam.score >= logprob(model, prompt, greedy, src) - 1e-6


# --- EOS, early stopping, length penalty ---------------------------------------------------
# P -> EOS finishes at once (0.2); P A C scores 0.7 * 0.8 = 0.56 and finishes next step (C -> EOS).
TABLE = {P: {A: 0.7, EOS: 0.2, B: 0.05}, A: {C: 0.8, EOS: 0.15}, B: {D: 0.9}, C: {EOS: 0.9}}


def test_beams_still_running_at_max_new_tokens_compete_with_finished_ones():
    """Two hypotheses finished ([EOS], [A EOS]) but the running [A C] is likelier than both: at
    max_new_tokens it competes as it is (transformers' finalize does the same)."""
    model = BigramLM(TABLE)
    beam = beam_search(
        model, [[P]], GenerationConfig(2, num_beams=2, stop_tokens=[EOS], length_penalty=0.0)
    )[0][0]
    assert beam.tokens == [A, C]
    assert beam.score == pytest.approx(math.log(0.7 * 0.8), abs=1e-5)
    greedy = generate(model, [[P]], GenerationConfig(2, GREEDY, stop_tokens=[EOS]))[0]
    assert logprob(model, [P], beam.tokens) >= logprob(model, [P], greedy)


def test_finished_hypotheses_keep_their_eos_and_early_stopping_stops_at_num_beams():
    model = BigramLM(TABLE)
    # Not early: it goes on while the running [A C] can still beat the finished, and wins.
    full = beam_search(
        model, [[P]], GenerationConfig(5, num_beams=2, stop_tokens=[EOS], length_penalty=0.0)
    )[0][0]
    assert full.tokens == [A, C, EOS]
    assert full.score == pytest.approx(math.log(0.7 * 0.8 * 0.9), abs=1e-5)
    # Early: it stops once 2 hypotheses ([EOS] and [A EOS]) are finished, and returns the better.
    early = beam_search(
        model,
        [[P]],
        GenerationConfig(
            5, num_beams=2, stop_tokens=[EOS], length_penalty=0.0, early_stopping=True
        ),
    )[0][0]
    assert early.tokens == [EOS]
    assert early.score == pytest.approx(math.log(0.2), abs=1e-5)


def test_length_penalty_divides_by_length_to_the_power():
    """[EOS]: log 0.4 = -0.92; [A C EOS]: log(0.35 * 0.9 * 0.9) = -1.26. Raw sums prefer the short
    one; divided by the length (1 vs 3) the long one wins."""
    model = BigramLM(
        {P: {EOS: 0.4, A: 0.35}, A: {C: 0.9}, B: {D: 0.9}, C: {EOS: 0.9}, D: {EOS: 0.9}}
    )
    raw = beam_search(
        model, [[P]], GenerationConfig(3, num_beams=2, stop_tokens=[EOS], length_penalty=0.0)
    )[0][0]
    per_token = beam_search(
        model, [[P]], GenerationConfig(3, num_beams=2, stop_tokens=[EOS], length_penalty=1.0)
    )[0][0]
    assert raw.tokens == [EOS] and per_token.tokens == [A, C, EOS]
    assert per_token.score == pytest.approx(math.log(0.35 * 0.9 * 0.9) / 3, abs=1e-5)


def test_several_eos_ids_can_fill_the_top_candidates():
    """With 4 EOS ids the 2 * W best extensions can all end: the others must still be reached."""
    model = BigramLM({P: {A: 0.3, B: 0.25, C: 0.2, D: 0.15, EOS: 0.07}})
    beam = beam_search(
        model, [[P]], GenerationConfig(3, num_beams=2, stop_tokens=[A, B, C, D], length_penalty=0.0)
    )[0][0]
    assert beam.tokens == [A] and beam.score == pytest.approx(math.log(0.3), abs=1e-5)


# --- encoder-decoder -----------------------------------------------------------------------
def test_encoder_decoder_beam_search_scores_its_hypothesis():
    model = tiny_t5()
    src = torch.tensor([[5, 6, 7, 8, 9, 1]])
    src_mask = torch.ones_like(src, dtype=torch.bool)
    beam = beam_search(
        model,
        [[0]],
        GenerationConfig(6, num_beams=3, stop_tokens=[1], length_penalty=0.0),
        source=src,
        source_mask=src_mask,
    )[0][0]
    assert 1 <= len(beam.tokens) <= 6 and 1 not in beam.tokens[:-1]
    with torch.no_grad():
        assert beam.score == pytest.approx(logprob(model, [0], beam.tokens, src), abs=1e-4)


# --- batches ----------------------------------------------------------------------------------
@pytest.mark.parametrize("position", ["rope", "learned", "alibi"])
def test_a_batch_gives_each_prompt_its_own_hypotheses(position):
    """Left padding and the B * W cache rows keep prompts apart: each row as if searched alone,
    its hypotheses best first, each scored by the recomputed log-probability."""
    model, prompts = tiny_decoder(position=position), [[4, 5], [1, 2, 3, 6, 7], [9]]
    batched = beam_search(
        model, prompts, GenerationConfig(5, num_beams=3, length_penalty=0.0, num_return_sequences=3)
    )
    alone = [
        beam_search(
            model, [p], GenerationConfig(5, num_beams=3, length_penalty=0.0, num_return_sequences=3)
        )[0]
        for p in prompts
    ]
    assert [[h.tokens for h in row] for row in batched] == [
        [h.tokens for h in row] for row in alone
    ]
    for prompt, row in zip(prompts, batched):
        assert [h.score for h in row] == sorted((h.score for h in row), reverse=True)
        for h in row:
            assert h.score == pytest.approx(logprob(model, prompt, h.tokens), abs=1e-4)


def test_num_return_sequences_must_fit_the_beams():
    with pytest.raises(
        ValueError, match=r"num_return_sequences must be in \[1, num_beams=2\], got 3"
    ):
        beam_search(tiny_decoder(), [[1]], GenerationConfig(3, num_beams=2, num_return_sequences=3))


# --- equal to transformers' generate(num_beams=..), row for row ------------------------------
HF_VOCAB = 96
HF_PAD = 1  # the id HF fills a row with after its hypothesis ends (-1 without an EOS id)
START = 0  # T5's decoder start
PROMPTS = [[5, 9, 17, 3, 44], [7, 8], [60, 2, 33, 71, 12, 90, 4, 25]]  # left-padded together
SEARCHES = [(3, 1.0, False), (4, 2.0, True), (4, 0.5, "never")]  # beams, penalty, stopping


def hf_tiny(family: str):
    """A tiny random-init transformers model (wide init: peaked, varied distributions)."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = T.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=HF_VOCAB, n_positions=64,
            initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=HF_PAD,
        )  # fmt: skip
        return T.GPT2LMHeadModel(cfg).eval()
    if family == "llama":
        cfg = T.LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=HF_VOCAB, max_position_embeddings=64,
            initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=HF_PAD,
        )  # fmt: skip
        return T.LlamaForCausalLM(cfg).eval()
    cfg = T.T5Config(
        d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=HF_VOCAB,
        initializer_factor=0.5, decoder_start_token_id=START, eos_token_id=None,
        pad_token_id=HF_PAD,
    )  # fmt: skip
    return T.T5ForConditionalGeneration(cfg).eval()


@pytest.fixture(scope="module", params=["gpt2", "llama", "t5"])
def hf_pair(request, tmp_path_factory):
    """(family, the transformers model, ours converted from its save_pretrained directory)."""
    from attnlab.interop.hf.auto import load_hf

    hf = hf_tiny(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    hf = type(hf).from_pretrained(path).eval()  # as stored
    ours, _ = load_hf(path)
    return request.param, hf, ours


@pytest.mark.hf
@pytest.mark.parametrize("with_eos", [False, True])
@pytest.mark.parametrize("num_beams, length_penalty, early_stopping", SEARCHES)
def test_batched_beam_search_equals_transformers(
    hf_pair, with_eos, num_beams, length_penalty, early_stopping
):
    """Prompts (or sources) of different lengths in one batch, 2 sequences returned for each:
    the same token ids as transformers, row for row, EOS (a token the model likes, so that some
    beams finish early) or none."""
    family, hf, ours = hf_pair
    n_new, n_return = 12, 2
    ids, mask = left_pad(PROMPTS, pad_id=HF_PAD)  # (B, T0)
    if family == "t5":  # the prompts are sources (right-padded, as a tokenizer pads them)
        src = torch.full_like(ids, HF_PAD)
        src_mask = torch.arange(ids.shape[1])[None, :] < mask.sum(1, keepdim=True)  # (B, M)
        src[src_mask] = ids[mask]
        prompts, source, source_mask = [[START]] * len(PROMPTS), src, src_mask
        hf_inputs = dict(input_ids=src, attention_mask=src_mask.long())
    else:
        prompts, source, source_mask = PROMPTS, None, None
        hf_inputs = dict(input_ids=ids, attention_mask=mask.long())
    eos = None
    if with_eos:  # the token greedy decoding writes most often: hypotheses end early
        greedy = generate(
            ours, prompts, GenerationConfig(n_new, GREEDY), source=source, source_mask=source_mask
        )
        eos = Counter(t for row in greedy for t in row).most_common(1)[0][0]
    with torch.no_grad():
        out = hf.generate(
            **hf_inputs,
            max_new_tokens=n_new,
            num_beams=num_beams,
            num_return_sequences=n_return,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=HF_PAD,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
    hyps = beam_search(
        ours,
        prompts,
        GenerationConfig(
            n_new,
            num_beams=num_beams,
            stop_tokens=[] if eos is None else [eos],
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            num_return_sequences=n_return,
        ),
        source=source,
        source_mask=source_mask,
    )
    rows = [h.tokens for per_prompt in hyps for h in per_prompt]  # (B * n_return) rows
    length = max(map(len, rows))
    fill = -1 if eos is None else HF_PAD
    start = 1 if family == "t5" else ids.shape[1]
    assert [r + [fill] * (length - len(r)) for r in rows] == out[:, start:].tolist()
    if eos is not None:
        assert any(r[-1] == eos and len(r) < n_new for r in rows)  # the EOS case is exercised
