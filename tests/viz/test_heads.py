"""viz/heads.py: the heatmaps show exactly the scores, the pruning plot exactly the curves."""

import numpy as np

from attnlab.viz.figures import image_array
from attnlab.viz.heads import plot_head_scores, plot_pruning


def test_each_heatmap_is_its_score(tmp_path):
    rng = np.random.default_rng(0)
    scores = {"importance": rng.random((3, 4)), "previous_token": rng.random((3, 4))}
    fig = plot_head_scores(scores, out=tmp_path / "heads.png", title="t")
    for i, s in enumerate(scores.values()):
        np.testing.assert_array_equal(image_array(fig, i), s)  # rows layers, columns heads
    assert [ax.get_title() for ax in fig.axes[:2]] == ["importance", "previous token"]
    assert (tmp_path / "heads.png").stat().st_size > 1000
    assert all(im.get_clim() == (0.0, 1.0) for ax in fig.axes[:2] for im in ax.images)


def test_the_pruning_plot_draws_every_curve():
    pruning = {
        "fractions": [0.0, 0.5, 1.0],
        "by_importance": [1.0, 1.2, 2.0],
        "by_raw_importance": [1.0, 1.1, 2.0],
        "random": [[1.0, 1.5, 2.0], [1.0, 1.4, 2.0]],
        "tolerance": 0.01,
    }
    ax = plot_pruning(pruning).axes[0]
    ys = [list(line.get_ydata()) for line in ax.lines]
    assert ys[:4] == [[1.0, 1.5, 2.0], [1.0, 1.4, 2.0], [1.0, 1.2, 2.0], [1.0, 1.1, 2.0]]
    assert ys[4] == [1.01, 1.01]  # the +1% line
