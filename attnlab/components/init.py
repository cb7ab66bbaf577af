"""Weight initialisation schemes.

- "gpt2": normal(0, 0.02) everywhere, biases zero, and the projections that write into the
  residual stream (attention `o_proj`, FFN `down_proj`) scaled by 1/sqrt(2 * n_layers), because
  each block adds two such outputs and the sum's variance would otherwise grow with depth
  (Radford et al. 2019).
- "xavier": Glorot-uniform linear weights as in the 2017 Transformer's reference code; embeddings
  normal(0, d_model^-0.5), which the sqrt(d_model) embedding scale brings back to unit variance.
- "trunc_normal": normal(0, 0.02) truncated at two standard deviations (BERT, ViT).
Norm weights stay one and their biases zero.
"""

import math

from torch import nn

RESIDUAL_PROJECTIONS = ("o_proj", "down_proj")
INIT_SCHEMES = ("gpt2", "xavier", "trunc_normal")


def init_weights(model: nn.Module, scheme: str, n_layers: int, std: float = 0.02) -> None:
    """Initialise every Linear and Embedding of `model` in place.

    Args:
        model: the module tree.  scheme: one of INIT_SCHEMES.
        n_layers: blocks in the residual stream (for the GPT-2 scaling).  std: the normal's std.
    """
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"unknown init scheme {scheme!r}; choose from {list(INIT_SCHEMES)}")
    if all(p.is_meta for p in model.parameters()):
        return  # built on "meta" to be loaded: no values to draw (PyTorch's meta normal_ is slow)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if scheme == "xavier":
                nn.init.xavier_uniform_(module.weight)
            else:
                s = std / math.sqrt(2 * n_layers) if name.endswith(RESIDUAL_PROJECTIONS) else std
                _normal(module.weight, s, truncated=scheme == "trunc_normal")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            s = module.embedding_dim**-0.5 if scheme == "xavier" else std
            _normal(module.weight, s, truncated=scheme == "trunc_normal")


def _normal(weight, std: float, truncated: bool) -> None:
    if truncated:
        nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)
    else:
        nn.init.normal_(weight, std=std)
