"""Head masks: a gate on each attention head's output, installed as a hook from outside.

    head_layers(model)                  the self-attention modules of a decoder LM
    head_shape(model)                   (L, H)
    set_head_mask(model, mask)          a gate per head, (L, H), on every self-attention layer

Michel et al. 2019 ("Are Sixteen Heads Really Better than One?") multiply every head's output
by a gate xi_h before the output projection: 1 keeps the head, 0 removes it, and with the gates
requiring grad, dL/dxi_h is the head's importance (lab/heads.py). Here the gate is a hook on
each layer's `hook_z` (components/hooks.py), so `Attention.forward` knows nothing of it.

Shapes: L layers, H heads, B batch, T length, D head_dim.
"""

from torch import Tensor, nn

from attnlab.models.decoder import DecoderLM


def head_layers(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a decoder LM, in layer order (each has `hook_z`)."""
    if not isinstance(model, DecoderLM):
        raise ValueError(
            f"the heads experiments take a causal LM (DecoderLM), got {type(model).__name__}; "
            "train one with `attnlab train` (task clm)"
        )
    return [block.self_attn for block in model.blocks]


def head_shape(model: nn.Module) -> tuple[int, int]:
    """(L, H): layers and query heads per layer."""
    layers = head_layers(model)
    return len(layers), layers[0].n_heads


class HeadGate:
    """A hook on an attention layer's `hook_z` (components/hooks.py): head h's output times
    gate[h], before o_proj (Michel et al. 2019).

    Args:
        gate: (H,) gates; a view of a tensor that requires grad gives dL/d gate.
    """

    def __init__(self, gate: Tensor):
        self.gate = gate

    def __call__(self, z: Tensor, hook=None) -> Tensor:
        return z * self.gate.to(z.dtype).view(1, -1, 1, 1)  # (B, H, T, D)


def head_gates(attn: nn.Module) -> list[HeadGate]:
    """The HeadGates installed on one attention layer."""
    return [fn for fn in attn.hook_z.fns if isinstance(fn, HeadGate)]


def set_head_mask(model: nn.Module, mask: Tensor | None) -> None:
    """Gate every head's output before its layer's o_proj (Michel et al. 2019), as a HeadGate
    hook on each self-attention layer's `hook_z` (replacing any gate set before).

    Args:
        model: a DecoderLM.
        mask: (L, H) gates (1 keeps a head, 0 removes it, anything between scales it; a tensor
            that requires grad gives dL/d gate), or None to remove every gate.
    """
    layers = head_layers(model)
    if mask is not None and tuple(mask.shape) != (len(layers), layers[0].n_heads):
        shape = (len(layers), layers[0].n_heads)
        raise ValueError(
            f"head mask of shape {tuple(mask.shape)} for a model of {shape[0]} layers x "
            f"{shape[1]} heads; give shape {shape}"
        )
    for i, attn in enumerate(layers):
        for gate in head_gates(attn):
            attn.hook_z.remove(gate)
        if mask is not None:
            attn.hook_z.add(HeadGate(mask[i]))  # (H,), a view: gradients flow back to `mask`
