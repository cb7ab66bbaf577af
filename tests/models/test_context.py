"""The per-forward context: what every layer needs is computed once per forward, in the model,
and a layer's forward reads nothing back from the device (no host sync), also while decoding."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

import attnlab.components.positions.rope as rope_module
from attnlab.components.kv_cache import ModelCache
from attnlab.components.positions import ALiBi, T5Bias
from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig

N_LAYERS, VOCAB = 3, 40


def tiny(position: str, arch: str = "decoder", kind: str = "standard") -> ModelConfig:
    mla = dict(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    return ModelConfig(
        arch=arch,
        d_model=32,
        n_layers=N_LAYERS,
        vocab_size=VOCAB,
        max_seq_len=16,
        d_ff=32,
        attention=AttentionConfig(n_heads=4, kind=kind, **(mla if kind == "mla" else {})),
        position=position,
        t5_num_buckets=8,
        t5_max_distance=10,
    )


def _count(monkeypatch, owner, name) -> list:
    """Count the calls of owner.name (a function or method), still running the real one."""
    calls, real = [], getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


@pytest.mark.parametrize(("position", "kind"), [("rope", "standard"), ("rope", "mla")])
def test_rope_rows_are_gathered_once_per_forward(monkeypatch, position, kind):
    model = build_model(tiny(position, kind=kind)).eval()
    gathers = _count(monkeypatch, rope_module, "_gather")
    with torch.no_grad():
        model(torch.randint(VOCAB, (2, 7)))
    assert len(gathers) == 1  # not 2 per layer (queries and keys) x N_LAYERS


@pytest.mark.parametrize(("position", "scheme"), [("alibi", ALiBi), ("t5_bias", T5Bias)])
@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
def test_score_bias_is_computed_once_per_stack_and_forward(monkeypatch, position, scheme, arch):
    model = build_model(tiny(position, arch)).eval()
    biases = _count(monkeypatch, scheme, "score_bias")
    ids = torch.randint(VOCAB, (2, 7))
    with torch.no_grad():
        model(ids, ids) if arch == "encoder_decoder" else model(ids)
    assert len(biases) == (2 if arch == "encoder_decoder" else 1)  # one per stack, not per layer


class NoHostSync(TorchFunctionMode):
    """Raise on anything that reads a tensor's value back to Python."""

    SYNCS = {"item", "tolist", "__int__", "__bool__", "__float__", "__index__"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.SYNCS:
            raise AssertionError(f"host sync {func.__name__} inside a layer's forward")
        return func(*args, **(kwargs or {}))


def _forbid_syncs_in(modules) -> list:
    """Hooks that turn NoHostSync on for the duration of each module's forward; the last
    handle also turns it off if a forward raised in between."""
    mode, handles, active = NoHostSync(), [], []

    def enter(*_):
        mode.__enter__()
        active.append(1)

    def leave(*_):
        active.pop()
        mode.__exit__(None, None, None)

    class Cleanup:
        def remove(self):
            while active:
                leave()

    for m in modules:
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    return [*handles, Cleanup()]


@pytest.mark.parametrize(
    ("position", "kind"),
    [("rope", "standard"), ("rope", "mla"), ("alibi", "standard"), ("t5_bias", "standard")],
)
def test_no_host_sync_in_a_layer_while_prefilling_or_decoding(position, kind):
    model = build_model(tiny(position, kind=kind)).eval()
    key_valid = torch.ones(2, 12, dtype=torch.bool)
    key_valid[1, :3] = False  # row 1 is left-padded
    cache = ModelCache.for_decoder(model, key_valid)
    ids = torch.randint(VOCAB, (2, 5))
    handles = _forbid_syncs_in(model.blocks)
    try:
        with torch.no_grad():
            model(ids, cache=cache, slots=torch.arange(5))  # prefill
            for slot in range(5, 8):  # decode steps
                model(ids[:, :1], cache=cache, slots=torch.tensor([slot]))
    finally:
        for h in handles:
            h.remove()


class ReadsBack(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x)[..., : int(x.argmax()) + 1]  # a host sync, as RoPE had


def test_the_sync_detector_catches_a_sync():
    # The detector itself can fail: a layer that reads a value back is caught.
    layer = ReadsBack(2, 2)
    handles = _forbid_syncs_in([layer])
    try:
        with pytest.raises(AssertionError, match="host sync __int__"):
            layer(torch.randn(1, 2))
    finally:
        for h in handles:
            h.remove()
