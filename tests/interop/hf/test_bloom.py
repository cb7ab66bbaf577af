"""BLOOM: logits (eager, sdpa, flex) and greedy decoding identical to transformers; the per-head
fused qkv, ALiBi slopes for head counts that are not powers of two, export and round trips."""

from dataclasses import replace

import pytest
import torch

from attnlab.components.positions.alibi import alibi_slopes
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.interop.hf import bloom, load_hf, save_hf
from attnlab.models.build import build_model
from tests.interop.helpers import VOCAB, max_diff, padded_batch, same_state

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

ATOL = 1e-5  # issue 20: the flex path equals the dense-bias path within 1e-5
GREEDY = SamplingConfig(temperature=0)
PROMPTS = [[5, 9, 17, 3, 44], [7, 8, 100]]


def tiny(n_head: int = 4, **overrides):
    torch.manual_seed(0)
    cfg = dict(
        hidden_size=12 * n_head,
        n_layer=2,
        n_head=n_head,
        vocab_size=VOCAB,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    hf = T.BloomForCausalLM(T.BloomConfig(**cfg | overrides)).eval()
    with torch.no_grad():  # HF initialises LayerNorms to (1, 0): make them matter
        for name, p in hf.named_parameters():
            if "layernorm" in name or "ln_f" in name:
                p.add_(0.3 * torch.randn_like(p))
    return hf


@pytest.fixture(scope="module", params=[4, 6], ids=["4-heads", "6-heads"])
def pair(request, tmp_path_factory):
    hf = tiny(request.param)
    path = tmp_path_factory.mktemp("bloom")
    hf.save_pretrained(path)
    ours, cfg = load_hf(path)
    return hf, ours, cfg, path


def hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask.long()).logits


def with_backend(ours, cfg, backend):
    if backend == cfg.attention.backend:
        return ours
    model = build_model(replace(cfg, attention=replace(cfg.attention, backend=backend))).eval()
    model.load_state_dict(ours.state_dict())
    return model


def test_config_and_tie(pair):
    hf, ours, cfg, _ = pair
    assert (cfg.position, cfg.activation, cfg.embed_norm, cfg.ffn_width) == (
        "alibi",
        "gelu_tanh",
        True,
        4 * cfg.d_model,
    )
    assert cfg.attention.n_heads == hf.config.n_head
    assert cfg.tie_embeddings and ours.head.weight is ours.embed.weight


def test_alibi_slopes_equal_hf_for_any_head_count():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    for H in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 112):
        ones = torch.ones(1, 2)  # position 1 of one row: the bias is the slope itself
        hf = build_alibi_tensor(ones, H, torch.float32).view(H, 2)[:, 1]
        torch.testing.assert_close(alibi_slopes(H), hf, rtol=1e-6, atol=0)  # HF: fp32 pow


def test_fused_qkv_is_split_per_head(pair):
    hf, ours, cfg, _ = pair
    H, D, C = cfg.attention.n_heads, cfg.head_dim, cfg.d_model
    fused = hf.transformer.h[0].self_attention.query_key_value.weight  # (3C, C)
    attn = ours.blocks[0].self_attn
    for h in range(H):  # rows 3 h D .. 3 h D + 3D of the fused weight are [q_h; k_h; v_h]
        q, k, v = fused[3 * h * D : 3 * (h + 1) * D].split(D)
        assert torch.equal(attn.q_proj.weight[h * D : (h + 1) * D], q)
        assert torch.equal(attn.k_proj.weight[h * D : (h + 1) * D], k)
        assert torch.equal(attn.v_proj.weight[h * D : (h + 1) * D], v)
    assert attn.q_proj.weight.shape == (C, C)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_match_with_padding(pair, backend):
    hf, ours, cfg, _ = pair
    model = with_backend(ours, cfg, backend)
    ids, mask = padded_batch()
    with torch.no_grad():
        assert max_diff(model(ids, mask), hf_logits(hf, ids, mask), mask) <= ATOL


@pytest.mark.slow
def test_logits_match_through_flex(pair):
    """The ALiBi bias as a score_mod (nothing (H, T, S) built) gives HF's logits."""
    hf, ours, cfg, _ = pair
    flex = with_backend(ours, cfg, "flex")
    assert flex.positions.bias_form == "score_mod"
    ids, mask = padded_batch(T=11, seed=3)
    with torch.no_grad():
        assert max_diff(flex(ids, mask), hf_logits(hf, ids, mask), mask) <= ATOL


def test_greedy_tokens_match_generate(pair):
    hf, ours, _, _ = pair
    T0 = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (T0 - len(p)) + p for p in PROMPTS])  # left padding, as HF wants
    mask = torch.tensor([[0] * (T0 - len(p)) + [1] * len(p) for p in PROMPTS])
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert generate(ours, PROMPTS, GenerationConfig(8, GREEDY)) == out[:, T0:].tolist()


def test_export_loads_in_transformers_and_round_trips(pair, tmp_path):
    hf, ours, cfg, _ = pair
    save_hf(ours, cfg, tmp_path)
    back = T.BloomForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask = padded_batch(seed=1)
    assert max_diff(hf_logits(back, ids, mask), hf_logits(hf, ids, mask), mask) == 0.0
    again, cfg2 = load_hf(tmp_path)
    assert cfg2 == cfg and same_state(again.state_dict(), ours.state_dict())


def test_attnlab_model_round_trips_through_hf(tmp_path):
    """A model attnlab built (not one HF made) -> HF -> attnlab: same weights, same logits."""
    cfg = bloom.config_from_hf(tiny(6).config.to_dict())
    torch.manual_seed(1)
    ours = build_model(cfg).eval()
    save_hf(ours, cfg, tmp_path)
    hf = T.BloomForCausalLM.from_pretrained(tmp_path).eval()
    back, cfg2 = load_hf(tmp_path)
    ids, mask = padded_batch(seed=2)
    with torch.no_grad():
        assert max_diff(ours(ids, mask), hf_logits(hf, ids, mask), mask) <= ATOL
    assert cfg2 == cfg and same_state(back.state_dict(), ours.state_dict())


def test_checkpoint_without_the_transformer_prefix_loads(pair, tmp_path):
    """bigscience/bloom-* store BloomModel's names (no "transformer.", no lm_head)."""
    from attnlab.interop.hf import common

    hf, ours, _, path = pair
    state = {
        k.removeprefix("transformer."): v
        for k, v in common.read_state_dict(path).items()
        if k != "lm_head.weight"
    }
    common.write_hf_dir(tmp_path, common.read_config(path), state)
    bare, _ = load_hf(tmp_path)
    assert same_state(bare.state_dict(), ours.state_dict())


def test_unsupported_options_raise_one_clear_line(tmp_path):
    hf = tiny(4, apply_residual_connection_post_layernorm=True)
    with pytest.raises(ValueError, match="apply_residual_connection_post_layernorm"):
        bloom.config_from_hf(hf.config.to_dict())
    cfg = bloom.config_from_hf(tiny(4).config.to_dict())
    with pytest.raises(ValueError, match="embed_norm=False"):
        bloom.config_to_hf(replace(cfg, embed_norm=False))
