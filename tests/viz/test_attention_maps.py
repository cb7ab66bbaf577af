"""viz/attention_maps.py: the grid is the captured maps, and the figures draw exactly them."""

import numpy as np
import pytest
import torch

from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.viz.attention_maps import (
    attention_grid,
    display_token,
    model_kind,
    plot_attention_grid,
    plot_attention_head,
    run_attention,
)
from attnlab.viz.figures import image_array


@pytest.fixture(scope="module")
def seq2seq():
    torch.manual_seed(0)
    model = build_model(get_preset("transformer-tiny")).eval()
    src, tgt = torch.tensor([list(b"hello world")]), torch.tensor([list(b"dlrow")])
    return model, src, tgt, run_attention(model, src, tgt)


def test_grid_stacks_the_captured_maps(seq2seq):
    model, src, tgt, maps = seq2seq
    assert model_kind(model) == "encoder_decoder"
    grid = attention_grid(maps, "cross")
    assert grid.shape == (2, 4, 5, 11)  # layers, heads, target tokens, source tokens
    for layer in range(2):
        np.testing.assert_array_equal(grid[layer], maps["cross"][layer][0].numpy())
    np.testing.assert_array_equal(attention_grid(maps, "cross", layers=[1])[0], grid[1])
    with pytest.raises(ValueError, match="not captured"):
        attention_grid(maps, "cross", layers=[5])


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_grid_figure_draws_every_layer_and_head(seq2seq, tmp_path):
    _, _, _, maps = seq2seq
    grid = attention_grid(maps, "encoder_self")
    tokens = list("hello world")
    fig = plot_attention_grid(grid, tokens, tokens, out=tmp_path / "grid.png")
    for layer in range(2):
        for head in range(4):
            np.testing.assert_array_equal(image_array(fig, layer * 4 + head), grid[layer, head])
    first = fig.axes[0]
    assert first.get_title() == "layer 0 head 0"
    assert [t.get_text() for t in first.get_yticklabels()] == [display_token(t) for t in tokens]
    bottom_left = fig.axes[4]
    assert [t.get_text() for t in bottom_left.get_xticklabels()][5] == "\u2423"  # the space
    assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="tokens"):
        plot_attention_grid(grid, tokens[:3], tokens)


def test_single_head_writes_its_values_for_short_inputs(seq2seq):
    _, _, _, maps = seq2seq
    w = attention_grid(maps, "decoder_self")[1, 2]  # (5, 5), causal
    tokens = list("dlrow")
    fig = plot_attention_head(w, tokens, tokens)
    np.testing.assert_array_equal(image_array(fig), w)
    texts = {
        (round(t.get_position()[1]), round(t.get_position()[0])): t.get_text()
        for t in fig.axes[0].texts
    }
    assert len(texts) == 25
    for (i, j), text in texts.items():
        assert text == f"{w[i, j]:.2f}"
    assert texts[(0, 4)] == "0.00"  # the future is masked
    long = np.full((20, 20), 1 / 20, dtype=np.float32)
    assert not plot_attention_head(long, ["a"] * 20, ["b"] * 20).axes[0].texts


def test_decoder_and_encoder_models_run():
    torch.manual_seed(0)
    ids = torch.randint(100, (1, 6))
    for preset, kind in (("gpt2-tiny", "decoder_self"), ("bert-tiny", "encoder_self")):
        model = build_model(get_preset(preset)).eval()
        maps = run_attention(model, ids, heads=[1])
        assert maps.kinds == [kind]
        assert attention_grid(maps, kind).shape == (2, 1, 6, 6)


def test_display_token():
    assert display_token(" ") == "\u2423"
    assert display_token("\n") == "\u21b5"
    assert display_token("a\tb") == "a\u21e5b"
    assert display_token("") == "\u2205"
    assert display_token("word") == "word"
