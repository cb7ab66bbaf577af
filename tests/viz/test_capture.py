"""viz/capture.py: the captured probabilities are the layer's attention, recomputed here by hand.

The reference never calls the backends: a forward pre-hook (in this test, not in the components)
records what each Attention layer received; the test then projects q and k with the layer's own
weights, applies the position scheme's hooks, scales, adds the bias, masks and softmaxes in
float64, and compares.
"""

from dataclasses import replace

import pytest
import torch

from attnlab.components.attention import Attention
from attnlab.components.context import NO_CONTEXT
from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig
from attnlab.models.presets import get_preset
from attnlab.viz.capture import attention_layers, capture_attention

TOL = 1e-6


# Learned, RoPE + GQA, BERT padding, sinusoidal enc-dec, T5 bias + unscaled, ALiBi, a sliding
# window, and MQA on the eager backend (capture then recomputes what the output used).
CASES = [
    "gpt2-tiny",
    "llama-tiny",
    "bert-tiny",
    "transformer-tiny",
    "t5-tiny",
    "alibi-tiny",
    "window-tiny",
    "mqa-eager-tiny",
]


def _model(name: str):
    if name == "alibi-tiny":
        cfg = replace(get_preset("gpt2-tiny"), position="alibi")
    elif name == "window-tiny":
        base = get_preset("llama-tiny")
        cfg = replace(base, attention=replace(base.attention, sliding_window=3))
    elif name == "mqa-eager-tiny":
        base = get_preset("llama-tiny")
        cfg = replace(base, attention=AttentionConfig(n_heads=4, n_kv_heads=1, backend="eager"))
    else:
        cfg = get_preset(name)
    torch.manual_seed(0)
    return build_model(cfg).eval(), cfg


def _inputs(cfg, padded: bool):
    """Arguments of model(...): ids (and a padding mask, and a target for encoder-decoders)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(cfg.vocab_size, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.bool)
    if padded:
        mask[1, 5:] = False  # row 1 ends in two padding tokens
    if cfg.arch == "encoder_decoder":
        tgt = torch.randint(cfg.vocab_size, (2, 5), generator=g)
        return (ids, tgt, {"attention_mask": mask}) if padded else (ids, tgt, {})
    return (ids, {"attention_mask": mask}) if padded else (ids, {})


def _forward(model, inputs):
    *args, kwargs = inputs
    return model(*args, **kwargs)


def _record_inputs(model):
    """Forward pre-hooks on every Attention: {module: (args, kwargs)} of its latest call."""
    seen, handles = {}, []
    for m in model.modules():
        if isinstance(m, Attention):

            def hook(module, args, kwargs):
                seen[module] = (args, kwargs)

            handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


def _reference(attn: Attention, args, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities (B, H, T, S) float64, allowed (B, H, T, S) bool) from the layer's inputs."""
    x = args[0]
    ctx = args[1] if len(args) > 1 else kwargs.get("ctx", NO_CONTEXT)  # the AttentionContext
    mask = ctx.memory_mask if attn.cross else ctx.mask
    B, T, _ = x.shape
    H, K, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    source = ctx.memory if attn.cross else x
    S = source.shape[1]
    q = attn.q_norm(attn.q_proj(x).view(B, T, H, D).transpose(1, 2))  # (B, H, T, D)
    k = attn.k_norm(attn.k_proj(source).view(B, S, K, D).transpose(1, 2))  # (B, K, S, D)
    bias = None
    if not attn.cross:  # the position terms the model prepared for this forward
        q, k = ctx.positions.rotate_qk(q, k)
        bias = ctx.positions.bias
    k = k.repeat_interleave(H // K, dim=1)  # (B, H, S, D): query head h reads kv head h // G
    scale = D**-0.5 if attn.scale is None else attn.scale
    scores = (q.double() @ k.double().transpose(-2, -1)) * scale  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias.double()
    allowed = torch.ones(B, H, T, S, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if not attn.cross and ctx.is_causal:
        allowed = allowed & torch.ones(T, S, dtype=torch.bool).tril(S - T)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return probs.nan_to_num(0.0).masked_fill(~allowed, 0.0), allowed


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_captured_probabilities_are_the_layers_attention(name, padded):
    model, cfg = _model(name)
    inputs = _inputs(cfg, padded)
    with torch.no_grad():
        plain = _forward(model, inputs)
        seen, handles = _record_inputs(model)
        with capture_attention(model) as maps:
            captured_out = _forward(model, inputs)
        for h in handles:
            h.remove()
    # Capture changes nothing the model computes.
    assert torch.equal(plain, captured_out)
    layers = attention_layers(model)
    assert maps.kinds == list(layers)
    expected_kinds = {
        "decoder": ["decoder_self"],
        "encoder": ["encoder_self"],
        "encoder_decoder": ["encoder_self", "decoder_self", "cross"],
    }[cfg.arch]
    assert maps.kinds == expected_kinds
    for kind, modules in layers.items():
        assert sorted(maps[kind]) == list(range(len(modules)))
        for i, attn in enumerate(modules):
            got = maps[kind][i]
            ref, allowed = _reference(attn, *seen[attn])
            assert got.shape == ref.shape
            assert got.dtype == torch.float32
            assert (got.double() - ref).abs().max() <= TOL, (kind, i)
            # Rows that may attend somewhere sum to 1; masked entries are exactly 0.
            live = allowed.any(-1)
            sums = got.double().sum(-1)
            assert torch.allclose(sums[live], torch.ones_like(sums[live]), atol=TOL)
            assert (got[~allowed] == 0).all()
            if kind == "decoder_self":
                assert (got[..., torch.ones(got.shape[-2:], dtype=torch.bool).triu(1)] == 0).all()


def test_layers_and_heads_are_selected_and_flags_restored():
    model, cfg = _model("transformer-tiny")
    ids, tgt, _ = _inputs(cfg, padded=False)
    with torch.no_grad(), capture_attention(model) as full:
        model(ids, tgt)
    with (
        torch.no_grad(),
        capture_attention(model, layers=[1], heads=[2, 0], kinds=["cross"]) as some,
    ):
        model(ids, tgt)
    assert some.kinds == ["cross"] and list(some["cross"]) == [1]
    assert some.heads == [2, 0]
    assert torch.equal(some["cross"][1], full["cross"][1][:, [2, 0]])
    for attn in (m for m in model.modules() if isinstance(m, Attention)):
        assert attn.hook_pattern.fns == []  # every hook capture installed is off again


def test_flags_restored_after_an_error_and_earlier_state_kept():
    model, cfg = _model("gpt2-tiny")
    first = model.blocks[0].self_attn
    mine = first.hook_pattern.add(lambda w, hook: None)  # a user had hooked it themselves
    with pytest.raises(RuntimeError, match="boom"), capture_attention(model):
        raise RuntimeError("boom")
    assert first.hook_pattern.fns == [mine]
    assert model.blocks[1].self_attn.hook_pattern.fns == []


def test_layers_that_did_not_run_are_left_out():
    model, cfg = _model("transformer-tiny")
    ids, _ = _inputs(cfg, padded=False)[:2]
    with torch.no_grad(), capture_attention(model) as maps:
        model.encode(ids)  # the decoder never runs
    assert maps.kinds == ["encoder_self"]
    with pytest.raises(KeyError, match="cross"):
        maps["cross"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": [2]}, "layers"),
        ({"heads": [4]}, "heads"),
        ({"kinds": ["cross"]}, "cross"),
    ],
)
def test_bad_selection_names_the_problem(kwargs, message):
    model, _ = _model("gpt2-tiny")
    with pytest.raises(ValueError, match=message), capture_attention(model, **kwargs):
        pass


def test_any_stack_of_encoder_blocks_is_encoder_self():
    from torch import nn

    from attnlab.models.build import build_block

    cfg = get_preset("bert-tiny")

    class Tower(nn.Module):  # e.g. a ViT: not an `Encoder`, but a stack of EncoderBlocks
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(build_block(cfg, causal=False) for _ in range(3))
            self.empty = nn.Module()
            self.empty.blocks = nn.ModuleList()  # an empty stack is no kind at all

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    tower = Tower().eval()
    layers = attention_layers(tower)
    assert list(layers) == ["encoder_self"] and len(layers["encoder_self"]) == 3
    with torch.no_grad(), capture_attention(tower, layers=[2]) as maps:
        tower(torch.randn(1, 5, cfg.d_model))
    assert list(maps["encoder_self"]) == [2]
    assert maps["encoder_self"][2].shape == (1, 4, 5, 5)
