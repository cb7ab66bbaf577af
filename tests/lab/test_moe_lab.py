"""`attnlab lab moe`: the three models' parameter budgets, and the fast mode end to end."""

import contextlib
import io
import json

import pytest
import torch

from attnlab.cli.__main__ import main
from attnlab.lab.moe import FAST, model_configs
from attnlab.models.build import build_model
from attnlab.models.inspect import active_parameters, count_parameters
from tests.data import SHAKESPEARE


def test_moe_models_match_the_dense_active_or_total_parameters():
    with torch.device("meta"):
        models = {n: build_model(c) for n, c in model_configs(FAST, 64).items()}
    routers = FAST.n_layers * FAST.n_experts * FAST.d_model  # each MoE block adds its router
    dense = count_parameters(models["dense"])
    assert active_parameters(models["moe-active"]) == dense + routers
    assert count_parameters(models["moe-total"]) == dense + routers
    assert active_parameters(models["moe-total"]) < dense < count_parameters(models["moe-active"])


@pytest.mark.slow  # trains three small models
def test_fast_mode_writes_the_table_the_results_and_the_picture(tmp_path):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        argv = ["lab", "moe", "--fast", "--steps", "2", "--out", str(tmp_path)]
        assert main(argv + ["--source", str(SHAKESPEARE)]) == 0
    assert "moe-active" in buf.getvalue() and (tmp_path / "moe.png").is_file()
    result = json.loads((tmp_path / "moe.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert rows["dense"]["expert_load"] is None
    tokens = FAST.batch_size * FAST.context * FAST.k
    for name in ("moe-active", "moe-total"):
        assert [sum(layer) for layer in rows[name]["expert_load"]] == [tokens] * FAST.n_layers
        assert rows[name]["val_loss"][-1][0] == 2  # measured at the last step
