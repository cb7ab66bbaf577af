"""Prefix-LM (UniLM) and permutation-LM (XLNet, content stream) tasks: batches as the papers
define them, and a few steps through `train()` (issue 20 item 4)."""

import math

import pytest
import torch

from attnlab.models.build import build_model
from attnlab.training.checks import check_run
from attnlab.training.loop import train
from attnlab.training.objectives import IGNORE_INDEX
from attnlab.training.tasks import PermutationLMTask, PrefixLMTask, build_task


def _task(make_run, kind: str, **train_kw):
    run = make_run("llama-tiny", data={"task": kind}, **train_kw)
    return run, build_task(run)


def test_prefix_lm_batch_bidirectional_prefix_causal_rest_loss_after_prefix(make_run):
    run, task = _task(make_run, "prefix_lm")
    assert isinstance(task, PrefixLMTask)
    batch = task.train_batch(torch.Generator().manual_seed(0))
    x, mask, labels = batch["x"], batch["attn_mask"], batch["labels"]
    B, T = x.shape
    assert mask.shape == (B, T, T) and mask.dtype == torch.bool
    for b in range(B):
        P = int(mask[b, 0].sum())  # the first query sees exactly the prefix
        assert 1 <= P < T
        for i in range(T):
            for j in range(T):  # UniLM: key j visible iff j in the prefix or j <= i
                assert bool(mask[b, i, j]) == (j < P or j <= i)
        # Labels only from the output that predicts x[P] on; they are the next tokens.
        assert (labels[b, : P - 1] == IGNORE_INDEX).all()
        assert torch.equal(labels[b, P - 1 : T - 1], x[b, P:])
        assert labels[b, T - 1] != IGNORE_INDEX
    assert task.n_targets(batch) == int((labels != IGNORE_INDEX).sum())


def test_permutation_lm_batch_follows_a_random_order(make_run):
    run, task = _task(make_run, "permutation_lm")
    assert isinstance(task, PermutationLMTask)
    batch = task.train_batch(torch.Generator().manual_seed(0))
    x, mask, labels = batch["x"], batch["attn_mask"], batch["labels"]
    B, T = x.shape
    orders = []
    for b in range(B):
        seen = mask[b].sum(-1)  # the r-th in the order sees r + 1 tokens (itself and earlier)
        assert sorted(seen.tolist()) == list(range(1, T + 1))
        order = torch.argsort(seen)  # order[r]: the position r-th in the order
        orders.append(order.tolist())
        rank = torch.argsort(order)
        for i in range(T):
            for j in range(T):
                assert bool(mask[b, i, j]) == (rank[j] <= rank[i])
        for r in range(T - 1):  # each output predicts the next token in the order
            assert labels[b, order[r]] == x[b, order[r + 1]]
        assert labels[b, order[T - 1]] == IGNORE_INDEX
    assert task.n_targets(batch) == B * (T - 1)
    assert orders[0] != list(range(T)) and orders[0] != orders[1]  # random, per sequence


def test_masked_objectives_need_a_decoder(make_run):
    run = make_run("bert-tiny", data={"task": "prefix_lm"})
    with pytest.raises(ValueError, match="needs model.arch='decoder'"):
        check_run(run, build_task(run))


@pytest.mark.parametrize("kind", ["prefix_lm", "permutation_lm"])
def test_a_few_steps_through_train_lower_a_finite_loss(make_run, kind):
    torch.manual_seed(0)
    run, task = _task(make_run, kind, steps=30, lr=3e-3, batch_size=8, eval_batches=2)
    model = build_model(run.model)
    state = train(model, task, run)
    losses = state.losses
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    metrics = task.evaluate(model.eval(), 2, "cpu")
    assert math.isfinite(metrics["val_loss"])
