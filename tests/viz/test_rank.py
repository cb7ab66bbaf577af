"""viz/rank.py: the rank plot draws exactly the measured rows."""

import numpy as np
import pytest
import torch

from attnlab.analysis.rank import model_rank_table, random_rank_table, random_spectra
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.viz.rank import plot_rank


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_plot_draws_the_rows(tmp_path):
    ns = [8, 16]
    rows = random_rank_table(ns, [2, 4], [1, 2], seed=0)
    torch.manual_seed(0)
    model = build_model(get_preset("gpt2-tiny"))
    ids = torch.randint(256, (1, 16))
    for n in ns:
        rows += model_rank_table(model, ids[:, :n], "init")
    spectra = random_spectra(ns, 2)
    fig = plot_rank(rows, spectra, 2, out=tmp_path / "rank.png")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [
        "random weights, d_k = 2",
        "random weights, d_k = 4",
        "spectrum of P, one random head (d_k = 2)",
        "init weights",
    ]
    lines = {line.get_label(): line for line in fig.axes[1].get_lines()}
    mine = [r for r in rows if r.source == "random" and r.d_k == 4]
    np.testing.assert_array_equal(
        lines["rank Q K^T"].get_ydata(), [r.logits_rank for r in mine if r.n_heads == 1]
    )
    np.testing.assert_array_equal(
        lines["rank [P_1..P_2] (2 heads)"].get_ydata(),
        [r.joint_rank for r in mine if r.n_heads == 2],
    )
    spectrum = fig.axes[2].get_lines()[0]
    np.testing.assert_array_equal(spectrum.get_ydata(), spectra[8])
    layer0 = {line.get_label(): line for line in fig.axes[3].get_lines()}
    np.testing.assert_array_equal(
        layer0["decoder_self layer 0: min rank P_h"].get_ydata(),
        [r.head_rank[0] for r in rows if r.source == "init decoder_self layer 0"],
    )
    assert (tmp_path / "rank.png").read_bytes()[:4] == b"\x89PNG"
