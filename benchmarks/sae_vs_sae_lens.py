"""`attnlab lab sae` beside sae-lens on the same activations (docs/interpretability.md, "SAEs").

What `attnlab lab sae` does (lab/sae_lab.py: stdlib windows, run_with_cache at the point,
shuffled batches, SAETrainer, held-out metrics, SAELens files, features.md), with one more SAE:
sae-lens' TopKTrainingSAE from the same initial weights, stepped by sae-lens' own
`SAETrainer.step` on the same batches in the same order. Both are then measured by the same
held-out metrics (SAELens' definitions, lab/sae_lab.py). sae-lens comes in through the tests'
shim (tests/lab/sae_lens_shim.py: why, there).

    PYTHONPATH=. taskset -c 0 python benchmarks/sae_vs_sae_lens.py --ckpt SMOLLM2.gguf \
        --hook blocks.15.hook_resid_post --features 4608 --k 32 --tokens 131072 \
        --batch 1024 --lr 1e-3 --out runs/sae_smollm2
"""

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from attnlab.checkpoint import open_checkpoint
from attnlab.lab.sae import SAE, SAEConfig, load_sae, save_sae
from attnlab.lab.sae_lab import (
    SAELab,
    collect_activations,
    evaluate_sae,
    feature_page,
    format_metrics,
    split_windows,
    token_windows,
    train_sae,
)


def train_sae_lens(sl, sae: SAE, acts: torch.Tensor, opts: SAELab):
    """sae-lens' TopKTrainingSAE from `sae`'s weights; its SAETrainer.step on the batches
    train_sae takes (the same shuffle)."""
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    cfg = sae.cfg
    ref = sl.TopKTrainingSAE(sl.TopKTrainingSAEConfig(d_in=cfg.d_in, d_sae=cfg.d_sae, k=cfg.k))
    ref.load_state_dict(sae.state_dict())
    n_steps = len(acts) // opts.batch
    tcfg = SAETrainerConfig(
        n_steps * opts.batch, opts.batch, lr=opts.lr, lr_end=opts.lr, dead_feature_window=1000
    )
    trainer = SAETrainer(tcfg, ref, data_provider=iter([]))
    order = torch.randperm(len(acts), generator=torch.Generator().manual_seed(opts.seed))
    for i in range(0, len(acts) - opts.batch + 1, opts.batch):
        trainer.step(acts[order[i : i + opts.batch]])
    return ref


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("ckpt", "hook", "out"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--features", type=int, default=4608)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-4)
    a = p.parse_args()
    torch.set_num_threads(1)
    from tests.lab import sae_lens_shim as sl

    opts = SAELab(a.ckpt, a.hook, "topk", a.features, a.k, tokens=a.tokens, out=a.out)
    opts = SAELab(**(asdict(opts) | {"eval_tokens": a.eval_tokens, "batch": a.batch, "lr": a.lr}))
    times = {}
    start = time.perf_counter()
    loaded = open_checkpoint(opts.ckpt)
    model, tok = loaded.model.eval(), loaded.tokenizer
    windows = token_windows(tok, opts.tokens + opts.eval_tokens, opts.context)
    train_w, eval_w = split_windows(windows, -(-opts.eval_tokens // opts.context))
    acts = collect_activations(model, train_w, opts.hook)
    times["activations_s"] = time.perf_counter() - start
    cfg = SAEConfig(acts.shape[-1], opts.features, "topk", opts.k, hook_name=opts.hook)
    cfg = SAEConfig(**(asdict(cfg) | {"model_name": str(loaded.path)}))
    torch.manual_seed(opts.seed)
    ours = SAE(cfg)
    init = SAE(cfg)
    init.load_state_dict(ours.state_dict())
    start = time.perf_counter()
    train_sae(ours, acts, opts)
    times["attnlab_train_s"] = time.perf_counter() - start
    start = time.perf_counter()
    ref = train_sae_lens(sl, init, acts, opts)
    times["sae_lens_train_s"] = time.perf_counter() - start
    out = Path(opts.out)
    save_sae(ours, out / "attnlab_sae")
    ref.save_inference_model(out / "sae_lens_sae")
    results = {"tokens": len(acts), "steps": len(acts) // opts.batch, **times}
    for name in ("attnlab", "sae_lens"):
        sae = load_sae(out / f"{name}_sae")
        start = time.perf_counter()
        metrics, eval_acts = evaluate_sae(model, sae, opts.hook, eval_w)
        metrics |= {"steps": results["steps"], "train_tokens": len(acts)}
        metrics["train_s"] = times[f"{name}_train_s"]
        results[name] = metrics
        print(f"== {name} (eval {time.perf_counter() - start:.0f} s)\n{format_metrics(metrics)}")
        if name == "attnlab":
            (out / "features.md").write_text(feature_page(eval_acts, eval_w, tok, 24))
    diff = max((ours.state_dict()[k] - ref.state_dict()[k]).abs().max().item() for k in ["W_enc"])
    results["max_abs_W_enc_diff_after_training"] = diff
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict)}, indent=1))
    (out / "comparison.json").write_text(json.dumps(results | {"options": asdict(opts)}, indent=1))


if __name__ == "__main__":
    main()
