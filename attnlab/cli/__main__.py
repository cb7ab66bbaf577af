"""`attnlab <command>`: thin wrappers over library functions."""

import argparse
import importlib
import sys

# Each subcommand is a module of attnlab.cli with add_parser(parser) and run(args); imported only
# when chosen, so one command's dependencies never slow down (or break) another.
COMMANDS = {
    "train": "Train a model (default: a small Llama on the Python standard library), then sample.",
    "eval": "Evaluate a checkpoint: loss/perplexity, masked-token accuracy or exact match.",
    "generate": "Generate text from a checkpoint: sampling, beam search, stop strings, streaming.",
    "embodied": "Answer a generated VQA/VLA scene with a checkpoint; draw where it looked.",
    "inspect": "Count a model's parameters, FLOPs per token and KV-cache bytes (no memory used).",
    "viz": "Draw attention maps (PNG and an HTML viewer), positions, masks and loss curves.",
    "analyze": "Measured analyses: numerical rank of attention matrices (attnlab analyze rank).",
    "quantize": "Quantize a checkpoint's Linear weights to int8 or int4 (weight-only).",
    "convert": "Convert a checkpoint between the HF (safetensors) and attnlab formats.",
    "check": "Compare two models layer by layer and name the likely cause of a divergence.",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, summary in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary)
        if name == chosen:
            module = importlib.import_module(f"attnlab.cli.{name}")
            module.add_parser(p)
    args = parser.parse_args(argv)
    module = importlib.import_module(f"attnlab.cli.{args.command}")
    try:
        return module.run(args) or 0
    except ValueError as e:
        print(f"attnlab {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
