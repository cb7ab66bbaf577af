"""quantize_state_dict / swap_modules / quantize_model (attnlab/quantize/handler.py), and
quantized checkpoints (written by attnlab/inference/quantized.py, opened by
attnlab.checkpoint.open_checkpoint): which layers, the two steps composing, the scheme in the
safetensors metadata, and clear errors for the wrong scheme."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_model
from torch import nn

from attnlab.checkpoint import open_checkpoint, save_checkpoint
from attnlab.configs import to_dict
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.quantized import save_quantized
from attnlab.inference.sampling import SamplingConfig
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.models.weights import load_weights
from attnlab.quantize import (
    Int4Linear,
    Int8Linear,
    float_misfits,
    linear_names,
    logit_error,
    quantize_model,
    quantize_state_dict,
    read_scheme,
    swap_modules,
)
from attnlab.training.config import RunConfig

QUANT = {"int8": Int8Linear, "int4": Int4Linear}


def _model(preset="llama-tiny"):
    return build_model(get_preset(preset)).eval()


# The LM heads: untied (Llama), tied to the embedding (GPT-2, T5), BERT's tied MLM decoder.
HEADS = {
    "llama-tiny": "head",
    "gpt2-tiny": "head",
    "t5-tiny": "decoder.head",
    "bert-tiny": "head.decoder",
}


@pytest.mark.parametrize("preset", list(HEADS))
def test_linear_names_are_every_linear_or_all_but_the_head(preset):
    model = _model(preset)
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert HEADS[preset] in linears and set(linear_names(model)) == linears
    assert set(linear_names(model, heads=False)) == linears - {HEADS[preset]}
    assert {f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")} <= {
        n.split("blocks.0.")[-1] for n in linear_names(model)
    }


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_two_steps_on_meta_equal_quantize_model(scheme):
    model = _model()
    names = linear_names(model)
    sd = quantize_state_dict(model.state_dict(), scheme, 32, names)
    assert sd[f"{names[0]}.weight"].dtype == (torch.int8 if scheme == "int8" else torch.uint8)
    assert "head" in names and sd["head.weight"].dtype == sd[f"{names[0]}.weight"].dtype
    assert sd["embed.weight"].dtype == torch.float32  # the embedding is never quantized
    with torch.device("meta"):
        empty = _model()
    swap_modules(empty, scheme, 32)
    assert all(isinstance(empty.get_submodule(n), QUANT[scheme]) for n in names)
    load_weights(empty, sd)
    direct = quantize_model(_model_copy(model), scheme, 32)
    ids = torch.randint(256, (2, 12))
    assert torch.equal(empty(ids), direct(ids))


def _model_copy(model):
    fresh = build_model(get_preset("llama-tiny")).eval()
    fresh.load_state_dict(model.state_dict())
    return fresh


# int4 errors compound over every layer, the head included: 16 levels per group of weights
@pytest.mark.parametrize("scheme, max_rel", [("int8", 0.01), ("int4", 0.15)])
@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_logit_error_is_reported_and_small(preset, scheme, max_rel):
    model = _model(preset)
    ids = torch.randint(256, (2, 16))
    with torch.no_grad():
        reference = model(ids)
        err = logit_error(reference, quantize_model(model, scheme, 32)(ids))
    assert 0 < err.mean_abs <= err.max_abs
    assert err.max_abs < max_rel * reference.abs().max().item()
    assert 0.0 <= err.top1_agreement <= 1.0


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_tied_head_is_untied_by_quantizing_it(scheme):
    model = _model("gpt2-tiny")
    embedding = model.embed.weight.detach().clone()
    quantize_model(model, scheme, 32)
    assert isinstance(model.head, QUANT[scheme])
    assert isinstance(model.embed.weight, nn.Parameter)
    assert torch.equal(model.embed.weight, embedding)  # lookups still read the float matrix
    assert model.head.out_features == embedding.shape[0]


def test_float_heads_stay_tied_and_float():
    model = quantize_model(_model("gpt2-tiny"), "int8", heads=False)
    assert isinstance(model.head, nn.Linear) and model.head.weight is model.embed.weight
    assert isinstance(model.blocks[0].self_attn.q_proj, Int8Linear)


@pytest.mark.parametrize(
    "scheme, group_size, metadata",
    [
        ("int8", None, {"quantization": "int8"}),
        ("int4", 32, {"quantization": "int4", "group_size": "32"}),
        ("int4", 64, {"quantization": "int4", "group_size": "64"}),
    ],
)
@pytest.mark.parametrize("heads", [True, False])
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_save_load_round_trip(tmp_path, preset, heads, scheme, group_size, metadata):
    model = quantize_model(_model(preset), scheme, group_size, heads)
    run = to_dict(RunConfig(get_preset(preset)))
    path = save_quantized(model, tmp_path / "q", scheme, group_size, run)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        # the scheme's entries, among any others the file holds
        assert metadata.items() <= f.metadata().items()
        assert ("group_size" in f.metadata()) == (scheme == "int4")
        assert f.metadata()["heads"] == ("quantized" if heads else "float")
    opened = open_checkpoint(path, scheme=scheme, group_size=group_size)
    loaded, tokenizer, loaded_run = opened.model, opened.tokenizer, opened.run
    assert tokenizer is None and loaded_run == run
    ids = torch.randint(256, (2, 10))
    assert torch.equal(loaded(ids), model(ids))
    assert isinstance(loaded.head, QUANT[scheme] if heads else nn.Linear)
    if preset == "gpt2-tiny":  # a float head's tie is re-linked after the load
        assert (loaded.head.weight is loaded.embed.weight) == (not heads)
    assert str(read_scheme(path / "model.safetensors")).startswith(scheme)


def test_files_without_the_heads_key_load_with_float_heads(tmp_path):
    """Quantized checkpoints written before heads were quantized have no "heads" metadata."""
    model = quantize_model(_model("gpt2-tiny"), "int8", heads=False)
    path = tmp_path / "old"
    path.mkdir()
    run = to_dict(RunConfig(get_preset("gpt2-tiny")))
    (path / "config.json").write_text(json.dumps(run))
    save_model(model, str(path / "model.safetensors"), metadata={"quantization": "int8"})
    loaded = open_checkpoint(path, scheme="int8").model
    assert isinstance(loaded.head, nn.Linear) and loaded.head.weight is loaded.embed.weight
    ids = torch.randint(256, (2, 10))
    assert torch.equal(loaded(ids), model(ids))


@pytest.fixture
def int4_checkpoint(tmp_path):
    model = quantize_model(_model(), "int4", 32)
    return save_quantized(
        model, tmp_path / "q4", "int4", 32, to_dict(RunConfig(get_preset("llama-tiny")))
    )


def test_wrong_scheme_names_both(int4_checkpoint):
    with pytest.raises(ValueError, match=r"holds int4 \(group_size 32\).*but int8 was asked"):
        open_checkpoint(int4_checkpoint, scheme="int8")
    with pytest.raises(ValueError, match=r"int4 \(group_size 32\).*int4 \(group_size 128\)"):
        open_checkpoint(int4_checkpoint, scheme="int4", group_size=128)
    open_checkpoint(int4_checkpoint, scheme="int4")  # no group size: the file's is accepted
    opened = open_checkpoint(int4_checkpoint)  # no scheme: whatever the file holds
    assert isinstance(opened.model.head, Int4Linear)


def test_plain_checkpoint_as_quantized_names_both(tmp_path):
    model = _model()
    path = save_checkpoint(tmp_path / "plain", model, None, RunConfig(get_preset("llama-tiny")), {})
    with pytest.raises(ValueError, match=r"unquantized \(float\).*but int8 was asked"):
        open_checkpoint(path, scheme="int8")
    with pytest.raises(ValueError, match="unquantized"):
        open_checkpoint(path, scheme="int4")
    assert type(open_checkpoint(path).model.head) is nn.Linear  # no scheme asked: float opens


def test_unknown_scheme_and_missing_files(tmp_path, int4_checkpoint):
    with pytest.raises(ValueError, match="'int3'.*int8"):
        open_checkpoint(int4_checkpoint, scheme="int3")
    with pytest.raises(ValueError, match="not a checkpoint"):
        open_checkpoint(tmp_path / "nothing")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_cached_generation_matches_full_forward(preset, scheme):
    model = quantize_model(_model(preset), scheme, 32)
    prompt = [5, 17, 42]
    new = generate(model, [prompt], GenerationConfig(6, SamplingConfig(temperature=0.0)))[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):  # recompute the whole sequence each step, no cache
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert new == ids[len(prompt) :]


def test_layers_the_group_size_does_not_fit_stay_float(tmp_path):
    # d_ff 96: a group of 64 fits every layer that reads the residual stream (64 wide), not the
    # down projections (96); a Llama recipe with d_ff 350 fits no group size at all.
    cfg = replace(get_preset("llama-tiny"), d_ff=96)
    model = build_model(cfg).eval()
    ids = torch.randint(256, (2, 10))
    with torch.no_grad():
        reference = model(ids)
    misfits = float_misfits(model, True, 64)
    assert misfits == {f"blocks.{i}.ffn.down_proj": 96 for i in range(cfg.n_layers)}
    quantize_model(model, "int4", 64)
    assert all(type(model.get_submodule(n)) is nn.Linear for n in misfits)
    assert isinstance(model.blocks[0].ffn.up_proj, Int4Linear)
    assert isinstance(model.head, Int4Linear)
    run = to_dict(RunConfig(cfg))
    path = save_quantized(model, tmp_path / "q", "int4", 64, run)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["heads"] == "quantized"
    loaded = open_checkpoint(path, scheme="int4", group_size=64).model
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
        assert logit_error(reference, model(ids)).max_abs < 0.15 * reference.abs().max().item()


def test_a_group_size_that_fits_no_layer_is_an_error():
    # llama-tiny: d_model 64, d_ff 192: a group of 128 divides no in_features
    with pytest.raises(ValueError, match=r"group_size=128 divides .* none.*q_proj': 64"):
        quantize_model(_model(), "int4", 128)
    with pytest.raises(ValueError, match="must be one of"):
        quantize_model(_model(), "int4", 48)
