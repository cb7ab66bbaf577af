"""The config fields of the newer dense families (Qwen3, OLMo 2, Gemma 2/3): what they build,
what the windowed and global layers see, and one-line errors naming the field."""

from dataclasses import replace

import pytest
import torch

from attnlab.components.norms import RMSNorm
from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig, RopeConfig
from attnlab.models.presets import get_preset


def test_is_local_follows_the_pattern():
    a = AttentionConfig(sliding_window=4, global_every=3)
    assert [a.is_local(i) for i in range(6)] == [True, True, False, True, True, False]
    assert AttentionConfig(sliding_window=4).is_local(5)  # no pattern: every layer windowed
    assert not AttentionConfig().is_local(0)


def _reach(cfg: ModelConfig, T: int = 20) -> bool:
    """Whether token 0 changes the last position's logits (T - 1 tokens later)."""
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    other = ids.clone()
    other[0, 0] = (ids[0, 0] + 1) % cfg.vocab_size
    with torch.no_grad():
        return not torch.allclose(model(ids)[0, -1], model(other)[0, -1])


def test_a_global_layer_sees_past_the_window():
    """Two layers of window 8 reach 14 tokens back; one global layer of two reaches all 19."""
    cfg = get_preset("gemma3-tiny")  # window 8 on layer 0, layer 1 global
    assert _reach(cfg)
    attention, rope = replace(cfg.attention, global_every=None), replace(cfg.rope, local_theta=None)
    assert not _reach(replace(cfg, attention=attention, rope=rope))  # every layer windowed


def test_norm_placements_build_their_norms():
    cfg = get_preset("gemma2-tiny")
    r = build_model(cfg).blocks[0].residuals[0]
    assert isinstance(r.norm, RMSNorm) and isinstance(r.out_norm, RMSNorm)
    assert r.norm.unit_offset and torch.equal(r.norm.weight, torch.zeros(64))
    olmo = build_model(get_preset("olmo2-tiny")).blocks[0].residuals[1]
    assert isinstance(olmo.norm, torch.nn.Identity) and isinstance(olmo.out_norm, RMSNorm)
    assert isinstance(build_model(get_preset("olmo2-tiny")).norm, RMSNorm)  # a final norm too


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: AttentionConfig(logit_softcap=50.0), "logit_softcap=50.0 .*backend='eager'"),
        (lambda: AttentionConfig(global_every=2), "global_every=2 .*sliding_window"),
        (lambda: AttentionConfig(sliding_window=4, global_every=1), "global_every must be >= 2"),
        (
            lambda: replace(get_preset("llama-tiny"), rope=RopeConfig(local_theta=1e4)),
            "rope.local_theta=10000.0 .*global_every",
        ),
        (
            lambda: replace(get_preset("gpt2-tiny"), norm_unit_offset=True),
            "norm_unit_offset .*norm='layernorm'",
        ),
        (lambda: replace(get_preset("llama-tiny"), logit_softcap=0.0), "logit_softcap must be"),
    ],
)
def test_bad_fields_are_named_in_one_line(build, match):
    with pytest.raises(ValueError, match=match) as err:
        build()
    assert "\n" not in str(err.value)


def test_windowed_layers_count_only_their_window_of_keys():
    """gemma2-tiny at 32 keys: layer 1 (global) sees 32, layer 0 its window of 8 (4 H D each)."""
    from attnlab.models.inspect import flops_split

    cfg = get_preset("gemma2-tiny")
    H, D = cfg.attention.n_heads, cfg.head_dim
    assert flops_split(cfg, 32)["attention scores"] == 4 * H * D * (32 + 8)
    assert flops_split(cfg, 6)["attention scores"] == 4 * H * D * (6 + 6)  # inside the window


def test_embedding_scale_rounds_like_gemma_in_bf16():
    """Gemma scales by sqrt(C) cast to the weights' dtype first (HF's Gemma2/3
    TextScaledWordEmbedding: sqrt(3072) = 55.43 becomes 55.5 in bf16), not by the exact value."""
    from attnlab.components.embedding import TokenEmbedding

    ours = TokenEmbedding(10, 3072, scale=True).to(torch.bfloat16)
    ids = torch.arange(10)[None]
    rounded = torch.tensor(3072**0.5, dtype=torch.bfloat16)
    assert rounded.item() == 55.5
    assert torch.equal(ours(ids), ours.weight[ids] * rounded)
