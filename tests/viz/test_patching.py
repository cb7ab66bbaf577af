"""viz/patching.py: the heat maps draw the arrays they are given, on one scale centred on 0."""

import numpy as np

from attnlab.viz.figures import image_array
from attnlab.viz.patching import plot_attribution, plot_patching


def test_patching_maps_draw_each_array(tmp_path):
    rng = np.random.default_rng(0)
    maps = {"resid_pre": rng.normal(size=(3, 5)), "head": rng.normal(size=(3, 4)) * 2}
    fig = plot_patching(maps, list("abcde"), tmp_path / "p.png", "t")
    assert np.array_equal(image_array(fig, 0), maps["resid_pre"])
    assert np.array_equal(image_array(fig, 1), maps["head"])
    clim = fig.axes[0].images[0].get_clim()
    assert clim[0] == -clim[1] == -max(1.0, np.abs(maps["head"]).max())
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == list("abcde")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_attribution_draws_heads_layers_and_the_lens(tmp_path):
    heads, layers = np.arange(8.0).reshape(2, 4), np.ones((2, 2))
    fig = plot_attribution(heads, layers, {"clean": [0, 1, 2]}, tmp_path / "a.png")
    assert np.array_equal(image_array(fig, 0), heads)
    assert np.array_equal(image_array(fig, 1), layers)
    line = [ax for ax in fig.axes if ax.lines][0].lines[0]
    assert list(line.get_xdata()) == [-1, 0, 1] and list(line.get_ydata()) == [0, 1, 2]
