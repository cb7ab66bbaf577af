"""Convert a checkpoint directory between the HF and attnlab formats.

    attnlab convert --from hf ./tiny-llama --to attnlab ./ours
    attnlab convert --from attnlab ./ours --to hf ./exported      (transformers loads it)

HF families: GPT-2, Llama/Mistral/Qwen2, BLOOM, BERT and T5 (attnlab/interop/hf/). Only
safetensors are read and written; the tokenizer.json travels along when there is one.
"""

import argparse
import inspect

from attnlab.interop.convert import FORMATS, convert
from attnlab.interop.hf import ARCHITECTURES

FAMILIES = ", ".join(sorted(ARCHITECTURES))  # the HF architectures config.json may name
DEFAULTS = {k: p.default for k, p in inspect.signature(convert).parameters.items()}


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--from",
        dest="src",
        nargs=2,
        required=True,
        metavar=("FORMAT", "DIR"),
        help=f"the input: a format ({' or '.join(FORMATS)}) and a directory (HF: {FAMILIES})",
    )
    p.add_argument(
        "--to",
        dest="dst",
        nargs=2,
        required=True,
        metavar=("FORMAT", "DIR"),
        help=f"the output: a format ({' or '.join(FORMATS)}) and a directory",
    )
    p.add_argument(
        "--layout",
        choices=["half", "interleaved"],
        default=DEFAULTS["layout"],
        help="RoPE layout of the attnlab model made from an HF Llama-family "
        "checkpoint (default %(default)s, HF's own)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty output directory (its checkpoint files are replaced, "
        "nothing else)",
    )


def run(args: argparse.Namespace) -> int:
    (src_format, src), (dst_format, dst) = args.src, args.dst
    out = convert(src_format, src, dst_format, dst, layout=args.layout, overwrite=args.overwrite)
    print(f"wrote {dst_format} checkpoint {out}")
    return 0
