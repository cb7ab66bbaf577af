"""The MoE lab's picture (`attnlab lab moe`): held-out loss curves of the dense and MoE models,
and each MoE model's tokens per expert, one bar group per layer (how even the routing ended).

`load_shares` gives the numbers (data), `plot_moe_lab` draws them and returns the Figure.
"""

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from attnlab.viz.figures import finish


def load_shares(expert_load: list[list[int]]) -> np.ndarray:
    """(L, E) share of each layer's routed tokens that each expert took (rows sum to 1)."""
    load = np.asarray(expert_load, dtype=float)
    return load / load.sum(axis=1, keepdims=True)


def plot_moe_lab(rows: list[dict], out: str | Path | None = None) -> Figure:
    """Left: val loss against step for every model. Then one panel per MoE model: the share of
    tokens per expert in each layer, the uniform share 1/E dashed."""
    moe = [r for r in rows if r.get("expert_load")]
    fig = Figure(figsize=(4.5 * (1 + len(moe)), 3.6))
    axes = fig.subplots(1, 1 + len(moe), squeeze=False)[0]
    for r in rows:
        steps, losses = zip(*r["val_loss"])
        axes[0].plot(steps, losses, marker="o", label=r["name"])
    axes[0].set(xlabel="step", ylabel="held-out loss", title="validation loss")
    axes[0].legend()
    for ax, r in zip(axes[1:], moe):
        shares = load_shares(r["expert_load"])  # (L, E)
        L, E = shares.shape
        width = 0.8 / L
        for layer in range(L):
            ax.bar(np.arange(E) + layer * width, shares[layer], width, label=f"layer {layer}")
        ax.axhline(1 / E, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel="expert", ylabel="share of tokens", title=f"{r['name']}: expert load")
        ax.set_xticks(np.arange(E) + 0.4 - width / 2, [str(e) for e in range(E)])
        ax.legend(fontsize="small")
    return finish(fig, out)
