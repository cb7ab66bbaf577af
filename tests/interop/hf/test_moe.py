"""Mixture-of-Experts families against transformers: Mixtral, Qwen2-MoE (gated shared expert),
Qwen3-MoE (QK-norm), DeepSeek-V3 (MLA, sigmoid grouped routing with its bias, a dense first
layer, a shared expert): logits, the load-balancing loss (output_router_logits), cached decoding,
greedy generation, export and the fields attnlab refuses."""

import pytest
import torch

from attnlab.components.kv_cache import ModelCache
from attnlab.components.moe import router_aux_loss
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.inference.steps import decode_step, left_pad, prefill
from attnlab.interop.hf import converter_for_hf, load_hf, moe, save_hf
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from tests.interop.helpers import max_diff, padded_batch, same_state

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

ATOL = 1e-5  # fp32 logits
VOCAB = 64
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES = {
    "mixtral": ("Mixtral", dict(num_local_experts=4, sliding_window=5)),
    "qwen2_moe": (
        "Qwen2Moe",
        dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40),
    ),
    "qwen3_moe": (
        "Qwen3Moe",
        dict(num_experts=4, moe_intermediate_size=24, norm_topk_prob=True, head_dim=16),
    ),
    "deepseek_v3": (  # MLA; a dense first layer, then 8 experts in 4 groups, 2 groups kept
        "DeepseekV3",
        dict(
            num_key_value_heads=4,
            n_routed_experts=8,
            moe_intermediate_size=24,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=12,
        ),
    ),
}


def hf_model(name: str):
    family, extra = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(T, f"{family}ForCausalLM")(getattr(T, f"{family}Config")(**BASE | extra))
    with torch.no_grad():  # the routers start at zero (Qwen) and the norms at one: randomise
        for n, p in model.named_parameters():
            if "gate.weight" in n or "norm" in n:
                p.uniform_(0.5, 1.5) if "norm" in n else p.normal_(0, 0.5)
        for n, b in model.named_buffers():  # DeepSeek-V3's selection-only router bias
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    hf = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours, cfg = load_hf(path)
    return request.param, hf, ours, cfg


def test_config(pair):
    name, _, _, cfg = pair
    m = cfg.moe
    if name == "deepseek_v3":
        assert (m.n_experts, m.score, m.n_groups, m.topk_groups) == (8, "sigmoid", 4, 2)
        assert (m.d_shared, m.first_dense_layers, cfg.attention.kind) == (24, 1, "mla")
        return
    assert (m.n_experts, m.n_experts_per_token, m.score) == (4, 2, "softmax")
    assert m.normalize == (name != "qwen2_moe")  # Qwen2-MoE: norm_topk_prob False
    assert (m.d_shared, m.shared_gate) == ((40, True) if name == "qwen2_moe" else (0, False))
    assert cfg.attention.qk_norm == (name == "qwen3_moe")
    assert moe.family_of(cfg) == name


def test_logits_and_aux_loss_match_with_padding(pair):
    _, hf, ours, _ = pair
    ids, mask = padded_batch(vocab=VOCAB)
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask.long(), output_router_logits=True)
        logits = ours(ids, mask)
    assert max_diff(logits, out.logits, mask) <= ATOL
    if out.aux_loss is not None:  # DeepSeek-V3 balances with its router bias, no aux loss
        assert abs(router_aux_loss(ours, mask).item() - out.aux_loss.item()) <= 1e-6


def test_cached_decoding_equals_full_forward(pair):
    _, _, ours, _ = pair
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8, 9], [3, 4]])
    new = torch.randint(3, VOCAB, (2, 3), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([prompt_ids, new], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(new, dtype=torch.bool)], dim=1)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = ours(ids, mask, pos=pos)
        cache = ModelCache.for_decoder(ours, mask)
        steps = [prefill(ours, prompt_ids, cache)]
        T0 = prompt_ids.shape[1]
        for i in range(new.shape[1]):
            steps.append(
                decode_step(ours, new[:, i : i + 1], torch.tensor([T0 + i]), cache)[:, None]
            )
    torch.testing.assert_close(torch.cat(steps, 1)[mask], full[mask], atol=ATOL, rtol=0)


def test_greedy_tokens_match_generate(pair):
    _, hf, ours, _ = pair
    prompts = [[5, 9, 17, 3, 44, 8], [7, 8, 60]]
    ids = torch.tensor([prompts[0], [0, 0, 0] + prompts[1]])  # left-padded for HF
    mask = (torch.arange(6)[None] >= torch.tensor([[0], [3]])).long()
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    greedy = GenerationConfig(8, SamplingConfig(temperature=0))
    assert generate(ours, prompts, greedy) == out[:, 6:].tolist()


def test_export_and_round_trip(pair, tmp_path):
    _, hf, ours, cfg = pair
    save_hf(ours, cfg, tmp_path / "hf")
    back = type(hf).from_pretrained(tmp_path / "hf").eval()
    assert same_state(back.state_dict(), hf.state_dict())
    again, cfg2 = load_hf(tmp_path / "hf")
    assert cfg2 == cfg and same_state(again.state_dict(), ours.state_dict())


@pytest.mark.parametrize(
    ("family", "extra", "field"),
    [
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("mixtral", {"num_experts_per_tok": 5}, "n_experts_per_token"),
        ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
        ("deepseek_v3", {"n_group": 3}, "n_groups=3"),
    ],
)
def test_fields_attnlab_does_not_implement_are_named(family, extra, field):
    hf = getattr(T, f"{FAMILIES[family][0]}Config")(**BASE | FAMILIES[family][1]).to_dict()
    with pytest.raises(ValueError, match=field):
        converter_for_hf(hf).config_from_hf(hf | extra)


def test_an_attnlab_moe_model_exports_to_mixtral(tmp_path):
    """moe-tiny's experts are narrower than its (unused) dense d_ff: Mixtral's one width."""
    torch.manual_seed(0)
    cfg = get_preset("moe-tiny")
    ours = build_model(cfg).eval()
    save_hf(ours, cfg, tmp_path)
    theirs = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask = padded_batch(vocab=cfg.vocab_size)
    with torch.no_grad():
        assert (
            max_diff(ours(ids, mask), theirs(ids, attention_mask=mask.long()).logits, mask) <= ATOL
        )
