"""Synthetic seq2seq tasks for quick end-to-end checks: copy, reverse, sort.

A source is a random string over the first `n_symbols` of SYMBOLS; the target is the same string
copied, reversed or sorted. Strings keep examples readable ("hdbg" -> "gbdh") and let the usual
character tokenizer serve. Everything is drawn from a seeded torch.Generator.
"""

import torch

from attnlab.tokenizer import Tokenizer, train_char_tokenizer

SYMBOLS = "abcdefghijklmnopqrstuvwxyz0123456789"
TASKS = {
    "copy": lambda s: s,
    "reverse": lambda s: s[::-1],
    "sort": lambda s: "".join(sorted(s)),
}


def task_name(source: str) -> str:
    """ "synthetic:reverse" -> "reverse", with a ValueError for unknown tasks."""
    name = source.removeprefix("synthetic:")
    if not source.startswith("synthetic:") or name not in TASKS:
        raise ValueError(
            f"unknown synthetic task {source!r}; choose from {['synthetic:' + t for t in TASKS]}"
        )
    return name


def synthetic_tokenizer(n_symbols: int) -> Tokenizer:
    if not 1 <= n_symbols <= len(SYMBOLS):
        raise ValueError(f"n_symbols must be in [1, {len(SYMBOLS)}], got {n_symbols}")
    return train_char_tokenizer([SYMBOLS[:n_symbols]])


def synthetic_pairs(
    task: str, n: int, n_symbols: int, min_len: int, max_len: int, gen: torch.Generator
) -> list[tuple[str, str]]:
    """`n` (source, target) string pairs for `task` ("copy" | "reverse" | "sort")."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen).tolist()
    pairs = []
    for length in lengths:
        idx = torch.randint(n_symbols, (length,), generator=gen).tolist()
        src = "".join(SYMBOLS[i] for i in idx)
        pairs.append((src, TASKS[task](src)))
    return pairs
