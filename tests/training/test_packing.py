"""Sequence packing (data.pack, issue 20 item 3): packed rows of whole documents under a document
mask give what the documents give run one at a time.

References: each document run alone through the same model (no mask, positions 0..n-1), and the
same documents as an ordinary padded batch (one document per row, a padding mask, the padding's
labels ignored) with `torch.nn.functional.cross_entropy`; the files' own token counts for the
recorded offsets.
"""

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnlab.components.masks import document_mask_mod
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.training.config import DataConfig
from attnlab.training.data import pack_rows, packed_batch, prepare_text_data
from attnlab.training.loop import train
from attnlab.training.objectives import IGNORE_INDEX
from attnlab.training.tasks import PackedLMTask, build_task
from tests.data import SHAKESPEARE

V, CONTEXT = 32, 12
LENGTHS = (3, 5, 2, 7, 4, 9, 1, 6)  # short documents; several share a row of CONTEXT + 1


def _model(backend: str, preset: str = "llama-tiny"):
    torch.manual_seed(0)
    cfg = get_preset(preset)
    cfg = replace(cfg, vocab_size=V, attention=replace(cfg.attention, backend=backend))
    return build_model(cfg)


def _documents():
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, V, (n,), generator=gen) for n in LENGTHS]
    tokens = torch.cat(docs).numpy()
    offsets = np.cumsum([0, *LENGTHS])
    return docs, tokens, offsets


def _all_rows(tokens, offsets) -> dict:
    """Every packed row once (drawn with replacement, then deduplicated by sorting)."""
    layout = pack_rows(offsets, CONTEXT + 1)
    n_rows = len(layout[1]) - 1
    batch = packed_batch(tokens, layout, CONTEXT, 64, torch.Generator().manual_seed(0))
    _, first = np.unique(batch["x"].numpy(), axis=0, return_index=True)
    assert len(first) == n_rows  # every row was drawn
    return {k: v[torch.as_tensor(sorted(first))] for k, v in batch.items()}


def _segments(batch):
    """(row, start, length) of every document in the packed rows."""
    out = []
    for b, doc in enumerate(batch["doc"].tolist()):
        for d in sorted(set(doc) - {-1}):
            at = doc.index(d)
            out.append((b, at, doc.count(d)))
    return out


def test_pack_rows_keeps_whole_documents_and_cuts_long_ones():
    pieces, rows = pack_rows(np.array([0, 3, 7, 17]), 8)
    assert pieces.tolist() == [[0, 3], [3, 4], [7, 8], [15, 2]]
    assert rows.tolist() == [0, 2, 3, 4]  # a a a b b b b . | c*8 | c c . . .


def test_packed_batch_labels_positions_and_documents():
    docs, tokens, offsets = _documents()
    batch = _all_rows(tokens, offsets)
    seen = []
    for b, at, n in _segments(batch):
        doc = batch["x"][b, at : at + n]
        match = [d for d in docs if len(d) >= n and torch.equal(d[:n], doc)]
        assert match, "a packed segment is not the start of a document"
        seen.append(n)
        assert batch["pos"][b, at : at + n].tolist() == list(range(n))
        # Labels: the document's next tokens; its last token predicts nothing (the next token
        # belongs to another document or to padding).
        assert torch.equal(batch["labels"][b, at : at + n - 1], match[0][1:n])
        if at + n - 1 < CONTEXT:
            assert batch["labels"][b, at + n - 1] == IGNORE_INDEX
    assert sorted(seen) == sorted(LENGTHS)  # every document exactly once, whole
    assert (batch["labels"][batch["doc"] < 0] == IGNORE_INDEX).all()  # no loss on padding


@pytest.mark.parametrize("backend", ["eager", "sdpa", pytest.param("flex", marks=pytest.mark.slow)])
def test_packed_logits_equal_each_document_alone(backend):
    # flex compiles its kernel: this one small shape, forward only (its backward is CUDA's).
    model = _model(backend).eval()
    _, tokens, offsets = _documents()
    batch = _all_rows(tokens, offsets)
    task = object.__new__(PackedLMTask)  # loss_sum reads nothing of the task's state
    with torch.no_grad():
        packed = model(batch["x"], attn_mask=document_mask_mod(batch["doc"]), pos=batch["pos"])
        unmasked = model(batch["x"])
        for b, at, n in _segments(batch):
            alone = model(batch["x"][b : b + 1, at : at + n])  # (1, n, V), positions 0..n-1
            torch.testing.assert_close(packed[b, at : at + n], alone[0], atol=1e-5, rtol=0)
        assert torch.isfinite(task.loss_sum(model, batch))
    # The mask and positions did something: without them, the later documents read the earlier.
    later = [(b, at, n) for b, at, n in _segments(batch) if at > 0]
    b, at, n = later[0]
    assert not torch.allclose(unmasked[b, at : at + n], packed[b, at : at + n], atol=1e-3)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex"])
def test_packed_loss_and_gradients_equal_the_padded_unpacked_batch(backend):
    docs, tokens, offsets = _documents()
    batch = _all_rows(tokens, offsets)
    packed_model, padded_model = _model(backend), _model(backend)
    task = object.__new__(PackedLMTask)
    packed = task.loss_sum(packed_model, batch)  # flex on CPU: flash.py's tiled backward
    packed.backward()
    # Reference: one document per row, right-padded, padding masked and its labels ignored.
    T = max(LENGTHS)
    ids = torch.zeros(len(docs), T, dtype=torch.long)
    labels = torch.full((len(docs), T), IGNORE_INDEX)
    real = torch.zeros(len(docs), T, dtype=torch.bool)
    for r, d in enumerate(docs):
        ids[r, : len(d)], real[r, : len(d)] = d, True
        labels[r, : len(d) - 1] = d[1:]
    logits = padded_model(ids, real)  # (N, T, V)
    ref = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="sum")
    ref.backward()
    assert task.n_targets(batch) == int((labels != IGNORE_INDEX).sum()) == sum(LENGTHS) - 8
    torch.testing.assert_close(packed, ref, atol=1e-5, rtol=1e-6)
    for (name, p), q in zip(packed_model.named_parameters(), padded_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.fixture
def text_dir(tmp_path) -> Path:
    """Eight files cut from the Shakespeare fixture, of different lengths."""
    text = SHAKESPEARE.read_text()[:24_000]
    root = tmp_path / "texts"
    root.mkdir()
    at = 0
    for k, n in enumerate((900, 4000, 300, 2500, 6000, 1200, 5000, 4100)):
        (root / f"part{k}.txt").write_text(text[at : at + n])
        at += n
    return root


def test_the_cache_records_each_files_token_count(tmp_path, text_dir):
    cfg = DataConfig(source=str(text_dir), cache_dir=str(tmp_path / "cache"))
    data = prepare_text_data(cfg)
    (cache,) = (tmp_path / "cache").iterdir()
    offsets = np.load(cache / "offsets.npy")
    files = sorted(text_dir.iterdir())
    counts = [len(data.tokenizer.encode(f.read_text())) for f in files]
    assert np.diff(offsets).tolist() == counts
    assert offsets[-1] == json.loads((cache / "manifest.json").read_text())["tokens"]
    # Each split's documents: a document cut by the split is a document on both sides.
    split, starts = len(data.train), offsets[:-1].tolist()
    assert data.train_docs.tolist() == [o for o in starts if o < split] + [split]
    val_starts = [o - split for o in starts if o > split]
    assert data.val_docs.tolist() == [0] + val_starts + [len(data.val)]


def test_pack_is_for_clm_only():
    with pytest.raises(ValueError, match="data.pack"):
        DataConfig(task="mlm", pack=True)


def test_a_short_packed_run_through_train_lowers_the_loss(make_run, text_dir):
    torch.manual_seed(0)
    run = make_run(data={"source": str(text_dir), "pack": True}, steps=30, lr=3e-3, batch_size=8)
    task = build_task(run)
    assert isinstance(task, PackedLMTask)
    model = build_model(run.model)
    state = train(model, task, run)
    losses = state.losses
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    assert math.isfinite(task.evaluate(model.eval(), 2, "cpu")["val_loss"])


def test_a_cache_without_offsets_still_trains_unpacked_and_says_so_for_pack(tmp_path, make_run):
    run = make_run()
    build_task(run)  # writes the cache
    (cache,) = Path(run.data.cache_dir).iterdir()
    (cache / "offsets.npy").unlink()  # as a cache written before offsets were recorded
    assert build_task(run).train_batch(torch.Generator().manual_seed(0))["x"].shape == (4, 16)
    with pytest.raises(ValueError, match="data.pack needs the documents' offsets"):
        build_task(replace(run, data=replace(run.data, pack=True)))


def test_ranks_take_their_slices_of_one_global_packed_batch():
    _, tokens, offsets = _documents()
    layout = pack_rows(offsets, CONTEXT + 1)
    whole = packed_batch(tokens, layout, CONTEXT, 6, torch.Generator().manual_seed(3))
    for rank in range(2):
        part = packed_batch(tokens, layout, CONTEXT, 3, torch.Generator().manual_seed(3), rank, 2)
        for k in whole:
            assert torch.equal(part[k], whole[k][rank * 3 : (rank + 1) * 3])
