"""RoPE against references: HF's rope init functions and rotary embeddings, HF's
apply_rotary_pos_emb, Meta's complex-number formulation, the NTK formula, and the m - n property."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.components.positions.rope import (
    DynamicNTKRoPE,
    RoPE,
    RopeScaling,
    apply_rope,
    permute_qk_weight,
    rope_angles,
    rope_inv_freq,
)

HEAD_DIM = 64
ORIG = 256  # original_max_seq_len in the scaled cases


def _hf_rotary(rope_parameters: dict, max_position_embeddings: int, head_dim: int = HEAD_DIM):
    """An HF Llama config and its LlamaRotaryEmbedding for the given rope_parameters."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=dict(rope_parameters),
    )
    return config, LlamaRotaryEmbedding(config)


def _hf_cos_sin(rotary, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, n, 8)  # only its dtype and device are read
    cos, sin = rotary(x, torch.arange(n)[None])  # (1, n, R)
    return cos[0], sin[0]


# (our scaling, HF rope_parameters, HF max_position_embeddings)
SCALED_CASES = {
    "default": (None, {"rope_type": "default", "rope_theta": 10000.0}, 1024),
    "linear": (
        RopeScaling("linear", factor=4.0, original_max_seq_len=ORIG),
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        1024,
    ),
    "yarn": (
        RopeScaling("yarn", factor=4.0, original_max_seq_len=ORIG),
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": ORIG,
        },
        1024,
    ),  # fmt: skip
    "yarn_custom": (
        RopeScaling("yarn", 8.0, ORIG, beta_fast=16.0, beta_slow=2.0, attention_factor=1.3),
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "attention_factor": 1.3,
            "original_max_position_embeddings": ORIG,
        },
        2048,
    ),  # fmt: skip
    "llama3": (
        RopeScaling("llama3", factor=8.0, original_max_seq_len=ORIG),
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIG,
        },
        2048,
    ),  # fmt: skip
}


@pytest.mark.hf
@pytest.mark.parametrize("case", list(SCALED_CASES))
def test_inv_freq_and_cos_sin_match_hf(case):
    scaling, params, max_pos = SCALED_CASES[case]
    config, rotary = _hf_rotary(params, max_pos)
    theta = params["rope_theta"]

    inv_freq, attention_factor = rope_inv_freq(HEAD_DIM, theta, scaling)
    torch.testing.assert_close(inv_freq, rotary.inv_freq, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    if case != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
        torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
        assert attention_factor == pytest.approx(ref_factor, rel=1e-12)

    cos, sin = rope_angles(HEAD_DIM, 300, theta, scaling)  # (300, D), times the attention factor
    ref_cos, ref_sin = _hf_cos_sin(rotary, 300)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)


def test_llama3_exercises_all_three_bands():
    # Guards the parity test above: it only means something if every branch of the rule is hit.
    inv_freq = rope_inv_freq(HEAD_DIM, 500000.0)[0]
    wavelen = 2 * math.pi / inv_freq
    assert (wavelen < ORIG / 4).any() and (wavelen > ORIG).any()
    assert ((wavelen >= ORIG / 4) & (wavelen <= ORIG)).any()


@pytest.mark.hf
def test_partial_rotary_matches_hf():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_neox import modeling_gpt_neox as neox

    # YaRN with partial_rotary_factor 0.5, through HF's init function.
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": ORIG, "partial_rotary_factor": 0.5}  # fmt: skip
    config, _ = _hf_rotary(params, 1024)
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    inv_freq, factor = rope_inv_freq(HEAD_DIM // 2, 10000.0, RopeScaling("yarn", 4.0, ORIG))
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor)

    # Unscaled partial rotary end to end against GPT-NeoX's rotary embedding + apply function.
    neox_config = transformers.GPTNeoXConfig(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
    )  # fmt: skip
    rope = RoPE(HEAD_DIM, 128, partial_rotary=0.5)
    assert rope.rotary_dim == HEAD_DIM // 2
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 20, HEAD_DIM), torch.randn(2, 4, 20, HEAD_DIM)
    pos = torch.arange(20)
    ref_cos, ref_sin = neox.GPTNeoXRotaryEmbedding(neox_config)(q, pos[None])  # (1, 20, R)
    ref_q, ref_k = neox.apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    our_q, our_k = rope.rotate_qk(q, k, pos, pos)
    torch.testing.assert_close(our_q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_k, ref_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_q[..., HEAD_DIM // 2 :], q[..., HEAD_DIM // 2 :])


@pytest.mark.hf
def test_static_ntk_matches_formula_and_hf_dynamic():
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    factor, theta, d = 4.0, 10000.0, HEAD_DIM
    inv_freq, attention_factor = rope_inv_freq(d, theta, RopeScaling("ntk", factor, ORIG))
    assert attention_factor == 1.0

    # The NTK-aware formula, in float64 with math.pow.
    ntk_theta = theta * factor ** (d / (d - 2))
    formula = torch.tensor([ntk_theta ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    torch.testing.assert_close(inv_freq.double(), formula, rtol=1e-6, atol=0)

    # HF has no static NTK; its dynamic NTK base equals theta * factor^(d/(d-2)) exactly when
    # factor * L / orig - (factor - 1) = factor, i.e. at L = orig * (2 - 1 / factor).
    seq_len = int(ORIG * (2 - 1 / factor))
    assert seq_len == ORIG * (2 - 1 / factor)
    config, _ = _hf_rotary({"rope_type": "dynamic", "rope_theta": theta, "factor": factor}, ORIG)
    ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=seq_len)
    torch.testing.assert_close(inv_freq, ref, rtol=1e-6, atol=0)


@pytest.mark.hf
@pytest.mark.parametrize("seq_len", [None, 100, ORIG, 700, 2000])
def test_dynamic_inv_freq_matches_hf(seq_len):
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    config, _ = _hf_rotary(params, ORIG)  # HF reads the original length from max_position_emb.
    ref, ref_factor = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=seq_len)
    ours, factor = rope_inv_freq(HEAD_DIM, 10000.0, RopeScaling("dynamic", 2.0, ORIG), seq_len)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert factor == ref_factor


@pytest.mark.hf
@pytest.mark.parametrize("length", [100, 700])
def test_dynamic_rope_module_matches_hf_forward(length):
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    params = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    _, rotary = _hf_rotary(params, ORIG)
    rope = DynamicNTKRoPE(HEAD_DIM, ORIG, scaling=RopeScaling("dynamic", 2.0, ORIG))
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, length, HEAD_DIM), torch.randn(1, 2, length, HEAD_DIM)
    pos = torch.arange(length)
    ref_cos, ref_sin = rotary(q, pos[None])  # HF recomputes inv_freq when length > ORIG
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    our_q, our_k = rope.rotate_qk(q, k, pos, pos)
    torch.testing.assert_close(our_q, ref_q, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(our_k, ref_k, rtol=1e-4, atol=1e-4)


@pytest.mark.hf
def test_apply_rope_half_matches_hf_apply_rotary_pos_emb():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    B, H, T, D = 2, 4, 12, 32
    q, k = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    cos, sin = rope_angles(D, 64)  # (64, D)
    pos = torch.randint(0, 64, (B, T))
    cos_b, sin_b = cos[pos], sin[pos]  # (B, T, D)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos_b, sin_b)  # unsqueeze_dim=1
    torch.testing.assert_close(apply_rope(q, cos_b[:, None], sin_b[:, None], "half"), ref_q)
    torch.testing.assert_close(apply_rope(k, cos_b[:, None], sin_b[:, None], "half"), ref_k)


def test_interleaved_matches_meta_complex_formulation():
    # Meta's llama reference: view adjacent pairs as complex numbers, multiply by e^{i m w}.
    torch.manual_seed(0)
    B, H, T, D = 2, 3, 10, 16
    x = torch.randn(B, H, T, D)
    angles = torch.outer(torch.arange(T).float(), 1.0 / 10000.0 ** (torch.arange(0, D, 2) / D))
    freqs_cis = torch.polar(torch.ones_like(angles), angles)  # (T, D/2) complex
    ref = torch.view_as_real(torch.view_as_complex(x.reshape(B, H, T, D // 2, 2)) * freqs_cis)
    cos, sin = rope_angles(D, T, layout="interleaved")
    torch.testing.assert_close(apply_rope(x, cos, sin, "interleaved"), ref.flatten(-2))


def _hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """`permute` from HF's convert_llama_weights_to_hf.py (interleaved -> half), verbatim."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def _scores(wq, wk, x, pos, rope: RoPE, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    T, D = x.shape[0], rope.head_dim
    q = (x @ wq.T).view(1, T, n_heads, D).transpose(1, 2)  # (1, H, T, D)
    k = (x @ wk.T).view(1, T, n_kv_heads, D).transpose(1, 2)  # (1, K, T, D)
    q, k = rope.rotate_qk(q, k, pos, pos)
    k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)  # (1, H, T, D)
    return q @ k.transpose(-1, -2)  # (1, H, T, T)


@pytest.mark.parametrize("partial_rotary", [1.0, 0.5])
def test_permuted_weights_give_same_scores(partial_rotary):
    torch.manual_seed(0)
    C, H, K, D, T = 48, 4, 2, 16, 9
    wq, wk = torch.randn(H * D, C) / C**0.5, torch.randn(K * D, C) / C**0.5  # unit-scale q, k
    x, pos = torch.randn(T, C), torch.arange(3, 3 + T)
    half = RoPE(D, 32, layout="half", partial_rotary=partial_rotary)
    inter = RoPE(D, 32, layout="interleaved", partial_rotary=partial_rotary)
    R = half.rotary_dim
    wq_i = permute_qk_weight(wq, H, D, "interleaved", rotary_dim=R)
    wk_i = permute_qk_weight(wk, K, D, "interleaved", rotary_dim=R)
    ref = _scores(wq, wk, x, pos, half, H, K)
    torch.testing.assert_close(_scores(wq_i, wk_i, x, pos, inter, H, K), ref, rtol=1e-5, atol=1e-5)
    # Round trip, for weights and for a bias.
    torch.testing.assert_close(permute_qk_weight(wq_i, H, D, "half", rotary_dim=R), wq)
    bias = torch.randn(H * D)
    round_trip = permute_qk_weight(permute_qk_weight(bias, H, D, "interleaved", R), H, D, "half", R)
    torch.testing.assert_close(round_trip, bias)


def test_permute_to_half_matches_hf_convert_script():
    torch.manual_seed(0)
    w = torch.randn(4 * 16, 24)
    torch.testing.assert_close(permute_qk_weight(w, 4, 16, "half"), _hf_permute(w, 4))


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(0, 200),
    n=st.integers(0, 200),
    offset=st.integers(0, 200),
    layout=st.sampled_from(["half", "interleaved"]),
    partial_rotary=st.sampled_from([1.0, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_score_depends_only_on_relative_position(m, n, offset, layout, partial_rotary, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, 1, 1, 32, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, 1, 1, 32, generator=gen), dim=-1)
    rope = RoPE(32, 16, layout=layout, partial_rotary=partial_rotary)  # small: tables must grow

    def score(qm: int, kn: int) -> float:
        qr, kr = rope.rotate_qk(q, k, torch.tensor([qm]), torch.tensor([kn]))
        return float((qr * kr).sum())

    assert score(m + offset, n + offset) == pytest.approx(score(m, n), abs=1e-4)


def test_rotate_qk_contract():
    torch.manual_seed(0)
    rope = RoPE(16, 8)
    B, H, K, T = 2, 4, 2, 5
    q = torch.randn(B, H, T, 16, dtype=torch.bfloat16)
    k = torch.randn(B, K, T, 16, dtype=torch.bfloat16)
    pos = torch.arange(10, 10 + T)  # beyond max_seq_len=8: the table grows
    q1, k1 = rope.rotate_qk(q, k, pos, pos)
    assert q1.shape == q.shape and k1.shape == k.shape and q1.dtype == k1.dtype == torch.bfloat16
    assert rope.cos.shape[0] >= 10 + T
    # Batched (B, T) positions equal the shared (T,) ones when every row is the same.
    q2, k2 = rope.rotate_qk(q, k, pos.expand(B, T), pos.expand(B, T))
    torch.testing.assert_close(q2, q1)
    torch.testing.assert_close(k2, k1)
    # A grown table equals one built that long up front.
    big = RoPE(16, 64)
    torch.testing.assert_close(big.rotate_qk(q, k, pos, pos)[0], q1)
    assert rope.state_dict() == {}  # cos/sin/inv_freq are non-persistent


def test_bad_arguments_raise_with_values():
    with pytest.raises(ValueError, match="head_dim=7"):
        RoPE(7, 16)
    with pytest.raises(ValueError, match=r"'diagonal'.*half.*interleaved"):
        RoPE(16, 16, layout="diagonal")
    with pytest.raises(ValueError, match=r"int\(12 \* 0.25\) = 3 must be"):
        RoPE(12, 16, partial_rotary=0.25)  # an odd number of rotated features
    with pytest.raises(ValueError, match="0.5"):
        RopeScaling("linear", factor=0.5, original_max_seq_len=128)
    with pytest.raises(ValueError, match="'cubic'"):
        RopeScaling("cubic", factor=2.0, original_max_seq_len=128)
    with pytest.raises(ValueError, match="low_freq_factor=4.0"):
        RopeScaling("llama3", 8.0, 128, low_freq_factor=4.0, high_freq_factor=4.0)
    with pytest.raises(ValueError, match="DynamicNTKRoPE"):
        RoPE(16, 16, scaling=RopeScaling("dynamic", 2.0, 128))
    with pytest.raises(ValueError, match="kind 'dynamic', got .*'linear'"):
        DynamicNTKRoPE(16, 16, scaling=RopeScaling("linear", 2.0, 128))
    with pytest.raises(ValueError, match="rotary_dim > 2, got 2"):
        rope_inv_freq(2, 10000.0, RopeScaling("ntk", 2.0, 128))
    with pytest.raises(ValueError, match="30 rows"):
        permute_qk_weight(torch.randn(30, 4), 2, 16, "half")
    with pytest.raises(ValueError, match="'sideways'"):
        apply_rope(torch.randn(1, 1, 2, 4), *rope_angles(4, 2), layout="sideways")
