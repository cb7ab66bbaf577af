"""QK-norm: RMS-normalise queries and keys before their dot product.

Without it, attention logits grow with the norms of q and k, and large models trained at high
learning rates see a few logits explode and the softmax collapse to one-hot (Dehghani et al.
2023, arXiv:2302.05442, ViT-22B §2; Wortsman et al. 2023, arXiv:2309.14322). Normalising q and
k bounds every logit by |scale| * D * |weight_q| * |weight_k|. Two scopes are in use:

    "head"        one RMSNorm of width D, shared by every head      Qwen3, Gemma 3 (and ViT-22B)
    "projection"  one RMSNorm over all H * D features of q_proj     OLMo 2 (arXiv:2501.00656 §3.2)
                  (and all K * D of k_proj) at once

Both come before RoPE. Gemma 3 scales by (1 + weight), like all its norms (components/norms.py).

Shapes: B batch, T length, N heads of this projection (H for q, K for k), D head_dim.
"""

from typing import Literal

from torch import Tensor

from attnlab.components.norms import RMSNorm

Scope = Literal["head", "projection"]


class QKNorm(RMSNorm):
    """The RMSNorm of one projection's heads, over each head or over the whole projection.

    Args:
        n_heads: N, heads of this projection.  head_dim: D.
        scope: "head" (weight of D) or "projection" (weight of N * D).
        eps: added to the mean square.  unit_offset: scale by (1 + weight) (Gemma).
    """

    def __init__(
        self, n_heads: int, head_dim: int, scope: Scope, eps: float, unit_offset: bool = False
    ):
        if scope not in ("head", "projection"):
            raise ValueError(f"unknown QK-norm scope {scope!r}; choose 'head' or 'projection'")
        super().__init__(head_dim if scope == "head" else n_heads * head_dim, eps, unit_offset)
        self.per_head = scope == "head"

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, T, N, D) -> (B, T, N, D), normalised per head or across all N * D features."""
        if self.per_head:
            return super().forward(x)
        return super().forward(x.flatten(-2)).view_as(x)  # (B, T, N * D) normalised, reshaped
