"""Attention maps: run a model with capture on, then draw layers x heads grids and single heads.

    maps = run_attention(model, src_ids, tgt_ids)         # capture.py, the eager probabilities
    grid = attention_grid(maps, "decoder_self")           # (L, H, T, S) numpy
    plot_attention_grid(grid, q_tokens, k_tokens, out="attn.png")
    plot_attention_head(grid[0, 1], q_tokens, k_tokens)  # one head, values written in the cells

Rows of a map are queries, columns keys; row i is the distribution query i reads with.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from attnlab.models.encoder_decoder import EncoderDecoder
from attnlab.viz.capture import (
    AttentionMaps,
    attention_layers,
    capture_attention,
    display_token,
)
from attnlab.viz.figures import finish

ANNOTATE_MAX = 12  # write the values into the cells up to this many tokens per axis
LABEL_MAX = 48  # draw token labels up to this many tokens per axis


def model_kind(model: nn.Module) -> str:
    """ "decoder", "encoder" or "encoder_decoder", from the modules the model holds."""
    if isinstance(model, EncoderDecoder):
        return "encoder_decoder"
    return "decoder" if "decoder_self" in attention_layers(model) else "encoder"


@torch.no_grad()
def run_attention(
    model: nn.Module,
    ids: Tensor,
    tgt_ids: Tensor | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
) -> AttentionMaps:
    """One forward pass with every (chosen) attention layer captured.

    Args:
        model: DecoderLM (ids are its input), an encoder model, or EncoderDecoder (ids = source,
            tgt_ids = decoder input, default ids).
        ids: (B, T) token ids.  tgt_ids: (B, T') decoder ids for an encoder-decoder.
        layers, heads: passed to `capture_attention`.

    Returns:
        the captured AttentionMaps (probabilities (B, H, T, S) per kind and layer).
    """
    with capture_attention(model, layers, heads) as maps:
        if model_kind(model) == "encoder_decoder":
            model(ids, ids if tgt_ids is None else tgt_ids)
        else:
            model(ids)
    return maps


def attention_grid(
    maps: AttentionMaps, kind: str, layers: Sequence[int] | None = None, batch: int = 0
) -> np.ndarray:
    """Stack one batch row's maps of one kind into a layers x heads grid.

    Returns:
        (L, H, T, S) float32 numpy array, layers in the order of `layers` (default: all captured).
    """
    per_layer = maps[kind]
    layers = sorted(per_layer) if layers is None else list(layers)
    missing = [i for i in layers if i not in per_layer]
    if missing:
        raise ValueError(
            f"layers {missing} of {kind!r} were not captured; have {sorted(per_layer)}"
        )
    return torch.stack([per_layer[i][batch] for i in layers]).float().cpu().numpy()


def _label_axes(ax, q_tokens, k_tokens, left: bool, bottom: bool, fontsize: int = 7) -> None:
    T, S = len(q_tokens), len(k_tokens)
    ax.set_xticks(range(S) if bottom and S <= LABEL_MAX else [])
    ax.set_yticks(range(T) if left and T <= LABEL_MAX else [])
    if bottom and S <= LABEL_MAX:
        rotation = 90 if max(len(display_token(t)) for t in k_tokens) > 2 else 0
        ax.set_xticklabels(
            [display_token(t) for t in k_tokens], rotation=rotation, fontsize=fontsize
        )
    if left and T <= LABEL_MAX:
        ax.set_yticklabels([display_token(t) for t in q_tokens], fontsize=fontsize)


def plot_attention_grid(
    grid: np.ndarray,
    q_tokens: Sequence[str],
    k_tokens: Sequence[str],
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    title: str = "",
    out: str | Path | None = None,
) -> Figure:
    """A layers x heads grid of attention maps sharing one colour scale (0 .. the grid's max).

    Args:
        grid: (L, H, T, S) from `attention_grid`.
        q_tokens: T query token strings (rows).  k_tokens: S key token strings (columns).
        layers, heads: the labels of the grid's rows and columns (default 0..L-1, 0..H-1).
    """
    L, H, T, S = grid.shape
    if (len(q_tokens), len(k_tokens)) != (T, S):
        raise ValueError(f"{len(q_tokens)} x {len(k_tokens)} tokens for maps of {T} x {S}")
    layers = range(L) if layers is None else layers
    heads = range(H) if heads is None else heads
    step = min(0.22, 4.0 / max(T, S))  # inches per token, so a panel stays under ~4 inches
    fig = Figure(
        figsize=(H * (step * S + 0.7) + 1.6, L * (step * T + 0.7) + 1.0), layout="constrained"
    )
    vmax = float(grid.max()) or 1.0
    axes = fig.subplots(L, H, squeeze=False)
    for li, layer in enumerate(layers):
        for hi, head in enumerate(heads):
            ax = axes[li, hi]
            im = ax.imshow(grid[li, hi], cmap="Blues", vmin=0, vmax=vmax, interpolation="nearest")
            _label_axes(ax, q_tokens, k_tokens, left=hi == 0, bottom=li == L - 1)
            ax.set_title(f"layer {layer} head {head}", fontsize=8)
    fig.suptitle(title or "attention (rows: queries, columns: keys)")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6, label="probability")
    return finish(fig, out, tight=False)


def plot_attention_head(
    weights: np.ndarray,
    q_tokens: Sequence[str],
    k_tokens: Sequence[str],
    annotate: bool | None = None,
    title: str = "",
    out: str | Path | None = None,
) -> Figure:
    """One head's map, large, with each probability written in its cell for short inputs.

    Args:
        weights: (T, S) probabilities.  annotate: None = when T, S <= ANNOTATE_MAX.
    """
    T, S = weights.shape
    annotate = max(T, S) <= ANNOTATE_MAX if annotate is None else annotate
    step = min(0.55, 12.0 / max(T, S))  # inches per token
    fig = Figure(figsize=(step * S + 2.8, step * T + 1.6))
    ax = fig.add_subplot()
    im = ax.imshow(weights, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    _label_axes(ax, q_tokens, k_tokens, left=True, bottom=True, fontsize=9)
    if annotate:
        for i in range(T):
            for j in range(S):
                w = float(weights[i, j])
                ax.text(
                    j,
                    i,
                    f"{w:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if w > 0.5 else "black",
                )
    ax.set(xlabel="key", ylabel="query", title=title or "attention of one head")
    fig.colorbar(im, ax=ax, shrink=0.8, label="probability")
    return finish(fig, out)
