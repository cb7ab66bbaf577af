"""Attention against `torch.nn.MultiheadAttention` with copied weights; GQA/MQA/causal properties.

Conventions differ: torch's key_padding_mask and boolean attn_mask mean True = IGNORE,
ours True = attend.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from attnlab.components.attention import Attention
from attnlab.components.hooks import run_with_cache
from tests.compile_helpers import traced_graphs
from tests.components.helpers import context

ATOL = 1e-5  # fp32, max abs difference
PROPERTY = settings(max_examples=30, deadline=None, derandomize=True)


def _close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


@torch.no_grad()
def _copy_from_mha(ours: Attention, mha: nn.MultiheadAttention) -> None:
    """MHA's packed in_proj (or separate q/k/v_proj_weight when kdim != embed_dim) -> q/k/v_proj."""
    if mha._qkv_same_embed_dim:
        wq, wk, wv = mha.in_proj_weight.chunk(3)
    else:
        wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    for proj, w in zip((ours.q_proj, ours.k_proj, ours.v_proj), (wq, wk, wv), strict=True):
        proj.weight.copy_(w)
    if mha.in_proj_bias is not None:
        for proj, b in zip(
            (ours.q_proj, ours.k_proj, ours.v_proj), mha.in_proj_bias.chunk(3), strict=True
        ):
            proj.bias.copy_(b)
        ours.o_proj.bias.copy_(mha.out_proj.bias)
    ours.o_proj.weight.copy_(mha.out_proj.weight)


def _mha(d_model, n_heads, bias=True, kdim=None):
    mha = nn.MultiheadAttention(d_model, n_heads, bias=bias, batch_first=True, kdim=kdim, vdim=kdim)
    if bias:  # torch initialises these to zero, which would hide a bias that is not copied
        with torch.no_grad():
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
    return mha.eval()


def _ref_causal(T, S):
    return torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)  # True = attend


# --- parity with nn.MultiheadAttention ------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("masking", ["none", "padding", "is_causal", "causal_mask", "both"])
def test_self_attention_matches_torch_mha(backend, masking):
    B, T, C, H = 2, 6, 32, 4
    mha = _mha(C, H)
    ours = Attention(C, H, qkv_bias=True, out_bias=True, backend=backend).eval()
    _copy_from_mha(ours, mha)
    x = torch.randn(B, T, C)
    valid = torch.arange(T)[None, :] < torch.tensor([T, 4])[:, None]  # (B, T), True = real token
    causal = _ref_causal(T, T)
    kpm = ~valid if masking in ("padding", "both") else None
    attn_mask = ~causal if masking in ("is_causal", "causal_mask", "both") else None
    expected, _ = mha(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
    mask = valid[:, None, None, :] if kpm is not None else None  # (B, 1, 1, T)
    if masking == "causal_mask":
        mask = causal
    out = ours(x, context(x, mask, is_causal=masking in ("is_causal", "both")))
    _close(out, expected)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("kv_dim", [None, 24])
@pytest.mark.parametrize("padded", [False, True])
def test_cross_attention_matches_torch_mha(backend, kv_dim, padded):
    B, T, S, C, H = 2, 5, 7, 32, 4
    mha = _mha(C, H, kdim=kv_dim)
    ours = Attention(
        C, H, kv_dim=kv_dim, qkv_bias=True, out_bias=True, backend=backend, cross=True
    ).eval()
    _copy_from_mha(ours, mha)
    x, memory = torch.randn(B, T, C), torch.randn(B, S, kv_dim or C)
    valid = torch.arange(S)[None, :] < torch.tensor([S, 3])[:, None]  # (B, S)
    kpm = ~valid if padded else None
    expected, _ = mha(x, memory, memory, key_padding_mask=kpm, need_weights=False)
    out = ours(x, context(x, valid[:, None, None, :] if padded else None, memory=memory))
    _close(out, expected)


def test_captured_weights_match_torch_per_head_weights():
    B, T, C, H = 2, 6, 32, 4
    mha = _mha(C, H)
    ours = Attention(C, H, qkv_bias=True, out_bias=True).eval()
    _copy_from_mha(ours, mha)
    x = torch.randn(B, T, C)
    valid = torch.arange(T)[None, :] < torch.tensor([T, 4])[:, None]
    plain = ours(x, context(x, valid[:, None, None, :], is_causal=True))
    ctx = context(x, valid[:, None, None, :], is_causal=True)
    out, seen = run_with_cache(ours, x, ctx, names=["hook_pattern"])
    weights = seen["hook_pattern"]
    _, expected = mha(
        x,
        x,
        x,
        key_padding_mask=~valid,
        attn_mask=~_ref_causal(T, T),
        need_weights=True,
        average_attn_weights=False,
    )  # (B, H, T, T)
    assert torch.equal(out, plain)  # capturing never changes the output
    assert weights.shape == (B, H, T, T)
    _close(weights.sum(-1), torch.ones(B, H, T))
    _close(weights, expected)


def test_dropout_only_in_training():
    attn = Attention(32, 4, dropout=0.5, backend="eager")
    x = torch.randn(2, 6, 32)
    no_dropout = Attention(32, 4, backend="eager")
    no_dropout.load_state_dict(attn.state_dict())
    expected = no_dropout(x)
    _close(attn.eval()(x), expected)
    assert (attn.train()(x) - expected).abs().max() > 1e-3


# --- parameter counts -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_kv_heads", "expected"), [(None, 1_048_576), (8, 1_048_576), (2, 655_360), (1, 589_824)]
)
def test_parameter_counts(n_kv_heads, expected):
    # q and o: 512 x 512 each; k and v: 512 x (n_kv_heads * 64) each; no biases.
    attn = Attention(512, 8, n_kv_heads=n_kv_heads, head_dim=64)
    assert sum(p.numel() for p in attn.parameters()) == expected


# --- properties -----------------------------------------------------------------------------------


@st.composite
def configs(draw, cross_allowed=True):
    """A small attention config with an input batch; n_kv_heads divides n_heads."""
    n_heads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    n_kv_heads = draw(st.sampled_from([k for k in range(1, n_heads + 1) if n_heads % k == 0]))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    B, T = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    cross = cross_allowed and draw(st.booleans())
    S = draw(st.integers(1, 6)) if cross else T
    return dict(
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        B=B,
        T=T,
        S=S,
        cross=cross,
        causal=not cross and draw(st.booleans()),
        mask=draw(st.sampled_from(["none", "padding", "full"])),
        seed=draw(st.integers(0, 2**16)),
    )


def _inputs(cfg):
    """(x, memory, mask) for a drawn config; random masks may leave a row with nothing to see."""
    torch.manual_seed(cfg["seed"])
    B, T, S = cfg["B"], cfg["T"], cfg["S"]
    C = cfg["n_heads"] * cfg["head_dim"]
    x = torch.randn(B, T, C)
    memory = torch.randn(B, S, C) if cfg["cross"] else None
    mask = None
    if cfg["mask"] == "padding":
        mask = torch.rand(B, 1, 1, S) < 0.7
    elif cfg["mask"] == "full":
        mask = torch.rand(B, 1, T, S) < 0.7
    return x, memory, mask


def _attention(cfg, **overrides):
    kw = dict(
        d_model=cfg["n_heads"] * cfg["head_dim"],
        n_heads=cfg["n_heads"],
        n_kv_heads=cfg["n_kv_heads"],
        head_dim=cfg["head_dim"],
        qkv_bias=True,
        out_bias=True,
        cross=cfg["cross"],
    )
    return Attention(**(kw | overrides)).eval()


@PROPERTY
@given(cfg=configs())
def test_sdpa_equals_eager(cfg):
    x, memory, mask = _inputs(cfg)
    eager = _attention(cfg, backend="eager")
    sdpa = _attention(cfg, backend="sdpa")
    sdpa.load_state_dict(eager.state_dict())
    kw = dict(is_causal=cfg["causal"], memory=memory)
    _close(sdpa(x, context(x, mask, **kw)), eager(x, context(x, mask, **kw)))


def _mha_with_our_weights(ours: Attention) -> nn.MultiheadAttention:
    """A torch MHA layer with `ours`'s weights, each kv head copied to the G heads it serves."""
    H, K, D = ours.n_heads, ours.n_kv_heads, ours.head_dim
    C = ours.q_proj.in_features
    mha = nn.MultiheadAttention(C, H, batch_first=True, bias=True).eval()

    def expand(w):  # (K * D, ...) -> (H * D, ...): kv head j serves query heads jG .. jG + G - 1
        return w.unflatten(0, (K, D)).repeat_interleave(H // K, dim=0).flatten(0, 1)

    with torch.no_grad():
        mha.in_proj_weight.copy_(
            torch.cat([ours.q_proj.weight, expand(ours.k_proj.weight), expand(ours.v_proj.weight)])
        )
        mha.in_proj_bias.copy_(
            torch.cat([ours.q_proj.bias, expand(ours.k_proj.bias), expand(ours.v_proj.bias)])
        )
        mha.out_proj.weight.copy_(ours.o_proj.weight)
        mha.out_proj.bias.copy_(ours.o_proj.bias)
    return mha


def _mha_reference(mha, x, memory, mask, causal):
    """torch MHA with our conventions translated: True = ignore, and rows that see nothing -> 0."""
    B, T = x.shape[:2]
    source = x if memory is None else memory
    S = source.shape[1]
    allowed = torch.ones(B, 1, T, S, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        allowed = allowed & _ref_causal(T, S)
    H = mha.num_heads
    attn_mask = ~allowed.expand(B, H, T, S).reshape(B * H, T, S)  # torch: True = ignore
    out, _ = mha(x, source, source, attn_mask=attn_mask, need_weights=False)
    return out.nan_to_num(0.0), allowed.any(-1)[:, 0]  # (B, T, C), (B, T) rows with a key


@PROPERTY
@given(cfg=configs())
def test_gqa_with_all_kv_heads_is_torch_mha(cfg):
    cfg = cfg | {"n_kv_heads": cfg["n_heads"]}
    x, memory, mask = _inputs(cfg)
    for backend in ("sdpa", "eager"):
        ours = _attention(cfg, backend=backend)
        expected, live = _mha_reference(_mha_with_our_weights(ours), x, memory, mask, cfg["causal"])
        out = ours(x, context(x, mask, is_causal=cfg["causal"], memory=memory))
        _close(out[live], expected[live])  # rows that see nothing: torch gives NaN, not o_proj(0)


@PROPERTY
@given(cfg=configs())
def test_grouped_kv_equals_mha_with_hand_expanded_kv_weights(cfg):
    # GQA with any K, and MQA (K = 1), equal an MHA layer whose k/v weights repeat each kv head
    # for the G = H / K query heads that share it.
    x, memory, mask = _inputs(cfg)
    for n_kv_heads in {1, cfg["n_kv_heads"]}:
        ours = _attention(cfg, n_kv_heads=n_kv_heads, backend="eager")
        expected, live = _mha_reference(_mha_with_our_weights(ours), x, memory, mask, cfg["causal"])
        out = ours(x, context(x, mask, is_causal=cfg["causal"], memory=memory))
        _close(out[live], expected[live])


@PROPERTY
@given(cfg=configs(cross_allowed=False), data=st.data())
def test_causal_future_tokens_never_change_the_past(cfg, data):
    cfg = cfg | {"causal": True}
    x, _, mask = _inputs(cfg)
    T = cfg["T"]
    t = data.draw(st.integers(0, T - 1), label="first changed position")
    x_new = x.clone()
    x_new[:, t:] = torch.randn_like(x_new[:, t:])
    if mask is not None and mask.shape[-2] == T:  # a full mask may differ in the future, too
        mask_new = mask.clone()
        mask_new[..., t:, :] = torch.rand_like(mask_new[..., t:, :], dtype=torch.float) < 0.5
    else:
        mask_new = mask
    for backend in ("sdpa", "eager"):
        attn = _attention(cfg, backend=backend)
        before = attn(x, context(x, mask, is_causal=True))
        after = attn(x_new, context(x_new, mask_new, is_causal=True))
        _close(after[:, :t], before[:, :t], atol=1e-6)


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (dict(d_model=30, n_heads=4), ["d_model=30", "n_heads=4"]),
        (dict(d_model=32, n_heads=8, n_kv_heads=3), ["n_heads=8", "n_kv_heads=3"]),
        (dict(d_model=32, n_heads=4, n_kv_heads=0), ["n_kv_heads=0"]),
        (dict(d_model=32, n_heads=4, backend="fused"), ["'fused'", "sdpa", "eager"]),
    ],
)
def test_bad_constructor_arguments_raise_naming_the_values(kwargs, fragments):
    with pytest.raises(ValueError) as err:
        Attention(**kwargs)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("mask", "fragments"),
    [
        (torch.ones(6, 5, dtype=torch.bool), ["(6, 5)", "T=5", "S=5"]),  # (T + 1, S)
        (torch.ones(5, 4, dtype=torch.bool), ["(5, 4)", "S=5"]),  # wrong S
        (torch.ones(3, 1, 5, 5, dtype=torch.bool), ["(3, 1, 5, 5)", "B=2"]),  # wrong B
        (torch.ones(5, 5), ["torch.float32"]),  # not bool
        (torch.ones(5, 5, dtype=torch.int64), ["torch.int64"]),
    ],
)
def test_bad_mask_raises_naming_the_values(mask, fragments):
    attn = Attention(32, 4)
    with pytest.raises(ValueError) as err:
        x = torch.randn(2, 5, 32)
        attn(x, context(x, mask))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_cross_attention_without_memory_raises():
    attn = Attention(32, 4, cross=True)
    with pytest.raises(ValueError, match="memory"):
        attn(torch.randn(2, 5, 32))


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 8])
def test_compiled_attention_runs_the_configured_backend(T):
    # The core never swaps the backend behind the config's back: under torch.compile an "sdpa"
    # layer still calls SDPA, for one query and for short sequences alike (the written-out form
    # is an accelerator, attnlab/accel/short_attention.py, turned on explicitly).
    attn = Attention(d_model=16, n_heads=2)  # sdpa backend
    x = torch.randn(2, T, 16)
    out, graphs = traced_graphs(attn, x, context(x, is_causal=True))
    torch.testing.assert_close(out, attn(x, context(x, is_causal=True)), atol=1e-6, rtol=1e-5)
    assert "scaled_dot_product_attention" in "".join(graphs)
