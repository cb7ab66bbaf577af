"""Item 4 of `attnlab inspect`: KV cache of MHA/GQA/MQA variants at batch x context and the FLOPs
split (models/inspect.py), checked against formulas written out here; the bar chart draws them
(viz/costs.py); the CLI prints and plots them."""

import pytest

from attnlab.cli.__main__ import main
from attnlab.models.build import build_model
from attnlab.models.inspect import (
    flops_per_token,
    flops_split,
    format_costs,
    kv_cache_table,
    kv_variants,
)
from attnlab.models.presets import get_preset
from attnlab.viz.costs import GIB, plot_costs


@pytest.mark.parametrize(
    ("name", "heads"),
    [
        ("llama3-8b", {"MHA": 32, "GQA": 8, "MQA": 1}),  # its own GQA
        ("gpt2", {"MHA": 12, "GQA": 3, "MQA": 1}),  # divisor of 12 nearest 12 / 4
        ("llama-tiny", {"MHA": 4, "GQA": 2, "MQA": 1}),
    ],
)
def test_variants_change_only_n_kv_heads(name, heads):
    cfg = get_preset(name)
    variants = kv_variants(cfg)
    assert {k: v.n_kv_heads for k, v in variants.items()} == heads
    for v in variants.values():
        assert (v.d_model, v.n_layers, v.attention.n_heads, v.head_dim) == (
            cfg.d_model,
            cfg.n_layers,
            cfg.attention.n_heads,
            cfg.head_dim,
        )


def test_prime_head_count_has_no_gqa():
    from dataclasses import replace

    base = get_preset("gpt2-tiny")
    cfg = replace(base, d_model=70, attention=replace(base.attention, n_heads=7))
    assert list(kv_variants(cfg)) == ["MHA", "MQA"]


def test_kv_cache_bytes_by_hand():
    cfg = get_preset("llama2-7b")  # L 32, H 32, D 128
    batch, context = 4, 4096
    rows = {r.name: r for r in kv_cache_table(cfg, batch, context)}
    for name, K in (("MHA", 32), ("GQA", 8), ("MQA", 1)):
        # K and V, every layer, every kv head, head_dim numbers per token.
        per_token = 2 * 32 * K * 128
        assert rows[name].cache_bytes == {
            "fp32": 4 * per_token * batch * context,
            "bf16": 2 * per_token * batch * context,
        }
    assert rows["MHA"].cache_bytes["bf16"] == 8 * GIB  # the well-known 2 GiB per 4k sequence
    assert rows["MHA"].is_config and not rows["GQA"].is_config
    assert rows["MHA"].total_params == 6_738_415_616
    # GQA shrinks k_proj and v_proj: 2 * L * C * (H - K) * D fewer weights.
    assert rows["MHA"].total_params - rows["GQA"].total_params == 2 * 32 * 4096 * 24 * 128
    with pytest.raises(ValueError, match="batch"):
        kv_cache_table(cfg, 0, 10)


def test_flops_split_by_hand():
    cfg = get_preset("llama3-8b")
    L, C, H, K, D, F, V, T = 32, 4096, 32, 8, 128, 14336, 128256, 2048
    split = flops_split(cfg, T)
    assert split == {
        "attention projections": L * 2 * (2 * C * H * D + 2 * C * K * D),  # q, o and k, v
        "attention scores": L * 4 * H * D * T,  # Q K^T and P V
        "ffn": L * 2 * 3 * C * F,  # gate, up, down
        "head and other": 2 * C * V,  # the untied LM head
    }
    with __import__("torch").device("meta"):
        model = build_model(cfg)
    assert sum(split.values()) == flops_per_token(model, cfg, T)


@pytest.mark.parametrize("name", ["gpt2-tiny", "t5-tiny", "bert-tiny", "transformer-tiny"])
def test_split_sums_to_the_total(name):
    cfg = get_preset(name)
    with __import__("torch").device("meta"):
        model = build_model(cfg)
    split = flops_split(cfg, 64)
    assert sum(split.values()) == flops_per_token(model, cfg, 64)
    assert all(v > 0 for v in split.values())


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_format_and_plot(tmp_path):
    llama, bert = get_preset("llama-tiny"), get_preset("bert-tiny")
    text = format_costs(llama, 2, 32)
    assert "KV cache @ batch 2 x context 32" in text and "<- this config" in text
    assert "none" in format_costs(bert, 2, 32)
    models = [
        ("llama-tiny", kv_cache_table(llama, 2, 32), flops_split(llama, 32), 32),
        ("bert-tiny", [], flops_split(bert, 32), 32),
    ]
    fig = plot_costs(models, batch=2, out=tmp_path / "costs.png")
    kv_ax, flops_ax = fig.axes[0], fig.axes[1]
    heights = [bar.get_height() for bar in kv_ax.patches]
    assert heights == pytest.approx([r.cache_bytes["bf16"] / GIB for r in models[0][1]])
    widths = [bar.get_width() for bar in flops_ax.patches]
    assert widths == pytest.approx([v / 1e9 for v in models[0][2].values()])
    assert not fig.axes[2].axison  # the encoder has no cache to draw
    assert (tmp_path / "costs.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_inspect_cli_prints_tables_and_plots(capsys, tmp_path):
    out = tmp_path / "inspect.png"
    assert (
        main(
            [
                "inspect",
                "llama-tiny",
                "gpt2-tiny",
                "--batch",
                "8",
                "--context",
                "64",
                "--plot",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert text.count("KV cache @ batch 8 x context 64") == 2
    assert "attention projections" in text and "ffn" in text
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert main(["inspect", "llama-tiny", "--batch", "0"]) == 2
