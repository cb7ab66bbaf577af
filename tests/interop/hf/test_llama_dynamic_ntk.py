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
