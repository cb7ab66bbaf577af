"""The functions behind `attnlab viz`: each writes one family of pictures into a directory.

    attention_pictures(AttentionViz(ckpt=...), out)   grids per kind, one annotated head, viewer
    position_pictures(PositionViz(), out)             sinusoid, RoPE, ALiBi, T5 buckets
    mask_pictures(MaskViz(), out)                     every mask kind side by side
    loss_pictures(LossViz(metrics=...), out)          train/val loss and lr from metrics.jsonl

Each options dataclass is the single home of its defaults; the CLI derives its flags from it.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from attnlab.checkpoint import open_checkpoint, plain_model
from attnlab.components.embedding import TokenEmbedding
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.viz import positions as p
from attnlab.viz.attention_maps import (
    attention_grid,
    model_kind,
    plot_attention_grid,
    plot_attention_head,
    run_attention,
)
from attnlab.viz.loss import load_metrics, plot_loss
from attnlab.viz.masks import mask_grids, plot_masks
from attnlab.viz.viewer import write_viewer

DEFAULT_TEXT = "the cat sat on the mat"


@dataclass(frozen=True)
class AttentionViz:
    """Options of `attnlab viz attention`."""

    ckpt: str | None = field(
        default=None,
        metadata={
            "help": "checkpoint directory, a run's out_dir (its latest) or an HF directory "
            "(default: a randomly initialised --preset)"
        },
    )
    preset: str = field(
        default="transformer-tiny",
        metadata={"help": "model preset used when no --ckpt is given (random weights)"},
    )
    text: str = field(
        default=DEFAULT_TEXT, metadata={"help": "input text (the source, for an encoder-decoder)"}
    )
    target: str | None = field(
        default=None,
        metadata={"help": "decoder input of an encoder-decoder (default: the same text)"},
    )
    layer: int = field(default=0, metadata={"help": "layer of the single-head picture"})
    head: int = field(default=0, metadata={"help": "head of the single-head picture"})
    seed: int = field(default=0, metadata={"help": "seed of the random preset's weights"})


@dataclass(frozen=True)
class PositionViz:
    """Options of `attnlab viz positions`."""

    n_positions: int = field(default=100, metadata={"help": "positions in the sinusoid plots"})
    d_model: int = field(default=20, metadata={"help": "width of the sinusoidal encoding"})
    dims: tuple[int, ...] = field(
        default=(4, 5, 6, 7), metadata={"help": "dimensions drawn as curves"}
    )
    head_dim: int = field(default=64, metadata={"help": "RoPE head dimension"})
    max_distance: int = field(default=64, metadata={"help": "RoPE: largest relative distance"})
    offsets: tuple[int, ...] = field(
        default=(0, 100, 1000), metadata={"help": "RoPE: absolute key positions overlaid"}
    )
    n_heads: int = field(default=8, metadata={"help": "ALiBi heads"})
    seq_len: int = field(default=8, metadata={"help": "ALiBi matrix size"})


@dataclass(frozen=True)
class MaskViz:
    """Options of `attnlab viz masks`."""

    seq_len: int = field(default=8, metadata={"help": "sequence length T"})
    n_padding: int = field(default=2, metadata={"help": "padding tokens at the end"})
    window: int = field(default=3, metadata={"help": "sliding-window size"})
    prefix: int = field(default=3, metadata={"help": "prefix-LM prefix length"})


@dataclass(frozen=True)
class LossViz:
    """Options of `attnlab viz loss`."""

    metrics: str = field(
        default="runs/default", metadata={"help": "metrics.jsonl, or a run directory holding one"}
    )


def _encode(text: str, tokenizer, vocab_size: int, max_len: int) -> tuple[torch.Tensor, list[str]]:
    """(1, T) ids and their token strings; without a tokenizer one character = one token."""
    if tokenizer is None:
        ids = [ord(c) % vocab_size for c in text]
        tokens = list(text)
    else:
        ids = tokenizer.encode(text)
        tokens = [tokenizer.decode([i], skip_special=False) for i in ids]
    if not ids:
        raise ValueError(f"the text {text!r} gives no tokens")
    return torch.tensor([ids[:max_len]]), tokens[:max_len]


def load_for_viz(opts: AttentionViz) -> tuple[nn.Module, object, str]:
    """(model in eval mode, tokenizer or None, a name for titles)."""
    if opts.ckpt is not None:
        loaded = plain_model(open_checkpoint(opts.ckpt), "viz draws a plain model's attention")
        return loaded.model, loaded.tokenizer, Path(opts.ckpt).name
    torch.manual_seed(opts.seed)
    return build_model(get_preset(opts.preset)).eval(), None, f"{opts.preset} (random weights)"


def attention_pictures(
    opts: AttentionViz, out: str | Path, opened: tuple[nn.Module, object, str] | None = None
) -> list[Path]:
    """A layers x heads grid per attention kind, one annotated head, and the HTML viewer.

    Args:
        opened: (model, tokenizer, name) of the checkpoint already open (as `load_for_viz`
            gives them), so that it is not read a second time.
    """
    out = Path(out)
    model, tokenizer, name = opened or load_for_viz(opts)
    vocab = next(m for m in model.modules() if isinstance(m, TokenEmbedding)).num_embeddings
    max_len = _max_len(model)
    src, src_tokens = _encode(opts.text, tokenizer, vocab, max_len)
    tgt, tgt_tokens = src, src_tokens
    if model_kind(model) == "encoder_decoder" and opts.target is not None:
        tgt, tgt_tokens = _encode(opts.target, tokenizer, vocab, max_len)
    maps = run_attention(model, src, tgt)
    for kind in maps.kinds:  # check the single-head choice before drawing anything
        L, H = len(maps[kind]), maps[kind][0].shape[1]
        if not (0 <= opts.layer < L and 0 <= opts.head < H):
            raise ValueError(
                f"--layer {opts.layer} --head {opts.head} is outside {kind}'s {L} layers x "
                f"{H} heads"
            )
    tokens = {
        "encoder_self": (src_tokens, src_tokens),
        "decoder_self": (tgt_tokens, tgt_tokens),
        "cross": (tgt_tokens, src_tokens),
    }
    written = []
    for kind in maps.kinds:
        grid = attention_grid(maps, kind)  # (L, H, T, S)
        q, k = tokens[kind]
        title = f"{name}: {kind.replace('_', ' ')} attention (rows: queries, columns: keys)"
        written.append(out / f"attention_{kind}.png")
        plot_attention_grid(grid, q, k, title=title, out=written[-1])
        written.append(out / f"attention_{kind}_layer{opts.layer}_head{opts.head}.png")
        plot_attention_head(
            grid[opts.layer, opts.head],
            q,
            k,
            out=written[-1],
            title=f"{kind.replace('_', ' ')}, layer {opts.layer}, head {opts.head}",
        )
    written.append(
        write_viewer(
            maps,
            {k: tokens[k] for k in maps.kinds},
            out / "attention.html",
            title=f"attnlab attention viewer: {name}",
        )
    )
    return written


def _max_len(model: nn.Module) -> int:
    """The longest input the model's position tables allow (a large number when unbounded)."""
    limits = [m.max_positions for m in model.modules() if getattr(m, "max_positions", None)]
    return min(limits) if limits else 1 << 16


def position_pictures(opts: PositionViz, out: str | Path) -> list[Path]:
    """Sinusoid heatmap and curves, RoPE score against distance, ALiBi biases, T5 buckets."""
    out = Path(out)
    paths = [
        out / name
        for name in (
            "sinusoid_table.png",
            "sinusoid_curves.png",
            "rope_distance.png",
            "alibi.png",
            "t5_buckets.png",
        )
    ]
    p.plot_sinusoid_table(p.sinusoid_table(opts.n_positions, opts.d_model), out=paths[0])
    positions, curves = p.sinusoid_curves(opts.n_positions, opts.d_model, opts.dims)
    p.plot_sinusoid_curves(positions, curves, opts.dims, out=paths[1])
    distances, scores = p.rope_scores(opts.head_dim, opts.max_distance, opts.offsets)
    p.plot_rope_scores(distances, scores, opts.offsets, out=paths[2])
    p.plot_alibi(*p.alibi_biases(opts.n_heads, opts.seq_len), out=paths[3])
    p.plot_t5_buckets(p.t5_buckets(), out=paths[4])
    return paths


def mask_pictures(opts: MaskViz, out: str | Path) -> list[Path]:
    """Every mask kind in one figure."""
    path = Path(out) / "masks.png"
    grids = mask_grids(opts.seq_len, opts.n_padding, opts.window, opts.prefix)
    plot_masks(grids, out=path)
    return [path]


def loss_pictures(opts: LossViz, out: str | Path) -> list[Path]:
    """Loss curves (and lr) of a run."""
    path = Path(out) / "loss.png"
    plot_loss(load_metrics(opts.metrics), path, title=str(opts.metrics))
    return [path]
