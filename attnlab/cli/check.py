"""Compare two models layer by layer and name the likely cause of the first divergence.

    attnlab check --model ./ours --reference ./hf-tiny-llama --input "The cat sat"
    attnlab check --model ./hf-dir --reference ./hf-dir --input "1 2 3 4" --input "5 6"

Each of A and B is an attnlab checkpoint directory or an HF one (the reference HF directory
runs in transformers). Exit status 0 when every point is within tolerance, 1 otherwise.
"""

import argparse
import inspect

from attnlab.interop.reference import check_dirs

DEFAULTS = {k: p.default for k, p in inspect.signature(check_dirs).parameters.items()}


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="the model under test: an attnlab or HF checkpoint directory",
    )
    p.add_argument(
        "--reference",
        required=True,
        metavar="DIR",
        help="the reference: an attnlab or HF (run in transformers) directory",
    )
    p.add_argument(
        "--input",
        required=True,
        action="append",
        metavar="TEXT_OR_IDS",
        help="text (needs a tokenizer.json) or token ids '12 7 99'; repeat for a "
        "right-padded batch",
    )
    p.add_argument(
        "--atol",
        type=float,
        default=DEFAULTS["atol"],
        help="max abs difference still counted as equal (default %(default)s)",
    )
    p.add_argument(
        "--layout",
        choices=["half", "interleaved"],
        default=DEFAULTS["layout"],
        help="RoPE layout to load an HF --model in (default %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    report = check_dirs(args.model, args.reference, args.input, args.atol, args.layout)
    print(report)
    return 0 if report.ok else 1
