"""MultiHeadLatentAttention: shapes, the absorbed form against the plain one, its latent cache,
causality and RoPE's relative positions, and parity with transformers' DeepseekV3Attention."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.components.hooks import hooks
from attnlab.components.kv_cache import LatentCache
from attnlab.components.mla import MultiHeadLatentAttention
from attnlab.components.positions import ALiBi, RoPE
from tests.components.helpers import context

ATOL = 1e-5  # fp32, max abs difference
HF_ATOL = 1e-4
PROPERTY = settings(max_examples=15, deadline=None, derandomize=True)


def _close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def _mla(C=32, H=4, r=16, R=8, Dn=8, Dv=12, q_lora=None, **kw) -> MultiHeadLatentAttention:
    mla = MultiHeadLatentAttention(C, H, r, R, Dn, Dv, q_lora, **kw).eval()
    with torch.no_grad():  # norms start at one, which would hide a norm weight that is not used
        for name, p in mla.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return mla


def _run(mla, x, mask=None, cache=None, **kw):
    """mla(x) with the context a model would build (tests/components/helpers.py)."""
    return mla(x, context(x, mask, **kw), cache)


def _both_forms(mla, x, **kw):
    """(plain, absorbed) outputs of the same module."""
    outs = []
    for absorb in (False, True):
        mla.absorb = absorb
        outs.append(_run(mla, x, **kw))
    mla.absorb = False
    return outs


# --- contract ----------------------------------------------------------------------------------
@pytest.mark.parametrize("q_lora", [None, 12])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_shapes_and_parameters(q_lora, backend):
    C, H, r, R, Dn, Dv = 32, 4, 16, 8, 8, 12
    mla = _mla(C, H, r, R, Dn, Dv, q_lora, backend=backend)
    x = torch.randn(2, 5, C)
    out = _run(mla, x, is_causal=True, positions=RoPE(R, 16))
    assert out.shape == (2, 5, C) and out.dtype == torch.float32
    q = C * H * (Dn + R) if q_lora is None else C * q_lora + q_lora + q_lora * H * (Dn + R)
    kv = C * (r + R) + r + r * H * (Dn + Dv)
    assert sum(p.numel() for p in mla.parameters()) == q + kv + H * Dv * C


def test_cross_attention_is_rejected():
    with pytest.raises(ValueError, match="self-attention only"):
        _run(_mla(), torch.randn(1, 3, 32), memory=torch.randn(1, 4, 32))


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention backend 'fused'"):
        MultiHeadLatentAttention(32, 4, 16, 8, 8, 8, backend="fused")


def test_default_scale_is_the_full_query_width():
    assert _mla(R=8, Dn=8).scale == pytest.approx(16**-0.5)  # (Dn + R)^-0.5, as DeepSeek


# --- invariants ----------------------------------------------------------------------------------
@PROPERTY
@given(
    H=st.integers(1, 4),
    r=st.integers(1, 12),
    R=st.sampled_from([2, 4, 6]),
    Dn=st.integers(1, 8),
    Dv=st.integers(1, 8),
    q_lora=st.sampled_from([None, 5]),
    T=st.integers(1, 6),
    backend=st.sampled_from(["sdpa", "eager"]),
)
def test_absorbed_equals_plain(H, r, R, Dn, Dv, q_lora, T, backend):
    torch.manual_seed(0)
    mla = _mla(24, H, r, R, Dn, Dv, q_lora, backend=backend)
    plain, absorbed = _both_forms(mla, torch.randn(2, T, 24), is_causal=True, positions=RoPE(R, 8))
    _close(absorbed, plain)


@pytest.mark.parametrize("absorb", [False, True])
def test_absorbed_equals_plain_with_bias_and_padding(absorb):
    """ALiBi's score bias and a padding mask reach both forms the same way."""
    mla, x = _mla(), torch.randn(2, 6, 32)
    key_valid = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = torch.ones(6, 6, dtype=torch.bool).tril() & key_valid[:, None, None, :]
    plain, absorbed = _both_forms(mla, x, mask=mask, positions=ALiBi(4))
    _close(absorbed[:, 2:], plain[:, 2:])  # rows of padded queries see nothing at all


@pytest.mark.parametrize("absorb", [False, True])
def test_sdpa_equals_eager(absorb):
    x, rope = torch.randn(2, 7, 32), RoPE(8, 16)
    eager = _mla(backend="eager", absorb=absorb)
    sdpa = _mla(backend="sdpa", absorb=absorb)
    sdpa.load_state_dict(eager.state_dict())
    _close(
        _run(sdpa, x, is_causal=True, positions=rope),
        _run(eager, x, is_causal=True, positions=rope),
    )


@pytest.mark.parametrize("absorb", [False, True])
def test_future_tokens_do_not_change_the_past(absorb):
    mla, rope = _mla(absorb=absorb), RoPE(8, 16)
    x = torch.randn(1, 8, 32)
    y = x.clone()
    y[:, 5:] = torch.randn(1, 3, 32)
    _close(
        _run(mla, y, is_causal=True, positions=rope)[:, :5],
        _run(mla, x, is_causal=True, positions=rope)[:, :5],
    )


def test_rope_part_sees_only_relative_positions():
    """Shifting every position leaves the output alone: the rope scores depend on m - n only,
    and the position-free part on no position at all."""
    mla, rope, x = _mla(), RoPE(8, 64), torch.randn(1, 6, 32)
    pos = torch.arange(6)
    _close(
        _run(mla, x, is_causal=True, positions=rope, q_pos=pos + 37),
        _run(mla, x, is_causal=True, positions=rope, q_pos=pos),
        atol=1e-4,
    )


def test_capture_weights_are_probabilities():
    mla, seen = _mla(absorb=True), []
    with hooks(mla, [("hook_pattern", lambda w, hook: seen.append(w))]):
        _run(mla, torch.randn(2, 5, 32), is_causal=True, positions=RoPE(8, 16))
    w = seen[-1]
    assert w.shape == (2, 4, 5, 5)
    _close(w.sum(-1), torch.ones(2, 4, 5))
    assert (w.triu(1) == 0).all()


# --- the latent cache --------------------------------------------------------------------------
def test_make_cache_holds_only_the_latent_and_rope_key():
    cache = _mla(r=16, R=8).make_cache(3, 10, torch.bfloat16)
    assert isinstance(cache, LatentCache)
    assert [(n, tuple(b.shape), b.dtype) for n, b in cache.named_buffers()] == [
        ("c_kv", (3, 10, 16), torch.bfloat16),
        ("k_pe", (3, 10, 8), torch.bfloat16),
    ]
    assert cache.state_dict() == {}  # scratch space, never in a checkpoint


@pytest.mark.parametrize("absorb", [False, True])
def test_token_by_token_through_the_cache_equals_full(absorb):
    B, T, S_max = 2, 6, 8
    mla, rope, x = _mla(absorb=absorb), RoPE(8, 16), torch.randn(B, T, 32)
    full = _run(mla, x, is_causal=True, positions=rope)
    cache, k_pos = mla.make_cache(B, S_max, torch.float32), torch.arange(S_max)
    steps = []
    for t in range(T):
        slots = torch.tensor([t])
        mask = (k_pos <= t)[None, :]  # (1, S_max): written slots up to and including t
        steps.append(
            _run(
                mla,
                x[:, t : t + 1],
                mask,
                positions=rope,
                q_pos=slots,
                k_pos=k_pos,
                cache=cache,
                slots=slots,
            )
        )
    _close(torch.cat(steps, dim=1), full)


def test_latent_cache_update_and_reorder():
    cache = LatentCache(2, 4, 3, 2)
    c, k = torch.randn(2, 2, 3), torch.randn(2, 2, 2)
    c_all, k_all = cache.update(c, k, torch.tensor([1, 2]))
    assert c_all.shape == (2, 4, 3) and k_all.shape == (2, 4, 2)
    _close(c_all[:, 1:3], c)
    _close(k_all[:, 1:3], k)
    assert (c_all[:, 0] == 0).all() and (c_all[:, 3] == 0).all()
    cache.reorder(torch.tensor([1, 1]))
    _close(cache.c_kv[0, 1:3], c[1])
    _close(cache.k_pe[0, 1:3], k[1])


# --- parity with transformers' DeepseekV3Attention ---------------------------------------------
def _hf_attention(tf, C, H, r, R, Dn, Dv, q_lora, interleave):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    cfg = tf.DeepseekV3Config(
        hidden_size=C,
        num_attention_heads=H,
        num_key_value_heads=H,
        kv_lora_rank=r,
        q_lora_rank=q_lora,
        qk_rope_head_dim=R,
        qk_nope_head_dim=Dn,
        v_head_dim=Dv,
        rope_interleave=interleave,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg._attn_implementation = "eager"
    return ds.DeepseekV3Attention(cfg, layer_idx=0).eval(), ds.DeepseekV3RotaryEmbedding(cfg)


HF_NAMES = {
    "kv_a_proj": "kv_a_proj_with_mqa",
    "kv_a_norm": "kv_a_layernorm",
    "q_a_norm": "q_a_layernorm",
}


def hf_attention_key(ours: str) -> str:
    """Our MLA parameter name -> DeepseekV3Attention's (q_proj, kv_b_proj, o_proj: the same)."""
    module, _, rest = ours.partition(".")
    return f"{HF_NAMES.get(module, module)}.{rest}"


@pytest.mark.hf
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora", [None, 24])
def test_matches_transformers_deepseek_v3_attention(interleave, q_lora):
    tf = pytest.importorskip("transformers")
    C, H, r, R, Dn, Dv, B, T = 48, 4, 16, 8, 12, 10, 2, 7
    theirs, rotary = _hf_attention(tf, C, H, r, R, Dn, Dv, q_lora, interleave)
    ours = _mla(C, H, r, R, Dn, Dv, q_lora, norm_eps=1e-6)  # their latent norms' eps
    with torch.no_grad():  # their latent norms start at one too
        for name, p in theirs.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
    hf_state = theirs.state_dict()
    assert {hf_attention_key(k) for k in ours.state_dict()} == set(hf_state)
    ours.load_state_dict({k: hf_state[hf_attention_key(k)] for k in ours.state_dict()})
    rope = RoPE(R, 64, 10000.0, layout="interleaved" if interleave else "half")
    x, pos = torch.randn(B, T, C), torch.arange(T)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]  # (1, 1, T, T) additive
    with torch.no_grad():
        expected, _ = theirs(x, position_embeddings=rotary(x, pos[None]), attention_mask=causal)
        for absorb in (False, True):
            ours.absorb = absorb
            _close(_run(ours, x, is_causal=True, positions=rope), expected, atol=HF_ATOL)
