"""AdamW with weight-decay groups (Loshchilov & Hutter 2019).

Decay pulls weights towards zero, which is right for matrices that mix features but wrong for
norm gains (their neutral value is one), biases (offsets) and embeddings (rows that a token only
sees when it appears). So: decay on every >= 2-D weight of a Linear, none on anything else.
"""

import torch
from torch import nn

from attnlab.accel.flat_adamw import FlatAdamW


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: Linear weights (decayed) and everything else (norms, biases, embeddings)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            is_matrix = isinstance(m, nn.Linear) and name == "weight" and id(p) not in embeddings
            (decay if is_matrix else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    flat: bool = False,
) -> torch.optim.AdamW:
    """AdamW over `param_groups`, with the fused kernel where PyTorch offers it for the device.

    flat: an accelerator, off by default: one buffer per group for the parameters and one for
    their gradients (attnlab/accel/flat_adamw.py): the same updates, with the per-tensor costs of
    the step, the clip and zero_grad paid once per group. Moves the model's parameters into the
    buffers; one process only.
    """
    device = next(model.parameters()).device.type
    fused = device in ("cpu", "cuda")
    adamw = FlatAdamW if flat else torch.optim.AdamW
    return adamw(param_groups(model, weight_decay), lr=lr, betas=betas, fused=fused)
