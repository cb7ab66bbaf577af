"""The loss-vs-position picture of `attnlab lab extrapolate`: its smoothing and its curves."""

import numpy as np
import torch

from attnlab.viz.extrapolation import extrapolation_figure, smooth


def test_smooth_averages_a_window_that_grows_with_the_position():
    ramp = np.arange(1.0, 65.0)  # a straight line is its own symmetric average
    torch.testing.assert_close(smooth(ramp)[:56], ramp[:56])  # before the window hits the end
    y = np.array([1.0, np.nan, 3.0] + [5.0] * 13)
    got = smooth(y)
    assert np.isnan(got[1]) and got[0] == 1.0 and got[-1] == 5.0
    assert got[8] == 5.0 and got[2] == 3.0  # position 9 averages 8..10; position 3 only itself


def test_one_curve_per_record_in_its_panel_and_learned_stops_at_L():
    L, n = 8, 64

    def record(name, scaling=None, factor=1, finetuned=False, stop=n):
        losses = [1.0 + i / n for i in range(stop)] + [None] * (n - stop)
        return {"name": name, "scaling": scaling, "factor": factor, "finetuned": finetuned,
                "per_position": losses}  # fmt: skip

    records = [record("rope"), record("learned", stop=L), record("rope PI x2", "linear", 2)]
    records += [record("rope YaRN x4 ft", "yarn", 4, True)]
    fig = extrapolation_figure(records, L)
    curves = [[ln for ln in ax.get_lines() if ln.get_label()[0] != "_"] for ax in fig.axes]
    assert [[c.get_label() for c in cs] for cs in curves] == [
        ["rope", "learned"],
        ["rope PI x2"],
        ["rope YaRN x4 ft"],
    ]
    learned = curves[0][1].get_ydata()
    assert np.isfinite(learned[:L]).all() and np.isnan(learned[L:]).all()
    for ax in fig.axes:  # the training length is marked
        assert any(list(ln.get_xdata()) == [L, L] for ln in ax.get_lines())
