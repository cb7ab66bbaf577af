"""Encoding a large file as a stream: the same ids as encoding it whole, in bounded memory."""

import random
import tracemalloc

import numpy as np
import pytest

from attnlab.tokenizer import CHAT_TOKENS, train_bpe_tokenizer, train_char_tokenizer

WORDS = ["def", "return", "self", "x", "café", "日本", "🤖", "(", "):", "==", "#", "1234", "'s"]


def generated_text(n_chars: int, seed: int = 0) -> str:
    """Python-like lines: indentation, blank lines, trailing spaces, tabs, CRLF, non-ASCII."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < n_chars:
        indent = rng.choice(["", "    ", "        ", "\t", " "])
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 9)))
        end = rng.choice(["\n", "\n", "\n", "\r\n", "  \n", "\n\n", "\n\n\n"])
        line = indent + words + end
        if rng.random() < 0.01:
            line += "<|end|>"  # a special token now and then
        lines.append(line)
        size += len(line)
    return "".join(lines)


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "big.txt"
    with open(path, "w", encoding="utf-8", newline="") as fh:
        fh.write(generated_text(3_000_000))  # ~3 MB of characters (more in bytes)
    return path


@pytest.fixture(scope="module")
def bpe():
    return train_bpe_tokenizer([generated_text(200_000, seed=1)], 400, CHAT_TOKENS)


def whole(path) -> str:
    with open(path, encoding="utf-8", newline="") as fh:
        return fh.read()


def test_cutting_just_after_a_newline_would_change_the_ids(bpe):
    # Why chunks end *before* a line break: "\n" + the next line's indent is one BPE piece.
    text = "x = 1\n    return x\n"
    naive = bpe.encode(text[:6]) + bpe.encode(text[6:])
    assert naive != bpe.encode(text)


@pytest.mark.slow
def test_stream_encode_equals_whole_file_encode(tmp_path, big_file, bpe):
    want = bpe.encode(whole(big_file))
    chunks = list(bpe.iter_encode_file(big_file, chunk_chars=50_000))
    assert len(chunks) > 20  # it really streamed
    assert [i for c in chunks for i in c] == want
    n = bpe.encode_file(big_file, tmp_path / "ids.bin", chunk_chars=50_000)
    assert n == len(want)
    assert np.fromfile(tmp_path / "ids.bin", dtype=np.uint16).tolist() == want


@pytest.mark.parametrize("chunk_chars", [1, 7, 4096])
def test_any_chunk_size_gives_the_same_ids(tmp_path, bpe, chunk_chars):
    text = generated_text(20_000, seed=2) + "no newline at the end   "
    (tmp_path / "t.txt").write_bytes(text.encode())
    got = [i for c in bpe.iter_encode_file(tmp_path / "t.txt", chunk_chars) for i in c]
    assert got == bpe.encode(text)
    char = train_char_tokenizer([text], special_tokens=CHAT_TOKENS)
    got = [i for c in char.iter_encode_file(tmp_path / "t.txt", chunk_chars) for i in c]
    assert got == char.encode(text)


@pytest.mark.slow
def test_stream_memory_stays_bounded(tmp_path, big_file, bpe):
    # tracemalloc sees Python's allocations (the text read, the id lists), not the Rust side's.
    size = big_file.stat().st_size
    tracemalloc.start()
    try:
        bpe.encode_file(big_file, tmp_path / "ids.bin", chunk_chars=4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < size / 10, (peak, size)
    # The measure is not blind: one chunk's ids as a Python list are counted.
    tracemalloc.start()
    try:
        ids = bpe.encode(whole(big_file)[: size // 10])
        _, tenth = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert tenth > peak and len(ids) > 0


def test_chunk_chars_must_be_positive(big_file, bpe):
    with pytest.raises(ValueError, match="chunk_chars must be >= 1, got 0"):
        next(bpe.iter_encode_file(big_file, 0))
