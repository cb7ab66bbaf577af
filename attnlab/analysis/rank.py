"""The numerical rank of attention matrices, measured: one head against several heads.

A head's logits Q K^T / sqrt(d_k) are an n x n matrix of rank at most d_k. It is often said that
the attention matrix P = softmax(Q K^T / sqrt(d_k)) is therefore low-rank too; but softmax is
exp() applied entry by entry, then a row scaling, and exp() of a rank-d_k matrix is in general
of full rank (its Taylor series adds Hadamard powers of ever higher rank). This module measures
rather than assumes:

    rank(Q_h K_h^T)         logits of head h              at most d_k
    rank(P_h)               one head's attention matrix   at most n
    rank([P_1 | ... | P_H]) every head side by side       at most n; the layer's output
                            sum_h P_h (V_h W_o,h) has its columns in this span, so it bounds the
                            token mixing the heads can do together. Every P_h holds the all-ones
                            vector in its column space (P 1 = 1), so this is at most
                            sum_h rank(P_h) - (H - 1)
    99%-energy rank         fewest singular values holding 99% of sum(sigma^2): how spread the
                            spectrum is, which a tolerance-based rank does not show

Numerical rank = the number of singular values above tol = max(rows, cols) * eps * sigma_max,
with eps the machine epsilon of the dtype the matrix was computed in (NumPy's matrix_rank
default): float64 for the random-weight experiment, float32 for matrices captured from a model
(the eager backend's softmax runs in float32, so smaller singular values are rounding noise).

Shapes: n sequence length, H heads, d_k head dimension, C input width.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from attnlab.checkpoint import open_checkpoint, plain_model
from attnlab.models.build import build_model
from attnlab.viz.attention_maps import run_attention
from attnlab.viz.capture import attention_layers

ENERGY = 0.99  # fraction of sum(sigma^2) the energy rank keeps
RANDOM_WIDTH = 64  # C, the width of the random inputs X (n, C)


@dataclass(frozen=True)
class RankRow:
    """One measured configuration. Ranks over heads are given as min / median / max."""

    source: str  # "random", or e.g. "trained decoder_self layer 1"
    n: int
    d_k: int
    n_heads: int
    logits_rank: int | None  # max over heads of rank(Q_h K_h^T); None when not measured
    head_rank: tuple[int, int, int]  # rank(P_h): min, median, max over heads
    head_energy_rank: float  # mean over heads of the 99%-energy rank of P_h
    joint_rank: int  # rank([P_1 | ... | P_H])
    joint_energy_rank: int
    tol_eps: float  # the eps in tol = max(shape) * eps * sigma_max


@contextmanager
def _one_thread():
    # These SVDs are small (n up to a few hundred): a thread team only adds synchronisation,
    # and on a busy shared machine its spin-waits made them 30-100x slower than one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def singular_values(a: Tensor) -> Tensor:
    """Singular values of (..., m, k) matrices in float64, largest first."""
    with _one_thread():
        return torch.linalg.svdvals(a.double())


def rank_from_sigma(sigma: Tensor, shape: tuple[int, int], eps: float) -> int:
    """Singular values above max(shape) * eps * sigma_max (sigma sorted, largest first)."""
    if sigma.numel() == 0 or sigma[0] == 0:
        return 0
    return int((sigma > max(shape) * eps * sigma[0]).sum())


def energy_from_sigma(sigma: Tensor, fraction: float = ENERGY) -> int:
    """Fewest singular values whose squares hold `fraction` of the total."""
    energy = sigma**2
    cumulative = energy.cumsum(0) / energy.sum()
    return int((cumulative < fraction - 1e-12).sum()) + 1


def numerical_rank(a: Tensor, eps: float | None = None) -> int:
    """Singular values above max(m, k) * eps * sigma_max; eps defaults to the dtype's epsilon."""
    eps = torch.finfo(a.dtype).eps if eps is None else eps
    return rank_from_sigma(singular_values(a), tuple(a.shape[-2:]), eps)


def energy_rank(a: Tensor, fraction: float = ENERGY) -> int:
    """Fewest singular values of `a` whose squares hold `fraction` of the total."""
    return energy_from_sigma(singular_values(a), fraction)


def measure_heads(
    probs: Tensor, source: str, d_k: int, logits: Tensor | None = None, eps: float | None = None
) -> RankRow:
    """Ranks of one layer's attention matrices.

    Args:
        probs: (H, n, S) attention probabilities of one layer (one batch row).
        source: label for the row.  d_k: the head dimension (for the table).
        logits: (H, n, S) pre-softmax scores, or None.
        eps: tolerance epsilon; None -> the epsilon of probs.dtype.
    """
    H, n, S = probs.shape
    eps = torch.finfo(probs.dtype).eps if eps is None else eps
    sigma = singular_values(probs)  # (H, min(n, S)), one SVD per head, batched
    ranks = sorted(rank_from_sigma(s, (n, S), eps) for s in sigma)
    joint = probs.permute(1, 0, 2).reshape(n, H * S)  # (n, H*S): [P_1 | ... | P_H]
    joint_sigma = singular_values(joint)  # (min(n, H*S),)
    logits_rank = None
    if logits is not None:
        logits_rank = max(rank_from_sigma(s, (n, S), eps) for s in singular_values(logits))
    return RankRow(
        source=source,
        n=n,
        d_k=d_k,
        n_heads=H,
        logits_rank=logits_rank,
        head_rank=(ranks[0], ranks[(H - 1) // 2], ranks[-1]),
        head_energy_rank=float(np.mean([energy_from_sigma(s) for s in sigma])),
        joint_rank=rank_from_sigma(joint_sigma, (n, H * S), eps),
        joint_energy_rank=energy_from_sigma(joint_sigma),
        tol_eps=eps,
    )


def random_attention(
    n: int, d_k: int, n_heads: int, seed: int = 0, causal: bool = False, width: int = RANDOM_WIDTH
) -> tuple[Tensor, Tensor]:
    """Attention of random weights on random inputs, in float64.

    X ~ N(0, 1) of shape (n, C) and W_q, W_k ~ N(0, 1/C) per head, so queries and keys have
    unit-variance entries and the logits q.k / sqrt(d_k) have unit variance.

    Returns:
        probs (H, n, n) float64; logits (H, n, n) float64, Q K^T / sqrt(d_k) before any mask.
    """
    with _one_thread():
        return _random_attention(n, d_k, n_heads, seed, causal, width)


def _random_attention(n, d_k, n_heads, seed, causal, width) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g, dtype=torch.float64)  # (n, C)
    w_q = torch.randn(n_heads, width, d_k, generator=g, dtype=torch.float64) / width**0.5
    w_k = torch.randn(n_heads, width, d_k, generator=g, dtype=torch.float64) / width**0.5
    q, k = x @ w_q, x @ w_k  # (H, n, d_k) each
    logits = q @ k.transpose(-2, -1) / d_k**0.5  # (H, n, n), rank <= d_k
    scores = logits
    if causal:
        future = torch.ones(n, n, dtype=torch.bool).triu(1)  # (n, n) keys after the query
        scores = logits.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1), logits


def random_rank_table(
    ns: list[int], d_ks: list[int], heads: list[int], seed: int = 0, causal: bool = False
) -> list[RankRow]:
    """`measure_heads` on `random_attention` for every (n, d_k, H); seeded per configuration."""
    rows = []
    for n in ns:
        for d_k in d_ks:
            for H in heads:
                probs, logits = random_attention(n, d_k, H, seed, causal)
                rows.append(measure_heads(probs, "random", d_k, logits))
    return rows


def random_spectra(ns: list[int], d_k: int, seed: int = 0, causal: bool = False):
    """Normalised singular values sigma_i / sigma_1 of one random head's P, for each n.

    Returns:
        {n: (n,) float64 numpy}.
    """
    spectra = {}
    for n in ns:
        sigma = singular_values(random_attention(n, d_k, 1, seed, causal)[0][0])  # (n,)
        spectra[n] = (sigma / sigma[0]).numpy()
    return spectra


@torch.no_grad()
def model_rank_table(
    model: nn.Module,
    ids: Tensor,
    source: str,
    kinds: tuple[str, ...] = ("encoder_self", "decoder_self"),
) -> list[RankRow]:
    """Ranks of every layer's self-attention matrices for one input (captured on the eager path).

    Args:
        model: a DecoderLM or encoder model, or an EncoderDecoder (ids feed both sides).
        ids: (1, n) token ids.
        source: label prefix ("init", "trained").
    """
    maps = run_attention(model.eval(), ids)
    layers = attention_layers(model)
    rows = []
    for kind in kinds:
        for layer, probs in sorted(maps.weights.get(kind, {}).items()):
            d_k = layers[kind][layer].head_dim
            rows.append(measure_heads(probs[0], f"{source} {kind} layer {layer}", d_k))
    return rows


def format_rank_table(rows: list[RankRow]) -> str:
    """A fixed-width table, one row per configuration."""
    head = (
        f"{'source':<28} {'n':>4} {'d_k':>4} {'H':>3} {'rank QK^T':>9} "
        f"{'rank P_h min/med/max':>20} {'99%-energy P_h':>14} {'rank [P_1..P_H]':>15} "
        f"{'99%-energy joint':>16}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        logits = "-" if r.logits_rank is None else str(r.logits_rank)
        lines.append(
            f"{r.source:<28} {r.n:>4} {r.d_k:>4} {r.n_heads:>3} {logits:>9} "
            f"{'/'.join(map(str, r.head_rank)):>20} {r.head_energy_rank:>14.1f} "
            f"{r.joint_rank:>15} {r.joint_energy_rank:>16}"
        )
    return "\n".join(lines)


def summarize(rows: list[RankRow]) -> str:
    """What the rows show, stated from the numbers (not from expectations)."""
    out = []
    random_rows = [r for r in rows if r.source == "random"]
    if random_rows:
        low = [r for r in random_rows if r.d_k < r.n]
        bounded = all(r.logits_rank <= min(r.n, r.d_k) for r in random_rows)
        out.append(f"rank(Q K^T) <= d_k held in {'every' if bounded else 'NOT every'} row.")
        if low:
            full = sum(r.head_rank[0] == r.n for r in low)
            out.append(
                f"with d_k < n ({len(low)} rows), every head's P was full rank n in {full} rows: "
                "the logits are low-rank, the attention matrix after softmax "
                + ("is not." if full == len(low) else "mostly is not." if full else "is too.")
            )
            frac = np.mean([r.head_energy_rank / r.n for r in low])
            out.append(
                f"yet 99% of the spectral energy of P_h sits in {frac:.0%} of its n "
                "singular values on average (the spectrum decays; rank alone hides that)."
            )
    model_rows = [r for r in rows if r.source != "random"]
    for source in sorted({r.source.split()[0] for r in model_rows}):
        group = [r for r in model_rows if r.source.split()[0] == source]
        full = sum(r.head_rank[0] == r.n for r in group)
        deficient = [r for r in group if r.head_rank[0] < r.n]
        msg = (
            f"{source} weights: every head of the layer full rank in {full} of {len(group)} "
            "(layer, n) pairs"
        )
        if deficient:
            worst = min(deficient, key=lambda r: r.head_rank[0] / r.n)
            msg += (
                f"; lowest: rank {worst.head_rank[0]} of n={worst.n} ({worst.source}), "
                f"where [P_1..P_H] together reach rank {worst.joint_rank}"
            )
        out.append(msg + ".")
    if any("decoder_self" in r.source for r in model_rows):
        out.append(
            "(a causal P is lower-triangular with a positive diagonal, so it is invertible in "
            "exact arithmetic; a numerical rank below n means it is ill-conditioned beyond "
            "float32: e.g. a previous-token head, whose mass sits below the diagonal, has an "
            "inverse that grows like (off-diagonal / diagonal)^n.)"
        )
    return "\n".join(out)


# --- the `attnlab analyze rank` report ------------------------------------------------------
@dataclass(frozen=True)
class RankAnalysis:
    """Options of `attnlab analyze rank` (the CLI derives its flags from these fields)."""

    n: tuple[int, ...] = field(default=(16, 32, 64, 128), metadata={"help": "sequence lengths n"})
    d_k: tuple[int, ...] = field(
        default=(4, 16), metadata={"help": "head dimensions d_k (random weights)"}
    )
    heads: tuple[int, ...] = field(
        default=(1, 4), metadata={"help": "head counts H (random weights)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of every random draw"})
    causal: bool = field(
        default=False, metadata={"help": "causal mask in the random-weight experiment"}
    )
    ckpt: str | None = field(
        default=None,
        metadata={
            "help": "checkpoint (or a run's out_dir): also measure its trained weights and the "
            "same config at init"
        },
    )
    text: str | None = field(
        default=None,
        metadata={
            "help": "input for --ckpt (default: the stdlib textwrap.py source when the checkpoint "
            "has a tokenizer, else random token ids)"
        },
    )
    plot: str | None = field(default=None, metadata={"help": "write the rank plot (PNG) here"})


def _model_inputs(opts: RankAnalysis, tokenizer, vocab_size: int, max_n: int):
    """(ids (1, max_n), description): text through the tokenizer, or seeded random ids."""
    text = opts.text
    if text is None and tokenizer is not None:
        import textwrap

        text = Path(textwrap.__file__).read_text()
        source = "the stdlib textwrap.py source"
    else:
        source = f"text {text!r}"
    if text is not None and tokenizer is not None:
        ids = tokenizer.encode(text)
        if len(ids) < max_n:
            raise ValueError(f"{source} gives {len(ids)} tokens; n up to {max_n} needs more")
        return torch.tensor([ids[:max_n]]), f"the first n tokens of {source}"
    g = torch.Generator().manual_seed(opts.seed)
    return torch.randint(
        vocab_size, (1, max_n), generator=g
    ), f"random token ids (seed {opts.seed})"


def rank_analysis(opts: RankAnalysis) -> tuple[list[RankRow], str]:
    """Run the measurements the options ask for; returns (rows, the printable report)."""
    bad = [v for v in (*opts.n, *opts.d_k, *opts.heads) if v < 1]
    if bad:
        raise ValueError(f"n, d_k and heads must be >= 1, got {bad}")
    rows = random_rank_table(list(opts.n), list(opts.d_k), list(opts.heads), opts.seed, opts.causal)
    mask = "causal" if opts.causal else "bidirectional (no mask)"
    text = [
        "Numerical rank of attention matrices P = softmax(Q K^T / sqrt(d_k))",
        f"random weights: X ~ N(0,1) (n x {RANDOM_WIDTH}), W_q, W_k ~ N(0, 1/{RANDOM_WIDTH}) per "
        f"head (unit-variance logits), {mask}, seed {opts.seed}; computed in float64,",
        "  rank = #sigma > tol, tol = max(rows, cols) * eps * sigma_max, eps = 2.2e-16 (float64)",
    ]
    if opts.ckpt is not None:
        rows += _checkpoint_rows(opts, text)
    text += ["", format_rank_table(rows), "", "Findings:", summarize(rows)]
    return rows, "\n".join(text)


def _checkpoint_rows(opts: RankAnalysis, text: list[str]) -> list[RankRow]:
    loaded = plain_model(open_checkpoint(opts.ckpt), "analyze takes a plain model")
    trained, tokenizer, cfg = loaded.model, loaded.tokenizer, loaded.config
    torch.manual_seed(opts.seed)
    init = build_model(cfg).eval()
    ns = [n for n in opts.n if n <= cfg.max_seq_len]
    if not ns:
        raise ValueError(
            f"every n {list(opts.n)} exceeds the checkpoint's max_seq_len {cfg.max_seq_len}"
        )
    ids, source = _model_inputs(opts, tokenizer, cfg.vocab_size, max(ns))
    text += [
        f"checkpoint {opts.ckpt} ({cfg.arch}, {cfg.n_layers} layers, {cfg.attention.n_heads}"
        f" heads, d_k {cfg.head_dim}) and the same config at init (seed {opts.seed}),",
        f"  input: {source}; captured in float32 (eager backend),",
        "  tol = max(rows, cols) * eps * sigma_max, eps = 1.19e-07 (float32)",
    ]
    rows = []
    for name, model in (("init", init), ("trained", trained)):
        for n in ns:
            rows += model_rank_table(model, ids[:, :n], name)
    return rows
