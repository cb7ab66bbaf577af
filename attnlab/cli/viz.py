"""Draw pictures: `attnlab viz attention|positions|masks|loss --out DIR`.

Each subcommand is a thin wrapper over a function in attnlab/viz/report.py; its flags are derived
from that function's options dataclass (cli/options.py), so every default lives in one place.
"""

import argparse
from pathlib import Path

from attnlab.cli.options import add_dataclass_flags, options_from_args
from attnlab.viz.report import (
    AttentionViz,
    LossViz,
    MaskViz,
    PositionViz,
    attention_pictures,
    loss_pictures,
    mask_pictures,
    position_pictures,
)

PICTURES = {
    "attention": (
        AttentionViz,
        attention_pictures,
        "attention maps (PNG grids, one annotated head) and the HTML viewer",
    ),
    "positions": (
        PositionViz,
        position_pictures,
        "sinusoidal encoding, RoPE score vs distance, ALiBi biases, T5 buckets",
    ),
    "masks": (
        MaskViz,
        mask_pictures,
        "padding, causal, combined, sliding-window, prefix-LM and permutation masks",
    ),
    "loss": (LossViz, loss_pictures, "train/validation loss and learning rate of a run"),
}


def add_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", required=True, metavar="{" + ",".join(PICTURES) + "}")
    for name, (cls, _, summary) in PICTURES.items():
        q = sub.add_parser(name, help=summary, description=summary)
        q.add_argument("--out", required=True, metavar="DIR", help="directory for the pictures")
        add_dataclass_flags(q, cls)


def run(args: argparse.Namespace) -> int:
    cls, draw, _ = PICTURES[args.what]
    for path in draw(options_from_args(cls, args), Path(args.out)):
        print(path)
    return 0
