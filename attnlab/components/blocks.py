"""Transformer blocks: a stack of residual sublayers, pre-norm or post-norm.

    post-norm (Vaswani et al. 2017):   x = norm(x + dropout(sublayer(x)))
    pre-norm  (GPT-2, Llama, T5):      x = x + dropout(sublayer(norm(x)))
    sandwich  (Gemma 2 and 3):         x = x + dropout(out_norm(sublayer(norm(x))))
    output norm only (OLMo 2):         x = x + dropout(out_norm(sublayer(x)))

Post-norm is the original; pre-norm keeps an unnormalised residual path from input to output,
which trains deep stacks without warm-up tricks (Xiong et al. 2020), and needs a final norm after
the last block (the model adds it). A norm on the sublayer's output as well (Ding et al. 2021,
CogView's "sandwich-LN"; Gemma Team 2024, arXiv:2408.00118) bounds what each sublayer adds to
the residual stream; OLMo 2 keeps only that output norm (arXiv:2501.00656 §3.2), which its
authors found more stable than the pre-norm. Both keep the unnormalised residual path.

    EncoderBlock:  self-attention -> FFN
    DecoderBlock:  self-attention (causal) -> [cross-attention to memory] -> FFN

Shapes: B batch, T length, S memory length, C d_model.
"""

from typing import Literal

from torch import Tensor, nn

from attnlab.components.attention import Attention
from attnlab.components.context import NO_CONTEXT, AttentionContext
from attnlab.components.hooks import HookPoint

Placement = Literal["pre", "post"]


class Residual(nn.Module):
    """One residual sublayer with its norm and dropout, pre- or post-norm.

    out_norm: a norm of the sublayer's output before the residual add (pre-norm only): with a
    `norm` too it is the sandwich, with `norm` an Identity OLMo 2's output norm; None: none.
    """

    def __init__(
        self,
        norm: nn.Module,
        placement: Placement,
        dropout: float,
        out_norm: nn.Module | None = None,
    ):
        super().__init__()
        if placement not in ("pre", "post"):
            raise ValueError(f"unknown norm placement {placement!r}; choose 'pre' or 'post'")
        if out_norm is not None and placement != "pre":
            raise ValueError("an output norm sits inside the residual branch: placement 'pre'")
        self.norm, self.pre, self.drop = norm, placement == "pre", nn.Dropout(dropout)
        self.out_norm = nn.Identity() if out_norm is None else out_norm  # no weights if unused

    def forward(self, x: Tensor, sublayer) -> Tensor:
        """x: (B, T, C); sublayer: a callable (B, T, C) -> (B, T, C)."""
        if self.pre:
            return x + self.drop(self.out_norm(sublayer(self.norm(x))))
        return self.norm(x + self.drop(sublayer(x)))


class DecoderBlock(nn.Module):
    """Self-attention, optional cross-attention, feed-forward; each a residual sublayer.

    Args:
        self_attn: an Attention.  ffn: MLP or GatedMLP.
        norms: one norm per sublayer (2, or 3 with cross-attention).
        cross_attn: an Attention built with cross=True, or None (decoder-only models).
        placement: "pre" or "post".  dropout: residual dropout.
        out_norms: one norm per sublayer for its output (see Residual), or None.
    """

    def __init__(
        self,
        self_attn: Attention,
        ffn: nn.Module,
        norms: list[nn.Module],
        cross_attn: Attention | None = None,
        placement: Placement = "pre",
        dropout: float = 0.0,
        out_norms: list[nn.Module] | None = None,
    ):
        super().__init__()
        expected = 2 if cross_attn is None else 3
        out_norms = [None] * len(norms) if out_norms is None else out_norms
        if len(norms) != expected or len(out_norms) != expected:
            raise ValueError(
                f"this block has {expected} sublayers but got {len(norms)} norms and "
                f"{len(out_norms)} output norms"
            )
        self.self_attn, self.cross_attn, self.ffn = self_attn, cross_attn, ffn
        self.residuals = nn.ModuleList(
            Residual(n, placement, dropout, out) for n, out in zip(norms, out_norms)
        )
        # The residual stream before the block and after each sublayer (components/hooks.py).
        self.hook_resid_pre, self.hook_resid_mid = HookPoint(), HookPoint()
        self.hook_resid_cross = HookPoint() if cross_attn is not None else None
        self.hook_resid_post = HookPoint()

    def forward(
        self, x: Tensor, ctx: AttentionContext = NO_CONTEXT, cache=None, cross_cache=None
    ) -> Tensor:
        """x: (B, T, C) -> (B, T, C).

        Args:
            x: (B, T, C).
            ctx: the forward's AttentionContext: masks, position terms, slots, memory.
            cache: the self-attention's cache.  cross_cache: the cross-attention's CrossKV.
        """
        res = iter(self.residuals)
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(next(res)(x, lambda h: self.self_attn(h, ctx, cache)))
        if self.cross_attn is not None:
            x = self.hook_resid_cross(next(res)(x, lambda h: self.cross_attn(h, ctx, cross_cache)))
        return self.hook_resid_post(next(res)(x, self.ffn))  # (B, T, C)


class EncoderBlock(DecoderBlock):
    """Self-attention then feed-forward (no cross-attention): BERT, the 2017 encoder, ViT."""

    def __init__(
        self,
        self_attn: Attention,
        ffn: nn.Module,
        norms: list[nn.Module],
        placement: Placement = "pre",
        dropout: float = 0.0,
        out_norms: list[nn.Module] | None = None,
    ):
        super().__init__(self_attn, ffn, norms, None, placement, dropout, out_norms)
