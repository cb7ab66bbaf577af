"""T5 v1.0 (ReLU, tied, head rescale) and v1.1 (gated GELU, untied): logits with padding,
encoder hidden states, greedy and beam search identical to transformers, export."""

import pytest
import torch
from torch import nn

from attnlab.inference.beam import beam_search
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.interop.hf import load_hf, save_hf, t5
from tests.interop.helpers import ATOL, VOCAB, max_diff, padded_batch, same_state

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

CONFIG = dict(
    d_model=64,
    d_kv=16,
    d_ff=128,
    num_layers=2,
    num_heads=4,
    vocab_size=VOCAB,
    initializer_factor=0.5,
)
VERSIONS = {"v1.0": {}, "v1.1": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}}
START = 0  # decoder_start_token_id


def tiny(version: str):
    torch.manual_seed(0)
    hf = T.T5ForConditionalGeneration(T.T5Config(**CONFIG | VERSIONS[version]))
    if version == "v1.1":  # transformers 5 builds T5 tied; v1.1 checkpoints store their own head
        hf.lm_head.weight = nn.Parameter(torch.randn(VOCAB, 64) * 0.5)
    return hf.eval()


@pytest.fixture(scope="module", params=sorted(VERSIONS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"t5-{request.param}")
    tiny(request.param).save_pretrained(path)
    hf = T.T5ForConditionalGeneration.from_pretrained(path).eval()  # loads untied as stored
    ours, cfg = load_hf(path)
    return request.param, hf, ours, cfg


def test_config(pair):
    version, _, ours, cfg = pair
    tied = version == "v1.0"
    assert (cfg.tie_embeddings, cfg.head_rescale) == (tied, tied)
    assert (cfg.ffn, cfg.activation) == (("mlp", "relu") if tied else ("geglu", "gelu_tanh"))
    assert (ours.decoder.head.weight is ours.encoder.embed.weight) == tied
    assert ours.decoder.embed is ours.encoder.embed  # one shared embedding, as HF's `shared`


def test_logits_and_encoder_states_with_padding(pair):
    _, hf, ours, _ = pair
    src, src_mask = padded_batch(T=11, seed=5)
    tgt, tgt_mask = padded_batch(T=7, seed=6, lengths=(7, 4, 2))
    with torch.no_grad():
        out = hf(
            input_ids=src,
            attention_mask=src_mask.long(),
            decoder_input_ids=tgt,
            decoder_attention_mask=tgt_mask.long(),
        )
        assert max_diff(ours.encode(src, src_mask), out.encoder_last_hidden_state, src_mask) <= ATOL
        assert (
            max_diff(
                ours(src, tgt, attention_mask=src_mask, decoder_attention_mask=tgt_mask),
                out.logits,
                tgt_mask,
            )
            <= ATOL
        )


def test_greedy_20_tokens_match_generate(pair):
    _, hf, ours, _ = pair
    src, src_mask = padded_batch(B=2, T=9, seed=7, lengths=(9, 6))
    out = hf.generate(
        input_ids=src,
        attention_mask=src_mask.long(),
        max_new_tokens=20,
        do_sample=False,
        eos_token_id=None,
        decoder_start_token_id=START,
    )
    mine = generate(
        ours,
        [[START], [START]],
        GenerationConfig(20, SamplingConfig(temperature=0)),
        source=src,
        source_mask=src_mask,
    )
    assert mine == out[:, 1:].tolist()


def test_beam_search_matches_generate(pair):
    version, hf, ours, _ = pair
    length_penalty, early_stopping = {"v1.0": (1.0, False), "v1.1": (2.0, True)}[version]
    src = padded_batch(B=1, T=9, seed=8, lengths=(9,))[0]
    with torch.no_grad():
        first = ours(src, torch.tensor([[START]]))[0, -1]  # (V,)
    eos = int(first.topk(2).indices[1])  # the runner-up first token: some beams end at once
    out = hf.generate(
        input_ids=src,
        max_new_tokens=20,
        num_beams=4,
        do_sample=False,
        eos_token_id=eos,
        decoder_start_token_id=START,
        pad_token_id=START,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    best = beam_search(
        ours,
        [[START]],
        GenerationConfig(
            20,
            num_beams=4,
            stop_tokens=[eos],
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        ),
        source=src,
    )[0][0]
    assert best.tokens == out[0, 1:].tolist()


def test_export_and_round_trip(pair, tmp_path):
    _, hf, ours, cfg = pair
    save_hf(ours, cfg, tmp_path / "hf")
    back = T.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    assert same_state(back.state_dict(), hf.state_dict())
    src, src_mask = padded_batch(T=8, seed=9)
    with torch.no_grad():
        a = back(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=src).logits
        b = hf(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=src).logits
    assert max_diff(a, b) == 0.0
    again, cfg2 = t5.load_hf(tmp_path / "hf")
    assert cfg2 == cfg and same_state(again.state_dict(), ours.state_dict())
