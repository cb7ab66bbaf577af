"""Inside torch.compile, attention written out for one query or a few keys; SDPA otherwise.

Written out (`eager_attention`), inductor fuses the scale, mask and softmax, forward and
backward, with their neighbours and leaves two batched matmuls; SDPA stays one opaque kernel
call. The written-out form wins for one query (a compiled decode step), and on CPU for short
sequences (up to about SHORT_KEYS_CPU keys); beyond that SDPA's flash kernel, which skips the
masked half, wins (benchmarks/README.md). Outside torch.compile this backend is SDPA itself.

The core always runs the configured backend; `use_short_attention(model)` sets this one on the
model's "sdpa" attention layers, and the compiled decode step and the compiled training step
turn it on explicitly. Both paths compute the same attention (tested equal).

Shapes: B batch, H query heads, K kv heads, T queries, S keys, D head_dim.
"""

import torch
from torch import Tensor, nn

from attnlab.components.attention import Attention
from attnlab.components.backends import eager_attention, sdpa_attention

SHORT_KEYS_CPU = 64  # inside torch.compile on CPU, attend to at most this many keys written out
NAME = "short"  # the backend name a layer reports once it uses this one


def written_out_is_faster(q: Tensor, k: Tensor) -> bool:
    """Whether, inside torch.compile, the written-out attention beats SDPA's kernel.

    Args:
        q: (B, H, T, D).  k: (B, K, S, D).
    """
    if not torch.compiler.is_compiling():
        return False
    return q.shape[2] == 1 or (q.device.type == "cpu" and k.shape[2] <= SHORT_KEYS_CPU)


def short_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> tuple[Tensor, Tensor | None]:
    """A backend: `eager_attention` where `written_out_is_faster`, else `sdpa_attention`.

    Arguments and shapes as `eager_attention`: q (B, H, T, D), k and v (B, K, S, D).
    """
    attend = eager_attention if written_out_is_faster(q, k) else sdpa_attention
    return attend(q, k, v, **kwargs)


def use_short_attention(model: nn.Module) -> int:
    """Give every "sdpa" Attention layer of `model` this backend; return how many.

    Layers configured "eager" stay eager (they may be returning weights for pictures).
    """
    layers = [m for m in model.modules() if isinstance(m, Attention) and m.backend == "sdpa"]
    for m in layers:
        m.backend, m.attend = NAME, short_attention
    return len(layers)
