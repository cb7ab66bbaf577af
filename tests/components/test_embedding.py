"""TokenEmbedding against F.embedding, weight tying, and id validation."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.components.embedding import TokenEmbedding, tie_weights

V, C = 50, 16


def test_plain_lookup_is_f_embedding():
    emb = TokenEmbedding(V, C)
    ids = torch.randint(0, V, (2, 7))
    assert torch.equal(emb(ids), F.embedding(ids, emb.weight))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_scaled_lookup_is_sqrt_d_times_plain(dtype):
    emb = TokenEmbedding(V, C, scale=True)
    ids = torch.randint(0, V, (2, 7), dtype=dtype)
    expected = math.sqrt(C) * F.embedding(ids.long(), emb.weight)  # Vaswani et al. 2017, §3.4
    torch.testing.assert_close(emb(ids), expected, atol=1e-6, rtol=0)


def test_normed_lookup_is_layer_norm_of_plain():
    """BLOOM's word_embeddings_layernorm; the decoder built with embed_norm holds it in .embed."""
    from attnlab.models.build import build_model
    from attnlab.models.config import ModelConfig

    norm = nn.LayerNorm(C)
    nn.init.normal_(norm.weight), nn.init.normal_(norm.bias)
    emb = TokenEmbedding(V, C, norm=norm)
    ids = torch.randint(0, V, (2, 7))
    expected = F.layer_norm(F.embedding(ids, emb.weight), (C,), norm.weight, norm.bias)
    torch.testing.assert_close(emb(ids), expected, atol=1e-6, rtol=0)
    cfg = ModelConfig("decoder", C, 1, V, 8, position="alibi", norm="layernorm", embed_norm=True)
    assert {"embed.norm.weight", "embed.norm.bias"} <= build_model(cfg).state_dict().keys()
    assert "embed.norm.weight" not in build_model(replace(cfg, embed_norm=False)).state_dict()


def test_tie_weights_shares_one_parameter():
    emb, head = TokenEmbedding(V, C), nn.Linear(C, V, bias=False)
    tie_weights(head, emb)
    assert head.weight is emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert sum(p.numel() for p in model.parameters()) == V * C  # counted once
    x = torch.randn(3, C)
    torch.testing.assert_close(head(x), x @ emb.weight.T)
    head(emb(torch.tensor([[1, 2]]))).sum().backward()
    assert emb.weight.grad is not None and head.weight.grad is emb.weight.grad


@pytest.mark.parametrize("bad", [V, V + 7, -1])
def test_out_of_range_ids_raise_naming_the_id(bad):
    emb = TokenEmbedding(V, C)
    ids = torch.tensor([[0, 3, bad, 4]])
    with pytest.raises(ValueError) as err:
        emb(ids)
    assert f"token id {bad} " in str(err.value) and str(V) in str(err.value)


def test_float_ids_raise():
    with pytest.raises(ValueError, match="torch.float32"):
        TokenEmbedding(V, C)(torch.zeros(1, 3))


def test_largest_valid_id_is_accepted():
    emb = TokenEmbedding(V, C)
    assert emb(torch.tensor([[0, V - 1]])).shape == (1, 2, C)
