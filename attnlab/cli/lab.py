"""`attnlab lab <experiment>`: experiments that test the seeds' claims (attnlab/lab/).

A small dispatcher: each experiment has one `<name>_parser(p)` that adds its flags and one
`<name>_main(args)` that runs it.

    attnlab lab heads --ckpt runs/default [--fast] [--out DIR] [--data.source PATH]
"""

import argparse


def heads_parser(p: argparse.ArgumentParser) -> None:
    from attnlab.lab.heads import HeadsLab

    p.add_argument("--ckpt", required=True, help="a causal LM checkpoint or a run's out_dir")
    p.add_argument("--out", default="lab/heads", metavar="DIR", help="where results go")
    p.add_argument("--fast", action="store_true", help="a few small batches (for tests)")
    p.add_argument(
        "--data.source",
        dest="source",
        default=None,
        metavar="SRC",
        help="text to measure on (default: the checkpoint's own source), read with the "
        "checkpoint's tokenizer",
    )
    p.add_argument("--seed", type=int, default=HeadsLab.seed, help="seed of data and orders")


def heads_main(args: argparse.Namespace) -> int:
    """Head importance, pruning curves, pattern scores and the logit lens of one checkpoint."""
    from attnlab.lab.heads import HeadsLab, format_report, heads_lab

    opts = HeadsLab(ckpt=args.ckpt, source=args.source, fast=args.fast, seed=args.seed)
    result = heads_lab(opts, args.out)
    print(format_report(result))
    print(f"\nwrote {args.out}/heads.json, heads.png, pruning.png, attention.html")
    print(f"took {result['seconds']} s")
    return 0


EXPERIMENTS = {
    "heads": (
        heads_parser,
        heads_main,
        "what heads do: importance and pruning (Michel et al. 2019), previous-token and "
        "induction heads (Olsson et al. 2022), the logit lens",
    ),
}


def add_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(
        dest="experiment", required=True, metavar="{" + ",".join(EXPERIMENTS) + "}"
    )
    for name, (add_flags, _, summary) in EXPERIMENTS.items():
        add_flags(sub.add_parser(name, help=summary, description=summary))


def run(args: argparse.Namespace) -> int:
    return EXPERIMENTS[args.experiment][1](args)
