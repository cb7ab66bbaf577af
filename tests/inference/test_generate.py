"""Generation: stop tokens and stop strings, left-padded batches, streaming, length limits, errors.

Most tests drive `generate` with `ScriptedLM`, a stand-in decoder whose logits force a chosen
sequence (one token per call), so the expected output is known before it runs and the number of
model calls shows exactly when generation stopped.
"""

import warnings
from dataclasses import replace
from functools import partial

import pytest
import torch
from torch import nn

from attnlab.components.positions.base import NoPosition
from attnlab.inference.beam import beam_search
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import (
    ContextCropWarning,
    generate,
    generate_text,
    stream_tokens,
)
from attnlab.inference.sampling import SamplingConfig
from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig
from attnlab.models.presets import get_preset
from attnlab.tokenizer import train_char_tokenizer

GREEDY = SamplingConfig(temperature=0.0)
VOCAB = 23
EOS = 3


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread: reproducible, and no threads spinning against each other on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ScriptedLM(nn.Module):
    """A stand-in decoder: call i (the prefill is call 0, each decode step adds one) puts all
    the probability of row b on scripts[b][i]. No blocks, so its ModelCache holds no layers.

    Args:
        scripts: one token list per batch row.  vocab_size: V.
    """

    def __init__(self, scripts: list[list[int]], vocab_size: int):
        super().__init__()
        self.head = nn.Linear(1, vocab_size, bias=False)  # generate reads V and the device here
        self.embed = nn.Embedding(vocab_size, 1)  # the KV cache takes its dtype from here
        self.blocks = nn.ModuleList()
        self.positions = NoPosition()
        self.scripts, self.calls = scripts, 0

    def forward(self, ids, attention_mask=None, **_):
        B, T = ids.shape
        logits = torch.full((B, T, self.head.out_features), -50.0)
        for b in range(B):
            logits[b, :, self.scripts[b][min(self.calls, len(self.scripts[b]) - 1)]] = 50.0
        self.calls += 1
        return logits  # (B, T, V)


def tiny_decoder(position: str = "rope", max_seq_len: int = 12) -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="decoder",
        d_model=32,
        n_layers=2,
        vocab_size=VOCAB,
        max_seq_len=max_seq_len,
        d_ff=32,
        position=position,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2),
    )
    return build_model(cfg).eval()


# --- stop tokens ---------------------------------------------------------------------------
def test_each_row_stops_at_and_keeps_its_first_stop_token():
    model = ScriptedLM([[5, 6, EOS, 7, 8, 9], [7, 8, 9, 10, 11, 12]], VOCAB)
    out = generate(model, [[1], [2]], GenerationConfig(6, GREEDY, stop_tokens=[EOS]))
    assert out == [[5, 6, EOS], [7, 8, 9, 10, 11, 12]]


def test_generation_ends_once_every_row_has_stopped():
    model = ScriptedLM([[5, EOS, 7, 8, 9, 10], [7, 8, 9, 10, 11, 12]], VOCAB)
    out = generate(
        model, [[1], [2]], GenerationConfig(6, GREEDY, stop_tokens=[EOS, 9])
    )  # any of several ids
    assert out == [[5, EOS], [7, 8, 9]]
    assert model.calls == 3  # prefill + 2 steps: nothing is computed after the last stop


def test_stream_tokens_repeats_the_stop_token_of_finished_rows():
    """Documented: a finished row keeps yielding its stop token until every row is done."""
    model = ScriptedLM([[5, EOS, 7, 8], [7, 8, 9, EOS]], VOCAB)
    steps = [
        t.tolist()
        for t in stream_tokens(model, [[1], [2]], GenerationConfig(6, GREEDY, stop_tokens=[EOS]))
    ]
    assert steps == [[5, 7], [EOS, 8], [EOS, 9], [EOS, EOS]]


# --- stop strings --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def char_tok():
    return train_char_tokenizer(["abcdefghijklmnopqrstuvwxyz .,!"])


def scripted_text(tok, *texts: str) -> ScriptedLM:
    return ScriptedLM([tok.encode(t) for t in texts], tok.vocab_size)


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("we are at the end. more text", ["end."], "we are at the end."),
        ("then the end is near", ["the end"], "then the end"),  # "the" of "then" is no stop
        ("abc, then xyz. then more", ["more", "xyz."], "abc, then xyz."),  # the earliest wins
        ("no stop in here", ["zzz"], "no stop in here"),
    ],
)
def test_stop_strings_spanning_tokens_cut_right_after_the_string(char_tok, text, stops, expected):
    model = scripted_text(char_tok, text)
    out = generate(
        model,
        [char_tok.encode("x")],
        GenerationConfig(len(text), GREEDY, stop_strings=stops),
        decode=char_tok.decode,
    )
    assert char_tok.decode(out[0]) == expected
    assert model.calls == len(expected)  # it stopped there, not at max_new_tokens


def test_stop_strings_cut_each_row_of_a_batch(char_tok):
    model = scripted_text(char_tok, "ab stop cd efgh", "abcdefg stop hi")
    out = generate(
        model,
        [char_tok.encode("x")] * 2,
        GenerationConfig(15, GREEDY, stop_strings=["stop"]),
        decode=char_tok.decode,
    )
    assert [char_tok.decode(r) for r in out] == ["ab stop", "abcdefg stop"]


def test_stop_string_completed_inside_a_multi_character_token():
    """With multi-character tokens the token that completes the string is kept, whole."""
    pieces = ["ab", "c en", "d.x", "yz", "!!"]

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    model = ScriptedLM([[0, 1, 2, 3, 4]], len(pieces))
    out = generate(model, [[0]], GenerationConfig(5, GREEDY, stop_strings=["end."]), decode=decode)
    assert out == [[0, 1, 2]] and decode(out[0]) == "abc end.x"


def test_generate_text_streams_pieces_that_add_up_to_the_result(char_tok):
    model = scripted_text(char_tok, "to be or not to be")
    pieces = []
    text = generate_text(
        model,
        char_tok,
        "x",
        GenerationConfig(30, GREEDY, stop_strings=["not"]),
        on_text=pieces.append,
    )
    assert text == "to be or not"
    assert "".join(pieces) == text and len(pieces) == len(text)  # one piece per character


# --- batches with left padding -------------------------------------------------------------
@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal", "alibi", "t5_bias"])
def test_left_padded_batch_gives_each_prompt_its_own_greedy_tokens(position):
    model = tiny_decoder(position)
    prompts = [[1], [4, 5, 6, 7, 8], [9, 10, 11]]
    batched = generate(model, prompts, GenerationConfig(6, GREEDY))
    alone = [generate(model, [p], GenerationConfig(6, GREEDY))[0] for p in prompts]
    assert batched == alone


# --- streaming -----------------------------------------------------------------------------
def test_on_token_sees_each_token_before_the_next_step_is_computed():
    model = ScriptedLM([[5, 6, 7, 8, 9]], VOCAB)
    seen = []  # (model calls so far, token)
    out = generate(
        model,
        [[1]],
        GenerationConfig(5, GREEDY),
        on_token=lambda t: seen.append((model.calls, t.item())),
    )
    # Token i comes from call i (prefill = call 0): it is handed out when i + 1 calls were made.
    assert seen == [(i + 1, t) for i, t in enumerate([5, 6, 7, 8, 9])]
    assert out == [[5, 6, 7, 8, 9]]


def test_stream_tokens_is_lazy_and_leaves_grad_mode_alone():
    model = ScriptedLM([[5, 6, 7, 8]], VOCAB)
    stream = stream_tokens(model, [[1]], GenerationConfig(4, GREEDY))
    assert model.calls == 0  # nothing runs before the first token is asked for
    for i, token in enumerate(stream):
        assert model.calls == i + 1 and token.tolist() == [[5, 6, 7, 8][i]]
        assert torch.is_grad_enabled()  # no_grad applies inside the generator only


def test_streamed_tokens_equal_the_returned_tokens():
    model = tiny_decoder()
    prompts, cfg = [[1, 2, 3], [4]], SamplingConfig(temperature=1.0, top_k=10)
    streamed = []
    out = generate(
        model,
        prompts,
        GenerationConfig(8, cfg, seed=3),
        on_token=lambda t: streamed.append(t.tolist()),
    )
    assert [list(r) for r in zip(*streamed)] == out
    from_iterator = [
        t.tolist() for t in stream_tokens(model, prompts, GenerationConfig(8, cfg, seed=3))
    ]
    assert from_iterator == streamed


# --- length limits -------------------------------------------------------------------------
def test_max_total_len_caps_the_longest_prompt_plus_new_tokens():
    model = ScriptedLM([list(range(5, 15))] * 2, VOCAB)
    out = generate(model, [[1, 2], [3, 4, 5, 6]], GenerationConfig(10, GREEDY, max_total_len=7))
    assert [len(r) for r in out] == [3, 3]  # 4 + 3 = 7
    with pytest.raises(ValueError, match="max_total_len=4"):
        generate(model, [[1, 2], [3, 4, 5, 6]], GenerationConfig(10, GREEDY, max_total_len=4))


# --- errors --------------------------------------------------------------------------------
def test_empty_prompt_is_an_error():
    with pytest.raises(ValueError, match="empty prompt"):
        generate(tiny_decoder(), [[1, 2], []], GenerationConfig(3))
    with pytest.raises(ValueError, match="empty prompt"):
        beam_search(tiny_decoder(), [[1], []], GenerationConfig(3, num_beams=2))


# --- the context crop ----------------------------------------------------------------------
@torch.no_grad()
def cropped_reference(model, prompt: list[int], n: int, window: int, keep: int) -> list[int]:
    """Greedy tokens without a cache, each from one full forward over the visible text, cropped
    as documented: once the text outgrows `window` tokens, it continues from its last `keep`."""
    seq, start = list(prompt), 0
    for _ in range(n):
        if len(seq) - start > window:
            start = len(seq) - keep
        logits = model(torch.tensor([seq[start:]]))[0, -1]  # (V,)
        seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("position", ["learned", "sinusoidal"])
def test_a_position_table_crops_the_context_as_a_no_cache_reference(position):
    """Prompt + new tokens pass the 12 positions: generation goes on from the last 12 tokens,
    row by row in a left-padded batch, with a one-line notice."""
    model = tiny_decoder(position, max_seq_len=12)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], list(range(1, 16))]  # the last: > 12
    notices = []
    out = generate(model, prompts, GenerationConfig(10, GREEDY), on_notice=notices.append)
    assert out == [cropped_reference(model, p, 10, 12, 12) for p in prompts]
    assert len(notices) == 1 and "12 positions" in notices[0] and "\n" not in notices[0]
    with pytest.warns(ContextCropWarning, match="12 positions"):
        assert generate(model, prompts[:1], GenerationConfig(10, GREEDY)) == out[:1]
    with pytest.warns(ContextCropWarning, match="12 positions"):  # the table binds first
        assert generate(model, prompts[:1], GenerationConfig(10, GREEDY, max_context=50)) == out[:1]


def test_an_encoder_decoder_crops_its_decoder_context_and_keeps_the_source():
    """The 2017 model's sinusoidal table, cut to 8 positions: the decoder side is cropped, the
    refilled cache cross-attends to the same source."""
    torch.manual_seed(0)
    cfg = replace(get_preset("transformer-tiny"), d_model=32, d_ff=32, vocab_size=VOCAB)
    model = build_model(replace(cfg, max_seq_len=8)).eval()
    src = torch.tensor([[4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 0, 0, 0, 0, 0]])
    src_mask = src != 0
    notices = []
    out = generate(
        model,
        [[1], [1]],
        GenerationConfig(12, GREEDY),
        source=src,
        source_mask=src_mask,
        on_notice=notices.append,
    )
    assert len(notices) == 1
    for b, n in enumerate(src_mask.sum(1).tolist()):
        row = partial(model, src[b : b + 1, :n])  # ids -> logits against this source, unpadded
        assert out[b] == cropped_reference(row, [1], 12, 8, 8)


def test_prompt_plus_new_tokens_that_fit_the_table_are_not_cropped():
    model = tiny_decoder("learned", max_seq_len=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no notice
        out = generate(model, [[1] * 8], GenerationConfig(4, GREEDY))  # 8 + 4 = 12 fits exactly
    assert out == [cropped_reference(model, [1] * 8, 4, 100, 100)]


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_max_context_and_crop_to_refill_from_the_last_tokens(position):
    """A smaller window than the table (as LMTask.sample uses the trained context), refilled
    from its last half: no notice (the caller chose it), tokens as the reference's."""
    model = tiny_decoder(position, max_seq_len=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = generate(model, [[5, 6, 7]], GenerationConfig(14, GREEDY, max_context=6, crop_to=3))
    assert out == [cropped_reference(model, [5, 6, 7], 14, 6, 3)]
    with pytest.raises(ValueError, match=r"crop_to must be in \[1, 6\].*got 7"):
        generate(model, [[5, 6, 7]], GenerationConfig(14, GREEDY, max_context=6, crop_to=7))
    with pytest.raises(ValueError, match="max_context must be >= 1, got 0"):
        generate(model, [[5, 6, 7]], GenerationConfig(14, GREEDY, max_context=0))


def test_beam_search_names_the_numbers_past_a_learned_table():
    model = tiny_decoder("learned", max_seq_len=12)
    with pytest.raises(ValueError) as err:
        beam_search(model, [[1] * 8], GenerationConfig(5, num_beams=2))
    assert all(str(n) in str(err.value) for n in (8, 5, 12))


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, -1])
def test_token_ids_outside_the_vocabulary_are_named(bad):
    with pytest.raises(ValueError) as err:
        generate(tiny_decoder(), [[1, 2], [3, bad]], GenerationConfig(3))
    assert f"token id {bad}" in str(err.value) and f"[0, {VOCAB})" in str(err.value)


@pytest.mark.parametrize("num_beams", [0, -2])
def test_num_beams_below_one_is_an_error(num_beams, char_tok):
    with pytest.raises(ValueError, match=f"num_beams must be >= 1, got {num_beams}"):
        beam_search(tiny_decoder(), [[1, 2]], GenerationConfig(3, num_beams=num_beams))
    model = scripted_text(char_tok, "abc")
    with pytest.raises(ValueError, match=f"num_beams must be >= 1, got {num_beams}"):
        generate_text(model, char_tok, "x", GenerationConfig(3, num_beams=num_beams))


def test_other_bad_arguments_are_errors():
    model = ScriptedLM([[5, 6]], VOCAB)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        generate(model, [[1]], GenerationConfig(0))
    with pytest.raises(ValueError, match="decode"):
        generate(model, [[1]], GenerationConfig(2, stop_strings=["x"]))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        beam_search(tiny_decoder(), [[1]], GenerationConfig(0, num_beams=2))


# --- text in, text out ---------------------------------------------------------------------
def test_generate_text_reads_the_prompt_as_the_source_of_an_encoder_decoder(char_tok):
    torch.manual_seed(0)
    cfg = replace(get_preset("t5-tiny"), d_model=32, d_ff=32, vocab_size=char_tok.vocab_size)
    model = build_model(cfg).eval()
    eos, bos = char_tok.token_id("<eos>"), char_tok.token_id("<bos>")
    prompt = "abc"
    src = torch.tensor([char_tok.encode(prompt) + [eos]])
    expected = generate(
        model,
        [[bos]],
        GenerationConfig(6, GREEDY, stop_tokens=[eos]),
        source=src,
        source_mask=torch.ones_like(src, dtype=torch.bool),
    )[0]
    assert generate_text(model, char_tok, prompt, GenerationConfig(6, GREEDY)) == char_tok.decode(
        expected
    )
    beam = generate_text(model, char_tok, prompt, GenerationConfig(6, num_beams=3))
    assert isinstance(beam, str)
    with pytest.raises(ValueError, match="deterministic"):
        generate_text(
            model, char_tok, prompt, GenerationConfig(6, SamplingConfig(top_k=3), num_beams=3)
        )
