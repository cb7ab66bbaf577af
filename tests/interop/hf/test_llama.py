"""The Llama family: Llama (GQA, llama3 RoPE scaling, tied + biases), Mistral (sliding window),
Qwen2 (q/k/v bias): logits and greedy ids identical to transformers, export, RoPE layouts."""

import pytest
import torch

from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.interop.hf import llama, load_hf, save_hf
from tests.interop.helpers import ATOL, TINY_LLAMA, max_diff, padded_batch, same_state

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

BASE = TINY_LLAMA | dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
VARIANTS = {
    "llama-gqa": ("Llama", {}),
    "llama3-rope-scaling": ("Llama", {"rope_parameters": LLAMA3}),
    "llama-tied-biases": (
        "Llama",
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    ),
    "mistral-window": ("Mistral", {"sliding_window": 4}),  # shorter than the 12-token batch
    "qwen2-qkv-bias": ("Qwen2", {}),
}


def hf_model(name: str):
    family, extra = VARIANTS[name]
    torch.manual_seed(0)
    config = getattr(T, f"{family}Config")(**BASE | extra)
    return getattr(T, f"{family}ForCausalLM")(config).eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours, cfg = load_hf(path)
    return request.param, hf, ours, cfg, path


def hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask.long()).logits


def test_config(pair):
    name, _, ours, cfg, _ = pair
    a = cfg.attention
    assert (cfg.n_kv_heads, cfg.position, cfg.ffn) == (2, "rope", "swiglu")
    assert (a.sliding_window == 4) == (name == "mistral-window")
    assert (a.qkv_bias, a.out_bias) == {
        "qwen2-qkv-bias": (True, False),
        "llama-tied-biases": (True, True),
    }.get(name, (False, False))
    assert (cfg.rope.scaling is not None) == (name == "llama3-rope-scaling")
    assert (ours.head.weight is ours.embed.weight) == (name == "llama-tied-biases")


def test_logits_match_with_padding(pair):
    _, hf, ours, _, _ = pair
    ids, mask = padded_batch()
    with torch.no_grad():
        assert max_diff(ours(ids, mask), hf_logits(hf, ids, mask), mask) <= ATOL


def test_export_and_round_trip(pair, tmp_path):
    _, hf, ours, cfg, _ = pair
    save_hf(ours, cfg, tmp_path / "hf")
    back = type(hf).from_pretrained(tmp_path / "hf").eval()
    assert same_state(back.state_dict(), hf.state_dict())
    again, cfg2 = load_hf(tmp_path / "hf")
    assert cfg2 == cfg and same_state(again.state_dict(), ours.state_dict())


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
def test_greedy_20_tokens_match_generate(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    ours, _ = load_hf(tmp_path)
    prompts = [[5, 9, 17, 3, 44, 8], [7, 8, 100]]
    ids = torch.tensor([[0, 0, 0] + prompts[1], prompts[0]][::-1])  # left-padded for HF
    mask = (torch.arange(6)[None] >= torch.tensor([[0], [3]])).long()
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=20,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert (
        generate(ours, prompts, GenerationConfig(20, SamplingConfig(temperature=0)))
        == out[:, 6:].tolist()
    )


def test_interleaved_layout_gives_the_same_logits(tmp_path):
    hf = hf_model("llama-gqa")
    hf.save_pretrained(tmp_path / "hf")
    half, _ = load_hf(tmp_path / "hf")
    inter, cfg = load_hf(tmp_path / "hf", layout="interleaved")
    assert cfg.rope.layout == "interleaved"
    q = "blocks.0.self_attn.q_proj.weight"
    assert not torch.equal(half.state_dict()[q], inter.state_dict()[q])  # rows were permuted
    ids, mask = padded_batch(seed=3)
    with torch.no_grad():
        assert max_diff(inter(ids, mask), half(ids, mask), mask) <= ATOL
    save_hf(inter, cfg, tmp_path / "back")  # saving permutes back to HF's half layout
    back = T.LlamaForCausalLM.from_pretrained(tmp_path / "back")
    assert same_state(back.state_dict(), hf.state_dict())


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
)
def test_other_rope_scalings(rope, tmp_path):
    torch.manual_seed(0)
    hf = T.LlamaForCausalLM(T.LlamaConfig(**BASE, rope_parameters=rope)).eval()
    hf.save_pretrained(tmp_path)
    ours, cfg = load_hf(tmp_path)
    assert cfg.rope.scaling.kind == rope["rope_type"]
    ids, mask = padded_batch(seed=4)
    with torch.no_grad():
        assert max_diff(ours(ids, mask), hf_logits(hf, ids, mask), mask) <= ATOL


def test_legacy_rope_scaling_fields():
    """Older config.json files carry rope_theta and rope_scaling ({"type": ...}) at the top."""
    cfg = llama.config_from_hf(
        {
            **BASE,
            "model_type": "llama",
            "rope_theta": 500000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        }
    )
    assert cfg.rope.theta == 500000.0 and cfg.rope.scaling.kind == "linear"


def test_family_chosen_on_save():
    base = llama.config_from_hf({**BASE, "model_type": "llama"})
    qwen = llama.config_from_hf({**BASE, "model_type": "qwen2"})
    mistral = llama.config_from_hf({**BASE, "model_type": "mistral", "sliding_window": 8})
    assert [llama.config_to_hf(c)["model_type"] for c in (base, qwen, mistral)] == [
        "llama",
        "qwen2",
        "mistral",
    ]
