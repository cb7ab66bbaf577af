"""Experiments that test the seeds' claims: `attnlab lab extrapolate` (length extrapolation) and
`attnlab lab heads` (what heads do),
`attnlab lab patch` (activation patching and logit attribution),
`attnlab lab moe` (dense against Mixture-of-Experts models at equal active and total parameters),
`attnlab lab sae` (a sparse autoencoder on one hook point, saved in SAELens' format).

A small dispatcher: each experiment is one subcommand with one `<name>_main(args)` function and
its flags (attnlab/lab/).
"""

import argparse
from pathlib import Path

from attnlab.cli.options import (
    add_ckpt_flag,
    add_dataclass_flags,
    apply_config_flags,
    options_from_args,
)
from attnlab.lab.extrapolate import Extrapolation, default_data, run_extrapolation
from attnlab.lab.heads import COARSE_LEVELS, CURVES, HeadsLab, format_report, heads_lab
from attnlab.lab.moe import MoELab, run_moe_lab
from attnlab.lab.patching import patch_lab
from attnlab.lab.sae_lab import SAELab, format_metrics, run_sae_lab

EXTRAPOLATE_HELP = (
    "train small models that differ only in the position scheme at context L, then measure "
    "validation loss per position up to 8L, and RoPE scalings (PI, NTK, dynamic NTK, YaRN) "
    "x2/x4/x8 with and without a short fine-tune; cached, so a rerun only plots"
)


# The corpus flags that apply (the task is always causal LM on windows of a token stream).
DATA_FLAGS = {
    "source": "stdlib, shakespeare (after `attnlab data get shakespeare`), a file or a directory",
    "tokenizer": "char, bpe, or a tokenizer.json",
    "bpe_vocab_size": "with --data.tokenizer bpe",
    "max_chars": "characters of the corpus read",
    "val_fraction": "the held-out end of the corpus, where the losses are measured",
    "cache_dir": "where the tokenized corpus is kept",
}


def add_extrapolate_flags(p: argparse.ArgumentParser) -> None:
    add_dataclass_flags(p, Extrapolation)
    group = p.add_argument_group("data (DataConfig fields)")
    full, fast = default_data(Extrapolation()), default_data(Extrapolation(fast=True))
    for name, text in DATA_FLAGS.items():
        default, small = getattr(full, name), getattr(fast, name)
        if name == "cache_dir":
            default, small = "OUT/data", "OUT/data"
        text += f" (default: {default}" + ("" if small == default else f"; fast: {small}") + ")"
        group.add_argument(
            f"--data.{name}", dest=f"data.{name}", default=None, metavar="V", help=text
        )


def extrapolate_main(args: argparse.Namespace) -> int:
    """`attnlab lab extrapolate`: run (or read back) the experiment; print the table."""
    opts = options_from_args(Extrapolation, args)
    data = apply_config_flags({"data": default_data(opts)}, args)[0]["data"]
    result = run_extrapolation(opts, data)
    print(Path(result["table"]).read_text(), end="")
    cached = (
        "everything cached"
        if not (result["trained"] or result["measured"])
        else (
            f"trained {len(result['trained'])} models, measured {len(result['measured'])} variants"
        )
    )
    print(f"\n{cached}; {result['wall_s']:.0f} s")
    for key in ("json", "png"):
        print(f"wrote {result[key]}")
    return 0


HEADS_HELP = (
    "what the heads of a causal LM checkpoint do: importance and pruning curves (Michel et al. "
    "2019), previous-token, induction (Olsson et al. 2022) and positional scores, the logit "
    "lens; JSON, heatmaps and the attention viewer"
)


def add_heads_flags(p: argparse.ArgumentParser) -> None:
    add_ckpt_flag(p, "a causal LM")
    p.add_argument("--out", default="lab/heads", metavar="DIR", help="where the results go")
    p.add_argument("--fast", action="store_true", help="a few small batches (for tests)")
    p.add_argument(
        "--data.source",
        dest="source",
        default=None,
        metavar="SRC",
        help="text to measure on, read with the checkpoint's tokenizer (default: the "
        "checkpoint's own data source)",
    )
    p.add_argument("--seed", type=int, default=HeadsLab.seed, help="seed of batches and orders")
    p.add_argument(
        "--curves",
        choices=CURVES,
        default=HeadsLab.curves,
        help="pruning curves at every level (L*H + 1 evaluations per order), at "
        f"{COARSE_LEVELS + 1} levels (coarse: a large model in minutes), or none "
        "(default %(default)s)",
    )
    p.add_argument(
        "--check-induction",
        type=int,
        default=HeadsLab.check_induction,
        metavar="K",
        help="check the top K induction heads: masked against K random heads (5 draws), and "
        "per-head patching from [r, r] into [r', r] (L*H + 11 more forwards; default: off)",
    )
    for name, text in SIZE_FLAGS.items():
        default = getattr(HeadsLab, name)
        text += "" if default is None else f" (default {default}; --fast shrinks it)"
        p.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, metavar="N", help=text
        )


# HeadsLab's sizes, each a flag (--fast sets them all)
SIZE_FLAGS = {
    "batches": "importance batches, and as many held-out ones",
    "batch_size": "sequences per batch (and [r, r] sequences)",
    "context": "tokens per sequence (default: the checkpoint's training context)",
    "repeat_len": "n of the [r, r] sequences (default: context / 2)",
    "random_orders": "random pruning orders, the control",
}


def heads_main(args: argparse.Namespace) -> int:
    """`attnlab lab heads`: measure one checkpoint; print the summary."""
    given = [n for n in SIZE_FLAGS if getattr(args, n) is not None]
    if args.fast and given:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"--fast sets the sizes itself; leave out {flag} or --fast")
    opts = options_from_args(HeadsLab, args)
    result = heads_lab(opts, args.out)
    print(format_report(result))
    print(f"\n{result['seconds']:.0f} s")
    drawn = ["heads.json", "heads.png"]
    drawn += ["pruning.png"] * (result["pruning"] is not None)
    drawn += ["induction.png"] * ("induction_check" in result)
    print(f"wrote {args.out}/{', '.join(drawn)}, attention.html")
    return 0


PATCH_HELP = (
    "activation patching between a clean and a corrupted prompt (residual stream, attention and "
    "MLP outputs by layer and position, each head), direct logit attribution per head and layer, "
    "the logit lens; patching.json, patching.png, attribution.png"
)


def add_patch_flags(p: argparse.ArgumentParser) -> None:
    add_ckpt_flag(p, "a causal LM with a tokenizer")
    p.add_argument("--clean", required=True, help="the prompt whose answer is restored")
    p.add_argument("--corrupt", required=True, help="a prompt of the same length in tokens")
    p.add_argument("--answer", required=True, help="the clean answer, one token (e.g. ' Paris')")
    p.add_argument(
        "--wrong",
        default=None,
        help="the corrupted answer, one token: the metric is logit(answer) - logit(wrong); "
        "without it, the answer's log-probability",
    )
    p.add_argument("--out", default="lab/patch", metavar="DIR", help="where the results go")


def patch_main(args: argparse.Namespace) -> int:
    """`attnlab lab patch`: patch and attribute one pair of prompts; print the summary."""
    data = patch_lab(args.ckpt, args.clean, args.corrupt, args.answer, args.wrong, args.out)
    print(f"metric {data['metric']}: clean {data['clean']:.3f}, corrupt {data['corrupt']:.3f}")
    heads = data["dla"]["heads"]
    best = max(((v, i, h) for i, row in enumerate(heads) for h, v in enumerate(row)))
    print(f"largest direct logit attribution: head L{best[1]}H{best[2]} ({best[0]:+.3f})")
    for f in data["files"]:
        print(f"wrote {f}")
    return 0


MOE_HELP = (
    "train a dense decoder and two Mixture-of-Experts ones, at its active and at its total "
    "parameters, on the same tokens: held-out loss curves, tokens/s, tokens per expert"
)


def add_moe_flags(p: argparse.ArgumentParser) -> None:
    add_dataclass_flags(p, MoELab)


def moe_main(args: argparse.Namespace) -> int:
    """`attnlab lab moe`: train the three models; print the table."""
    result = run_moe_lab(options_from_args(MoELab, args))
    print(Path(result["files"][1]).read_text(), end="")
    print(f"\n{result['wall_s']:.0f} s")
    for f in result["files"]:
        print(f"wrote {f}")
    return 0


SAE_HELP = (
    "train a sparse autoencoder (TopK or ReLU+L1, as SAELens) on one hook point over stdlib "
    "text; save it in SAELens' format; L0, explained variance, CE loss recovered, dead "
    "features and a page of each feature's top tokens on held-out text"
)


def add_sae_flags(p: argparse.ArgumentParser) -> None:
    add_dataclass_flags(p, SAELab)


def sae_main(args: argparse.Namespace) -> int:
    """`attnlab lab sae`: train, save, measure; print the metrics."""
    result = run_sae_lab(options_from_args(SAELab, args))
    print(format_metrics(result))
    for f in result["files"]:
        print(f"wrote {f}")
    return 0


# name: (help, add its flags, run it). One line per experiment.
EXPERIMENTS = {
    "extrapolate": (EXTRAPOLATE_HELP, add_extrapolate_flags, extrapolate_main),
    "heads": (HEADS_HELP, add_heads_flags, heads_main),
    "patch": (PATCH_HELP, add_patch_flags, patch_main),
    "moe": (MOE_HELP, add_moe_flags, moe_main),
    "sae": (SAE_HELP, add_sae_flags, sae_main),
}


def add_parser(p: argparse.ArgumentParser) -> None:
    p.description = f"Experiments that test the seeds' claims: {' | '.join(EXPERIMENTS)}."
    metavar = "{" + ",".join(EXPERIMENTS) + "}"
    sub = p.add_subparsers(dest="experiment", required=True, metavar=metavar)
    for name, (summary, add_flags, _) in EXPERIMENTS.items():
        add_flags(sub.add_parser(name, help=summary, description=summary))


def run(args: argparse.Namespace) -> int:
    return EXPERIMENTS[args.experiment][2](args)
