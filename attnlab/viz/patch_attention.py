"""Which image patches an answer looked at: attention from the answer's tokens to the patch tokens,
laid out on the patch grid and drawn over the image.

    cross-attention model (VisionEncoderDecoder): the decoder's cross-attention, whose keys are
        exactly the patches, so each query's weights over the patches sum to 1
    prefix model (PrefixVisionLM): the decoder's self-attention, keys restricted to the image
        prefix; the rest of the mass went to text tokens, so a map may sum to less than 1

The queries are the positions that *produce* the answer: the last prompt token (it predicts the
first answer token) through the last answer token (it predicts <eos>). Weights come from
`viz.capture` (the eager recomputation, never hooks). Heads are kept apart: averaging them hides
the one head that found the object, next to heads that look at everything.

    figure rows: one per answer token ("-> r3", "-> c3", "-> <eos>")
    figure columns: the scene, then layer 1 head 1 ... layer L head H, all on one 0..1 scale

Shapes: L decoder layers, H heads, A answer tokens (+ <eos>), G patches per side.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from attnlab.models.vision import PrefixVisionLM
from attnlab.viz.capture import capture_attention
from attnlab.viz.figures import finish

PANEL_INCHES = 1.3  # side of one small map in the figure


@torch.no_grad()
def patch_attention(model: nn.Module, image: Tensor, ids: Tensor, n_prompt: int) -> np.ndarray:
    """Attention of each answer-producing query to each image patch, per layer and head.

    Args:
        model: a VisionEncoderDecoder or PrefixVisionLM (eval mode).
        image: (3, H, W) or (1, 3, H, W) the scene.
        ids: (T,) or (1, T) prompt + answer ids (the answer without <eos>).
        n_prompt: how many of `ids` are the prompt.

    Returns:
        (L, H, A, G, G) float numpy, A = T - n_prompt + 1 queries: the prompt's last token
        (producing the first answer token) through the answer's last token (producing <eos>).
    """
    image, ids = image.reshape(1, *image.shape[-3:]), ids.reshape(1, -1)
    if not 1 <= n_prompt <= ids.shape[1]:
        raise ValueError(f"n_prompt={n_prompt} must be in [1, {ids.shape[1]}] (the ids' length)")
    patches = model.encoder.patches
    N, G, cls = patches.n_tokens, patches.grid, int(patches.cls is not None)
    prefix = isinstance(model, PrefixVisionLM)
    kind = "decoder_self" if prefix else "cross"
    with capture_attention(model, kinds=[kind]) as maps:
        model(image, ids)
    offset = N if prefix else 0  # prefix model: text queries come after the image tokens
    queries = slice(offset + n_prompt - 1, offset + ids.shape[1])
    layers = [maps[kind][i][0, :, queries, cls:N] for i in sorted(maps[kind])]  # (H, A, G*G)
    out = torch.stack(layers)  # (L, H, A, G*G)
    return out.reshape(*out.shape[:3], G, G).float().cpu().numpy()  # (L, H, A, G, G)


def plot_patch_attention(
    image: np.ndarray | Tensor,
    maps: np.ndarray,
    produced: Sequence[str],
    title: str = "",
    out: str | Path | None = None,
) -> Figure:
    """A grid of patch-attention maps over the dimmed scene: rows = answer tokens, columns = heads.

    Args:
        image: (3, H, W) floats in [0, 1].  maps: (L, H, A, G, G) from `patch_attention`.
        produced: the A tokens the queries produce, e.g. ["r3", "c3", "<eos>"] (row labels).
        title: e.g. the question and the model's answer.  out: PNG path, or None.
    """
    L, H, A, G, _ = maps.shape
    if len(produced) != A:
        raise ValueError(f"maps have {A} answer queries but {len(produced)} labels: {produced}")
    image = np.asarray(image, dtype=np.float32).transpose(1, 2, 0)  # (H, W, 3)
    side = image.shape[0]
    fig = Figure(figsize=(PANEL_INCHES * (1 + L * H) + 0.8, PANEL_INCHES * A + 0.7))
    axes = fig.subplots(A, 1 + L * H, squeeze=False)
    extent = (-0.5, side - 0.5, side - 0.5, -0.5)  # the G x G map stretched over the image
    for a in range(A):
        axes[a, 0].imshow(image, interpolation="nearest")
        axes[a, 0].set_ylabel(f"-> {produced[a]}", fontsize=9)
        for j in range(L * H):
            layer, head = divmod(j, H)
            ax = axes[a, 1 + j]
            ax.imshow(image * 0.4, interpolation="nearest")  # dimmed scene under the heat map
            heat = ax.imshow(
                maps[layer, head, a],
                cmap="magma",
                alpha=0.75,
                vmin=0.0,
                vmax=1.0,
                extent=extent,
                interpolation="nearest",
            )
            if a == 0:
                ax.set_title(f"L{layer + 1} H{head + 1}", fontsize=8)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0, 0].set_title("scene", fontsize=8)
    fig.colorbar(heat, ax=axes, fraction=0.02, pad=0.01, label="attention weight")
    if title:
        fig.suptitle(title, fontsize=10)
    return finish(fig, out, tight=False)
