"""pack_weights: every tensor moves into one buffer per dtype; the model computes what it did."""

import copy
from dataclasses import replace

import torch
from torch import nn

from attnlab.accel.packing import ALIGN_BYTES, pack_weights
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.quantize import quantize_model


def _tiny(preset: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = replace(get_preset(preset), d_model=32, n_layers=2, vocab_size=64, max_seq_len=32)
    return build_model(replace(cfg, d_ff=72)).eval()


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def test_every_tensor_is_a_view_of_one_buffer_per_dtype_and_the_model_is_unchanged():
    model = _tiny("gpt2-tiny")  # tied head: the embedding and the head share one Parameter
    ids = torch.randint(0, 64, (2, 9))
    params = dict(model.named_parameters())
    with torch.no_grad():
        before, state = model(ids), {k: v.clone() for k, v in model.state_dict().items()}
    moved = pack_weights(model)
    assert moved == len(_tensors(model))
    storages = {(t.dtype, t.untyped_storage().data_ptr()) for t in _tensors(model)}
    assert len(storages) == len({t.dtype for t in _tensors(model)})  # one buffer per dtype
    for t in _tensors(model):
        assert t.data_ptr() % ALIGN_BYTES == 0
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert model.head.weight is model.embed.weight
    assert list(model.state_dict()) == list(state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    with torch.no_grad():
        assert torch.equal(model(ids), before)  # same values, same kernels: bit for bit


def test_a_quantized_model_packs_its_int8_buffers_and_fp32_tensors_apart():
    model = quantize_model(_tiny("llama-tiny"), "int8")
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        before = model(ids)
    pack_weights(model)
    by_dtype: dict[torch.dtype, set[int]] = {}
    for t in _tensors(model):
        by_dtype.setdefault(t.dtype, set()).add(t.untyped_storage().data_ptr())
    assert torch.int8 in by_dtype and torch.float32 in by_dtype
    assert all(len(ptrs) == 1 for ptrs in by_dtype.values())
    with torch.no_grad():
        assert torch.equal(model(ids), before)


def test_a_packed_model_trains_as_the_unpacked_one():
    model = _tiny("llama-tiny").train()
    twin = copy.deepcopy(model)  # the reference: the same weights, each in its own allocation
    pack_weights(model)
    ids = torch.randint(0, 64, (2, 9))
    for m in (model, twin):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(ids).logsumexp(-1).mean().backward()
        opt.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(
        model.blocks[0].ffn.up_proj.weight, _tiny("llama-tiny").blocks[0].ffn.up_proj.weight
    )
