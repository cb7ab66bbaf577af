"""What attention heads do: importance, pruning, attention patterns and the logit lens.

    set_head_mask(model, mask)          a gate per head, (L, H), on every self-attention layer
                                        (lab/head_masks.py)
    head_importance(model, batches)     Michel et al. 2019: |dL / d gate|, gates at 1
    pruning_curve(model, batches, order)  loss as heads are masked one by one in `order`
                                        (or only at some `levels`: `pruning_levels`)
    heads_lab(HeadsLab(ckpt=...), out)  all of it for one checkpoint: importance, pruning, the
                                        pattern and induction scores and the logit lens of
                                        lab/head_scores.py; JSON, PNGs, the HTML viewer

Head importance (Michel et al. 2019, "Are Sixteen Heads Really Better than One?"): every
head's output is multiplied by a gate xi_h before the output projection; with all gates at 1 the
model is unchanged, and I_h = mean over batches of |dL/dxi_h| is a first-order estimate of how
much the loss moves when the head is removed. As the paper recommends, the scores are then
normalised per layer by their L2 norm, so layers compare on one scale. The pruning curve masks
heads in the order of one importance pass, least important first (HF transformers' bertology
example recomputes the scores between pruning steps; not done here), beside the order of the
scores not normalised and seeded random orders as the control, all measured on held-out batches.
A full curve costs L*H + 1 evaluations per order: on a 30-layer model of 270 heads that is
over half an hour on 2 CPU cores even with --fast's small batches, so `curves="coarse"`
measures COARSE_LEVELS + 1 evenly spaced levels instead (the prunable fraction is then read
off that grid) and `curves="none"` skips them.

The experiments run on causal language models (`DecoderLM`): the loss is next-token cross-entropy.

Shapes: L layers, H heads, B batch, T length, S keys, V vocab.
"""

import json
import math
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from attnlab.checkpoint import open_checkpoint, plain_model
from attnlab.configs import from_dict
from attnlab.lab.head_masks import head_shape, set_head_mask
from attnlab.lab.head_scores import (
    Batch,
    induction_chance,
    induction_scores,
    layer_probs,
    mean_logit_lens,
    pattern_scores,
    token_loss,
)
from attnlab.lab.induction import induction_check
from attnlab.training.config import DataConfig
from attnlab.training.data import lm_batch, prepare_text_data
from attnlab.viz.heads import plot_head_scores, plot_induction_check, plot_pruning
from attnlab.viz.report import AttentionViz, attention_pictures

MAX_LOSS_INCREASE = 0.01  # "heads that can be removed": at most 1% above the unpruned loss
DEFAULT_CONTEXT = 128  # measuring context of a checkpoint that does not record its own
VIEWER_TOKENS = 32  # the viewer shows a text of this many tokens, twice (induction stripes)
COARSE_LEVELS = 16  # curves="coarse": the pruning curves at k = 0, n/16, 2n/16, ..., n heads
CURVES = ("full", "coarse", "none")


# --- loss, importance, pruning -------------------------------------------------------------------
def lm_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Mean next-token cross-entropy of one batch (a scalar tensor)."""
    x, y = batch
    return token_loss(model(x), y)


@torch.no_grad()
def mean_loss(model: nn.Module, batches: Sequence[Batch]) -> float:
    """The mean of the batches' losses."""
    return sum(lm_loss(model, b).item() for b in batches) / len(batches)


def head_importance(model: nn.Module, batches: Sequence[Batch]) -> tuple[Tensor, Tensor]:
    """Per-head importance: I_h = mean over batches of |dL/dxi_h|, gates xi at 1.

    Args:
        model: a DecoderLM (its parameters' gradients are left untouched).
        batches: the data the expectation is taken over.

    Returns:
        (raw, normalised): each (L, H); normalised divides each layer's row by its L2 norm.
    """
    L, H = head_shape(model)
    gate = torch.ones(L, H, requires_grad=True)
    total = torch.zeros(L, H)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)  # only the gates need gradients
    try:
        set_head_mask(model, gate)
        for batch in batches:
            (grad,) = torch.autograd.grad(lm_loss(model, batch), gate)
            total += grad.abs()  # |dL/dxi| per batch, as in the paper's code
    finally:
        set_head_mask(model, None)
        for p in params:
            p.requires_grad_(True)
    raw = total / len(batches)
    return raw, raw / raw.norm(dim=1, keepdim=True).clamp_min(1e-20)


def pruning_levels(n: int, curves: str = "full") -> list[int]:
    """The numbers of heads masked at which a pruning curve is measured, 0 .. n.

    Args:
        n: heads in the model (L*H).
        curves: "full" (every k), "coarse" (COARSE_LEVELS + 1 evenly spaced k, or every k on
            a model with fewer heads than that).
    """
    if curves not in CURVES[:2]:
        raise ValueError(f"pruning curves {curves!r}: choose full or coarse")
    if curves == "full" or n <= COARSE_LEVELS:
        return list(range(n + 1))
    return sorted({round(i * n / COARSE_LEVELS) for i in range(COARSE_LEVELS + 1)})


@torch.no_grad()
def pruning_curve(
    model: nn.Module,
    batches: Sequence[Batch],
    order: Sequence[int],
    levels: Sequence[int] | None = None,
) -> list[float]:
    """The loss with the first k heads of `order` masked, for each k of `levels`.

    Args:
        order: flat head indices (layer * H + head), the first to be removed first.
        levels: increasing k in 0 .. L*H (default: all of them).

    Returns:
        One mean loss over `batches` per level.
    """
    L, H = head_shape(model)
    levels = range(L * H + 1) if levels is None else levels
    mask = torch.ones(L * H)
    losses = []
    try:
        for k in levels:
            mask[list(order[:k])] = 0.0
            set_head_mask(model, mask.view(L, H))
            losses.append(mean_loss(model, batches))
    finally:
        set_head_mask(model, None)
    return losses


def prunable_fraction(
    losses: Sequence[float],
    fractions: Sequence[float] | None = None,
    tolerance: float = MAX_LOSS_INCREASE,
) -> float:
    """The largest fraction of heads masked before the loss first rises above (1 + tolerance)
    times the unpruned loss (losses[0]).

    Args:
        losses: a pruning curve.
        fractions: the fraction masked at each point (default: losses[k] has k of
            len(losses) - 1 heads masked); on a coarse grid the answer is the last grid point
            before the rise, a lower bound.
    """
    if fractions is None:
        fractions = [k / (len(losses) - 1) for k in range(len(losses))]
    limit = losses[0] * (1 + tolerance)
    k = next((k for k, loss in enumerate(losses) if loss > limit), len(losses)) - 1
    return fractions[k]


# --- the experiment ------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadsLab:
    """Options of `attnlab lab heads`; `fast` shrinks the data for tests.

    ckpt: a causal LM checkpoint (or a run directory).  source: text to measure on (default:
    the checkpoint's own data source, through its tokenizer).  batches / batch_size / context:
    the importance batches (training split) and, as many again, the evaluation batches
    (validation split); context None = the checkpoint's training context (measuring past it
    would mix in how well the positions extrapolate).  random_orders: seeded random pruning
    orders, the control.  repeat_len: n of the [r, r] induction sequences; None = context / 2.
    curves: the pruning curves at every level ("full"), at COARSE_LEVELS + 1 ("coarse") or
    none.  check_induction: K > 0 checks the top K induction heads by ablation and per-head
    patching (lab/induction.py; L*H + 11 more forwards on the [r, r] batch).
    """

    ckpt: str
    source: str | None = None
    fast: bool = False
    batches: int = 16
    batch_size: int = 12
    context: int | None = None
    random_orders: int = 5
    repeat_len: int | None = None
    offsets: tuple[int, ...] = (2,)
    seed: int = 0
    curves: str = "full"
    check_induction: int = 0

    def __post_init__(self):
        least = {"batches": 1, "batch_size": 1, "context": 2, "repeat_len": 2}
        least |= {"random_orders": 0, "check_induction": 0}
        for name, low in least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} {value}: give at least {low}")
        if self.curves not in CURVES:
            raise ValueError(f"--curves {self.curves!r}: choose one of {', '.join(CURVES)}")

    def sized(self) -> "HeadsLab":
        """These options, shrunk in fast mode."""
        if not self.fast:
            return self
        return replace(self, batches=2, batch_size=4, context=32, random_orders=2, repeat_len=16)


def max_len(model: nn.Module) -> int:
    """The longest input the model's position tables allow (a large number when unbounded)."""
    limits = [m.max_positions for m in model.modules() if getattr(m, "max_positions", None)]
    return min(limits) if limits else 1 << 16


def own_corpus(run: dict) -> DataConfig | None:
    """The corpus a training run read (its "data" section); None for a checkpoint without one:
    an HF or model-only directory, or a fine-tuning run (whose data section names examples,
    not a text corpus: finetune.config.FinetuneDataConfig)."""
    try:
        return from_dict(DataConfig, run["data"]) if "data" in run else None
    except ValueError:
        return None


def load_data(loaded, source: str | None) -> tuple[np.ndarray, np.ndarray]:
    """The (train, val) token streams of the checkpoint's data, or of `source` through the
    checkpoint's tokenizer."""
    own = own_corpus(loaded.run)
    data = own or DataConfig()
    if source is not None or own is None:
        if loaded.tokenizer is None:
            raise ValueError(f"{str(loaded.path)!r} has no tokenizer.json to read text with")
        tokenizer = loaded.path / "tokenizer.json"
        if not tokenizer.is_file():  # a GGUF file carries its tokenizer in its metadata
            tokenizer = Path(tempfile.mkdtemp(prefix="attnlab-heads-")) / "tokenizer.json"
            loaded.tokenizer.save(tokenizer)
        data = replace(data, source=source or data.source, tokenizer=str(tokenizer))
    tokens = prepare_text_data(data)
    return tokens.train, tokens.val


def sample_batches(tokens: np.ndarray, opts: HeadsLab, seed: int) -> list[Batch]:
    """`opts.batches` seeded random windows of `opts.context` tokens."""
    gen = torch.Generator().manual_seed(seed)
    return [lm_batch(tokens, opts.context, opts.batch_size, gen) for _ in range(opts.batches)]


def pruning_curves(
    model: nn.Module,
    batches: Sequence[Batch],
    raw: Tensor,
    importance: Tensor,
    n_random: int,
    seed: int,
    curves: str = "full",
) -> dict:
    """Pruning curves by normalised importance, by raw importance and in seeded random orders.

    Args:
        raw, importance: (L, H) from `head_importance`.  n_random: random orders drawn.
        curves: "full" or "coarse" (`pruning_levels`).

    Returns:
        {"fractions", "by_importance", "by_raw_importance", "random": [curves], the orders,
        "prunable_*": the fractions removable within MAX_LOSS_INCREASE, "tolerance"}.
    """
    n = raw.numel()
    levels = pruning_levels(n, curves)
    by_importance = importance.flatten().argsort().tolist()  # least important first
    by_raw = raw.flatten().argsort().tolist()
    gen = torch.Generator().manual_seed(seed)
    random_orders = [torch.randperm(n, generator=gen).tolist() for _ in range(n_random)]
    curve, raw_curve = (
        pruning_curve(model, batches, by_importance, levels),
        pruning_curve(model, batches, by_raw, levels),
    )
    random_curves = [pruning_curve(model, batches, order, levels) for order in random_orders]
    fractions = [k / n for k in levels]
    return {
        "fractions": fractions,
        "by_importance": curve,
        "by_raw_importance": raw_curve,
        "random": random_curves,
        "importance_order": by_importance,
        "raw_importance_order": by_raw,
        "random_orders": random_orders,
        "prunable_by_importance": prunable_fraction(curve, fractions),
        "prunable_by_raw_importance": prunable_fraction(raw_curve, fractions),
        "prunable_random": [prunable_fraction(c, fractions) for c in random_curves],
        "tolerance": MAX_LOSS_INCREASE,
    }


def heads_lab(opts: HeadsLab, out: str | Path) -> dict:
    """Every measurement for one checkpoint, written to `out`: heads.json, heads.png (layer x
    head heatmaps), pruning.png (unless curves="none"), induction.png (with check_induction),
    and the attention viewer of a repeated text (attention.html).

    Returns:
        The dict saved as heads.json.
    """
    started, out, opts = time.perf_counter(), Path(out), opts.sized()
    loaded = plain_model(open_checkpoint(opts.ckpt), "the heads experiments take a plain causal LM")
    model = loaded.model.eval()
    try:
        L, H = head_shape(model)
    except ValueError as e:  # not a causal LM: say which checkpoint
        raise ValueError(f"checkpoint {str(loaded.path)!r}: {e}") from None
    limit, vocab = max_len(model), model.embed.num_embeddings
    trained = loaded.run.get("train", {}).get("context", DEFAULT_CONTEXT)
    context = min(opts.context or trained, limit)
    n = min(opts.repeat_len or context // 2, limit // 2, vocab)
    opts = replace(opts, context=context, repeat_len=n)
    train, val = load_data(loaded, opts.source)
    result, scores = measure(model, opts, train, val)
    result = {"options": asdict(opts), "checkpoint": str(loaded.path)} | result
    plot_head_scores(scores, out / "heads.png", title=Path(opts.ckpt).name)
    if result["pruning"] is not None:
        plot_pruning(result["pruning"], out / "pruning.png")
    if "induction_check" in result:
        check = result["induction_check"]
        plot_induction_check(scores["induction"], check, out / "induction.png")
    # The viewer opens at the top induction head, or the top previous-token head where no head
    # scores clearly above chance on [r, r].
    found = scores["induction"].max() > 2 * induction_chance(n)
    best = int(scores["induction" if found else "previous_token"].flatten().argmax())
    shown = min(n, VIEWER_TOKENS)
    text = loaded.tokenizer.decode(val[:shown].tolist()) if loaded.tokenizer else None
    if text:
        viz = AttentionViz(ckpt=opts.ckpt, text=text + text, layer=best // H, head=best % H)
        opened = (model, loaded.tokenizer, Path(opts.ckpt).name)
        result["pictures"] = [str(p) for p in attention_pictures(viz, out, opened)]
    result["seconds"] = round(time.perf_counter() - started, 1)
    (out / "heads.json").write_text(json.dumps(result, indent=1))
    return result


def measure(
    model: nn.Module, opts: HeadsLab, train: np.ndarray, val: np.ndarray
) -> tuple[dict, dict[str, Tensor]]:
    """The numbers of `heads_lab` (its options already sized): importance, the scores, the
    pruning curves, the logit lens and, with opts.check_induction, the induction check.

    Returns:
        (the JSON-ready dict, {score name: (L, H) tensor}).
    """
    L, H = head_shape(model)
    vocab, n = model.embed.num_embeddings, opts.repeat_len
    fit, held_out = sample_batches(train, opts, opts.seed), sample_batches(val, opts, opts.seed + 1)
    raw, importance = head_importance(model, fit)
    scores = pattern_scores(layer_probs(model, held_out[0][0]), opts.offsets)
    scores["induction"] = induction_scores(model, vocab, n, opts.batch_size, opts.seed)
    scores = {"importance": importance, **scores}
    pruning = None
    if opts.curves != "none":
        args = (opts.random_orders, opts.seed, opts.curves)
        pruning = pruning_curves(model, held_out, raw, importance, *args)
    result = {
        "layers": L,
        "heads": H,
        "importance_raw": raw.tolist(),
        "scores": {k: v.tolist() for k, v in scores.items()},
        "induction_chance": induction_chance(n),
        "pruning": pruning,
        "logit_lens": mean_logit_lens(model, held_out),
    }
    if opts.check_induction:
        k = min(opts.check_induction, L * H - 1)
        args = (vocab, n, opts.batch_size, scores["induction"], k, opts.seed)
        result["induction_check"] = induction_check(model, *args)
    return result, scores


# --- the terminal report ------------------------------------------------------------------------
def format_report(result: dict) -> str:
    """The terminal summary: the top heads per score, pruning, the induction check, the logit
    lens."""
    lines, H = [], result["heads"]
    for name, s in result["scores"].items():
        flat = torch.tensor(s).flatten()
        top = flat.argsort(descending=True)[: 5 if name == "induction" else 3].tolist()
        best = ", ".join(f"L{i // H}H{i % H} {flat[i]:.3f}" for i in top)
        lines.append(f"{name:16s} top heads: {best}")
    lines.append(f"induction chance level (uniform attention): {result['induction_chance']:.3f}")
    p = result["pruning"]
    if p is not None:
        random = p["prunable_random"]
        grid = "" if len(p["fractions"]) == H * result["layers"] + 1 else " (on a coarse grid)"
        lines.append(
            f"prunable at <= {p['tolerance']:.0%} loss increase{grid}: "
            f"{p['prunable_by_importance']:.1%} of heads by importance "
            f"({p['prunable_by_raw_importance']:.1%} by the scores not normalised per layer), "
            f"{_mean(random):.1%} at random (orders: {', '.join(f'{f:.1%}' for f in random)})"
        )
    if "induction_check" in result:
        lines += induction_lines(result["induction_check"])
    lines.append("logit lens (final norm + head on each layer's residual stream):")
    lines.append(f"  {'stream':12s} {'loss':>8s} {'top-1 agrees':>13s}")
    for row in result["logit_lens"]:
        lines.append(f"  {row['stream']:12s} {row['loss']:8.4f} {row['agreement']:13.3f}")
    return "\n".join(lines)


def induction_lines(check: dict) -> list[str]:
    """The induction check (lab/induction.py) in three lines."""
    a, p, k = check["ablation"], check["patching"], len(check["heads"])
    names = ", ".join(f"L{layer}H{h}" for layer, h in check["heads"])
    best = ", ".join(f"L{layer}H{h}" for layer, h in p["best_heads"])
    return [
        f"induction check, the top {k} heads by score ({names}), on [r, r]:",
        f"  loss on the second copy {a['loss']:.3f}; those heads masked {a['ablated']:.3f}; "
        f"{k} random heads masked {_mean(a['random']):.3f} (mean of {len(a['random'])} draws)",
        f"  patched together from [r, r] into [r', r] they restore {p['together']:.1%} of the "
        f"second copy's log-probability ({p['corrupt']:.3f} -> {p['clean']:.3f}); the {k} best "
        f"heads by patching alone ({best}) restore {p['best_together']:.1%}",
    ]


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan
