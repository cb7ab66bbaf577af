"""Run two models side by side and find where, and why, their numbers part.

    check(model_a, model_b, input_ids, attention_mask) -> Report;  print(report)

Forward hooks record the hidden states at the same points of both models: the input of the
first block ("embed"), each block's output ("block.0", ...), the final norm ("norm") and the
logits (an encoder-decoder has "encoder.*" and "decoder.*" points). Each point is compared at
real tokens only (padding positions may legitimately differ), by its max and mean absolute
difference; the first point beyond the tolerance is where the bug is.

Then comes the diagnosis. The usual suspects of a port are each a small, reversible change
to an attnlab model: RoPE layout (half vs interleaved without the q/k permutation), norm eps,
GELU variant (exact vs tanh), mask polarity, the sqrt(d) embedding scale, the output head (tied vs
untied), T5's head rescale and, in an MoE, the experts per token and the top-k renormalisation.
The attnlab side is re-run with one suspect changed at a time; a suspect that makes the first
divergent point match, and ideally every point, is the likely cause. Each model can be
attnlab's or a `transformers` one (recognised by its `config.model_type`; transformers is never
imported here).

Shapes: B batch, T tokens, C d_model, V vocab_size.
"""

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from attnlab.interop.sides import Inputs, Side, make_side, run
from attnlab.interop.suspects import Suspect, eps_of, fmt_eps, suspects

DEFAULT_ATOL = 1e-4


# --- comparing -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PointDiff:
    """The difference at one point, over real tokens."""

    name: str
    max_abs: float
    mean_abs: float
    ok: bool


def _real(name: str, t: Tensor, x: Inputs, kind: str) -> Tensor:
    """t restricted to real tokens: (N, C) for per-token tensors, else t itself."""
    mask = (
        x.decoder_mask if kind == "encoder_decoder" and not name.startswith("encoder.") else x.mask
    )
    if kind == "classifier" and name == "logits":
        return t
    if mask is None or t.dim() < 3 or t.shape[:2] != mask.shape:
        return t
    return t[mask]


def compare(
    a: dict[str, Tensor], b: dict[str, Tensor], names: list[str], x: Inputs, kind: str, atol: float
) -> list[PointDiff]:
    rows = []
    for name in names:
        ta, tb = _real(name, a[name], x, kind), _real(name, b[name], x, kind)
        if ta.shape != tb.shape:
            rows.append(PointDiff(name, math.inf, math.inf, False))
            continue
        d = (ta - tb).abs()
        worst = float(d.max()) if d.numel() else 0.0
        worst = math.inf if math.isnan(worst) else worst
        rows.append(PointDiff(name, worst, float(d.mean()) if d.numel() else 0.0, worst <= atol))
    return rows


def first_divergence(rows: list[PointDiff]) -> int:
    """Index of the first point beyond tolerance (len(rows) when every point matches)."""
    return next((i for i, r in enumerate(rows) if not r.ok), len(rows))


# --- the report ------------------------------------------------------------------------------
@dataclass
class Trial:
    """A re-run of the attnlab side with one suspect changed."""

    suspect: Suspect
    first: str | None  # first divergent point after the change (None: all match)
    progress: int  # index of that point


@dataclass
class Report:
    """Per-point differences, where they begin, and the likely cause."""

    label_a: str
    label_b: str
    atol: float
    n_tokens: int
    points: list[PointDiff]
    trials: list[Trial] = field(default_factory=list)
    cause: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.points)

    @property
    def first_divergence(self) -> str | None:
        i = first_divergence(self.points)
        return None if i == len(self.points) else self.points[i].name

    def __str__(self) -> str:
        lines = [
            f"A: {self.label_a}",
            f"B: {self.label_b}",
            f"{self.n_tokens} real tokens compared; tolerance {self.atol:.1e} (max abs)",
            "",
        ]
        width = max(len(p.name) for p in self.points)
        lines.append(f"  {'point':<{width}}  {'max abs':>9}  {'mean abs':>9}")
        first = self.first_divergence
        for p in self.points:
            flag = "ok" if p.ok else "DIVERGES" + ("  <- first" if p.name == first else "")
            lines.append(f"  {p.name:<{width}}  {p.max_abs:9.2e}  {p.mean_abs:9.2e}  {flag}")
        lines.append("")
        if first is None:
            lines.append("every point is within tolerance")
            return "\n".join(lines)
        lines.append(f"first divergence: {first}")
        lines.append(f"likely cause: {self.cause or 'unknown'}")
        if self.trials:
            lines.append("")
            lines.append("diagnostics (the attnlab side re-run with one suspect changed):")
            w = max(len(t.suspect.change) for t in self.trials)
            for t in self.trials:
                result = "every point matches" if t.first is None else f"first divergence {t.first}"
                lines.append(f"  {t.suspect.change:<{w}}  -> {result}")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def _where_hint(name: str) -> str:
    if name.endswith("embed"):
        return (
            "no single suspect explains it; the embeddings already differ: token, position "
            "or segment embedding weights, or their scale"
        )
    if name == "logits":
        return "no single suspect explains it; only the head differs: its weights, bias or scale"
    return (
        f"no single suspect explains it; compare the weights feeding {name} (key map, "
        "a missing transpose or qkv split)"
    )


# --- the entry point -------------------------------------------------------------------------
def _as_tensor(ids, dtype=torch.long) -> Tensor | None:
    if ids is None:
        return None
    t = torch.as_tensor(ids, dtype=dtype)
    return t[None] if t.dim() == 1 else t


def _shift_right(ids: Tensor, mask: Tensor | None, start: int) -> tuple[Tensor, Tensor | None]:
    """Decoder inputs for an encoder-decoder: the start token, then ids without their last."""
    start_col = torch.full_like(ids[:, :1], start)
    dec = torch.cat([start_col, ids[:, :-1]], dim=1)
    if mask is None:
        return dec, None
    return dec, torch.cat([torch.ones_like(mask[:, :1]), mask[:, :-1]], dim=1)


def check(
    model_a: nn.Module,
    model_b: nn.Module,
    input_ids,
    attention_mask=None,
    *,
    decoder_input_ids=None,
    decoder_attention_mask=None,
    decoder_start_id: int = 0,
    atol: float = DEFAULT_ATOL,
    diagnose: bool = True,
) -> Report:
    """Compare two models point by point and explain the first divergence.

    Args:
        model_a, model_b: attnlab models or `transformers` models (either order); both in fp32
            for the default tolerance. They are put in eval mode.
        input_ids: (B, T) or (T,) token ids (a tensor or nested lists).
        attention_mask: (B, T), True/1 = real token; None = no padding.
        decoder_input_ids, decoder_attention_mask: for encoder-decoders; default: input_ids
            shifted right behind `decoder_start_id`.
        atol: the largest max-abs difference that still counts as equal.
        diagnose: re-run the attnlab side with each usual suspect changed.

    Returns:
        a Report; `str(report)` is a readable table, `report.first_divergence` the first
        point beyond tolerance (None if all match) and `report.cause` the likely cause.
    """
    side_a, side_b = make_side(model_a), make_side(model_b)
    if side_a.kind != side_b.kind:
        raise ValueError(
            f"cannot compare a {side_a.kind} ({side_a.label}) with a {side_b.kind} ({side_b.label})"
        )
    names_a = [p[0] for p in side_a.points] + ["logits"]
    names_b = [p[0] for p in side_b.points] + ["logits"]
    if names_a != names_b:
        raise ValueError(f"the models have different points: A {names_a}, B {names_b}")
    ids = _as_tensor(input_ids)
    mask = None if attention_mask is None else _as_tensor(attention_mask, torch.bool)
    x = Inputs(ids, mask)
    if side_a.kind == "encoder_decoder":
        if decoder_input_ids is None:
            x.decoder_ids, x.decoder_mask = _shift_right(ids, mask, decoder_start_id)
        else:
            x.decoder_ids = _as_tensor(decoder_input_ids)
            x.decoder_mask = (
                None
                if decoder_attention_mask is None
                else _as_tensor(decoder_attention_mask, torch.bool)
            )
    seen_a, seen_b = run(side_a, x), run(side_b, x)
    points = compare(seen_a, seen_b, names_a, x, side_a.kind, atol)
    count = x.decoder_mask if side_a.kind == "encoder_decoder" else x.mask
    n_tokens = int(count.sum()) if count is not None else ids.numel()
    report = Report(side_a.label, side_b.label, atol, n_tokens, points)
    if report.ok or not diagnose:
        return report
    _diagnose(report, side_a, side_b, seen_a, seen_b, x, names_a, atol)
    return report


def _diagnose(
    report: Report,
    side_a: Side,
    side_b: Side,
    seen_a,
    seen_b,
    x: Inputs,
    names: list[str],
    atol: float,
) -> None:
    """Fill report.trials and report.cause by re-running the attnlab side per suspect."""
    if side_a.ours:
        ours, ref, ref_seen, tag, ref_tag = side_a, side_b, seen_b, "A", "B"
    elif side_b.ours:
        ours, ref, ref_seen, tag, ref_tag = side_b, side_a, seen_a, "B", "A"
    else:
        report.notes.append("neither model is an attnlab model, so no suspect was re-run")
        report.cause = _where_hint(report.first_divergence)
        return
    start = first_divergence(report.points)
    for suspect in suspects(ours, ref, x, tag, ref_tag):
        with suspect.apply(x):
            seen = run(ours, x)
        rows = compare(seen, ref_seen, names, x, ours.kind, atol)
        i = first_divergence(rows)
        report.trials.append(Trial(suspect, None if i == len(rows) else rows[i].name, i))
    ref_eps, ours_eps = eps_of(ref.model), eps_of(ours.model)
    if ref_eps and ours_eps and set(ref_eps) != set(ours_eps):
        report.notes.append(
            f"norm eps differ: {tag} {fmt_eps(ours_eps)}, {ref_tag} {fmt_eps(ref_eps)}"
        )
    helped = [t for t in report.trials if t.progress > start]
    if not helped:
        report.cause = _where_hint(report.first_divergence)
        return
    best = max(helped, key=lambda t: t.progress)
    if best.first is None:
        report.cause = best.suspect.cause
    else:
        report.cause = (
            f"{best.suspect.cause} (with it changed the first divergence moves to "
            f"{best.first}: there is more than one difference)"
        )
