"""Data: the memory-mapped token cache, LM windows, BERT masking rates, padding, synthetic tasks."""

import json
import math

import numpy as np
import pytest
import torch

import attnlab.training.data as data_module
from attnlab.tokenizer import SPECIAL_TOKENS, Tokenizer, train_bpe_tokenizer
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from attnlab.training.data import lm_batch, mask_tokens, pad_batch, prepare_text_data
from attnlab.training.synthetic import synthetic_pairs, synthetic_tokenizer, task_name
from attnlab.training.tasks import Seq2SeqTask


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def data_cfg(tmp_path, source, **kw) -> DataConfig:
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw)


# --- the token cache ----------------------------------------------------------------------
def test_prepare_tokenises_the_whole_text_and_splits_off_the_tail(tmp_path, tiny_text):
    data = prepare_text_data(data_cfg(tmp_path, tiny_text, val_fraction=0.1))
    text = tiny_text.read_text()
    stream = np.concatenate([data.train, data.val])
    assert len(stream) == len(text)  # character level: one token per character
    assert data.tokenizer.decode(stream.tolist()) == text
    assert len(data.val) == int(len(text) * 0.1)
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.uint16


def test_cache_is_built_once_and_rebuilt_when_the_source_changes(tmp_path, tiny_text, monkeypatch):
    cfg = data_cfg(tmp_path, tiny_text)
    first = prepare_text_data(cfg)
    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    mtime = manifest.stat().st_mtime_ns
    assert json.loads(manifest.read_text())["dtype"] == "uint16"

    def no_tokenising(*args):
        raise AssertionError("the cached token stream should have been reused")

    with monkeypatch.context() as m:
        m.setattr(data_module, "build_tokenizer", no_tokenising)
        second = prepare_text_data(cfg)
    assert manifest.stat().st_mtime_ns == mtime
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)

    tiny_text.write_text(tiny_text.read_text()[:5000] + "something new")
    calls = []
    real = data_module.build_tokenizer
    monkeypatch.setattr(data_module, "build_tokenizer", lambda *a: calls.append(1) or real(*a))
    third = prepare_text_data(cfg)
    assert calls == [1] and len(third.train) + len(third.val) == 5000 + len("something new")
    assert len(list((tmp_path / "cache").glob("*/manifest.json"))) == 2


def test_a_tokenizer_file_is_used_as_given(tmp_path, tiny_text):
    text = tiny_text.read_text()
    tok = train_bpe_tokenizer([text[:8000]], vocab_size=320)
    tok.save(tmp_path / "tokenizer.json")
    cfg = data_cfg(tmp_path, tiny_text, tokenizer=str(tmp_path / "tokenizer.json"))
    data = prepare_text_data(cfg)
    assert np.concatenate([data.train, data.val]).tolist() == tok.encode(text)
    assert data.tokenizer.vocab_size == 320


def test_large_vocabularies_are_stored_as_uint32(tmp_path, tiny_text, monkeypatch):
    real = data_module.build_tokenizer

    class BigVocab(Tokenizer):
        vocab_size = 70_000  # more ids than uint16 holds

    def big_vocab(cfg, texts):
        tok = real(cfg, texts)
        tok.__class__ = BigVocab
        return tok

    monkeypatch.setattr(data_module, "build_tokenizer", big_vocab)
    data_module._write_cache(data_cfg(tmp_path, tiny_text), [tiny_text], tmp_path / "big")
    manifest = json.loads((tmp_path / "big" / "manifest.json").read_text())
    assert manifest["dtype"] == "uint32" and manifest["vocab_size"] == 70_000


def test_directory_source_reads_files_in_sorted_order_up_to_max_chars(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("bbbb" * 50)
    (corpus / "a.txt").write_text("aaaa" * 50)
    (corpus / "sub" / "c.txt").write_text("cccc" * 50)
    (corpus / ".hidden").write_text("zzzz" * 50)
    data = prepare_text_data(data_cfg(tmp_path, corpus, max_chars=500))
    text = data.tokenizer.decode(np.concatenate([data.train, data.val]).tolist())
    assert text == "a" * 200 + "b" * 200 + "c" * 100


def test_empty_sources_are_value_errors(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        prepare_text_data(data_cfg(tmp_path, tmp_path / "empty.txt"))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="no files"):
        prepare_text_data(data_cfg(tmp_path, tmp_path / "nothing"))
    with pytest.raises(ValueError, match="neither"):
        prepare_text_data(data_cfg(tmp_path, tmp_path / "missing.txt"))
    (tmp_path / "short.txt").write_text("abcdefg")  # 7 tokens: 10% of them is not one token
    with pytest.raises(ValueError, match="only 7 tokens"):
        prepare_text_data(data_cfg(tmp_path, tmp_path / "short.txt"))


# --- LM windows ---------------------------------------------------------------------------
def test_lm_batch_windows_come_from_the_stream_and_y_is_x_shifted():
    tokens = np.arange(5000, dtype=np.uint16)
    x, y = lm_batch(tokens, context=32, batch_size=16, gen=gen())
    assert x.shape == y.shape == (16, 32) and x.dtype == y.dtype == torch.int64
    starts = x[:, 0]
    assert torch.equal(x, starts[:, None] + torch.arange(32))  # contiguous windows of the stream
    assert torch.equal(y, x + 1)  # the next token of each position
    assert int(starts.min()) >= 0 and int(starts.max()) + 32 < 5000
    x2, _ = lm_batch(tokens, context=32, batch_size=16, gen=gen())
    assert torch.equal(x, x2)  # seeded


def test_lm_batch_ranks_take_slices_of_one_global_batch():
    tokens = np.random.default_rng(0).integers(0, 60000, 3000).astype(np.uint16)
    whole, _ = lm_batch(tokens, 8, batch_size=12, gen=gen(5))
    parts = [lm_batch(tokens, 8, batch_size=4, gen=gen(5), rank=r, world=3)[0] for r in range(3)]
    assert torch.equal(torch.cat(parts), whole)


def test_lm_batch_split_shorter_than_context_names_the_sizes():
    x, y = lm_batch(np.arange(9, dtype=np.uint16), context=8, batch_size=2, gen=gen())
    assert torch.equal(x[0], torch.arange(8)) and torch.equal(y[0], torch.arange(1, 9))
    with pytest.raises(ValueError, match=r"8 tokens .*context 8.*at least 9"):
        lm_batch(np.arange(8, dtype=np.uint16), context=8, batch_size=2, gen=gen())


# --- BERT masking -------------------------------------------------------------------------
def within(count: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    """`count` successes in `n` Bernoulli(p) trials is within `sigmas` standard deviations."""
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_mask_tokens_rates_match_bert():
    V, specials, mask_id = 1000, list(range(len(SPECIAL_TOKENS))), 4
    ids = torch.randint(V, (256, 512), generator=gen(1))  # about 7 in 1000 tokens are special
    inputs, labels = mask_tokens(ids, mask_id, V, specials, gen(2), probability=0.15)

    special = ids < len(SPECIAL_TOKENS)
    chosen = labels != -100
    assert not (chosen & special).any()  # specials are never selected
    assert torch.equal(inputs[special], ids[special])
    assert torch.equal(labels[chosen], ids[chosen])  # labels: the original token, -100 elsewhere
    assert torch.equal(inputs[~chosen], ids[~chosen])  # nothing else is touched

    n_regular, n_chosen = int((~special).sum()), int(chosen.sum())
    assert within(n_chosen, n_regular, 0.15)
    masked = chosen & (inputs == mask_id)
    same = chosen & (inputs == ids)
    randomised = chosen & (inputs != mask_id) & (inputs != ids)
    R = V - len(specials)  # a random replacement is one of the R regular tokens...
    assert within(int(masked.sum()), n_chosen, 0.8)
    assert within(int(randomised.sum()), n_chosen, 0.1 * (1 - 1 / R))
    assert within(int(same.sum()), n_chosen, 0.1 + 0.1 / R)  # ...sometimes the same one
    assert not torch.isin(inputs[randomised], torch.tensor(specials)).any()


def test_mask_tokens_probability_and_seed():
    ids = torch.randint(7, 100, (64, 64), generator=gen(1))
    _, labels = mask_tokens(ids, 4, 100, list(range(7)), gen(3), probability=0.4)
    assert within(int((labels != -100).sum()), ids.numel(), 0.4)
    again = mask_tokens(ids, 4, 100, list(range(7)), gen(3), probability=0.4)
    assert torch.equal(again[1], labels)


# --- padding and the synthetic seq2seq tasks ----------------------------------------------
def test_pad_batch():
    ids, mask = pad_batch([[5, 6, 7], [8], [9, 10]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert mask.tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    with pytest.raises(ValueError, match="empty"):
        pad_batch([], pad_id=0)


@pytest.mark.parametrize(
    "task, reference",
    [("copy", lambda s: s), ("reverse", lambda s: s[::-1]), ("sort", lambda s: "".join(sorted(s)))],
)
def test_synthetic_targets_and_seeding(task, reference):
    pairs = synthetic_pairs(task, 200, n_symbols=5, min_len=3, max_len=9, gen=gen(7))
    assert pairs == synthetic_pairs(task, 200, n_symbols=5, min_len=3, max_len=9, gen=gen(7))
    assert pairs != synthetic_pairs(task, 200, n_symbols=5, min_len=3, max_len=9, gen=gen(8))
    for src, tgt in pairs:
        assert tgt == reference(src)
        assert 3 <= len(src) <= 9 and set(src) <= set("abcde")
    assert {len(s) for s, _ in pairs} == set(range(3, 10))


def test_seq2seq_batches_teacher_force_with_bos_and_eos():
    cfg = DataConfig(task="seq2seq", source="synthetic:reverse", synthetic_n_val=4)
    task = Seq2SeqTask(RunConfig(model=None, train=TrainConfig(batch_size=8), data=cfg))
    batch = task.train_batch(gen(0))
    tok = task.tokenizer
    for src, src_mask, tgt, tgt_mask, labels in zip(
        *(batch[k] for k in ("src", "src_mask", "tgt", "tgt_mask", "labels"))
    ):
        s = src[src_mask].tolist()
        t = tgt[tgt_mask].tolist()
        assert s[-1] == task.eos and t[0] == task.bos
        assert tok.decode(t[1:]) == tok.decode(s[:-1])[::-1]
        n = len(t)
        assert labels[: n - 1].tolist() == t[1:] and labels[n - 1] == task.eos
        assert (labels[n:] == task.pad).all()


def test_synthetic_bad_names_and_sizes():
    assert task_name("synthetic:sort") == "sort"
    with pytest.raises(ValueError, match="synthetic:reverse"):
        task_name("synthetic:rotate")
    with pytest.raises(ValueError, match="n_symbols"):
        synthetic_tokenizer(99)
    with pytest.raises(ValueError, match="min_len <= max_len, got 5, 3"):
        synthetic_pairs("copy", 3, 5, 5, 3, gen())


# --- files that are not text ------------------------------------------------------------------


def test_a_file_with_nul_bytes_is_not_text(tmp_path):
    path = tmp_path / "program.bin"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    with pytest.raises(ValueError, match=rf"{path} holds NUL bytes: it is not a text file"):
        prepare_text_data(data_cfg(tmp_path, path))


def test_random_bytes_are_not_text(tmp_path):
    path = tmp_path / "random.dat"
    raw = np.random.default_rng(0).integers(1, 256, 20_000, dtype=np.uint8).tobytes()
    path.write_bytes(raw)  # no NUL, but about half the bytes are not UTF-8
    with pytest.raises(ValueError, match=rf"{path}: \d+% of its bytes are not UTF-8"):
        prepare_text_data(data_cfg(tmp_path, path))


def test_a_few_bad_bytes_are_replaced_and_tolerated(tmp_path, tiny_text):
    raw = tiny_text.read_bytes()
    path = tmp_path / "nearly.txt"
    path.write_bytes(raw[:1000] + b"caf\xe9" + raw[1000:])  # one Latin-1 byte in 20k: under 1%
    data = prepare_text_data(data_cfg(tmp_path, path))
    assert "\ufffd" in data.tokenizer.decode(np.concatenate([data.train, data.val]).tolist())
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café crème brûlée à la française ".encode("latin-1") * 200)  # ~10% bad
    with pytest.raises(ValueError, match="not UTF-8"):
        prepare_text_data(data_cfg(tmp_path, bad))
