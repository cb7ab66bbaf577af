"""MLA in whole models: config validation, cached decoding against the full forward, the KV
cache's bytes per token (counted and measured), `attnlab inspect`, and logit parity with
transformers' DeepseekV3ForCausalLM (dense MLPs only: first_k_dense_replace >= n_layers)."""

import re
from dataclasses import replace

import pytest
import torch

from attnlab.cli.__main__ import main
from attnlab.components.kv_cache import ModelCache
from attnlab.components.mla import MultiHeadLatentAttention
from attnlab.inference.beam import beam_search
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.steps import decode_step, left_pad, prefill
from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig, RopeConfig
from attnlab.models.inspect import DTYPE_BYTES, inspect_config, kv_cache_bytes_per_token
from attnlab.models.presets import get_preset

ATOL = 1e-5  # fp32, max abs difference
HF_ATOL = 1e-4
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mla_attention(**kw) -> AttentionConfig:
    dims = dict(
        n_heads=4,
        kind="mla",
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=10,
    )
    return AttentionConfig(**(dims | kw))


def mla_config(**kw) -> ModelConfig:
    base = dict(
        arch="decoder",
        d_model=48,
        n_layers=2,
        vocab_size=64,
        max_seq_len=64,
        attention=mla_attention(),
        rope=RopeConfig(layout="interleaved"),
        norm_eps=1e-6,
        d_ff=96,
        tie_embeddings=False,
    )
    return ModelConfig(**(base | kw))


def _set_absorb(model, absorb: bool) -> None:
    for m in model.modules():
        if isinstance(m, MultiHeadLatentAttention):
            m.absorb = absorb


# --- config ------------------------------------------------------------------------------------
def test_build_picks_mla_and_rope_is_sized_for_the_rope_part():
    model = build_model(mla_config())
    assert all(isinstance(b.self_attn, MultiHeadLatentAttention) for b in model.blocks)
    assert model.positions.head_dim == 8  # qk_rope_head_dim, not d_model // n_heads


@pytest.mark.parametrize(
    ("attention", "match"),
    [
        (dict(kv_lora_rank=49), r"\{'kv_lora_rank': 49\} exceed d_model=48"),
        (dict(q_lora_rank=64), r"\{'q_lora_rank': 64\} exceed d_model=48"),
    ],
)
def test_ranks_wider_than_the_model_are_rejected(attention, match):
    with pytest.raises(ValueError, match=match):
        mla_config(attention=mla_attention(**attention))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kind="mla", kv_lora_rank=16), r"needs \['qk_rope_head_dim', 'qk_nope_head_dim'"),
        (dict(kv_lora_rank=16), r"\{'kv_lora_rank': 16\} are MLA settings; set attention.kind"),
        (
            dict(kind="mla", kv_lora_rank=0, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
            r"MLA widths must be >= 1, got \{'kv_lora_rank': 0\}",
        ),
        (
            dict(
                kind="mla",
                kv_lora_rank=8,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
                n_kv_heads=2,
            ),
            r"\{'n_kv_heads': 2\} do not apply",
        ),
        (dict(kind="flash"), r"kind='flash' is not one of \['standard', 'mla'\]"),
    ],
)
def test_bad_attention_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionConfig(**kwargs)


def test_odd_rope_part_and_cross_attention_are_rejected():
    with pytest.raises(ValueError, match=r"qk_rope_head_dim=7"):
        mla_config(attention=mla_attention(qk_rope_head_dim=7))
    with pytest.raises(ValueError, match=r"self-attention only; arch='encoder_decoder'"):
        mla_config(arch="encoder_decoder")


def test_mla_width_need_not_divide_the_heads():
    cfg = mla_config(d_model=50)  # no head_dim = d_model // n_heads is ever formed
    assert build_model(cfg)(torch.randint(0, 64, (1, 3))).shape == (1, 3, 64)


def test_encoder_with_mla():
    model = build_model(mla_config(arch="encoder", final_norm=True)).eval()
    assert model(torch.randint(0, 64, (2, 5))).shape == (2, 5, 64)


# --- cached decoding ---------------------------------------------------------------------------
@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_cached_decoding_equals_full_forward(absorb, q_lora_rank):
    """Left-padded prompts, prefill, then one decode_step per token, against one full forward."""
    model = build_model(mla_config(attention=mla_attention(q_lora_rank=q_lora_rank))).eval()
    _set_absorb(model, absorb)
    prompts, n_new = [[5, 6, 7, 8, 9], [3, 4]], 4
    prompt_ids, prompt_mask = left_pad(prompts)  # (B, T0)
    new = torch.randint(0, 64, (2, n_new))
    ids = torch.cat([prompt_ids, new], dim=1)  # (B, T0 + N)
    mask = torch.cat([prompt_mask, torch.ones_like(new, dtype=torch.bool)], dim=1)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # what the cache counts too
    with torch.no_grad():
        full = model(ids, mask, pos=pos)  # (B, T0 + N, V)
        cache = ModelCache.for_decoder(model, mask)
        steps = [prefill(model, prompt_ids, cache)]
        T0 = prompt_ids.shape[1]
        for i in range(n_new):
            slot = torch.tensor([T0 + i])
            steps.append(decode_step(model, new[:, i : i + 1], slot, cache)[:, None])
    cached = torch.cat(steps, dim=1)
    torch.testing.assert_close(cached[mask], full[mask], atol=ATOL, rtol=0)


def test_generate_and_beam_search_run_on_mla():
    model = build_model(get_preset("mla-tiny")).eval()
    rows = generate(model, [[1, 2, 3], [4]], GenerationConfig(5))
    assert [len(r) for r in rows] == [5, 5]
    assert len(beam_search(model, [[1, 2, 3]], GenerationConfig(4, num_beams=3))[0][0].tokens) == 4


# --- KV-cache bytes ----------------------------------------------------------------------------
def _measured_bytes_per_token(model, dtype: torch.dtype, B: int = 3, S_max: int = 10) -> int:
    cache = ModelCache.for_decoder(model, torch.ones(B, S_max, dtype=torch.bool), dtype=dtype)
    total = sum(b.numel() * b.element_size() for layer in cache.layers for b in layer.buffers())
    return total // (B * S_max)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("preset", ["mla-tiny", "llama-tiny"])
def test_kv_bytes_per_token_counted_and_measured(preset, dtype):
    cfg = get_preset(preset)
    a, L, size = cfg.attention, cfg.n_layers, DTYPE_BYTES[dtype]
    if a.kind == "mla":
        expected = (a.kv_lora_rank + a.qk_rope_head_dim) * L * size
    else:
        expected = 2 * cfg.n_kv_heads * cfg.head_dim * L * size
    assert kv_cache_bytes_per_token(cfg, dtype) == expected
    assert inspect_config(cfg).kv_bytes_per_token[dtype] == expected
    assert _measured_bytes_per_token(build_model(cfg), TORCH_DTYPES[dtype]) == expected


def test_mla_cache_against_mha_and_gqa():
    """DeepSeek-V2-Lite's shapes: (512 + 64) x 27 layers x 2 bytes, against MHA's
    2 x 16 heads x 128 x 27 x 2 and GQA's with 4 kv heads, at the same d_h = 128."""
    cfg = get_preset("deepseek-v2-lite-dense")
    mha = replace(cfg, attention=AttentionConfig(n_heads=16, head_dim=128))
    gqa = replace(cfg, attention=AttentionConfig(n_heads=16, n_kv_heads=4, head_dim=128))
    assert kv_cache_bytes_per_token(cfg) == 576 * 27 * 2 == 31_104
    assert kv_cache_bytes_per_token(mha) == 2 * 16 * 128 * 27 * 2 == 221_184
    assert kv_cache_bytes_per_token(gqa) == 55_296


def test_inspect_shows_mla(capsys):
    assert main(["inspect", "mla-tiny", "--context", "16"]) == 0
    out = capsys.readouterr().out
    assert "4 heads MLA: kv latent 32 + rope key 8, q latent 48" in out
    assert re.search(r"KV cache / token bf16 +160 B", out)  # (32 + 8) x 2 layers x 2 bytes
    assert re.search(r"MLA +1 .*<- this config", out)
    assert re.search(r"MHA +4 ", out) and re.search(r"GQA +2 ", out)


# --- parity with transformers' DeepseekV3ForCausalLM -------------------------------------------
HF_ATTENTION = {
    "kv_a_proj": "kv_a_proj_with_mqa",
    "kv_a_norm": "kv_a_layernorm",
    "q_a_norm": "q_a_layernorm",
}  # q_proj, q_a/b_proj, kv_b_proj, o_proj: the same


def _hf_key(ours: str) -> str:
    """Our DecoderLM state-dict key -> DeepseekV3ForCausalLM's."""
    top = {
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight",
    }
    if ours in top:
        return top[ours]
    _, i, kind, rest = ours.split(".", 3)
    layer = f"model.layers.{i}."
    if kind == "self_attn":
        module, _, param = rest.partition(".")
        return f"{layer}self_attn.{HF_ATTENTION.get(module, module)}.{param}"
    if kind == "ffn":
        return layer + "mlp." + rest
    norms = {"0": "input_layernorm", "1": "post_attention_layernorm"}
    return layer + norms[rest.split(".")[0]] + ".weight"  # residuals.{0,1}.norm.weight


@pytest.mark.hf
@pytest.mark.parametrize(("q_lora_rank", "interleave"), [(None, True), (24, False)])
def test_matches_transformers_deepseek_v3_model(q_lora_rank, interleave):
    tf = pytest.importorskip("transformers")
    L = 2
    hf_cfg = tf.DeepseekV3Config(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=L,
        first_k_dense_replace=L,  # every layer a dense MLP: no MoE
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=10,
        rope_interleave=interleave,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    theirs = tf.DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # every norm starts at one, which would hide a mapping mistake
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    layout = "interleaved" if interleave else "half"
    ours = build_model(
        mla_config(attention=mla_attention(q_lora_rank=q_lora_rank), rope=RopeConfig(layout=layout))
    ).eval()
    hf_state = theirs.state_dict()
    assert {_hf_key(k) for k in ours.state_dict()} == set(hf_state)
    ours.load_state_dict({k: hf_state[_hf_key(k)] for k in ours.state_dict()})
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = theirs(ids).logits
        for absorb in (False, True):
            _set_absorb(ours, absorb)
            torch.testing.assert_close(ours(ids), expected, atol=HF_ATOL, rtol=0)
