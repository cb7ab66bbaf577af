"""Draw pictures: `attnlab viz attention|positions|masks|loss --out DIR`.

Each subcommand is a thin wrapper over a function in attnlab/viz/report.py; its flags are derived
from that function's options dataclass, so every default lives in one place.
"""

import argparse
import dataclasses
import types
import typing
from pathlib import Path

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


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--field-name` flag per field of `cls`; defaults stay in the dataclass (None here)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f.metadata.get("help", "") + (
            "" if default is None else f" (default: {default})"
        )
        if kind is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(
                flag,
                dest=f.name,
                nargs="+",
                type=typing.get_args(kind)[0],
                default=None,
                metavar="V",
                help=help_text,
            )
        else:
            parser.add_argument(
                flag, dest=f.name, type=kind, default=None, metavar="V", help=help_text
            )


def options_from_args(cls: type, args: argparse.Namespace):
    """The dataclass with every given flag applied (tuples from lists)."""
    given = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is not None:
            given[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**given)


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
