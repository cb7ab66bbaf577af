"""GPT-2: logits, greedy and beam search identical to transformers; export and round trips."""

import pytest
import torch

from attnlab.inference.beam import beam_search
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.interop.hf import gpt2, load_hf, save_hf
from tests.interop.helpers import ATOL, VOCAB, max_diff, padded_batch, same_state

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

GREEDY = SamplingConfig(temperature=0)
PROMPTS = [[5, 9, 17, 3, 44], [7, 8, 100]]


def tiny(**overrides):
    torch.manual_seed(0)
    cfg = dict(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return T.GPT2LMHeadModel(T.GPT2Config(**cfg | overrides)).eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = tiny()
    path = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(path)
    ours, cfg = load_hf(path)
    return hf, ours, cfg, path


def hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask.long()).logits


def test_config_and_tie(pair):
    _, ours, cfg, _ = pair
    assert (cfg.d_model, cfg.n_layers, cfg.attention.n_heads, cfg.activation) == (
        64,
        2,
        4,
        "gelu_tanh",
    )
    assert cfg.tie_embeddings and ours.head.weight is ours.embed.weight


def test_logits_match_with_padding(pair):
    hf, ours, _, _ = pair
    ids, mask = padded_batch()
    with torch.no_grad():
        assert max_diff(ours(ids, mask), hf_logits(hf, ids, mask), mask) <= ATOL


def test_greedy_20_tokens_match_generate(pair):
    hf, ours, _, _ = pair
    T0 = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (T0 - len(p)) + p for p in PROMPTS])  # left padding, as HF wants
    mask = torch.tensor([[0] * (T0 - len(p)) + [1] * len(p) for p in PROMPTS])
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=20,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert generate(ours, PROMPTS, GenerationConfig(20, GREEDY)) == out[:, T0:].tolist()


@pytest.mark.parametrize(
    "length_penalty, early_stopping", [(1.0, False), (2.0, True), (0.5, "never")]
)
def test_beam_search_matches_generate(pair, length_penalty, early_stopping):
    hf, ours, _, _ = pair
    prompt = PROMPTS[0]
    eos = generate(ours, [prompt], GenerationConfig(4, GREEDY))[0][
        -1
    ]  # a token the model likes: beams finish
    out = hf.generate(
        input_ids=torch.tensor([prompt]),
        max_new_tokens=20,
        num_beams=4,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    best = beam_search(
        ours,
        [prompt],
        GenerationConfig(
            20,
            num_beams=4,
            stop_tokens=[eos],
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        ),
    )[0][0]
    assert best.tokens == out[0, len(prompt) :].tolist()


def test_export_loads_in_transformers(pair, tmp_path):
    hf, ours, cfg, _ = pair
    save_hf(ours, cfg, tmp_path)
    back = T.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    ids, mask = padded_batch(seed=1)
    assert max_diff(hf_logits(back, ids, mask), hf_logits(hf, ids, mask), mask) == 0.0
    assert same_state(back.state_dict(), hf.state_dict())


def test_attnlab_hf_attnlab_is_identity(pair, tmp_path):
    _, ours, cfg, _ = pair
    gpt2.save_hf(ours, cfg, tmp_path)
    again, cfg2 = gpt2.load_hf(tmp_path)
    assert cfg2 == cfg and same_state(again.state_dict(), ours.state_dict())


def test_untied_head(tmp_path):
    hf = tiny(tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    ours, cfg = load_hf(tmp_path)
    assert not cfg.tie_embeddings and ours.head.weight is not ours.embed.weight
    ids, mask = padded_batch(seed=2)
    with torch.no_grad():
        assert max_diff(ours(ids, mask), hf_logits(hf, ids, mask), mask) <= ATOL
