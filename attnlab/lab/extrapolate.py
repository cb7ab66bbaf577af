"""Length extrapolation: which position schemes still work past the length they were trained on,
and how much RoPE scaling recovers, with and without a short fine-tune (issue 23).

The experiment, `attnlab lab extrapolate`:

1. Train small decoders that differ only in the position scheme (sinusoidal, learned, rope,
   alibi, t5_bias, none = NoPE) on windows of L tokens, same data, same seed, same steps.
2. Measure each one's validation loss per position up to 8L. Position i (1-based) is the
   prediction of token i + 1 from the i tokens before it; training only ever scored i <= L.
   Learned positions have no embedding past L: they are measured up to L and flagged "not
   applicable" past it (the model itself raises a ValueError there, see LearnedPosition).
3. The RoPE model again, its weights untouched, with each scaling (components/positions/
   rope_scaling.py: PI = "linear", NTK-aware = "ntk", dynamic NTK = "dynamic", YaRN) at factors
   2, 4, 8 over the original length L.
4. PI and YaRN at each factor f after a short fine-tune (`finetune_steps`) on windows of f * L
   tokens, starting from the RoPE model's weights (the PI and YaRN papers' recipe, shortened).

The table reports the mean per-position loss over four buckets of positions (1-based, ends
included): "L" = (L/2, L], "2L" = (L, 2L], "4L" = (2L, 4L], "8L" = (4L, 8L]. The "L" bucket is the
trained range's second half, so every model is compared where it has seen enough context.

How the losses are measured: each validation window of 8L + 1 tokens is cut at the bucket ends; the
positions of a bucket are scored in one forward over the window's first (bucket end) tokens. For
every static scheme that gives exactly the numbers of one 8L forward (attention is causal); for
dynamic NTK it means a position in bucket (L, 2L] is scored with the frequencies for length 2L,
as when a sequence of that length is processed, not with those for 8L.

Everything is seeded and cached in the run directory, so a rerun trains and measures nothing
and only redraws the table and the picture:

    OUT/models/<name>-<key>/     a `train()` run: checkpoints/, metrics.jsonl
    OUT/measurements/<name>-<key>.json   one variant's per-position losses
    OUT/data/                    the tokenized corpus
    OUT/extrapolation.txt, .json, .png   the table, the results, the picture (viz/extrapolation.py)

A key is a hash of every setting its result depends on (the model config, sizes, steps, seed,
data, what it was fine-tuned from), so changing one retrains only what it touches.
"""

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.checkpoint import copy_weights, latest_checkpoint, read_checkpoint
from attnlab.components.positions.rope_scaling import RopeScaling
from attnlab.configs import to_dict
from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig, RopeConfig
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from attnlab.training.data import TokenData, prepare_text_data
from attnlab.training.distributed import resolve_device
from attnlab.training.loop import train
from attnlab.training.tasks import LMTask
from attnlab.viz.extrapolation import plot_extrapolation

SCHEMES = ("sinusoidal", "learned", "rope", "alibi", "t5_bias", "none")
SCALINGS = {"linear": "PI", "ntk": "NTK", "dynamic": "dynamic NTK", "yarn": "YaRN"}
FACTORS = (2, 4, 8)
FINETUNED = ("linear", "yarn")
SPAN = 8  # measure up to SPAN * L
BUCKETS = ("L", "2L", "4L", "8L")
LATER = ("finetune_steps", "eval_windows")  # sizes a trained base model does not depend on


@dataclass(frozen=True)
class Sizes:
    """One mode's sizes. context: L, the training length. d_model, n_layers, n_heads: the model.
    batch_size, steps, lr: training (a fine-tune at f * L takes batch_size / f windows, the same
    tokens per step, for finetune_steps at lr / 3). eval_windows: validation windows of 8L + 1
    tokens measured. max_chars: of the corpus read."""

    context: int
    d_model: int
    n_layers: int
    n_heads: int
    batch_size: int
    steps: int
    finetune_steps: int
    lr: float
    eval_windows: int
    max_chars: int


# fast: for tests (seconds). full: sized to fit 30 minutes on 2 CPU cores (README, Experiments).
FAST = Sizes(32, 32, 2, 2, 8, 30, 4, 3e-3, 4, 200_000)
FULL = Sizes(64, 64, 2, 4, 16, 1500, 150, 3e-3, 32, 2_000_000)


@dataclass(frozen=True)
class Extrapolation:
    """Options of `attnlab lab extrapolate` (its flags are derived from these fields)."""

    fast: bool = field(default=False, metadata={"help": "tiny models, few steps, L = 32"})
    out: str = field(default="runs/extrapolate", metadata={"help": "the run directory (cache)"})
    steps: int | None = field(
        default=None,
        metadata={"help": f"training steps of each model ({FULL.steps}; fast: {FAST.steps})"},
    )
    finetune_steps: int | None = field(
        default=None,
        metadata={
            "help": "steps of each PI / YaRN fine-tune at the longer length "
            f"({FULL.finetune_steps}; fast: {FAST.finetune_steps})"
        },
    )
    seed: int = field(default=1337, metadata={"help": "seed of every model and batch"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or auto"})

    def __post_init__(self):
        for name in ("steps", "finetune_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    @property
    def sizes(self) -> Sizes:
        sizes = FAST if self.fast else FULL
        steps = sizes.steps if self.steps is None else self.steps
        ft = sizes.finetune_steps if self.finetune_steps is None else self.finetune_steps
        return replace(sizes, steps=steps, finetune_steps=ft)


def default_data(opts: Extrapolation) -> DataConfig:
    """The corpus: the standard library's own source (nothing downloaded), cached in OUT/data."""
    return DataConfig(max_chars=opts.sizes.max_chars, cache_dir=str(Path(opts.out) / "data"))


@dataclass(frozen=True)
class Variant:
    """One curve: a trained scheme, optionally RoPE-scaled by `factor`, optionally fine-tuned."""

    scheme: str
    scaling: str | None = None
    factor: int = 1
    finetuned: bool = False

    @property
    def name(self) -> str:
        if self.scaling is None:
            return self.scheme
        return f"rope {SCALINGS[self.scaling]} x{self.factor}" + (" ft" if self.finetuned else "")

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "_")


def variants() -> list[Variant]:
    """Every curve of the experiment, in table order."""
    out = [Variant(s) for s in SCHEMES]
    out += [Variant("rope", kind, f) for kind in SCALINGS for f in FACTORS]
    return out + [Variant("rope", kind, f, finetuned=True) for kind in FINETUNED for f in FACTORS]


def _key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def model_config(scheme: str, sizes: Sizes, vocab_size: int, max_seq_len: int) -> ModelConfig:
    """A small Llama-style decoder; only `position` (and with it, for sinusoidal, the embedding
    scale) differs between the schemes.

    T5's buckets reach to distance L (`t5_max_distance`); farther keys share the last bucket.
    Sinusoidal positions come with the 2017 paper's sqrt(d_model) scale on the token embeddings
    (Vaswani et al. §3.4): without it the fixed table (entries of size 1) swamps the token
    embeddings (std 0.02 at init), and the model trains far slower than the others.
    """
    return ModelConfig(
        arch="decoder",
        d_model=sizes.d_model,
        n_layers=sizes.n_layers,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        attention=AttentionConfig(n_heads=sizes.n_heads),
        position=scheme,
        t5_max_distance=sizes.context,
        scale_embeddings=scheme == "sinusoidal",
        dropout=0.0,
    )


def scaled(cfg: ModelConfig, kind: str | None, factor: int, original: int) -> ModelConfig:
    """cfg with RoPE scaling `kind` by `factor` over `original` positions (None: unscaled)."""
    scaling = None if kind is None else RopeScaling(kind, float(factor), original)
    return replace(cfg, rope=RopeConfig(scaling=scaling))


def eval_windows(tokens: np.ndarray, n_windows: int, length: int) -> Tensor:
    """n_windows windows of length + 1 tokens, evenly spread over `tokens` (no randomness).

    Returns:
        (N, length + 1) int64.
    """
    if len(tokens) < length + 1:
        raise ValueError(
            f"the validation split has {len(tokens)} tokens, too few for one window of "
            f"{length + 1} (8L + 1); use more text (--data.max_chars) or a smaller context"
        )
    starts = np.linspace(0, len(tokens) - length - 1, n_windows).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s : s + length + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def per_position_loss(model: nn.Module, windows: Tensor, ends: list[int], chunk: int = 8) -> Tensor:
    """Mean cross-entropy at each position, over the windows.

    Positions ends[k-1] + 1 .. ends[k] are scored in a forward over the first ends[k] tokens.

    Args:
        model: a decoder, ids (B, T) -> logits (B, T, V).
        windows: (N, n + 1) token ids; ends: increasing lengths, the last one <= n.
        chunk: windows per forward.

    Returns:
        (ends[-1],) float64: entry i - 1 is the mean loss of predicting token i + 1 of a window
        from its first i tokens.
    """
    out = torch.zeros(ends[-1], dtype=torch.float64)
    device = next(model.parameters()).device
    for batch in windows.split(chunk):
        batch, start = batch.to(device), 0
        for end in ends:
            logits = model(batch[:, :end])[:, start:end]  # (b, end - start, V)
            loss = F.cross_entropy(
                logits.transpose(1, 2).float(), batch[:, start + 1 : end + 1], reduction="none"
            )  # (b, end - start)
            out[start:end] += loss.sum(0).double().cpu()
            start = end
    return out / len(windows)


def bucket_means(losses: list[float | None], context: int) -> dict[str, float | None]:
    """The table's four columns: mean loss over positions (L/2, L], (L, 2L], (2L, 4L], (4L, 8L]
    (1-based), None where a bucket has a position without a loss."""
    edges = [context // 2, context, 2 * context, 4 * context, 8 * context]
    out = {}
    for name, lo, hi in zip(BUCKETS, edges, edges[1:]):
        part = losses[lo:hi]
        ok = len(part) == hi - lo and all(v is not None for v in part)
        out[name] = float(np.mean(part)) if ok else None
    return out


class Experiment:
    """The run directory: trains, fine-tunes and measures on demand, each result cached."""

    def __init__(self, opts: Extrapolation, data: DataConfig | None = None):
        self.opts, self.sizes = opts, opts.sizes
        self.data_cfg = data or default_data(opts)
        self.out = Path(opts.out)
        self._data: TokenData | None = None
        self.trained: list[str] = []  # what this call trained or fine-tuned (the rest was cached)
        self.measured: list[str] = []
        # What a trained model depends on (fine-tune steps and measuring windows key their own).
        data_settings = {k: v for k, v in asdict(self.data_cfg).items() if k != "cache_dir"}
        sizes = {k: v for k, v in asdict(self.sizes).items() if k not in LATER}
        self.settings = {"sizes": sizes, "seed": opts.seed, "data": data_settings}

    @property
    def data(self) -> TokenData:
        if self._data is None:  # prepared only when something has to be computed
            self._data = prepare_text_data(self.data_cfg)
        return self._data

    def _config(self, scheme: str, max_seq_len: int) -> ModelConfig:
        return model_config(scheme, self.sizes, self.data.tokenizer.vocab_size, max_seq_len)

    def _run(
        self,
        name: str,
        settings: dict,
        cfg: ModelConfig,
        context: int,
        steps: int,
        lr: float,
        init: dict | None = None,
    ) -> dict:
        """The final weights of a `train()` run in OUT/models/<name>-<key>, trained if missing."""
        out = self.out / "models" / f"{name}-{_key(settings)}"
        ckpt = latest_checkpoint(out / "checkpoints")
        if ckpt is not None and _step(ckpt) == steps:
            return read_checkpoint(ckpt)["weights"]
        s = self.sizes
        batch = max(1, s.batch_size * s.context // context)  # the same tokens per step
        tcfg = TrainConfig(
            steps=steps, batch_size=batch, context=context, lr=lr, min_lr=lr / 10,
            warmup=max(1, steps // 20), eval_every=steps, eval_batches=4, ckpt_every=steps,
            keep_last=1, sample_tokens=0, seed=self.opts.seed, device=self.opts.device,
            out_dir=str(out), progress=not self.opts.fast, log_every=max(1, steps // 20),
        )  # fmt: skip
        run = RunConfig(model=cfg, train=tcfg, data=self.data_cfg)
        torch.manual_seed(self.opts.seed)  # the same initial weights for every rerun
        model = build_model(cfg)
        if init is not None:
            copy_weights(model, init, f"the weights {name} starts from")
        t0 = time.perf_counter()
        resume = ckpt is not None  # a run cut short (Ctrl-C saves its last step) continues
        train(model, LMTask(self.data, run), run, resume=resume, overwrite=not resume)
        print(f"  trained {name}: {steps} steps in {time.perf_counter() - t0:.0f} s")
        self.trained.append(name)
        return read_checkpoint(latest_checkpoint(out / "checkpoints"))["weights"]

    def model_settings(self, v: Variant) -> dict:
        """What the weights `v` is measured with depend on (its cache key)."""
        # The whole model config (the vocabulary, set by the data, aside), so a change to
        # `model_config` retrains what it changes.
        model = to_dict(model_config(v.scheme, self.sizes, 1, self.sizes.context))
        base = {**self.settings, "scheme": v.scheme, "model": model}
        if not v.finetuned:
            return base
        steps = self.sizes.finetune_steps
        return {"from": base, "scaling": v.scaling, "factor": v.factor, "steps": steps}

    def weights(self, v: Variant) -> dict:
        """The trained weights `v` is measured with: its scheme's model trained at context L,
        or for a fine-tuned variant that RoPE model fine-tuned with its scaling at factor * L."""
        s = self.sizes
        if not v.finetuned:
            cfg = self._config(v.scheme, s.context)
            return self._run(v.scheme, self.model_settings(v), cfg, s.context, s.steps, s.lr)
        start = self.weights(Variant("rope"))
        length = v.factor * s.context
        cfg = scaled(self._config("rope", length), v.scaling, v.factor, s.context)
        settings = self.model_settings(v)
        return self._run(v.slug, settings, cfg, length, s.finetune_steps, s.lr / 3, start)

    def model(self, v: Variant) -> nn.Module:
        """The variant's model for measuring: its weights, built with room for 8L positions
        (learned: L) and with its RoPE scaling."""
        length = self.sizes.context if v.scheme == "learned" else SPAN * self.sizes.context
        cfg = scaled(self._config(v.scheme, length), v.scaling, v.factor, self.sizes.context)
        model = build_model(cfg)
        copy_weights(model, self.weights(v), f"the weights of {v.name}")
        return model.to(resolve_device(self.opts.device)).eval()

    def measure(self, v: Variant) -> dict:
        """The variant's per-position losses (cached in OUT/measurements)."""
        L = self.sizes.context
        ends = [L] if v.scheme == "learned" else [L * 2**k for k in range(4)]
        windows = {"n": self.sizes.eval_windows, "length": SPAN * L, "ends": ends}
        settings = {"model": self.model_settings(v), "variant": asdict(v), "windows": windows}
        path = self.out / "measurements" / f"{v.slug}-{_key(settings)}.json"
        if path.is_file():
            return json.loads(path.read_text())
        model = self.model(v)
        val = eval_windows(self.data.val, self.sizes.eval_windows, SPAN * L)
        losses: list[float | None] = per_position_loss(model, val, ends).tolist()
        losses += [None] * (SPAN * L - len(losses))
        record = {"name": v.name, **asdict(v), "per_position": losses}
        if v.scheme == "learned":
            record["note"] = (
                f"learned positions have no embedding past position L={L}: not applicable there"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        self.measured.append(v.name)
        return record


def _step(ckpt: Path) -> int:
    return json.loads((ckpt / "trainer_state.json").read_text())["step"]


def run_extrapolation(opts: Extrapolation, data: DataConfig | None = None) -> dict:
    """Run (or read back) the whole experiment; write the table, JSON and PNG into opts.out.

    Returns:
        the JSON result: settings, rows (name, losses per bucket, note), the files written, and
        which models were trained and which variants measured by this call (the rest: cached).
    """
    t0 = time.perf_counter()
    exp = Experiment(opts, data)
    records = [exp.measure(v) for v in variants()]
    L = exp.sizes.context
    rows = [
        {"name": r["name"], "loss": bucket_means(r["per_position"], L), "note": r.get("note")}
        for r in records
    ]
    out = Path(opts.out)
    result = {
        "settings": {
            **exp.settings,
            "sizes": asdict(exp.sizes),
            "span": SPAN * L,
            "device": opts.device,
            "python": platform.python_version(),  # "stdlib" is this Python's library
            "torch": torch.__version__,
        },
        "buckets": {b: f"positions ({lo}, {hi}]" for b, lo, hi in _bucket_edges(L)},
        "rows": rows,
        "table": str(out / "extrapolation.txt"),
        "json": str(out / "extrapolation.json"),
        "png": str(out / "extrapolation.png"),
        "trained": exp.trained,
        "measured": exp.measured,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    table = format_table(rows, L)
    out.mkdir(parents=True, exist_ok=True)
    (out / "extrapolation.txt").write_text(table + "\n")
    (out / "extrapolation.json").write_text(json.dumps(result, indent=1) + "\n")
    plot_extrapolation(records, L, out / "extrapolation.png")
    return result


def _bucket_edges(L: int) -> list[tuple[str, int, int]]:
    edges = [L // 2, L, 2 * L, 4 * L, 8 * L]
    return list(zip(BUCKETS, edges, edges[1:]))


def format_table(rows: list[dict], context: int) -> str:
    """The table as text: one row per variant, mean loss (nats/token) per bucket of positions."""
    head = "  ".join(f"{b:>7}" for b in BUCKETS)
    lines = [f"{'variant':<22}{head}"]
    for r in rows:
        cells = "  ".join(
            f"{'n/a':>7}" if r["loss"][b] is None else f"{r['loss'][b]:7.3f}" for b in BUCKETS
        )
        lines.append(f"{r['name']:<22}{cells}")
    spans = ", ".join(f"{b} = ({lo}, {hi}]" for b, lo, hi in _bucket_edges(context))
    lines.append(f"mean validation loss (nats/token) over 1-based positions {spans}; L = {context}")
    lines += sorted({f"note: {r['note']}" for r in rows if r["note"]})
    return "\n".join(lines)
