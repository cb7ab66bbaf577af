"""Dynamic-NTK RoPE against transformers, both directions, past the original length.

transformers takes `max_position_embeddings` as the original (pre-training) length for dynamic
scaling and ignores `original_max_position_embeddings` (`_compute_dynamic_ntk_parameters` in
`modeling_rope_utils.py`). These tests put that key in the config, smaller than the input, so a
converter that reads it scales a different set of frequencies from HF's and the logits part.
"""

from dataclasses import replace

import pytest
import torch

from attnlab.components.positions.rope_scaling import RopeScaling
from attnlab.inference.beam import beam_search
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.inference.steps import fill_cache, left_pad
from attnlab.interop.hf import llama, load_hf, save_hf
from attnlab.models.build import build_model
from tests.interop.helpers import ATOL, TINY_LLAMA, max_diff

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

MAX_POSITIONS = 32  # HF's original length for dynamic scaling
DYNAMIC = {
    "rope_type": "dynamic",
    "rope_theta": 10000.0,
    "factor": 2.0,
    "original_max_position_embeddings": 16,  # read by neither HF nor (now) attnlab
}
# 24: past the key above but within max_position_embeddings (HF: unscaled); 48: past both.
LENGTHS = (24, 48)


def hf_dynamic_model():
    torch.manual_seed(0)
    config = T.LlamaConfig(
        **TINY_LLAMA | dict(max_position_embeddings=MAX_POSITIONS), rope_parameters=DYNAMIC
    )
    return T.LlamaForCausalLM(config).eval()


@torch.no_grad()
def hf_logits(hf, ids):
    return hf(input_ids=ids).logits


@torch.no_grad()
def our_logits(model, ids):
    return model(ids)


@pytest.mark.parametrize("length", LENGTHS)
def test_hf_dynamic_ntk_loads_with_hf_logits(length, tmp_path):
    hf = hf_dynamic_model()
    hf.save_pretrained(tmp_path)
    ours, cfg = load_hf(tmp_path)
    assert cfg.rope.scaling.kind == "dynamic"
    ids = torch.randint(3, TINY_LLAMA["vocab_size"], (2, length))
    assert max_diff(our_logits(ours, ids), hf_logits(hf, ids)) <= ATOL


@pytest.mark.parametrize("length", LENGTHS)
def test_our_dynamic_ntk_exports_with_our_logits(length, tmp_path):
    cfg = llama.config_from_hf(TINY_LLAMA | {"model_type": "llama"})  # max_seq_len 64
    # Our original length (16) differs from max_seq_len (64): the export must carry the 16 where
    # HF reads it, in max_position_embeddings.
    scaling = RopeScaling("dynamic", factor=2.0, original_max_seq_len=16)
    cfg = replace(cfg, rope=replace(cfg.rope, scaling=scaling))
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    save_hf(ours, cfg, tmp_path)
    hf = T.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, cfg.vocab_size, (2, length))
    assert hf.config.max_position_embeddings == 16
    assert max_diff(hf_logits(hf, ids), our_logits(ours, ids)) <= ATOL


# --- cached generation: the cache is preallocated past the original length ---------------------
# The cache holds prompt + N_NEW slots (9 + 40 = 49 > 32): dynamic NTK must follow the real
# current length (the newest position + 1, as transformers does), not every preallocated slot,
# so the prefill and the first decode steps (all below 32) are unscaled and the later ones scale.
N_NEW = 40
GEN_PROMPTS = [[5, 9, 17, 3, 44, 21, 8, 30, 11], [7, 8, 60, 2], [60, 2, 33, 71, 12, 90, 4]]


@pytest.fixture(scope="module")
def dynamic_pair(tmp_path_factory):
    """(the transformers model with dynamic NTK, ours loaded from its save_pretrained dir)."""
    path = tmp_path_factory.mktemp("dynamic")
    hf = hf_dynamic_model()
    hf.generation_config.eos_token_id = hf.generation_config.bos_token_id = None
    hf.save_pretrained(path)
    ours, _ = load_hf(path)
    return hf, ours


@torch.no_grad()
def hf_generate(hf, prompts, **kwargs):
    """transformers' generate on left-padded prompts: the new tokens, (B * n, N_NEW)."""
    ids, mask = left_pad(prompts, pad_id=0)
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask.long(),
        max_new_tokens=N_NEW,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        **kwargs,
    )
    return out[:, ids.shape[1] :].tolist()


@pytest.mark.parametrize("prompts", [GEN_PROMPTS[:1], GEN_PROMPTS], ids=["one", "left-padded"])
def test_cached_greedy_generation_with_dynamic_ntk_equals_transformers(dynamic_pair, prompts):
    hf, ours = dynamic_pair
    got = generate(ours, prompts, GenerationConfig(N_NEW, SamplingConfig(temperature=0.0)))
    assert got == hf_generate(hf, prompts)


def test_beam_search_with_dynamic_ntk_equals_transformers(dynamic_pair):
    hf, ours = dynamic_pair
    hyps = beam_search(ours, GEN_PROMPTS, GenerationConfig(N_NEW, num_beams=3))
    assert [h[0].tokens for h in hyps] == hf_generate(hf, GEN_PROMPTS, num_beams=3)


def test_prefill_below_the_original_length_is_unscaled_however_large_the_cache(dynamic_pair):
    """The first token's logits of a 9-token prompt equal a plain forward's, with 49 slots."""
    hf, ours = dynamic_pair
    ids = torch.tensor(GEN_PROMPTS[:1])
    with torch.no_grad():
        want = hf(input_ids=ids).logits[:, -1]  # (1, V)
        got, _, _ = fill_cache(ours, ids, torch.ones_like(ids, dtype=torch.bool), N_NEW)
    assert max_diff(got, want) <= ATOL
