"""`attnlab lab sae`: train a sparse autoencoder on one hook point of a model and measure it.

    text (the standard library's .py files) ─> the checkpoint's tokenizer ─> windows of T tokens
    ─> run_with_cache at the point ─> activations (N, C), shuffled ─> SAETrainer (lab/sae.py)
    ─> held-out windows: L0, explained variance, CE loss recovered, dead features, top tokens

The metrics are SAELens' (sae_lens/evals.py), on held-out windows spread evenly through the
token stream (every (W / held-out windows)-th one; the files are read in sorted order):
    L0                   mean over tokens of the number of non-zero features.
    explained variance   1 - E||x - x_hat||^2 / Var(x), Var(x) = E||x||^2 - ||E x||^2 (summed
                         over C; float64 sums, as its ExplainedVarianceCalculator).
    CE loss score        (CE_zero - CE_sae) / (CE_zero - CE_clean): the next-token loss with the
                         point zeroed, with the SAE's reconstruction in its place (no error
                         term), and clean. 1 = the SAE loses nothing, 0 = as bad as zeroing.
    dead features        features that never fire on the held-out tokens.
Unlike run_evals, no token is left out (these windows hold no BOS or padding).

The page (features.md, Markdown) shows, for the most often firing features, the held-out tokens
that activate each most, with the text around them.

Shapes: N tokens, W windows, T window length, C the point's width, F features.
"""

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.checkpoint import open_checkpoint, plain_model
from attnlab.components.hooks import hooks, point_named, run_with_cache
from attnlab.lab.sae import SAE, SAEConfig, SAETrainer, save_sae, splice
from attnlab.training.data import decode_text, stdlib_files


@dataclass(frozen=True)
class SAELab:
    """Options of `attnlab lab sae` (its flags are derived from these fields)."""

    ckpt: str = field(default="", metadata={"help": "the causal LM (with its tokenizer)"})
    hook: str = field(
        default="", metadata={"help": "the point, attnlab's or TransformerLens' name"}
    )
    kind: str = field(default="topk", metadata={"help": "topk or relu (L1 penalty)"})
    features: int = field(default=0, metadata={"help": "SAE features; 0: 8 x the point's width"})
    k: int = field(default=32, metadata={"help": "topk: features kept per token"})
    l1: float = field(default=1.0, metadata={"help": "relu: the L1 coefficient"})
    l1_warm_up: int = field(default=0, metadata={"help": "relu: steps of L1 warm-up"})
    tokens: int = field(default=200_000, metadata={"help": "training tokens"})
    eval_tokens: int = field(default=8192, metadata={"help": "held-out tokens for the metrics"})
    context: int = field(default=128, metadata={"help": "tokens per window"})
    batch: int = field(default=4096, metadata={"help": "tokens per SAE step (SAELens' default)"})
    lr: float = field(default=3e-4, metadata={"help": "Adam's learning rate"})
    dead_window: int = field(default=1000, metadata={"help": "topk: steps unfired = dead"})
    page_features: int = field(default=24, metadata={"help": "features on features.md"})
    out: str = field(default="runs/sae", metadata={"help": "where the SAE and report go"})
    seed: int = field(default=0, metadata={"help": "the SAE's init and the shuffle"})

    def __post_init__(self):
        if not self.ckpt or not self.hook:
            raise ValueError("give --ckpt MODEL and --hook NAME (e.g. blocks.0.hook_resid_post)")
        if self.kind not in ("topk", "relu"):
            raise ValueError(f"--kind {self.kind!r}: give topk or relu")
        for name in ("tokens", "eval_tokens", "context", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: give >= 1")


def token_windows(tokenizer, n_tokens: int, context: int) -> Tensor:
    """(W, T) the first n_tokens (rounded up to whole windows) of the stdlib corpus."""
    ids: list[int] = []
    for path in stdlib_files():
        ids += tokenizer.encode(decode_text(path, path.read_bytes()))
        if len(ids) >= n_tokens + context:
            break
    W = -(-n_tokens // context)  # whole windows, rounded up
    if len(ids) < W * context:
        raise ValueError(
            f"the stdlib corpus holds {len(ids)} tokens; ask for fewer than {n_tokens}"
        )
    return torch.tensor(ids[: W * context]).view(W, context)  # (W, T)


def split_windows(windows: Tensor, n_eval: int) -> tuple[Tensor, Tensor]:
    """(train, held out): every (W // n_eval)-th window is held out, so the metrics read text
    from across the corpus rather than its last file alone."""
    every = max(1, len(windows) // n_eval)
    held = torch.zeros(len(windows), dtype=torch.bool)
    held[every - 1 :: every][:n_eval] = True
    return windows[~held], windows[held]


@torch.no_grad()
def collect_activations(model: nn.Module, windows: Tensor, hook: str, per_run: int = 8) -> Tensor:
    """(W * T, C) the point's activations on every window, as float32."""
    acts = []
    for i in range(0, len(windows), per_run):
        _, cache = run_with_cache(model, windows[i : i + per_run], names=[hook])
        acts.append(cache[hook].float().flatten(0, -2))  # (B * T, C)
    return torch.cat(acts)


def train_sae(sae: SAE, acts: Tensor, opts: SAELab) -> list[dict]:
    """Train `sae` on `acts` (N, C) shuffled (seed opts.seed), `opts.batch` tokens a step;
    returns the losses of each step."""
    g = torch.Generator().manual_seed(opts.seed)
    order = torch.randperm(len(acts), generator=g)
    trainer = SAETrainer(sae, lr=opts.lr, dead_feature_window=opts.dead_window)
    log = []
    for i in range(0, len(acts) - opts.batch + 1, opts.batch):
        out = trainer.step(acts[order[i : i + opts.batch]])
        log.append({k: round(v.item(), 6) for k, v in out.losses.items()})
    return log


def next_token_ce(model: nn.Module, windows: Tensor, per_run: int = 8) -> float:
    """The model's mean next-token cross-entropy over every prediction in windows (W, T)."""
    total, count = 0.0, 0
    for i in range(0, len(windows), per_run):
        ids = windows[i : i + per_run]  # (B, T)
        logits = model(ids)[:, :-1].float()  # (B, T - 1, V)
        targets = ids[:, 1:].reshape(-1)
        total += F.cross_entropy(logits.flatten(0, 1), targets, reduction="sum").item()
        count += targets.numel()
    return total / count


def _zero(x: Tensor, hook) -> Tensor:
    return torch.zeros_like(x)


@torch.no_grad()
def evaluate_sae(model: nn.Module, sae: SAE, hook: str, windows: Tensor) -> tuple[dict, Tensor]:
    """SAELens' metrics (module docstring) on the held-out windows (W, T); also (N, F) acts."""
    x = collect_activations(model, windows, hook).double()  # (N, C)
    acts = sae.encode(x.float())  # (N, F)
    x_hat = sae.decode(acts).double()
    variance = x.pow(2).sum(-1).mean() - x.mean(0).pow(2).sum()
    explained = 1 - (x - x_hat).pow(2).sum(-1).mean() / variance
    ce = {"clean": next_token_ce(model, windows)}
    with hooks(model, [(hook, _zero)]):
        ce["zero"] = next_token_ce(model, windows)
    with splice(model, sae, hook, use_error_term=False):
        ce["sae"] = next_token_ce(model, windows)
    metrics = {
        "l0": (acts != 0).sum(-1).float().mean().item(),
        "explained_variance": explained.item(),
        "mse": (x - x_hat).pow(2).sum(-1).mean().item(),
        "ce_loss_without_sae": ce["clean"],
        "ce_loss_with_ablation": ce["zero"],
        "ce_loss_with_sae": ce["sae"],
        "ce_loss_score": (ce["zero"] - ce["sae"]) / (ce["zero"] - ce["clean"]),
        "dead_features": int(((acts != 0).sum(0) == 0).sum()),
        "features": sae.cfg.d_sae,
    }
    return metrics, acts


def _md(text: str) -> str:
    """Text shown inside a Markdown table cell, whitespace made visible."""
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`")
    return text.replace("\n", "⏎").replace("\t", "→").replace("<", "&lt;")


def feature_page(acts: Tensor, windows: Tensor, tokenizer, n_features: int, top: int = 6) -> str:
    """Markdown: the `n_features` most often firing features, each with its `top` activating
    held-out tokens (in **bold**) and 12 tokens either side."""
    W, T = windows.shape
    flat = windows.reshape(-1)
    counts = (acts != 0).sum(0)  # (F,)
    chosen = counts.argsort(descending=True)[:n_features]
    lines = ["# SAE features: top-activating held-out tokens", ""]
    for f in chosen.tolist():
        if counts[f] == 0:
            break
        lines += [f"## Feature {f} (fires on {counts[f] / len(acts):.2%} of tokens)", ""]
        lines += ["| activation | text |", "|---:|:---|"]
        values, where = acts[:, f].topk(min(top, int(counts[f])))
        for v, n in zip(values.tolist(), where.tolist()):
            start = n - n % T  # never across windows
            before = tokenizer.decode(flat[max(start, n - 12) : n].tolist())
            token = tokenizer.decode([flat[n].item()])
            after = tokenizer.decode(flat[n + 1 : min(start + T, n + 13)].tolist())
            shown = _md(token).replace(" ", "␣")  # a space in bold would not show
            lines.append(f"| {v:.3f} | {_md(before)}**{shown}**{_md(after)} |")
        lines.append("")
    return "\n".join(lines)


def run_sae_lab(opts: SAELab) -> dict:
    """Open the checkpoint, train the SAE, save it in SAELens' format under out/sae, write
    metrics.json and features.md; returns the metrics with "files" and "train_s"."""
    loaded = plain_model(open_checkpoint(opts.ckpt), "an SAE is trained on a plain causal LM")
    model, tok = loaded.model.eval(), loaded.tokenizer
    if tok is None:
        raise ValueError(f"{opts.ckpt!r} has no tokenizer.json to read the text with")
    point_named(model, opts.hook)  # a ValueError naming the point, before any work
    windows = token_windows(tok, opts.tokens + opts.eval_tokens, opts.context)
    train_w, eval_w = split_windows(windows, -(-opts.eval_tokens // opts.context))
    acts = collect_activations(model, train_w, opts.hook)  # (N, C)
    C = acts.shape[-1]
    cfg = SAEConfig(C, opts.features or 8 * C, opts.kind, opts.k, **_kind_fields(opts, loaded.path))
    torch.manual_seed(opts.seed)
    sae = SAE(cfg)
    start = time.perf_counter()
    log = train_sae(sae, acts, opts)
    train_s = time.perf_counter() - start
    metrics, eval_acts = evaluate_sae(model, sae, opts.hook, eval_w)
    out = Path(opts.out)
    files = [save_sae(sae, out / "sae"), out / "metrics.json", out / "features.md"]
    record = metrics | {"steps": len(log), "train_tokens": len(acts), "train_s": train_s}
    files[1].write_text(
        json.dumps(record | {"options": asdict(opts), "losses": log[-5:]}, indent=1)
    )
    files[2].write_text(feature_page(eval_acts, eval_w, tok, opts.page_features))
    return record | {"files": [str(f) for f in files]}


def _kind_fields(opts: SAELab, path) -> dict:
    fields = {"hook_name": opts.hook, "model_name": str(path)}
    if opts.kind == "relu":
        fields |= {"l1_coefficient": opts.l1, "l1_warm_up_steps": opts.l1_warm_up}
    return fields


def format_metrics(m: dict) -> str:
    """The metrics as a small table."""
    rows = [
        ("L0 (mean active features)", f"{m['l0']:.2f}"),
        ("explained variance", f"{m['explained_variance']:.4f}"),
        ("CE loss score (recovered)", f"{m['ce_loss_score']:.4f}"),
        (
            "CE clean / with SAE / zeroed",
            f"{m['ce_loss_without_sae']:.4f} / "
            f"{m['ce_loss_with_sae']:.4f} / {m['ce_loss_with_ablation']:.4f}",
        ),
        ("dead features (held out)", f"{m['dead_features']} of {m['features']}"),
        ("steps, tokens, time", f"{m['steps']}, {m['train_tokens']}, {m['train_s']:.1f} s"),
    ]
    return "\n".join(f"{name:<30} {value}" for name, value in rows)
