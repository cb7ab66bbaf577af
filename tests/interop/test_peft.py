"""The peft adapter format without peft: placements read off the converters, round trips, and
the errors for adapters that do not fit (test_lora_peft.py checks the files against peft)."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab.adapters.lora import add_lora, lora_modules, lora_state_dict, merge_lora
from attnlab.interop.peft import hf_placements, load_peft, save_peft
from attnlab.models.build import build_model
from attnlab.models.config import HeadConfig
from attnlab.models.presets import get_preset
from attnlab.quantize import quantize_model


def base(preset: str):
    torch.manual_seed(0)
    cfg = get_preset(preset)
    return build_model(cfg).eval(), cfg


def with_adapters(preset: str, targets=("q", "v"), rank=4):
    model, cfg = base(preset)
    add_lora(model, targets, rank=rank, alpha=2 * rank)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.normal_(0.0, 0.1)
    return model, cfg


def ids(vocab: int):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


def test_gpt2_q_k_v_are_row_blocks_of_the_transposed_c_attn():
    cfg = get_preset("gpt2-tiny")
    C = cfg.d_model
    names = [f"blocks.1.self_attn.{p}_proj" for p in "qkvo"]
    places = hf_placements(cfg, names)
    for j, p in enumerate("qkv"):
        place = places[f"blocks.1.self_attn.{p}_proj"]
        assert place.module == "transformer.h.1.attn.c_attn" and place.transposed
        assert place.out_features == 3 * C
        assert torch.equal(place.rows, torch.arange(j * C, (j + 1) * C))
    assert places["blocks.1.self_attn.o_proj"].module == "transformer.h.1.attn.c_proj"


def test_llama_and_bert_names():
    places = hf_placements(get_preset("llama-tiny"), ["blocks.0.self_attn.k_proj"])
    place = places["blocks.0.self_attn.k_proj"]
    assert place.module == "model.layers.0.self_attn.k_proj" and not place.transposed
    assert torch.equal(place.rows, torch.arange(place.out_features))
    places = hf_placements(get_preset("bert-tiny"), ["encoder.blocks.1.ffn.down_proj"])
    assert places["encoder.blocks.1.ffn.down_proj"].module == "bert.encoder.layer.1.output.dense"


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_save_then_load_gives_the_same_outputs(preset, tmp_path):
    model, cfg = with_adapters(preset, ("q", "v", "o", "mlp"))
    save_peft(model, cfg, tmp_path)
    again, _ = base(preset)
    load_peft(again, cfg, tmp_path)
    x = ids(cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x), atol=1e-6, rtol=0)


def test_gpt2_q_v_come_back_as_q_k_v_with_k_zero(tmp_path):
    model, cfg = with_adapters("gpt2-tiny", ("q", "v"), rank=4)
    save_peft(model, cfg, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (8, 16.0, ["c_attn"])
    again, _ = base("gpt2-tiny")
    names = load_peft(again, cfg, tmp_path)
    assert names == [f"blocks.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkv"]
    k = again.get_submodule("blocks.0.self_attn.k_proj")
    assert k.rank == 8 and not k.lora_B.any()


def test_qlora_adapters_save_like_float_ones(tmp_path):
    model, cfg = with_adapters("llama-tiny", ("q", "v"))
    qmodel, _ = base("llama-tiny")
    quantize_model(qmodel, "int8")
    add_lora(qmodel, ("q", "v"), rank=4, alpha=8)
    with torch.no_grad():
        for name, m in lora_modules(qmodel).items():
            m.lora_A.copy_(model.get_submodule(name).lora_A)
            m.lora_B.copy_(model.get_submodule(name).lora_B)
    save_peft(model, cfg, tmp_path / "float")
    save_peft(qmodel, cfg, tmp_path / "int8")
    a = load_file(tmp_path / "float" / "adapter_model.safetensors")
    b = load_file(tmp_path / "int8" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fresh, _ = base("llama-tiny")
    load_peft(fresh, cfg, tmp_path / "int8")
    got = lora_state_dict(fresh)
    assert all(torch.equal(got[k], v) for k, v in lora_state_dict(qmodel).items())


def edit_config(path, **fields):
    file = path / "adapter_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | fields))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"bias": "some"}, "bias='some' is not one of"),
        ({"peft_type": "IA3"}, "peft_type='IA3', only LORA loads"),
    ],
)
def test_other_peft_methods_are_refused_by_name(tmp_path, fields, message):
    model, cfg = with_adapters("gpt2-tiny")
    save_peft(model, cfg, tmp_path)
    edit_config(tmp_path, **fields)
    with pytest.raises(ValueError, match=message):
        load_peft(base("gpt2-tiny")[0], cfg, tmp_path)


def test_an_adapter_for_another_model_is_refused(tmp_path):
    model, cfg = with_adapters("llama-tiny")
    save_peft(model, cfg, tmp_path)
    gpt2, gpt2_cfg = base("gpt2-tiny")
    with pytest.raises(ValueError, match=r"adapts \['model.layers.0.self_attn.q_proj'"):
        load_peft(gpt2, gpt2_cfg, tmp_path)


def test_broken_directories_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        load_peft(base("gpt2-tiny")[0], get_preset("gpt2-tiny"), tmp_path)
    model, cfg = with_adapters("gpt2-tiny")
    save_peft(model, cfg, tmp_path)
    file = tmp_path / "adapter_model.safetensors"
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if "h.0" not in k or "lora_A" in k}, file)
    with pytest.raises(ValueError, match=r"lora_A or lora_B only: \['transformer.h.0.attn.c_attn'"):
        load_peft(base("gpt2-tiny")[0], cfg, tmp_path)
    with pytest.raises(ValueError, match="already has LoRA"):
        load_peft(model, cfg, tmp_path)


def test_saving_needs_unmerged_adapters(tmp_path):
    model, cfg = base("gpt2-tiny")
    with pytest.raises(ValueError, match="no LoRA adapters to save"):
        save_peft(model, cfg, tmp_path)
    model, cfg = with_adapters("gpt2-tiny")
    merge_lora(model)
    with pytest.raises(ValueError, match="unmerge the adapters before saving"):
        save_peft(model, cfg, tmp_path)


def test_a_task_head_is_saved_in_modules_to_save(tmp_path):
    """A classifier's adapter holds its head whole (peft's SEQ_CLS modules_to_save), trained
    or not, and load_peft puts it back: the same logits from a fresh classifier."""
    cfg = replace(get_preset("bert-tiny"), head=HeadConfig("sequence", 3))
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    add_lora(model, ("q", "v"), rank=4)
    model.classifier.requires_grad_(True)  # as attnlab finetune --task classify --lora.rank
    with torch.no_grad():
        model.classifier.weight.normal_()
    save_peft(model, cfg, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS"
    assert config["modules_to_save"] == ["bert.pooler.dense", "classifier"]
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert torch.equal(tensors["base_model.model.classifier.weight"], model.classifier.weight)
    torch.manual_seed(0)
    again = build_model(cfg).eval()  # the same base ...
    with torch.no_grad():
        again.classifier.weight.zero_()  # ... whose head the adapter brings back
    load_peft(again, cfg, tmp_path)
    x = ids(cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x), atol=1e-6, rtol=0)
