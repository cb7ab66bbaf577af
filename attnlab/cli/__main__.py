"""`attnlab <command>`: thin wrappers over library functions."""

import argparse
import sys

from attnlab.cli import inspect, train

COMMANDS = {"train": train, "inspect": inspect}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_parser(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command].run(args) or 0
    except ValueError as e:
        print(f"attnlab {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
