"""Mask builders cell by cell against definitions written as plain loops over (query i, key j)."""

import re

import pytest
import torch

from attnlab.components.masks import (
    causal_mask,
    check_mask,
    format_mask,
    padding_mask,
    permutation_mask,
    prefix_lm_mask,
    sliding_window_mask,
)


def _grid(T, S, sees) -> torch.Tensor:
    """(T, S) bool with cell (i, j) = sees(i, j)."""
    return torch.tensor([[bool(sees(i, j)) for j in range(S)] for i in range(T)])


@pytest.mark.parametrize(("T", "S"), [(1, 1), (4, 4), (3, 7), (1, 5)])
def test_causal_mask(T, S):
    # The T queries are the last T of S positions: query i sits at absolute position i + S - T.
    m = causal_mask(T, S)
    assert m.dtype == torch.bool and m.shape == (T, S)
    assert torch.equal(m, _grid(T, S, lambda i, j: j <= i + (S - T)))


def test_causal_mask_defaults_to_square():
    assert torch.equal(causal_mask(5), _grid(5, 5, lambda i, j: j <= i))


@pytest.mark.parametrize(
    ("T", "S", "window"), [(6, 6, 1), (6, 6, 2), (6, 6, 3), (3, 8, 3), (5, 5, 10)]
)
def test_sliding_window_mask(T, S, window):
    def sees(i, j):
        pos = i + (S - T)  # absolute query position
        return pos - window < j <= pos  # itself and the window - 1 keys before it

    m = sliding_window_mask(T, window, S)
    assert m.dtype == torch.bool and m.shape == (T, S)
    assert torch.equal(m, _grid(T, S, sees))


def test_sliding_window_wider_than_sequence_is_causal():
    assert torch.equal(sliding_window_mask(5, window=5), _grid(5, 5, lambda i, j: j <= i))


@pytest.mark.parametrize("as_int", [False, True])
def test_padding_mask(as_int):
    valid = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    am = torch.tensor(valid) if as_int else torch.tensor(valid, dtype=torch.bool)
    m = padding_mask(am)
    assert m.dtype == torch.bool and m.shape == (3, 1, 1, 4)
    for b in range(3):
        for j in range(4):
            assert m[b, 0, 0, j].item() == bool(valid[b][j])
    expanded = padding_mask(am, T=5)
    assert expanded.shape == (3, 1, 5, 4)
    for b in range(3):
        assert torch.equal(expanded[b, 0], _grid(5, 4, lambda i, j, b=b: valid[b][j]))


@pytest.mark.parametrize("prefix", [0, 1, 3, 6])
def test_prefix_lm_mask_int(prefix):
    m = prefix_lm_mask(6, prefix)
    assert m.dtype == torch.bool and m.shape == (6, 6)
    # Every query sees the whole prefix; after it, attention is causal.
    assert torch.equal(m, _grid(6, 6, lambda i, j: j < prefix or j <= i))


def test_prefix_lm_mask_per_row():
    prefixes = [0, 2, 5]
    m = prefix_lm_mask(5, torch.tensor(prefixes))
    assert m.dtype == torch.bool and m.shape == (3, 1, 5, 5)
    for b, p in enumerate(prefixes):
        assert torch.equal(m[b, 0], _grid(5, 5, lambda i, j, p=p: j < p or j <= i))


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1], [1, 4, 0, 3, 2]])
def test_permutation_mask(order):
    # order[r] is the position predicted r-th; it may see the positions predicted before it.
    T = len(order)
    when = {pos: r for r, pos in enumerate(order)}
    m = permutation_mask(torch.tensor(order))
    assert m.dtype == torch.bool and m.shape == (T, T)
    assert torch.equal(m, _grid(T, T, lambda i, j: when[j] < when[i]))


def test_identity_permutation_is_strictly_causal():
    assert torch.equal(permutation_mask(torch.arange(5)), _grid(5, 5, lambda i, j: j < i))


def test_format_mask_draws_a_causal_grid():
    assert format_mask(causal_mask(4)) == "# . . .\n# # . .\n# # # .\n# # # #"
    assert format_mask(causal_mask(2), on="1", off="0") == "1 0\n1 1"


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [0, -2])
def test_bad_window_raises(window):
    with pytest.raises(ValueError, match=f"window={window}"):
        sliding_window_mask(4, window)


@pytest.mark.parametrize("order", [[0, 0, 2], [1, 2, 3], [0, 2]])
def test_non_permutation_order_raises(order):
    with pytest.raises(ValueError) as err:
        permutation_mask(torch.tensor(order))
    assert str(order) in str(err.value) and f"range({len(order)})" in str(err.value)


def test_three_dimensional_attention_mask_raises():
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        padding_mask(torch.ones(2, 3, 4, dtype=torch.bool))


def test_format_mask_needs_two_dimensions():
    with pytest.raises(ValueError, match=r"\(1, 1, 4, 4\)"):
        format_mask(torch.ones(1, 1, 4, 4, dtype=torch.bool))


@pytest.mark.parametrize("shape", [(5, 7), (1, 7), (4, 5, 7), (2, 1, 5, 7), (1, 1, 1, 7)])
def test_check_mask_accepts_broadcastable_shapes(shape):
    check_mask(torch.ones(shape, dtype=torch.bool), B=2, H=4, T=5, S=7)  # scores (2, 4, 5, 7)
    torch.ones(shape, dtype=torch.bool).expand(2, 4, 5, 7)  # and torch agrees they broadcast


@pytest.mark.parametrize("shape", [(6, 7), (5, 6), (7,), (3, 5, 7), (3, 1, 5, 7), (2, 1, 1, 5, 7)])
def test_check_mask_rejects_other_shapes(shape):
    with pytest.raises(ValueError, match=re.escape(str(shape))):
        check_mask(torch.ones(shape, dtype=torch.bool), B=2, H=4, T=5, S=7)


def test_check_mask_rejects_non_bool():
    with pytest.raises(ValueError, match="torch.float32"):
        check_mask(torch.ones(5, 7), B=2, H=4, T=5, S=7)
