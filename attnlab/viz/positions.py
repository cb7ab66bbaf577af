"""Pictures of the position schemes: the data functions come first, the `plot_*` functions after.

    sinusoid_table / sinusoid_curves   Vaswani et al. 2017, §3.5 (the Annotated Transformer's plot)
    rope_scores                        q.k after RoPE against relative distance, at several offsets
    alibi_biases                       ALiBi's per-head bias matrices and slopes (Press et al. 2022)
    t5_buckets                         T5's relative-position bucket ids (Raffel et al. 2020)

Every data function returns numpy arrays computed by the library's own position modules, so the
pictures show what the models use. Every `plot_*` returns its matplotlib Figure (and writes a PNG
when `out` is given); the arrays it drew can be read back from the figure's images and lines.
"""

from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from attnlab.components.positions import ALiBi, RoPE, relative_position_bucket, sinusoidal_table
from attnlab.viz.figures import finish


# --- data -----------------------------------------------------------------------------------
def sinusoid_table(n_positions: int = 100, d_model: int = 20) -> np.ndarray:
    """The sinusoidal encoding PE(pos, i). Returns (n_positions, d_model) float32."""
    return sinusoidal_table(n_positions, d_model).numpy()


def sinusoid_curves(
    n_positions: int = 100, d_model: int = 20, dims: tuple[int, ...] = (4, 5, 6, 7)
) -> tuple[np.ndarray, np.ndarray]:
    """Chosen columns of the table against position (the Annotated Transformer uses 4..7 of 20).

    Returns:
        positions (N,), curves (len(dims), N): curves[c] = PE(positions, dims[c]).
    """
    bad = [d for d in dims if not 0 <= d < d_model]
    if bad:
        raise ValueError(f"dims {bad} out of range for d_model={d_model}")
    table = sinusoid_table(n_positions, d_model)  # (N, C)
    return np.arange(n_positions), table[:, list(dims)].T.copy()


def rope_scores(
    head_dim: int = 64,
    max_distance: int = 64,
    offsets: tuple[int, ...] = (0, 100, 1000),
    theta: float = 10000.0,
    qk: str = "ones",
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """The score q_m . k_n after RoPE for one fixed (q, k) pair, against the distance r = m - n.

    The key sits at an absolute position `offset`, the query at offset + r. RoPE makes the score
    a function of r alone, so the rows for different offsets coincide (up to float32 rounding of
    the angles). qk="ones" is RoFormer's long-term-decay picture (Su et al. 2021, §3.4.3):
    with q = k = 1 the score is sum_i 2 cos(r w_i); qk="random" draws q, k ~ N(0, 1) with `seed`.

    Returns:
        distances (R,) = 0..max_distance, scores (len(offsets), R) float32.
    """
    if qk == "ones":
        q = k = torch.ones(head_dim)
    elif qk == "random":
        g = torch.Generator().manual_seed(seed)
        q, k = torch.randn(2, head_dim, generator=g)
    else:
        raise ValueError(f"qk must be 'ones' or 'random', got {qk!r}")
    rope = RoPE(head_dim, max(offsets) + max_distance + 1, theta)
    r = torch.arange(max_distance + 1)  # (R,)
    rows = []
    for offset in offsets:
        qs = q.expand(1, 1, len(r), head_dim)  # (1, 1, R, D): one query per distance
        ks = k.expand(1, 1, len(r), head_dim)
        q_rot, k_rot = rope.rotate_qk(qs, ks, offset + r, torch.full_like(r, offset))
        rows.append((q_rot * k_rot).sum(-1)[0, 0])  # (R,)
    return r.numpy(), torch.stack(rows).numpy()


def alibi_biases(n_heads: int = 8, seq_len: int = 8, causal: bool = True):
    """ALiBi's slopes and bias matrices -m_h |j - i| (future keys NaN when causal).

    Returns:
        slopes (H,), biases (H, T, T) float32 (NaN where a causal mask hides the key).
    """
    alibi = ALiBi(n_heads)
    pos = torch.arange(seq_len)
    bias = alibi.score_bias(pos, pos).numpy()  # (H, T, T)
    if causal:
        bias = np.where(np.tril(np.ones((seq_len, seq_len), dtype=bool)), bias, np.nan)
    return alibi.slopes.numpy(), bias.astype(np.float32)


def t5_buckets(
    seq_len: int = 48, num_buckets: int = 32, max_distance: int = 128, span: int = 160
) -> dict[str, np.ndarray]:
    """T5's bucket ids, as the (query, key) maps and as curves over the relative position j - i.

    Returns:
        {"bidirectional", "causal"}: (T, T) int bucket of (j - i);
        {"relative"}: (2 span + 1,) j - i from -span to span;
        {"bidirectional_curve", "causal_curve"}: bucket of each relative position.
    """
    pos = torch.arange(seq_len)
    grid = pos[None, :] - pos[:, None]  # (T, T): j - i, key minus query
    relative = torch.arange(-span, span + 1)  # (2 span + 1,)
    out = {"relative": relative.numpy()}
    for name, bidirectional in (("bidirectional", True), ("causal", False)):
        out[name] = relative_position_bucket(grid, bidirectional, num_buckets, max_distance).numpy()
        curve = relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
        out[f"{name}_curve"] = curve.numpy()
    return out


# --- pictures -------------------------------------------------------------------------------
def plot_sinusoid_table(table: np.ndarray, out: str | Path | None = None) -> Figure:
    """Heatmap of the encoding: position down, dimension across."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    im = ax.imshow(table, aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
    ax.set(xlabel="dimension i", ylabel="position", title="Sinusoidal position encoding PE(pos, i)")
    fig.colorbar(im, ax=ax)
    return finish(fig, out)


def plot_sinusoid_curves(
    positions: np.ndarray, curves: np.ndarray, dims: tuple[int, ...], out: str | Path | None = None
) -> Figure:
    """Chosen dimensions of the encoding against position, one line each."""
    fig = Figure(figsize=(9, 3.5))
    ax = fig.add_subplot()
    for d, curve in zip(dims, curves):
        kind = "sin" if d % 2 == 0 else "cos"
        ax.plot(positions, curve, label=f"dim {d} ({kind})")
    ax.set(xlabel="position", ylabel="PE(pos, dim)", title="Sinusoidal encoding: chosen dimensions")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    return finish(fig, out)


def plot_rope_scores(
    distances: np.ndarray,
    scores: np.ndarray,
    offsets: tuple[int, ...],
    out: str | Path | None = None,
) -> Figure:
    """Score against relative distance, one line per absolute offset (they overlap: invariance)."""
    fig = Figure(figsize=(8, 3.8))
    ax = fig.add_subplot()
    styles = ["-", "--", ":", "-."]
    for i, (offset, row) in enumerate(zip(offsets, scores)):
        ax.plot(
            distances,
            row,
            styles[i % len(styles)],
            lw=2.5 - 0.5 * (i % 3),
            label=f"key at position {offset}",
        )
    spread = float(np.abs(scores - scores[:1]).max()) if len(scores) > 1 else 0.0
    ax.set(
        xlabel="relative distance m - n",
        ylabel="q_m . k_n after RoPE",
        title=f"RoPE: the score depends only on m - n (max spread over offsets {spread:.1e})",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    return finish(fig, out)


def plot_alibi(slopes: np.ndarray, biases: np.ndarray, out: str | Path | None = None) -> Figure:
    """One bias matrix per head (query down, key across), its slope in the title."""
    H = len(slopes)
    cols = min(H, 4)
    rows = -(-H // cols)
    fig = Figure(figsize=(2.6 * cols, 2.6 * rows + 0.4))
    vmin = float(np.nanmin(biases))
    for h in range(H):
        ax = fig.add_subplot(rows, cols, h + 1)
        im = ax.imshow(biases[h], cmap="viridis", vmin=vmin, vmax=0, interpolation="nearest")
        ax.set_title(f"head {h}: m = 2^{np.log2(slopes[h]):.3g}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("ALiBi bias -m_h |j - i| (query down, key across; future masked)")
    fig.colorbar(im, ax=fig.axes, shrink=0.8)
    return finish(fig, out, tight=False)


def plot_t5_buckets(buckets: dict[str, np.ndarray], out: str | Path | None = None) -> Figure:
    """The two bucket maps (bidirectional, causal) and bucket id against relative position."""
    fig = Figure(figsize=(12, 3.8))
    for i, name in enumerate(("bidirectional", "causal")):
        ax = fig.add_subplot(1, 3, i + 1)
        im = ax.imshow(buckets[name], cmap="viridis", interpolation="nearest")
        ax.set(title=f"{name}: bucket(j - i)", xlabel="key j", ylabel="query i")
        fig.colorbar(im, ax=ax, shrink=0.8)
    ax = fig.add_subplot(1, 3, 3)
    for name in ("bidirectional", "causal"):
        ax.step(buckets["relative"], buckets[f"{name}_curve"], where="mid", label=name)
    ax.set(title="bucket id against j - i", xlabel="relative position j - i", ylabel="bucket")
    ax.legend()
    ax.grid(alpha=0.3)
    return finish(fig, out)
