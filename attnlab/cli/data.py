"""`attnlab data get NAME`: download a named dataset once into the user's cache (SHA-256 checked).

    attnlab data get shakespeare                  # from its canonical URL; a no-op when cached
    attnlab data get shakespeare --from input.txt # no network: register a copy you already have
    attnlab data list                             # the datasets, where they go, which are cached

Recipes then name the dataset (`data.source: shakespeare`); see attnlab/training/datasets.py.
"""

import argparse

from attnlab.training import datasets


def add_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", required=True, metavar="{get,list}")
    get = sub.add_parser("get", help="download a dataset (once) into the cache")
    get.add_argument("name", choices=sorted(datasets.DATASETS), help="the dataset")
    get.add_argument(
        "--from",
        dest="source",
        default=None,
        metavar="PATH",
        help="copy this local file into the cache instead of downloading (its hash is checked)",
    )
    sub.add_parser("list", help="the known datasets and whether they are cached")


def run(args: argparse.Namespace) -> int:
    if args.what == "list":
        for name, ds in datasets.DATASETS.items():
            state = "cached" if datasets.is_cached(name) else "not cached"
            print(f"{name:12s} {ds.about}\n{'':12s} {datasets.dataset_path(name)} ({state})")
        return 0
    path = datasets.dataset_path(args.name)
    if datasets.is_cached(args.name):
        print(f"{args.name}: already in {path}")
        return 0
    if args.source is not None:
        datasets.register(args.name, args.source)
        print(f"{args.name}: {args.source} checked (SHA-256) and copied to {path}")
        return 0
    print(f"{args.name}: downloading {datasets.get_dataset(args.name).url}")
    datasets.fetch(args.name)
    print(f"{args.name}: checked (SHA-256) and saved to {path}")
    return 0
