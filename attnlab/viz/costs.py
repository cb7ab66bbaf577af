"""Bar charts of what a config costs: KV-cache memory of its MHA / GQA / MQA variants and where
its forward FLOPs go (the numbers come from attnlab/models/inspect.py)."""

from pathlib import Path

from matplotlib.figure import Figure

from attnlab.models.inspect import KVVariant
from attnlab.viz.figures import finish

GIB = 2**30
SPLIT_COLORS = ("#4c78a8", "#72b7b2", "#f58518", "#bab0ac")


def plot_costs(
    models: list[tuple[str, list[KVVariant], dict[str, int], int]],
    batch: int,
    dtype: str = "bf16",
    out: str | Path | None = None,
) -> Figure:
    """One row per model: KV-cache GiB per variant (left), FLOPs per token by part (right).

    Args:
        models: (name, kv_cache_table(...), flops_split(...), context) per model; an encoder's
            empty table draws a left panel saying so.
        batch: what the cache was sized for (titles only).
        dtype: which cache dtype to draw ("bf16" or "fp32").
    """
    fig = Figure(figsize=(11, 3.2 * len(models)))
    axes = fig.subplots(len(models), 2, squeeze=False)
    for (name, kv, split, context), (ax_kv, ax_flops) in zip(models, axes):
        values = [r.cache_bytes[dtype] / GIB for r in kv]
        labels = [f"{r.name}\nK={r.n_kv_heads}" + (" *" if r.is_config else "") for r in kv]
        bars = ax_kv.bar(
            labels, values, color=["#c44e52" if r.is_config else "#8c8c8c" for r in kv]
        )
        ax_kv.bar_label(bars, fmt="%.3g", fontsize=8)
        ax_kv.set(
            ylabel=f"GiB ({dtype})",
            title=f"{name}: KV cache, batch {batch} x context {context}"
            + ("" if kv else " (none: encoder)"),
        )
        ax_kv.margins(y=0.15)
        if not kv:
            ax_kv.set_axis_off()
            ax_kv.text(
                0.5,
                0.5,
                "no KV cache (encoder)",
                ha="center",
                va="center",
                transform=ax_kv.transAxes,
            )
        total = sum(split.values())
        parts = list(split)
        flops = [split[p] / 1e9 for p in parts]
        bars = ax_flops.barh(parts, flops, color=SPLIT_COLORS[: len(parts)])
        ax_flops.bar_label(
            bars, labels=[f"{100 * split[p] / total:.1f}%" for p in parts], fontsize=8, padding=2
        )
        ax_flops.invert_yaxis()
        ax_flops.set(xlabel="GFLOP per token", title=f"{name}: forward FLOPs/token @ {context}")
        ax_flops.margins(x=0.2)
    fig.text(0.01, 0.005, "* = the config's own n_kv_heads", fontsize=7)
    return finish(fig, out)
