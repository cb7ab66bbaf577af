"""Quantize a checkpoint's Linear weights (int8 or int4) into a new checkpoint directory."""

import argparse

from attnlab.inference.quantized import quantize_checkpoint
from attnlab.quantize.handler import DEFAULT_GROUP_SIZE, SCHEMES

MB = 1e6


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ckpt",
        required=True,
        help="float checkpoint directory, or a run's out_dir or checkpoints/ (its latest)",
    )
    p.add_argument("--scheme", required=True, choices=SCHEMES, help="int8 or int4 (weight-only)")
    p.add_argument(
        "--group-size",
        type=int,
        default=DEFAULT_GROUP_SIZE,
        help=f"int4 inputs per scale (32, 64, 128 or 256; default {DEFAULT_GROUP_SIZE})",
    )
    p.add_argument("--out", required=True, help="directory for the quantized checkpoint")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out (its checkpoint files are replaced, nothing else)",
    )
    p.add_argument(
        "--float-heads",
        dest="heads",
        action="store_false",
        help="keep the LM head in float (and tied to the embedding, where it was)",
    )


def run(args: argparse.Namespace) -> int:
    report = quantize_checkpoint(
        args.ckpt,
        args.out,
        args.scheme,
        args.group_size,
        heads=args.heads,
        overwrite=args.overwrite,
    )
    e = report.error
    kept = "embeddings stay float" if args.heads else "embeddings and the LM head stay float"
    print(f"quantized {report.n_quantized} Linear layers to {report.scheme} ({kept})")
    if report.kept_float:
        print(f"kept in float, in_features not divisible by the group size: {report.kept_float}")
    print(
        f"logit error vs fp32 on random inputs: max {e.max_abs:.4g}, mean {e.mean_abs:.4g} "
        f"(float logits' std {e.logit_std:.4g}); top-1 agreement {e.top1_agreement:.1%}"
    )
    ratio = report.float_bytes / max(report.quantized_bytes, 1)
    print(
        f"model.safetensors: {report.float_bytes / MB:.2f} MB -> "
        f"{report.quantized_bytes / MB:.2f} MB ({ratio:.2f}x smaller)"
    )
    print(f"wrote {args.out}")
    return 0
