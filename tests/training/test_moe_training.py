"""Training a Mixture-of-Experts model: the load-balancing loss enters the loss with its weight
and is logged, tokens per expert are logged, DeepSeek-V3's router bias moves after each step."""

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attnlab.components.moe import router_aux_loss
from attnlab.models.build import build_model
from attnlab.training.loop import train
from attnlab.training.tasks import build_task


def run_one_step(run, seed: int = 0):
    torch.manual_seed(seed)
    model, task = build_model(run.model), build_task(run)
    start = copy.deepcopy(model)
    records = []
    train(model, task, run, callbacks=(lambda state, record: records.append(record),))
    return start, model, task, records


def test_aux_loss_and_expert_load_are_logged(make_run):
    run = make_run("moe-tiny", steps=1, sample_tokens=0)
    start, _, task, records = run_one_step(run)
    record = json.loads((Path(run.train.out_dir) / "metrics.jsonl").read_text().splitlines()[0])
    tokens = run.train.batch_size * run.train.context * run.model.moe.n_experts_per_token
    assert [sum(layer) for layer in record["expert_load"]] == [tokens] * run.model.n_layers
    batch = task.train_batch(torch.Generator().manual_seed(run.train.seed), 0, 1)
    start.train()(batch["x"])  # the step's one forward, from the same weights and batch
    assert abs(record["aux_loss"] - router_aux_loss(start).item()) < 1e-6


@pytest.mark.slow  # two runs
def test_aux_weight_changes_the_gradient_not_the_task_loss(make_run):
    runs = [
        make_run("moe-tiny", out=f"w{w}", steps=1, sample_tokens=0, moe_aux_weight=w)
        for w in (0.0, 10.0)
    ]
    (_, _, _, plain), (_, _, _, weighted) = (run_one_step(r) for r in runs)
    assert plain[0]["train_loss"] == weighted[0]["train_loss"]
    assert plain[0]["grad_norm"] != weighted[0]["grad_norm"]


def test_loss_free_bias_moves_against_the_load(make_run):
    run = make_run("moe-tiny", steps=1, sample_tokens=0)
    moe = replace(run.model.moe, score="sigmoid", bias_update_rate=0.01)
    run = replace(run, model=replace(run.model, moe=moe))
    _, model, _, records = run_one_step(run)
    for block, load in zip(model.blocks, records[0]["expert_load"]):
        load = torch.tensor(load, dtype=torch.float32)
        torch.testing.assert_close(block.ffn.router_bias, 0.01 * torch.sign(load.mean() - load))
