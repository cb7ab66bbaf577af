"""Text -> token ids in a memory-mapped file, and the batches every objective trains on.

Preparing is done once: the token stream is written next to a manifest (what it was made from,
with which tokenizer) and the documents' (files') start offsets, under a cache directory keyed by a
hash of both, then memory-mapped on every later run. The last `val_fraction` of the stream is the
validation split.

Batches: `lm_batch` reads random windows across document boundaries; `packed_batch` reads rows of
whole documents (sequence packing) with per-token document ids and positions.

Shapes: B batch, T context.
"""

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from attnlab.tokenizer import Tokenizer, train_bpe_tokenizer, train_char_tokenizer
from attnlab.training import datasets
from attnlab.training.config import DataConfig

# The "stdlib" corpus: the standard library's own code, without tests and installed packages.
STDLIB_SKIP = (
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "turtledemo",
)


CACHE_VERSION = "2"  # 2: documents' offsets recorded (offsets.npy); older caches are rebuilt


@dataclass
class TokenData:
    """A tokenizer and its train/validation token streams (1-D uint16/uint32 arrays).

    train_docs, val_docs: (n_docs + 1,) int64 start offsets of each split's documents and the
    split's length (a document cut by the split is a document on both sides); None for a cache
    written without offsets.
    """

    tokenizer: Tokenizer
    train: np.ndarray
    val: np.ndarray
    train_docs: np.ndarray | None = None
    val_docs: np.ndarray | None = None


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's .py files (sorted), without tests, site-packages and the like
    (the "stdlib" corpus, and the files fine-tuning's built-in tasks are made from)."""
    root = stdlib_root()
    return [
        p
        for p in sorted(root.rglob("*.py"))
        if not any(part in STDLIB_SKIP for part in p.relative_to(root).parts)
    ]


def corpus_files(source: str) -> list[Path]:
    """The text files behind `source`: "stdlib", a named dataset ("shakespeare", downloaded once
    into the user's cache: training/datasets.py), a file, or a directory (sorted, recursive)."""
    if source == "stdlib":
        return stdlib_files()
    if source in datasets.DATASETS and not Path(source).exists():
        return [datasets.resolve(source)]
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        return [p for p in sorted(path.rglob("*")) if p.is_file() and not p.name.startswith(".")]
    raise ValueError(
        f"data.source {source!r} is neither 'stdlib', a dataset ({', '.join(datasets.DATASETS)}), "
        "a file nor a directory"
    )


# A text file has no NUL bytes, and its bytes decode as UTF-8. A few bad bytes (a damaged line, a
# pasted Latin-1 word) are replaced by U+FFFD and tolerated; above 1% of the bytes the file is
# binary or in another encoding, and the model would learn replacement characters: an error.
MAX_UNDECODABLE = 0.01


def read_texts(files: list[Path], max_chars: int) -> list[str]:
    """Read files in order until `max_chars` characters (a few undecodable bytes are replaced;
    a file with NUL bytes, or with more than MAX_UNDECODABLE of its bytes undecodable, is a
    ValueError naming it)."""
    texts, total = [], 0
    for f in files:
        text = decode_text(f, f.read_bytes())
        texts.append(text[: max_chars - total])
        total += len(texts[-1])
        if total >= max_chars:
            break
    return texts


def decode_text(path: Path, data: bytes) -> str:
    """`data` (the bytes of `path`) as text, or a ValueError if it is not a text file."""
    if b"\0" in data:
        raise ValueError(
            f"{path} holds NUL bytes: it is not a text file (give data.source a UTF-8 text file)"
        )
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - data.count("\ufffd".encode())  # replaced, not written so
    if data and bad / len(data) > MAX_UNDECODABLE:
        raise ValueError(
            f"{path}: {bad / len(data):.0%} of its bytes are not UTF-8 (at most "
            f"{MAX_UNDECODABLE:.0%} may be): it is not a UTF-8 text file; convert it (e.g. "
            "iconv -t utf-8) or give data.source another file"
        )
    return text


def _fingerprint(cfg: DataConfig, files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(f"{cfg.tokenizer}|{cfg.bpe_vocab_size}|{cfg.max_chars}|v{CACHE_VERSION}".encode())
    if cfg.special_tokens:  # (not hashed when unset: the caches of earlier runs stay valid)
        h.update(f"|special:{cfg.special_token_list}".encode())
    if Path(cfg.tokenizer).is_file():
        h.update(Path(cfg.tokenizer).read_bytes())
    return h.hexdigest()[:16]


def build_tokenizer(cfg: DataConfig, texts: list[str]) -> Tokenizer:
    if cfg.tokenizer == "char":
        return train_char_tokenizer(texts, special_tokens=cfg.special_token_list)
    if cfg.tokenizer == "bpe":
        return train_bpe_tokenizer(texts, cfg.bpe_vocab_size, special_tokens=cfg.special_token_list)
    return Tokenizer.from_file(cfg.tokenizer)


def prepare_text_data(cfg: DataConfig) -> TokenData:
    """Tokenise `cfg.source` once (cached by content hash) and memory-map the token stream."""
    files = corpus_files(cfg.source)
    if not files:
        raise ValueError(f"data source {cfg.source!r} has no files")
    cache = Path(cfg.cache_dir) / _fingerprint(cfg, files)
    manifest_path = cache / "manifest.json"
    if not manifest_path.is_file():
        _write_cache(cfg, files, cache)
    manifest = json.loads(manifest_path.read_text())
    tokens = np.memmap(cache / "tokens.bin", dtype=manifest["dtype"], mode="r")
    n_val = int(len(tokens) * cfg.val_fraction)
    if len(tokens) < 2 or n_val < 1:
        raise ValueError(
            f"data source {cfg.source!r} gives only {len(tokens)} tokens: too few to "
            f"split off a validation fraction of {cfg.val_fraction}"
        )
    split = len(tokens) - n_val
    train_docs = val_docs = None
    if (cache / "offsets.npy").is_file():
        starts = np.load(cache / "offsets.npy")[:-1]  # (n_docs,) start of each document
        train_docs = np.append(starts[starts < split], split)
        val_starts = np.append(0, starts[starts > split] - split)
        val_docs = np.append(val_starts, n_val)
    return TokenData(
        Tokenizer.from_file(cache / "tokenizer.json"),
        tokens[:split],
        tokens[split:],
        train_docs,
        val_docs,
    )


def _write_cache(cfg: DataConfig, files: list[Path], cache: Path) -> None:
    """Tokenise into `cache`; the manifest is written last, so a crash leaves no half cache."""
    texts = [t for t in read_texts(files, cfg.max_chars) if t]
    if not texts:
        raise ValueError(f"data source {cfg.source!r} is empty")
    tokenizer = build_tokenizer(cfg, texts)
    encoded = tokenizer.encode_batch(texts)
    ids = np.concatenate([np.asarray(i, dtype=np.int64) for i in encoded])
    offsets = np.cumsum([0] + [len(i) for i in encoded], dtype=np.int64)  # (n_docs + 1,)
    dtype = "uint16" if tokenizer.vocab_size <= 2**16 else "uint32"
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f"tokens.bin.tmp{os.getpid()}"
    ids.astype(dtype).tofile(tmp)
    os.replace(tmp, cache / "tokens.bin")
    tmp = cache / f"offsets.tmp{os.getpid()}.npy"
    np.save(tmp, offsets)
    os.replace(tmp, cache / "offsets.npy")
    tmp = cache / f"tokenizer.json.tmp{os.getpid()}"  # ranks of a job may prepare at once
    tokenizer.save(tmp)
    os.replace(tmp, cache / "tokenizer.json")
    manifest = {
        "source": cfg.source,
        "files": len(texts),
        "tokens": int(len(ids)),
        "dtype": dtype,
        "tokenizer": cfg.tokenizer,
        "vocab_size": tokenizer.vocab_size,
    }
    tmp = cache / f"manifest.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, cache / "manifest.json")


def lm_batch(
    tokens: np.ndarray,
    context: int,
    batch_size: int,
    gen: torch.Generator,
    rank: int = 0,
    world: int = 1,
) -> tuple[Tensor, Tensor]:
    """Random windows: x = tokens[i : i+T], y = tokens[i+1 : i+T+1].

    All ranks draw the same global batch of `batch_size * world` windows and keep their own slice,
    so the data seen does not depend on how many processes share it.

    Returns:
        x, y: (B, T) int64.
    """
    if len(tokens) < context + 1:
        raise ValueError(
            f"a split of {len(tokens)} tokens is too short for context {context} "
            f"(needs at least {context + 1})"
        )
    starts = torch.randint(len(tokens) - context, (batch_size * world,), generator=gen)
    starts = starts[rank * batch_size : (rank + 1) * batch_size].tolist()
    window = np.stack([tokens[s : s + context + 1] for s in starts]).astype(np.int64)  # (B, T+1)
    window = torch.from_numpy(window)
    return window[:, :-1], window[:, 1:]  # (B, T), (B, T)


def pack_rows(docs: np.ndarray, row: int) -> tuple[np.ndarray, np.ndarray]:
    """Lay a split's documents out in rows of `row` tokens, each row holding whole documents.

    A document longer than a row is cut into pieces of `row` tokens (and a shorter last piece);
    pieces are taken in order, and a piece that does not fit in what is left of a row starts the
    next row (the rest of the row is padding).

        row = 8, documents of 3, 4, 10 tokens:
        row 0: a a a b b b b .      row 1: c c c c c c c c      row 2: c c . . . . . .

    Args:
        docs: (n_docs + 1,) start offsets of the documents and the split's length.
        row: tokens per row (context + 1).

    Returns:
        pieces (n_pieces, 2) int64 (start, length) in the stream, and rows (n_rows + 1,) int64:
        row r holds pieces rows[r] : rows[r + 1].
    """
    pieces, rows, used = [], [0], 0
    for start, end in zip(docs[:-1].tolist(), docs[1:].tolist()):
        for s in range(start, end, row):
            n = min(row, end - s)
            if used + n > row:
                rows.append(len(pieces))
                used = 0
            pieces.append((s, n))
            used += n
    if pieces:
        rows.append(len(pieces))
    return np.asarray(pieces, dtype=np.int64).reshape(-1, 2), np.asarray(rows, dtype=np.int64)


def packed_batch(
    tokens: np.ndarray,
    layout: tuple[np.ndarray, np.ndarray],
    context: int,
    batch_size: int,
    gen: torch.Generator,
    rank: int = 0,
    world: int = 1,
    ignore_index: int = -100,
) -> dict:
    """Random packed rows (`pack_rows`): whole documents, a document mask and restarting positions.

    Row r of context + 1 tokens gives inputs x = row[:-1] and labels y = row[1:], except that a
    label is `ignore_index` where it belongs to another document than its input (the first token
    of the next document) or to padding. Padding tokens are id 0, document -1, position 0. As in
    `lm_batch`, all ranks draw the same global batch and keep their own slice.

    Returns:
        {"x": (B, T) int64, "labels": (B, T) int64, "doc": (B, T) int64 document of each input
        (its index within the row; -1 = padding), "pos": (B, T) int64 position in its document}.
    """
    pieces, rows = layout
    n_rows = len(rows) - 1
    if n_rows < 1:
        raise ValueError("a split with no tokens cannot be packed; give data.source more text")
    drawn = torch.randint(n_rows, (batch_size * world,), generator=gen)
    drawn = drawn[rank * batch_size : (rank + 1) * batch_size].tolist()
    L = context + 1
    ids = np.zeros((len(drawn), L), dtype=np.int64)
    doc = np.full((len(drawn), L), -1, dtype=np.int64)
    pos = np.zeros((len(drawn), L), dtype=np.int64)
    for b, r in enumerate(drawn):
        at = 0
        for d, (start, n) in enumerate(pieces[rows[r] : rows[r + 1]].tolist()):
            ids[b, at : at + n] = tokens[start : start + n]
            doc[b, at : at + n] = d
            pos[b, at : at + n] = np.arange(n)
            at += n
    ids, doc, pos = (torch.from_numpy(a) for a in (ids, doc, pos))  # (B, T+1)
    same = (doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] >= 0)  # (B, T) the label is in-document
    labels = ids[:, 1:].masked_fill(~same, ignore_index)
    return {"x": ids[:, :-1], "labels": labels, "doc": doc[:, :-1], "pos": pos[:, :-1]}


def mask_tokens(
    ids: Tensor,
    mask_id: int,
    vocab_size: int,
    special_ids: list[int],
    gen: torch.Generator,
    probability: float = 0.15,
) -> tuple[Tensor, Tensor]:
    """BERT masking (Devlin et al. 2019): choose `probability` of the non-special tokens; of
    those 80% become <mask>, 10% a random token, 10% stay. Labels are -100 elsewhere.

    Args:
        ids: (B, T) token ids.

    Returns:
        inputs (B, T), labels (B, T).
    """
    special = torch.isin(ids, torch.tensor(special_ids, dtype=ids.dtype))
    chosen = (torch.rand(ids.shape, generator=gen) < probability) & ~special
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=gen)
    inputs = ids.clone()
    inputs[chosen & (roll < 0.8)] = mask_id
    random_ids = _random_regular_tokens(ids.shape, vocab_size, special_ids, gen)
    replace = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[replace] = random_ids[replace]
    return inputs, labels


def _random_regular_tokens(shape, vocab_size: int, special_ids: list[int], gen) -> Tensor:
    regular = torch.tensor(sorted(set(range(vocab_size)) - set(special_ids)))
    return regular[torch.randint(len(regular), shape, generator=gen)]


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad sequences to the longest.

    Returns:
        ids (B, T) int64, mask (B, T) bool (True = real token).
    """
    if not seqs:
        raise ValueError("cannot pad an empty list of sequences")
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs])
    return ids, torch.arange(T)[None, :] < lengths[:, None]
