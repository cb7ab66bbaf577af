"""Capture attention probabilities from a model's forward pass, per layer and head.

Each attention layer has a `hook_pattern` point (components/hooks.py): while a hook watches it,
the layer recomputes its probabilities on the eager backend (a flash layer, from its saved
log-sum-exp instead) and shows them to the hook, while its output stays on the fast path, so the
model computes exactly what it computes without capture. This module finds the layers, installs
a hook that keeps each layer's probabilities, and takes the hooks off again on the way out:

    with capture_attention(model) as maps:
        model(ids)
    maps["decoder_self"][0]     # (B, H, T, S) probabilities of the first decoder layer

Three kinds of attention, named after where they sit:

    "encoder_self"   encoder blocks' self-attention (bidirectional; text or ViT encoders)
    "decoder_self"   DecoderLM blocks' self-attention (causal)
    "cross"          DecoderLM blocks' cross-attention to the encoder memory (T queries, M keys)

Probabilities are taken before attention dropout (models are usually in eval mode for this);
masked entries are exactly 0 and every row that may attend to something sums to 1. Only the last
forward inside the `with` block is kept (a cached decode overwrites the prefill's maps).

Shapes: B batch, H heads kept, T query length, S key length.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor, nn

from attnlab.components.attention import Attention
from attnlab.components.blocks import EncoderBlock
from attnlab.models.decoder import DecoderLM

Kind = Literal["encoder_self", "decoder_self", "cross"]
KINDS: tuple[str, ...] = ("encoder_self", "decoder_self", "cross")


def attention_layers(model: nn.Module) -> dict[str, list[Attention]]:
    """The model's Attention modules by kind, each list in layer order.

    A `DecoderLM`'s blocks give "decoder_self" and, with cross-attention, "cross"; any other
    stack of `EncoderBlock`s (`Encoder`, the ViT of a vision model) gives "encoder_self".
    """
    found: dict[str, list[Attention]] = {}
    for module in model.modules():
        blocks = getattr(module, "blocks", None)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            continue
        if isinstance(module, DecoderLM):
            found["decoder_self"] = [b.self_attn for b in blocks]
            cross = [b.cross_attn for b in blocks if b.cross_attn is not None]
            if cross:
                found["cross"] = cross
        elif all(isinstance(b, EncoderBlock) for b in blocks):
            found["encoder_self"] = [b.self_attn for b in blocks]
    return {k: found[k] for k in KINDS if k in found}


@dataclass
class AttentionMaps:
    """Probabilities captured by `capture_attention`: maps[kind][layer] -> (B, H, T, S) float32.

    Attributes:
        weights: {kind: {layer index: probabilities}}, filled when the `with` block exits.
        heads: the head indices kept (None = all), in the order of the H axis.
    """

    weights: dict[str, dict[int, Tensor]] = field(default_factory=dict)
    heads: list[int] | None = None

    def __getitem__(self, kind: str) -> dict[int, Tensor]:
        if kind not in self.weights:
            raise KeyError(f"no {kind!r} attention captured; have {list(self.weights)}")
        return self.weights[kind]

    def __contains__(self, kind: str) -> bool:
        return kind in self.weights

    @property
    def kinds(self) -> list[str]:
        return list(self.weights)


def _check_indices(name: str, chosen: Sequence[int] | None, n: int) -> None:
    bad = [i for i in (chosen or []) if not 0 <= i < n]
    if bad:
        raise ValueError(f"{name} {bad} out of range: this model has {n} (valid 0..{n - 1})")


@contextmanager
def capture_attention(
    model: nn.Module,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    kinds: Sequence[str] | None = None,
) -> Iterator[AttentionMaps]:
    """Capture the attention probabilities of the chosen layers during a forward pass.

    Args:
        model: a DecoderLM, Encoder* or EncoderDecoder (anything holding those stacks).
        layers: layer indices to capture in each stack; None = all.
        heads: head indices to keep; None = all.
        kinds: any of "encoder_self", "decoder_self", "cross"; None = every kind the model has.

    Yields:
        AttentionMaps, filled when the block exits: maps[kind][layer] -> (B, len(heads), T, S).
    """
    found = attention_layers(model)
    kinds = list(found) if kinds is None else list(kinds)
    unknown = [k for k in kinds if k not in found]
    if unknown:
        raise ValueError(f"attention kinds {unknown} not in this model; it has {list(found)}")
    chosen: list[tuple[str, int, Attention]] = []
    for kind in kinds:
        _check_indices("layers", layers, len(found[kind]))
        for i, attn in enumerate(found[kind]):
            if layers is None or i in layers:
                _check_indices("heads", heads, attn.n_heads)
                chosen.append((kind, i, attn))
    maps = AttentionMaps(heads=None if heads is None else list(heads))
    kept: dict[int, Tensor] = {}  # position in `chosen` -> the layer's last probabilities

    def keeper(n: int):
        def keep(weights: Tensor, hook) -> None:
            kept[n] = weights.detach()  # (B, H, T, S)

        return keep

    installed = [
        (attn.hook_pattern, attn.hook_pattern.add(keeper(n))) for n, (*_, attn) in enumerate(chosen)
    ]
    try:
        yield maps
        for n, (kind, i, _) in enumerate(chosen):
            if n not in kept:
                continue  # this layer did not run inside the block
            w = kept[n]
            maps.weights.setdefault(kind, {})[i] = w if heads is None else w[:, list(heads)]
    finally:
        for point, fn in installed:
            point.remove(fn)


def display_token(token: str) -> str:
    """A token as a readable label: spaces and control characters made visible."""
    visible = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "": "\u2205"}
    if token in visible:
        return visible[token]
    return token.replace("\n", "\u21b5").replace("\t", "\u21e5")
