"""Qwen3, OLMo 2, Phi-3, Gemma 2, Gemma 3 (text) against transformers on tiny random models:
logits within 1e-5, cached decoding equal to the full forward, greedy ids equal to `generate`,
export that transformers loads to the same weights, and refusals naming the field."""

import pytest
import torch

from attnlab.components.kv_cache import ModelCache
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.inference.steps import decode_step, left_pad, prefill
from attnlab.interop.hf import families, load_hf, save_hf
from tests.interop.helpers import TINY_LLAMA, max_diff, padded_batch, same_state

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

ATOL = 1e-5
BASE = TINY_LLAMA | dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, head_dim=16)
GEMMA = dict(
    query_pre_attn_scalar=24,  # not head_dim: the scale is 24^-0.5
    sliding_window=4,  # shorter than the 12-token batch
    layer_types=["sliding_attention", "full_attention"],
)
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
VARIANTS = {  # name: (HF class prefix, config fields)
    "qwen3": ("Qwen3", {}),
    "qwen3-biases-tied": ("Qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
    "olmo2": ("Olmo2", {}),
    "phi3": (
        "Phi3",
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            },
            "sliding_window": 5,
        },
    ),
    "gemma2": ("Gemma2", GEMMA | {"attn_logit_softcapping": 4.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3Text", GEMMA | {"rope_parameters": GEMMA3_ROPE}),
}
HF_CLASSES = {"Gemma3Text": "Gemma3"}  # Gemma3TextConfig -> Gemma3ForCausalLM


def hf_model(name: str, **more):
    prefix, extra = VARIANTS[name]
    torch.manual_seed(0)
    config = getattr(T, f"{prefix}Config")(**BASE | extra | more)
    config._attn_implementation = "eager"  # HF's sdpa path ignores the attention soft-cap
    model = getattr(T, f"{HF_CLASSES.get(prefix, prefix)}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms start at 1 (or 0 for Gemma's 1 + w): make them matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours, cfg = load_hf(path)
    return request.param, hf, ours, cfg


def test_config_reads_each_family(pair):
    name, _, _, cfg = pair
    a = cfg.attention
    assert a.qk_norm == (name.startswith(("qwen3", "olmo2", "gemma3")))
    assert a.qk_norm_scope == ("projection" if name == "olmo2" else "head")
    assert cfg.norm_placement == {"olmo2": "post_sublayer", "gemma2": "sandwich"}.get(
        name, "sandwich" if name == "gemma3" else "pre"
    )
    assert (a.global_every, a.sliding_window) == {
        "gemma2": (2, 4),
        "gemma3": (2, 4),
        "phi3": (None, 5),
    }.get(name, (None, None))
    assert cfg.rope.partial_rotary == (0.5 if name == "phi3" else 1.0)
    assert cfg.rope.local_theta == (1e4 if name == "gemma3" else None)
    assert (a.logit_softcap, cfg.logit_softcap) == (
        (4.0, 3.0) if name == "gemma2" else (None, None)
    )


def test_logits_match_with_padding(pair):
    _, hf, ours, _ = pair
    ids, mask = padded_batch()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask.long()).logits
        assert max_diff(ours(ids, mask), theirs, mask) <= ATOL


def test_cached_decoding_equals_full_forward(pair):
    _, _, model, _ = pair
    prompts, n_new = [[5, 6, 7, 8, 9, 10], [3, 4]], 5
    prompt_ids, prompt_mask = left_pad(prompts)  # (B, T0)
    new = torch.randint(3, 128, (2, n_new), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([prompt_ids, new], dim=1)  # (B, T0 + N)
    mask = torch.cat([prompt_mask, torch.ones_like(new, dtype=torch.bool)], dim=1)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # what the cache counts too
    with torch.no_grad():
        full = model(ids, mask, pos=pos)  # (B, T0 + N, V)
        cache = ModelCache.for_decoder(model, mask)
        steps = [prefill(model, prompt_ids, cache)]
        T0 = prompt_ids.shape[1]
        for i in range(n_new):
            steps.append(
                decode_step(model, new[:, i : i + 1], torch.tensor([T0 + i]), cache)[:, None]
            )
    cached = torch.cat(steps, dim=1)
    torch.testing.assert_close(cached[mask], full[mask], atol=ATOL, rtol=0)


def test_greedy_tokens_match_generate(pair):
    _, hf, ours, _ = pair
    prompts = [[5, 9, 17, 3, 44, 8], [7, 8, 100]]
    ids = torch.tensor([prompts[0], [0, 0, 0] + prompts[1]])  # left-padded for HF
    mask = (torch.arange(6)[None] >= torch.tensor([[0], [3]])).long()
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert generate(ours, prompts, GenerationConfig(12, SamplingConfig(temperature=0))) == (
        out[:, 6:].tolist()
    )


def test_export_loads_in_transformers(pair, tmp_path):
    _, hf, ours, cfg = pair
    save_hf(ours, cfg, tmp_path / "hf")
    back = type(hf).from_pretrained(tmp_path / "hf").eval()
    assert same_state(back.state_dict(), hf.state_dict())
    again, cfg2 = load_hf(tmp_path / "hf")
    assert cfg2 == cfg and same_state(again.state_dict(), ours.state_dict())


# --- bad input -------------------------------------------------------------------------------
def _qwen3(**fields) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"} | BASE | fields


@pytest.mark.parametrize(
    "hf, field",
    [
        (_qwen3(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_type"),
        (
            _qwen3(
                architectures=["Gemma2ForCausalLM"],
                model_type="gemma2",
                layer_types=["full_attention", "sliding_attention"],
            ),
            "layer_types",
        ),
        (
            _qwen3(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True),
            "use_bidirectional_attention",
        ),
    ],
)
def test_unimplemented_fields_are_named(hf, field):
    with pytest.raises(ValueError, match=field) as err:
        families.config_from_hf(hf)
    assert "\n" not in str(err.value)


def test_a_family_refuses_what_it_cannot_hold(pair):
    name, _, _, cfg = pair
    if name != "olmo2":
        return
    from dataclasses import replace

    with pytest.raises(ValueError, match="norm_placement='sandwich'"):
        families.config_to_hf(replace(cfg, norm_placement="sandwich"), "olmo2")


def test_gemma3_attn_logit_softcapping_is_ignored_as_transformers_does(tmp_path, capsys):
    """Gemma3TextConfig stores attn_logit_softcapping but Gemma3ForCausalLM never applies it
    (Gemma 2 does): attnlab ignores it too, with one warning line, and the logits agree."""
    hf = hf_model("gemma3", attn_logit_softcapping=0.5)
    assert hf.config.attn_logit_softcapping == 0.5
    hf.save_pretrained(tmp_path)
    capsys.readouterr()
    ours, cfg = load_hf(tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    ids, mask = padded_batch()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask.long()).logits
        assert max_diff(ours(ids, mask), theirs, mask) <= ATOL
    assert cfg.attention.logit_softcap is None
    assert err == [
        "warning: gemma3_text attn_logit_softcapping=0.5 is ignored, as transformers' "
        "Gemma3ForCausalLM ignores it: attention logits are not soft-capped"
    ]


# --- published config.json files (older transformers formats) ---------------------------------
COMMON = dict(attention_dropout=0.0, initializer_range=0.02, hidden_act="silu", rope_scaling=None)
PUBLISHED = {  # preset: the fields of its published config.json that attnlab reads
    "qwen3-0.6b": COMMON | dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
        head_dim=128, hidden_size=1024, intermediate_size=3072, max_position_embeddings=40960,
        max_window_layers=28, num_attention_heads=16, num_hidden_layers=28,
        num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=1000000, sliding_window=None,
        tie_word_embeddings=True, use_sliding_window=False, vocab_size=151936,
    ),
    "olmo2-7b": COMMON | dict(
        architectures=["Olmo2ForCausalLM"], model_type="olmo2", attention_bias=False,
        hidden_size=4096, intermediate_size=11008, max_position_embeddings=4096,
        num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=32, rms_norm_eps=1e-6,
        rope_theta=500000, tie_word_embeddings=False, vocab_size=100352,
    ),
    "phi3-mini": COMMON | dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072,
        intermediate_size=8192, max_position_embeddings=4096, num_attention_heads=32,
        num_hidden_layers=32, num_key_value_heads=32, original_max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=2047, tie_word_embeddings=False,
        vocab_size=32064,
    ),
    "gemma2-2b": COMMON | dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", attention_bias=False,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, head_dim=256,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", hidden_size=2304,
        intermediate_size=9216, max_position_embeddings=8192, num_attention_heads=8,
        num_hidden_layers=26, num_key_value_heads=4, query_pre_attn_scalar=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096, vocab_size=256000,
    ),
    "gemma3-1b": COMMON | dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", attention_bias=False,
        attn_logit_softcapping=None, final_logit_softcapping=None, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", hidden_size=1152, intermediate_size=6912,
        max_position_embeddings=32768, num_attention_heads=4, num_hidden_layers=26,
        num_key_value_heads=1, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
        rope_local_base_freq=10000, rope_theta=1000000, sliding_window=512,
        sliding_window_pattern=6, vocab_size=262144,
    ),
}  # fmt: skip


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_config_reads_as_its_preset(preset):
    from attnlab.models.presets import get_preset

    assert families.config_from_hf(PUBLISHED[preset]) == get_preset(preset)
