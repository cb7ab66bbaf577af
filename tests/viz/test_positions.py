"""viz/positions.py: every picture's data against the paper's formula, and every plot_* draws
exactly that data (read back from the figure's images and lines)."""

import cmath
import math

import numpy as np
import pytest

from attnlab.viz import positions as p
from attnlab.viz.figures import image_array

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000


def test_sinusoid_table_is_the_papers_formula(tmp_path):
    N, C = 50, 20
    table = p.sinusoid_table(N, C)
    assert table.shape == (N, C)
    for pos in range(N):
        for i in range(C // 2):
            angle = pos / 10000 ** (2 * i / C)
            assert table[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-6)
    fig = p.plot_sinusoid_table(table, out=tmp_path / "table.png")
    np.testing.assert_array_equal(image_array(fig), table)
    assert_png(tmp_path / "table.png")


def test_sinusoid_curves_are_the_chosen_columns(tmp_path):
    dims = (4, 5, 6, 7)
    positions, curves = p.sinusoid_curves(100, 20, dims)
    assert curves.shape == (4, 100)
    for row, d in zip(curves, dims):
        fn = math.sin if d % 2 == 0 else math.cos
        expected = [fn(pos / 10000 ** ((d - d % 2) / 20)) for pos in range(100)]
        np.testing.assert_allclose(row, expected, atol=1e-6)
    fig = p.plot_sinusoid_curves(positions, curves, dims, out=tmp_path / "curves.png")
    lines = fig.axes[0].get_lines()
    assert len(lines) == 4
    for line, row in zip(lines, curves):
        np.testing.assert_array_equal(line.get_xdata(), positions)
        np.testing.assert_array_equal(line.get_ydata(), row)
    assert_png(tmp_path / "curves.png")
    with pytest.raises(ValueError, match="dims"):
        p.sinusoid_curves(10, 8, (8,))


def test_rope_score_is_sum_of_cosines_and_ignores_absolute_position(tmp_path):
    D, theta, offsets = 32, 10000.0, (0, 37, 500)
    distances, scores = p.rope_scores(D, 40, offsets, theta)
    # q = k = 1: each pair (x, x) rotated by (m - n) w_i contributes 2 cos((m - n) w_i).
    expected = [
        sum(2 * math.cos(r * theta ** (-2 * i / D)) for i in range(D // 2)) for r in distances
    ]
    for row in scores:
        np.testing.assert_allclose(row, expected, rtol=1e-4, atol=1e-3)
    fig = p.plot_rope_scores(distances, scores, offsets, out=tmp_path / "rope.png")
    lines = fig.axes[0].get_lines()
    assert len(lines) == len(offsets)
    for line, row in zip(lines, scores):
        np.testing.assert_array_equal(line.get_ydata(), row)
    assert_png(tmp_path / "rope.png")


def test_rope_random_pair_matches_complex_rotation():
    D, theta, offsets = 16, 10000.0, (0, 9)
    distances, scores = p.rope_scores(D, 12, offsets, theta, qk="random", seed=3)
    import torch

    q, k = torch.randn(2, D, generator=torch.Generator().manual_seed(3)).tolist()
    half = D // 2
    for r, got in zip(distances, scores.T):
        # "half" layout: pair (i, i + D/2) is the complex number x_i + j x_{i+D/2}; the score
        # is Re(z_q conj(z_k) e^{j r w_i}) summed over pairs.
        expected = sum(
            (
                complex(q[i], q[i + half])
                * complex(k[i], k[i + half]).conjugate()
                * cmath.exp(1j * r * theta ** (-2 * i / D))
            ).real
            for i in range(half)
        )
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="qk"):
        p.rope_scores(qk="zeros")


@pytest.mark.parametrize("n_heads", [4, 8, 16])
def test_alibi_slopes_are_the_papers_geometric_sequence(n_heads, tmp_path):
    T = 6
    slopes, biases = p.alibi_biases(n_heads, T)
    np.testing.assert_allclose(
        slopes, [2 ** (-8 * i / n_heads) for i in range(1, n_heads + 1)], rtol=1e-6
    )
    for h in range(n_heads):
        for i in range(T):
            for j in range(T):
                if j <= i:
                    assert biases[h, i, j] == pytest.approx(-slopes[h] * (i - j), abs=1e-6)
                else:
                    assert np.isnan(biases[h, i, j])  # the future, hidden by the causal mask
    fig = p.plot_alibi(slopes, biases, out=tmp_path / "alibi.png")
    for h in range(n_heads):
        np.testing.assert_array_equal(np.asarray(image_array(fig, h).filled(np.nan)), biases[h])
    assert_png(tmp_path / "alibi.png")


@pytest.mark.hf
def test_t5_buckets_match_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    buckets = p.t5_buckets(seq_len=40, num_buckets=32, max_distance=128, span=200)
    pos = torch.arange(40)
    relative = pos[None, :] - pos[:, None]  # (T, T): key minus query, as T5Attention
    for name, bidirectional in (("bidirectional", True), ("causal", False)):
        ref = t5.T5Attention._relative_position_bucket(
            relative, bidirectional=bidirectional, num_buckets=32, max_distance=128
        )
        np.testing.assert_array_equal(buckets[name], ref.numpy())
        curve = t5.T5Attention._relative_position_bucket(
            torch.arange(-200, 201),
            bidirectional=bidirectional,
            num_buckets=32,
            max_distance=128,
        )
        np.testing.assert_array_equal(buckets[f"{name}_curve"], curve.numpy())
    fig = p.plot_t5_buckets(buckets, out=tmp_path / "t5.png")
    np.testing.assert_array_equal(image_array(fig, 0), buckets["bidirectional"])
    np.testing.assert_array_equal(image_array(fig, 1), buckets["causal"])
    steps = [line for line in fig.axes[-1].get_lines()]
    np.testing.assert_array_equal(steps[0].get_ydata(), buckets["bidirectional_curve"])
    np.testing.assert_array_equal(steps[1].get_ydata(), buckets["causal_curve"])
    assert_png(tmp_path / "t5.png")
