"""Encoder and decoder blocks against torch.nn.TransformerEncoderLayer / TransformerDecoderLayer.

Our pieces are built directly from attnlab.components and the torch layer's weights are copied in:
self_attn / multihead_attn -> self_attn / cross_attn, linear1 -> up_proj, linear2 -> down_proj,
norm1..3 -> residuals[0..2].norm. torch's padding masks mean True = IGNORE, ours True = attend.
"""

import pytest
import torch
from torch import nn

from attnlab.components.attention import Attention
from attnlab.components.blocks import DecoderBlock, EncoderBlock, Residual
from attnlab.components.ffn import MLP
from attnlab.components.norms import LayerNorm
from tests.components.helpers import context

B, T, S, C, H, FF = 2, 6, 5, 32, 4, 64
ATOL = 1e-5  # fp32, max abs difference
PLACEMENTS = {False: "post", True: "pre"}  # torch's norm_first -> our placement


def _close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


@torch.no_grad()
def _randomise(layer: nn.Module) -> nn.Module:
    """Random values everywhere: a bias or norm weight left uncopied cannot pass as 0 or 1."""
    for p in layer.parameters():
        p.normal_(std=0.2)
    return layer.eval()


@torch.no_grad()
def _copy_attention(ours: Attention, mha: nn.MultiheadAttention) -> None:
    wq, wk, wv = mha.in_proj_weight.chunk(3)
    bq, bk, bv = mha.in_proj_bias.chunk(3)
    for proj, w, b in ((ours.q_proj, wq, bq), (ours.k_proj, wk, bk), (ours.v_proj, wv, bv)):
        proj.weight.copy_(w)
        proj.bias.copy_(b)
    ours.o_proj.weight.copy_(mha.out_proj.weight)
    ours.o_proj.bias.copy_(mha.out_proj.bias)


@torch.no_grad()
def _copy_common(ours: DecoderBlock, ref: nn.Module, norms: list[nn.LayerNorm]) -> None:
    _copy_attention(ours.self_attn, ref.self_attn)
    ours.ffn.up_proj.load_state_dict(ref.linear1.state_dict())
    ours.ffn.down_proj.load_state_dict(ref.linear2.state_dict())
    for residual, norm in zip(ours.residuals, norms, strict=True):
        residual.norm.load_state_dict(norm.state_dict())


def _attention(cross=False):
    return Attention(C, H, qkv_bias=True, out_bias=True, cross=cross)


def _valid(lengths, n):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, n), True = real token


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_block_matches_torch(norm_first):
    ref = _randomise(
        nn.TransformerEncoderLayer(
            C, H, FF, dropout=0.0, activation="relu", batch_first=True, norm_first=norm_first
        )
    )
    ours = EncoderBlock(
        _attention(),
        MLP(C, FF, activation="relu"),
        [LayerNorm(C), LayerNorm(C)],
        placement=PLACEMENTS[norm_first],
    ).eval()
    _copy_common(ours, ref, [ref.norm1, ref.norm2])
    x = torch.randn(B, T, C)
    valid = _valid([T, 4], T)
    expected = ref(x, src_key_padding_mask=~valid)
    _close(ours(x, context(x, valid[:, None, None, :])), expected)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("causal_as", ["flag", "mask"])
def test_decoder_block_with_cross_attention_matches_torch(norm_first, causal_as):
    ref = _randomise(
        nn.TransformerDecoderLayer(
            C, H, FF, dropout=0.0, activation="relu", batch_first=True, norm_first=norm_first
        )
    )
    ours = DecoderBlock(
        _attention(),
        MLP(C, FF, activation="relu"),
        [LayerNorm(C), LayerNorm(C), LayerNorm(C)],
        cross_attn=_attention(cross=True),
        placement=PLACEMENTS[norm_first],
    ).eval()
    _copy_common(ours, ref, [ref.norm1, ref.norm2, ref.norm3])
    _copy_attention(ours.cross_attn, ref.multihead_attn)
    x, memory = torch.randn(B, T, C), torch.randn(B, S, C)
    memory_valid = _valid([S, 2], S)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(T)  # float, -inf above the diagonal
    expected = ref(x, memory, tgt_mask=tgt_mask, memory_key_padding_mask=~memory_valid)
    if causal_as == "flag":
        out = ours(
            x,
            context(x, is_causal=True, memory=memory, memory_mask=memory_valid[:, None, None, :]),
        )
    else:
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        out = ours(x, context(x, causal, memory=memory, memory_mask=memory_valid[:, None, None, :]))
    _close(out, expected)


def test_decoder_only_block_is_encoder_layer_with_causal_mask():
    # A decoder block without cross-attention is an encoder layer with a causal self-attention mask.
    ref = _randomise(
        nn.TransformerEncoderLayer(
            C, H, FF, dropout=0.0, activation="relu", batch_first=True, norm_first=True
        )
    )
    ours = DecoderBlock(
        _attention(), MLP(C, FF, activation="relu"), [LayerNorm(C), LayerNorm(C)]
    ).eval()
    _copy_common(ours, ref, [ref.norm1, ref.norm2])
    x = torch.randn(B, T, C)
    expected = ref(x, src_mask=nn.Transformer.generate_square_subsequent_mask(T))
    _close(ours(x, context(x, is_causal=True)), expected)


def test_wrong_number_of_norms_raises():
    with pytest.raises(ValueError, match="3 sublayers but got 2"):
        DecoderBlock(_attention(), MLP(C, FF), [LayerNorm(C)] * 2, cross_attn=_attention(True))
    with pytest.raises(ValueError, match="2 sublayers but got 3"):
        EncoderBlock(_attention(), MLP(C, FF), [LayerNorm(C)] * 3)


def test_unknown_placement_raises():
    with pytest.raises(ValueError, match="'middle'"):
        Residual(LayerNorm(C), "middle", 0.0)
