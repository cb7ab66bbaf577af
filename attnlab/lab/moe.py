"""Does a Mixture of Experts pay at small scale? `attnlab lab moe` (issue 35).

Three small Llama-style decoders, identical but for their FFNs, trained on the same tokens
(same corpus, seed, steps, batch and context, so the same token budget):

    dense          one SwiGLU FFN of width F per block
    moe-active     E experts of width F / k, k per token: the dense model's active FFN
                   parameters and FLOPs, E / k times its FFN parameters in total
    moe-total      E experts of width F / E, k per token: the dense model's total FFN
                   parameters, k / E of them active

(each MoE block adds its router, E * d_model parameters). Each trains with the load-balancing
loss at `train.moe_aux_weight` (components/moe.py). Reported: the held-out loss curve (the
last val_fraction of the corpus, measured every eval_every steps), the parameters total and
active, the training tokens per second, and each MoE layer's tokens per expert over the last
step (how balanced the routers ended). The small-scale reports this compares with (the
Switch Transformer's own ablations start far larger) find that MoE at equal active compute
helps only with enough tokens per expert; at this size attnlab measures, it does not claim.

Files in OUT: models/<name>/ (each a `train()` run), moe.json (the results), moe.txt (the
table), moe.png (viz/moe.py: loss curves and expert load).
"""

import json
import platform
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig, MoEConfig
from attnlab.models.inspect import active_parameters, count_parameters
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from attnlab.training.data import prepare_text_data
from attnlab.training.loop import train
from attnlab.training.tasks import LMTask
from attnlab.viz.loss import load_metrics
from attnlab.viz.moe import plot_moe_lab


@dataclass(frozen=True)
class Sizes:
    """One mode's sizes: the model (d_model, n_layers, n_heads, d_ff = F), the experts (E, k),
    training (context, batch_size, steps, lr, eval_every) and the corpus read (max_chars)."""

    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    n_experts: int
    k: int
    context: int
    batch_size: int
    steps: int
    lr: float
    eval_every: int
    max_chars: int


FAST = Sizes(32, 2, 2, 64, 4, 2, 32, 8, 12, 3e-3, 6, 100_000)  # for tests (seconds)
FULL = Sizes(128, 4, 4, 512, 8, 2, 128, 16, 1200, 3e-3, 100, 2_000_000)  # ~20 min, 2 cores


@dataclass(frozen=True)
class MoELab:
    """Options of `attnlab lab moe` (its flags are derived from these fields)."""

    fast: bool = field(default=False, metadata={"help": "tiny models, a few steps"})
    out: str = field(default="runs/moe", metadata={"help": "the run directory"})
    steps: int | None = field(
        default=None,
        metadata={"help": f"training steps of each model ({FULL.steps}; fast: {FAST.steps})"},
    )
    aux_weight: float = field(default=0.01, metadata={"help": "train.moe_aux_weight"})
    source: str = field(default="stdlib", metadata={"help": "the corpus (data.source)"})
    seed: int = field(default=1337, metadata={"help": "seed of every model and batch"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or auto"})

    def __post_init__(self):
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")

    @property
    def sizes(self) -> Sizes:
        sizes = FAST if self.fast else FULL
        return sizes if self.steps is None else replace(sizes, steps=self.steps)


def model_configs(s: Sizes, vocab_size: int) -> dict[str, ModelConfig]:
    """The dense baseline and its two MoE counterparts (see the module docstring)."""
    dense = ModelConfig(
        arch="decoder",
        d_model=s.d_model,
        n_layers=s.n_layers,
        vocab_size=vocab_size,
        max_seq_len=s.context,
        attention=AttentionConfig(n_heads=s.n_heads),
        d_ff=s.d_ff,
        tie_embeddings=True,
    )
    experts = {"moe-active": s.d_ff // s.k, "moe-total": s.d_ff // s.n_experts}
    return {"dense": dense} | {
        name: replace(dense, moe=MoEConfig(s.n_experts, s.k, d_expert=width))
        for name, width in experts.items()
    }


def _train_one(name: str, cfg: ModelConfig, opts: MoELab, data, data_cfg: DataConfig) -> dict:
    """Train one model from scratch; its curve, counts, speed and last expert load."""
    s, out = opts.sizes, Path(opts.out) / "models" / name
    tcfg = TrainConfig(
        steps=s.steps, batch_size=s.batch_size, context=s.context, lr=s.lr, min_lr=s.lr / 10,
        warmup=max(1, s.steps // 20), eval_every=s.eval_every, eval_batches=4,
        ckpt_every=s.steps, keep_last=1, sample_tokens=0, seed=opts.seed, device=opts.device,
        out_dir=str(out), progress=not opts.fast, log_every=max(1, s.steps // 50),
        moe_aux_weight=opts.aux_weight,
    )  # fmt: skip
    run = RunConfig(model=cfg, train=tcfg, data=data_cfg)
    torch.manual_seed(opts.seed)
    model = build_model(cfg)
    last = {}
    t0 = time.perf_counter()
    train(model, LMTask(data, run), run, overwrite=True, callbacks=(lambda st, r: last.update(r),))
    metrics = load_metrics(out)
    return {
        "name": name,
        "total_params": count_parameters(model),
        "active_params": active_parameters(model),
        "val_loss": metrics["val_loss"],  # [(step, loss)]
        "tokens_per_s": sum(v for _, v in metrics["tokens_per_s"]) / len(metrics["tokens_per_s"]),
        "expert_load": last.get("expert_load"),  # per MoE layer, tokens per expert, last step
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def format_table(rows: list[dict]) -> str:
    lines = [f"{'model':<11} {'params':>9} {'active':>9} {'val loss':>9} {'tokens/s':>9}"]
    for r in rows:
        lines.append(
            f"{r['name']:<11} {r['total_params']:>9,} {r['active_params']:>9,} "
            f"{r['val_loss'][-1][1]:>9.4f} {r['tokens_per_s']:>9,.0f}"
        )
    return "\n".join(lines)


def run_moe_lab(opts: MoELab) -> dict:
    """Train the three models; write moe.json, moe.txt and moe.png into opts.out."""
    t0, s, out = time.perf_counter(), opts.sizes, Path(opts.out)
    data_cfg = DataConfig(source=opts.source, max_chars=s.max_chars, cache_dir=str(out / "data"))
    data = prepare_text_data(data_cfg)
    configs = model_configs(s, data.tokenizer.vocab_size)
    rows = [_train_one(name, cfg, opts, data, data_cfg) for name, cfg in configs.items()]
    result = {
        "settings": {
            "sizes": s.__dict__,
            "aux_weight": opts.aux_weight,
            "seed": opts.seed,
            "source": opts.source,
            "tokens_per_model": s.steps * s.batch_size * s.context,
            "device": opts.device,
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "rows": rows,
        "files": [str(out / f) for f in ("moe.json", "moe.txt", "moe.png")],
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe.txt").write_text(format_table(rows) + "\n")
    (out / "moe.json").write_text(json.dumps(result, indent=1) + "\n")
    plot_moe_lab(rows, out / "moe.png")
    return result
