"""viz/masks.py: every mask cell against a definition written out here, and the picture draws it."""

import numpy as np
import pytest

from attnlab.viz.figures import image_array
from attnlab.viz.masks import mask_grids, plot_masks


def reference(T: int, n_padding: int, window: int, prefix: int, order: list[int]):
    """The masks from their definitions, cell by cell (True = query i may attend to key j)."""
    real = T - n_padding
    rank = {pos: r for r, pos in enumerate(order)}  # when each position is predicted
    cell = {
        "padding": lambda i, j: j < real,
        "causal": lambda i, j: j <= i,
        "causal + padding": lambda i, j: j <= i and j < real,
        "sliding window": lambda i, j: i - window < j <= i,
        "prefix-LM": lambda i, j: j <= i or j < prefix,
        "permutation": lambda i, j: rank[j] < rank[i],
    }
    return {k: np.array([[f(i, j) for j in range(T)] for i in range(T)]) for k, f in cell.items()}


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.parametrize(("T", "n_padding", "window", "prefix"), [(8, 2, 3, 3), (5, 0, 1, 5)])
def test_mask_cells_match_their_definitions(T, n_padding, window, prefix, tmp_path):
    order = list(reversed(range(T)))
    grids = mask_grids(T, n_padding, window, prefix, tuple(order))
    expected = reference(T, n_padding, window, prefix, order)
    assert len(grids) == len(expected)
    for (name, grid), (kind, ref) in zip(grids.items(), expected.items()):
        assert name.startswith(kind)
        assert grid.dtype == bool and grid.shape == (T, T)
        np.testing.assert_array_equal(grid, ref, err_msg=name)
    fig = plot_masks(grids, out=tmp_path / "masks.png")
    for i, grid in enumerate(grids.values()):
        np.testing.assert_array_equal(image_array(fig, i), grid)
    assert [ax.get_title() for ax in fig.axes] == list(grids)
    assert (tmp_path / "masks.png").read_bytes()[:4] == b"\x89PNG"


def test_default_permutation_is_seeded_and_valid():
    first, second = mask_grids(), mask_grids()
    for a, b in zip(first.values(), second.values()):
        np.testing.assert_array_equal(a, b)
    perm = list(first.values())[-1]
    # Exactly one position is predicted first (sees nothing) and one last (sees all others).
    assert sorted(perm.sum(1).tolist()) == list(range(8))


def test_bad_padding_is_an_error():
    with pytest.raises(ValueError, match="n_padding"):
        mask_grids(4, n_padding=4)
