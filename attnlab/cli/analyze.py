"""Measured analyses: `attnlab analyze rank` (numerical rank of attention matrices).

A thin wrapper over attnlab/analysis/rank.py; flags come from its RankAnalysis dataclass.
"""

import argparse
from dataclasses import replace
from pathlib import Path

from attnlab.analysis.rank import RankAnalysis, random_spectra, rank_analysis
from attnlab.cli.options import add_dataclass_flags, options_from_args
from attnlab.viz.rank import plot_rank

ANALYSES = {
    "rank": (
        RankAnalysis,
        "numerical rank (SVD) of attention matrices, one head vs several, "
        "on random and on trained weights",
    ),
}


def add_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", required=True, metavar="{" + ",".join(ANALYSES) + "}")
    for name, (cls, summary) in ANALYSES.items():
        q = sub.add_parser(name, help=summary, description=summary)
        q.add_argument(
            "--out", default=None, metavar="DIR", help="directory for the pictures (DIR/rank.png)"
        )
        add_dataclass_flags(q, cls)


def run(args: argparse.Namespace) -> int:
    opts = options_from_args(RankAnalysis, args)
    if args.out is not None and opts.plot is None:  # --out DIR, as `attnlab viz` takes it
        Path(args.out).mkdir(parents=True, exist_ok=True)
        opts = replace(opts, plot=str(Path(args.out) / "rank.png"))
    rows, report = rank_analysis(opts)
    print(report)
    if opts.plot:
        d_k = min(opts.d_k)
        spectra = random_spectra(list(opts.n), d_k, opts.seed, opts.causal)
        plot_rank(rows, spectra, d_k, out=opts.plot)
        print(f"\nwrote {opts.plot}")
    return 0
