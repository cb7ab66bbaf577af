"""Experiments that test the seeds' claims: `attnlab lab heads` (what heads do).

A small dispatcher: each experiment is one subcommand with one `<name>_main(args)` function and
its flags (attnlab/lab/).
"""

import argparse

from attnlab.lab.heads import HeadsLab, format_report, heads_lab

HEADS_HELP = (
    "what the heads of a causal LM checkpoint do: importance and pruning curves (Michel et al. "
    "2019), previous-token, induction (Olsson et al. 2022) and positional scores, the logit "
    "lens; JSON, heatmaps and the attention viewer"
)


def add_heads_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="a causal LM checkpoint or a run's out_dir")
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


def heads_main(args: argparse.Namespace) -> int:
    """`attnlab lab heads`: measure one checkpoint; print the summary."""
    opts = HeadsLab(ckpt=args.ckpt, source=args.source, fast=args.fast, seed=args.seed)
    result = heads_lab(opts, args.out)
    print(format_report(result))
    print(f"\n{result['seconds']:.0f} s")
    print(f"wrote {args.out}/heads.json, heads.png, pruning.png, attention.html")
    return 0


# name: (help, add its flags, run it). One line per experiment.
EXPERIMENTS = {
    "heads": (HEADS_HELP, add_heads_flags, heads_main),
}


def add_parser(p: argparse.ArgumentParser) -> None:
    metavar = "{" + ",".join(EXPERIMENTS) + "}"
    sub = p.add_subparsers(dest="experiment", required=True, metavar=metavar)
    for name, (summary, add_flags, _) in EXPERIMENTS.items():
        add_flags(sub.add_parser(name, help=summary, description=summary))


def run(args: argparse.Namespace) -> int:
    return EXPERIMENTS[args.experiment][2](args)
