"""Invariants over drawn configs: family x attention kind x position x norm placement x FFN x mask.

    (1) causal models: changing future tokens never changes earlier logits
    (2) the sdpa and eager backends agree, for every mask and position scheme, biases included
    (3) an encoder without positions is permutation-equivariant
    (4) fully padded rows give no NaN

Shapes stay tiny (d_model 16 or 32, 1-2 layers, T <= 8); `derandomize` makes every run draw the
same examples, and each example seeds torch from a drawn integer.
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig

FAMILIES = ["decoder", "encoder", "encoder_decoder"]
KV_DIVISOR = {"mha": 1, "gqa": 2, "mqa": None}  # K = H // divisor; None -> K = 1
POSITIONS = ["none", "sinusoidal", "learned", "rope_half", "rope_interleaved", "alibi", "t5_bias"]
MAX_T = 8
ATOL = 1e-5

PROPERTY = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def configs(draw, families=FAMILIES, positions=POSITIONS) -> ModelConfig:
    arch = draw(st.sampled_from(families))
    n_heads = draw(st.sampled_from([2, 4]))
    kind = draw(st.sampled_from(sorted(KV_DIVISOR)))
    n_kv = 1 if KV_DIVISOR[kind] is None else n_heads // KV_DIVISOR[kind]
    position = draw(st.sampled_from(positions))
    layout = "interleaved" if position == "rope_interleaved" else "half"
    ffn = draw(st.sampled_from(["mlp", "swiglu", "geglu"]))
    cfg = ModelConfig(
        arch=arch,
        d_model=draw(st.sampled_from([16, 32])),
        n_layers=draw(st.integers(1, 2)),
        vocab_size=23,
        max_seq_len=MAX_T,
        attention=AttentionConfig(
            n_heads=n_heads, n_kv_heads=n_kv, backend=draw(st.sampled_from(["sdpa", "eager"]))
        ),
        position="rope" if position.startswith("rope") else position,
        norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        norm_placement=draw(st.sampled_from(["pre", "post"])),
        ffn=ffn,
        activation="gelu" if ffn == "geglu" else draw(st.sampled_from(["gelu", "relu"])),
        d_ff=24,
    )
    return dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, layout=layout))


@st.composite
def batches(draw, cfg: ModelConfig, fully_padded: bool = False):
    """ids (and, for encoder-decoder, source ids) with random right padding or no mask.

    A row may be all padding; with `fully_padded` the first target row and the last source row
    always are, and there is always a mask.
    """
    B, T = draw(st.integers(1, 3)), draw(st.integers(1, MAX_T))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    src = torch.randint(0, cfg.vocab_size, (B, draw(st.integers(1, MAX_T))), generator=g)
    masks = None
    if fully_padded or draw(st.booleans()):
        tgt_len = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
        src_len = draw(st.lists(st.integers(0, src.shape[1]), min_size=B, max_size=B))
        if fully_padded:
            tgt_len[0] = src_len[-1] = 0
        masks = _right_padding(tgt_len, T), _right_padding(src_len, src.shape[1])
    return seed, ids, src, masks


def _right_padding(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T) bool


def with_backend(cfg: ModelConfig, backend: str) -> ModelConfig:
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, backend=backend))


def build(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(cfg).eval()


def forward(model, cfg: ModelConfig, ids, src, masks) -> torch.Tensor:
    tgt_mask, src_mask = (None, None) if masks is None else masks
    with torch.no_grad():
        if cfg.arch == "encoder_decoder":
            return model(src, ids, attention_mask=src_mask, decoder_attention_mask=tgt_mask)
        return model(ids, tgt_mask)


# --- (1) causality -----------------------------------------------------------------------------
@PROPERTY
@given(data=st.data(), cfg=configs(families=["decoder", "encoder_decoder"]))
def test_future_tokens_never_change_earlier_logits(data, cfg):
    seed, ids, src, masks = data.draw(batches(cfg))
    T = ids.shape[1]
    t = data.draw(st.integers(0, T - 1), label="last unchanged position")
    changed = ids.clone()
    g = torch.Generator().manual_seed(seed + 1)
    changed[:, t + 1 :] = torch.randint(0, cfg.vocab_size, (ids.shape[0], T - t - 1), generator=g)
    model = build(cfg, seed)
    a = forward(model, cfg, ids, src, masks)
    b = forward(model, cfg, changed, src, masks)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=ATOL, rtol=0)


# --- (2) backends agree ------------------------------------------------------------------------
@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@PROPERTY
@given(data=st.data(), cfg=configs())
def test_sdpa_equals_eager(data, cfg):
    seed, ids, src, masks = data.draw(batches(cfg))
    sdpa, eager_cfg = build(with_backend(cfg, "sdpa"), seed), with_backend(cfg, "eager")
    eager = build(eager_cfg, seed + 1)  # another seed: the weights must come from the copy
    eager.load_state_dict(sdpa.state_dict())
    a = forward(sdpa, cfg, ids, src, masks)
    b = forward(eager, eager_cfg, ids, src, masks)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)


# --- (3) no positions: permutation-equivariant -------------------------------------------------
@PROPERTY
@given(data=st.data(), cfg=configs(families=["encoder"], positions=["none"]))
def test_encoder_without_positions_is_permutation_equivariant(data, cfg):
    assert not cfg.embed_norm and not cfg.type_vocab_size
    seed, ids, _, masks = data.draw(batches(cfg))
    perm = torch.tensor(data.draw(st.permutations(range(ids.shape[1])), label="perm"))
    mask = None if masks is None else masks[0]
    model = build(cfg, seed)
    out = forward(model, cfg, ids, None, None if mask is None else (mask, None))
    permuted = forward(
        model, cfg, ids[:, perm], None, None if mask is None else (mask[:, perm], None)
    )
    torch.testing.assert_close(permuted, out[:, perm], atol=ATOL, rtol=ATOL)


# --- (4) fully padded rows ---------------------------------------------------------------------
@PROPERTY
@given(data=st.data(), cfg=configs())
def test_fully_padded_rows_give_no_nan(data, cfg):
    seed, ids, src, masks = data.draw(batches(cfg, fully_padded=True))
    out = forward(build(cfg, seed), cfg, ids, src, masks)
    assert torch.isfinite(out).all()


# --- (2') the same, swept: every family x position scheme x placement, GQA, padded --------------
@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_sdpa_equals_eager_every_scheme(arch, position, placement):
    cfg = ModelConfig(
        arch=arch,
        d_model=16,
        n_layers=2,
        vocab_size=23,
        max_seq_len=MAX_T,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2),
        position="rope" if position.startswith("rope") else position,
        norm_placement=placement,
        d_ff=24,
    )
    cfg = dataclasses.replace(
        cfg,
        rope=dataclasses.replace(
            cfg.rope, layout="interleaved" if position == "rope_interleaved" else "half"
        ),
    )
    eager_cfg = with_backend(cfg, "eager")
    sdpa, eager = build(cfg, 0), build(eager_cfg, 1)
    eager.load_state_dict(sdpa.state_dict())
    ids, src = torch.randint(0, 23, (3, MAX_T)), torch.randint(0, 23, (3, 6))
    for masks in (None, (_right_padding([8, 5, 0], MAX_T), _right_padding([6, 0, 2], 6))):
        a = forward(sdpa, cfg, ids, src, masks)
        b = forward(eager, eager_cfg, ids, src, masks)
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)
