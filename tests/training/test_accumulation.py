"""Gradient accumulation is token-weighted: grad_accum micro-batches give the gradient of ONE
batch's mean loss over all its target tokens, computed here with F.cross_entropy (the
reference), for masked LM (a varying number of masked tokens) and seq2seq (padded targets)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import attnlab.training.loop as loop
from attnlab.models.build import build_model
from attnlab.training.optim import build_optimizer
from attnlab.training.tasks import build_task


def loop_gradients(monkeypatch, run, model, task) -> tuple[dict, list]:
    """The gradients the loop measures (before clipping) at its one step, by parameter name,
    and the logged records. The optimizer is plain AdamW, so gradients stay per parameter."""
    seen, records = {}, []
    names = {id(p): n for n, p in model.named_parameters()}
    real_clip = loop.clip_grad_norm_

    def recording_clip(params, max_norm):
        params = list(params)
        seen.update({names[id(p)]: p.grad.detach().clone() for p in params if p.grad is not None})
        return real_clip(params, max_norm)

    monkeypatch.setattr(loop, "clip_grad_norm_", recording_clip)
    monkeypatch.setattr(
        loop, "build_optimizer", lambda *args, flat=False: build_optimizer(*args, flat=False)
    )
    loop.train(model, task, run, callbacks=(lambda state, record: records.append(record),))
    return seen, records


def reference(model, task, micro_batches, logits_of, labels_key, ignore, eps=0.0):
    """d/dtheta of the mean F.cross_entropy over every target token of all micro-batches
    (the sum of per-batch sums over the total count: one batch's mean), and that mean."""
    total, count = 0.0, 0
    for batch in micro_batches:
        logits, labels = logits_of(model, batch), batch[labels_key]
        total = total + F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=ignore,
            label_smoothing=eps,
            reduction="sum",
        )
        count += int((labels != ignore).sum())
    loss = total / count
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: g for n, g in zip(params, grads) if g is not None}, loss.item()


def assert_same_gradients(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name in want:
        rel = (got[name] - want[name]).norm() / want[name].norm().clamp(min=1e-12)
        assert rel < 1e-5, (name, rel.item())


@pytest.mark.parametrize("k", [2, 3])
def test_mlm_accumulation_is_the_global_batch_mean(monkeypatch, make_run, k):
    run = make_run(
        "bert-tiny", steps=1, batch_size=2, grad_accum=k, model={"dropout": 0.0}, sample_tokens=0
    )
    torch.manual_seed(0)
    model, task = build_model(run.model), build_task(run)
    initial = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(run.train.seed)  # the loop's data generator
    micro = [task.train_batch(gen) for _ in range(k)]
    counts = [int((b["labels"] != -100).sum()) for b in micro]
    assert len(set(counts)) > 1, counts  # unequal: equal weights per micro-batch would be wrong

    got, records = loop_gradients(monkeypatch, run, model, task)
    # One batch: the micro-batches concatenated (same length T), through F.cross_entropy.
    whole = {key: torch.cat([b[key] for b in micro]) for key in micro[0]}
    want, loss = reference(initial, task, [whole], lambda m, b: m(b["x"]), "labels", -100)
    assert_same_gradients(got, want)
    assert records[0]["train_loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_seq2seq_accumulation_is_the_global_batch_mean(monkeypatch, make_run, eps):
    run = make_run(
        "transformer-tiny",
        steps=1,
        batch_size=2,
        grad_accum=2,
        label_smoothing=eps,
        model={"dropout": 0.0},
        data={"synthetic_min_len": 1, "synthetic_max_len": 8},
        sample_tokens=0,
    )
    torch.manual_seed(0)
    model, task = build_model(run.model), build_task(run)
    initial = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(run.train.seed)
    micro = [task.train_batch(gen) for _ in range(2)]
    counts = [int((b["labels"] != task.pad).sum()) for b in micro]
    assert counts[0] != counts[1], counts

    got, records = loop_gradients(monkeypatch, run, model, task)

    def logits_of(m, b):
        return m(
            b["src"],
            b["tgt"],
            attention_mask=b["src_mask"],
            decoder_attention_mask=b["tgt_mask"],
        )

    want, loss = reference(initial, task, micro, logits_of, "labels", task.pad, eps)
    assert_same_gradients(got, want)
    assert records[0]["train_loss"] == pytest.approx(loss, rel=1e-5)
