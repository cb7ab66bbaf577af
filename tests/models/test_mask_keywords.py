"""Every family takes its padding masks under the same keyword names (those of `transformers`):
`attention_mask` for the input (the source, for encoder-decoders), `decoder_attention_mask` for
an encoder-decoder's target."""

import inspect
from dataclasses import replace

import pytest
import torch

from attnlab.models.build import build_model
from attnlab.models.decoder import DecoderLM
from attnlab.models.encoder import Encoder, EncoderForClassification, EncoderForMLM
from attnlab.models.encoder_decoder import EncoderDecoder
from attnlab.models.presets import get_preset
from attnlab.models.vision import PrefixVisionLM, VisionEncoderDecoder


@pytest.mark.parametrize(
    "cls",
    [
        DecoderLM,
        Encoder,
        EncoderForMLM,
        EncoderForClassification,
        EncoderDecoder,
        VisionEncoderDecoder,
        PrefixVisionLM,
    ],
)
def test_every_family_names_its_padding_mask_attention_mask(cls):
    assert "attention_mask" in inspect.signature(cls.forward).parameters


def test_encoder_decoder_masks_are_keywords():
    params = inspect.signature(EncoderDecoder.forward).parameters
    for name in ("attention_mask", "decoder_attention_mask"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY


def test_encoder_decoder_masks_by_keyword_reach_their_stacks():
    torch.manual_seed(0)
    cfg = replace(get_preset("t5-tiny"), vocab_size=32)
    model = build_model(cfg).eval()
    src, tgt = torch.randint(0, 32, (1, 6)), torch.randint(0, 32, (1, 4))
    pad_src = torch.cat([src, torch.randint(0, 32, (1, 3))], 1)  # 3 padding tokens after
    src_mask = torch.tensor([[True] * 6 + [False] * 3])
    pad_tgt = torch.cat([tgt, torch.randint(0, 32, (1, 2))], 1)
    tgt_mask = torch.tensor([[True] * 4 + [False] * 2])
    with torch.no_grad():
        alone = model(src, tgt)
        padded = model(pad_src, pad_tgt, attention_mask=src_mask, decoder_attention_mask=tgt_mask)
    torch.testing.assert_close(padded[:, :4], alone, atol=1e-5, rtol=0)
    with pytest.raises(TypeError):
        model(pad_src, pad_tgt, src_mask, tgt_mask)  # positional masks are not accepted
