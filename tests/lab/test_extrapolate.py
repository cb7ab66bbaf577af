"""`attnlab lab extrapolate`: the fast mode end to end, its cache, the per-position loss against
F.cross_entropy, learned positions flagged past L, and RoPE scalings that really rescale."""

import contextlib
import io
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnlab.cli.__main__ import main
from attnlab.components.positions import RopeScaling, rope_angles, rope_inv_freq
from attnlab.lab.extrapolate import (
    FAST,
    SCALINGS,
    Experiment,
    Extrapolation,
    Variant,
    bucket_means,
    model_config,
    per_position_loss,
    run_extrapolation,
    scaled,
    variants,
)
from attnlab.models.build import build_model
from attnlab.training.config import DataConfig
from attnlab.viz.extrapolation import extrapolation_figure
from tests.data import SHAKESPEARE

L = FAST.context


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _data(out: Path) -> DataConfig:
    return DataConfig(
        source=str(SHAKESPEARE), max_chars=FAST.max_chars, cache_dir=str(out / "data")
    )


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    """The fast mode through the CLI, on the repository's Shakespeare fixture: (out, stdout)."""
    out = tmp_path_factory.mktemp("extrapolate")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        argv = [
            "lab",
            "extrapolate",
            "--fast",
            "--out",
            str(out),
            "--data.source",
            str(SHAKESPEARE),
        ]
        assert main(argv) == 0
    return out, buf.getvalue()


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_fast_mode_writes_table_json_and_png(fast_run):
    out, stdout = fast_run
    result = json.loads((out / "extrapolation.json").read_text())
    names = [v.name for v in variants()]
    assert [r["name"] for r in result["rows"]] == names
    assert len(names) == 6 + 4 * 3 + 2 * 3  # schemes, scalings x factors, fine-tuned PI / YaRN
    for name in names:  # every variant is a row of the printed table
        assert any(line.startswith(name + " ") for line in stdout.splitlines()), name
    assert result["buckets"] == {
        "L": "positions (16, 32]",
        "2L": "positions (32, 64]",
        "4L": "positions (64, 128]",
        "8L": "positions (128, 256]",
    }
    assert len(result["trained"]) == 6 + 6 and len(result["measured"]) == len(names)
    for row in result["rows"]:
        if row["name"] != "learned":
            assert all(np.isfinite(row["loss"][b]) for b in ("L", "2L", "4L", "8L")), row
    assert (out / "extrapolation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "extrapolation.txt").read_text() in stdout


@pytest.mark.slow
def test_a_rerun_trains_and_measures_nothing(fast_run):
    out, _ = fast_run
    models = _files(out / "models")
    steps = [n for n in models if "/step_" in n and n.endswith("model.safetensors")]
    assert len(steps) == 12  # 6 schemes, PI and YaRN fine-tuned at 3 factors
    result = run_extrapolation(Extrapolation(fast=True, out=str(out)), _data(out))
    assert result["trained"] == [] and result["measured"] == []
    assert _files(out / "models") == models  # no checkpoint written, none rewritten
    first = json.loads((out / "extrapolation.json").read_text())
    assert first["rows"] == result["rows"]


@pytest.mark.slow
def test_new_finetune_steps_retrain_only_the_finetunes(fast_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(fast_run[0], out)
    opts = Extrapolation(fast=True, out=str(out), finetune_steps=2)
    exp = Experiment(opts, _data(out))
    for v in variants():
        exp.measure(v)
    assert sorted(exp.trained) == sorted(v.slug for v in variants() if v.finetuned)
    assert sorted(exp.measured) == sorted(v.name for v in variants() if v.finetuned)


@pytest.mark.slow
def test_learned_positions_are_flagged_past_L(fast_run):
    out, stdout = fast_run
    result = json.loads((out / "extrapolation.json").read_text())
    row = next(r for r in result["rows"] if r["name"] == "learned")
    assert np.isfinite(row["loss"]["L"])
    assert row["loss"]["2L"] is None and row["loss"]["4L"] is None and row["loss"]["8L"] is None
    assert "no embedding past position L=32" in row["note"]
    line = next(line for line in stdout.splitlines() if line.startswith("learned "))
    assert line.split()[1:] == [f"{row['loss']['L']:.3f}", "n/a", "n/a", "n/a"]
    # Why: the model itself refuses a position past its table (one clear ValueError).
    model = Experiment(Extrapolation(fast=True, out=str(out)), _data(out)).model(Variant("learned"))
    with pytest.raises(ValueError, match="beyond the learned position table of 32 positions"):
        model(torch.zeros(1, L + 1, dtype=torch.long))


@pytest.mark.slow
def test_scaled_rope_variants_change_only_the_frequencies(fast_run):
    out, _ = fast_run
    exp = Experiment(Extrapolation(fast=True, out=str(out)), _data(out))
    plain = exp.model(Variant("rope"))
    R, theta, n = plain.positions.rotary_dim, plain.positions.theta, 8 * L
    base = rope_inv_freq(R, theta)[0]
    torch.testing.assert_close(plain.positions.inv_freq, base, rtol=0, atol=0)
    for kind in SCALINGS:
        for factor in (2, 4, 8):
            model = exp.model(Variant("rope", kind, factor))
            for a, b in zip(model.state_dict().values(), plain.state_dict().values()):
                torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same trained weights
            scaling = RopeScaling(kind, float(factor), original_max_seq_len=L)
            # positions/rope_scaling.py's frequencies, for the length measured (dynamic: 8L).
            want, attention_factor = rope_inv_freq(R, theta, scaling, seq_len=n)
            assert not torch.allclose(want, base)
            cos, sin = model.positions.tables_for(n)
            want_cos, want_sin = rope_angles(R, n, theta, scaling, seq_len=n)
            torch.testing.assert_close(cos[:n], want_cos)
            torch.testing.assert_close(sin[:n], want_sin)
            if kind == "yarn":
                assert attention_factor == pytest.approx(0.1 * np.log(factor) + 1)


@pytest.mark.slow
def test_finetuned_variants_start_from_rope_and_move(fast_run):
    out, _ = fast_run
    exp = Experiment(Extrapolation(fast=True, out=str(out)), _data(out))
    rope = exp.weights(Variant("rope"))
    for kind in ("linear", "yarn"):
        tuned = exp.weights(Variant("rope", kind, 4, finetuned=True))
        assert tuned.keys() == rope.keys()
        assert any(not torch.equal(tuned[k], rope[k]) for k in rope)
    model = exp.model(Variant("rope", "linear", 4, finetuned=True))
    assert model.positions.scaling == RopeScaling("linear", 4.0, L)


@pytest.mark.slow
def test_figure_has_one_curve_per_variant(fast_run):
    out, _ = fast_run
    exp = Experiment(Extrapolation(fast=True, out=str(out)), _data(out))
    records = [exp.measure(v) for v in variants()]  # read back from the cache
    assert exp.measured == []
    fig = extrapolation_figure(records, L)
    curves = [len([ln for ln in ax.get_lines() if ln.get_label()[0] != "_"]) for ax in fig.axes]
    assert curves == [6, 12, 6]


def _tiny(scheme: str, scaling: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = scaled(model_config(scheme, FAST, vocab_size=50, max_seq_len=4 * 8), scaling, 2, 8)
    return build_model(replace(cfg, init_std=0.3)).eval()  # wide enough that attention matters


@pytest.mark.parametrize("scheme", ["rope", "alibi", "t5_bias", "sinusoidal", "none"])
def test_per_position_loss_is_cross_entropy_per_position(scheme):
    model = _tiny(scheme)
    windows = torch.randint(0, 50, (5, 33), generator=torch.Generator().manual_seed(1))
    got = per_position_loss(model, windows, [8, 16, 32], chunk=2)
    with torch.no_grad():
        logits = model(windows[:, :-1])  # (5, 32, 50): one forward over every position
    by_hand = F.cross_entropy(logits.reshape(-1, 50), windows[:, 1:].reshape(-1), reduction="none")
    torch.testing.assert_close(got.float(), by_hand.view(5, 32).mean(0), rtol=1e-5, atol=1e-5)


def test_dynamic_ntk_scores_each_bucket_at_its_own_length():
    model = _tiny("rope", "dynamic")  # scaling x2 over 8 positions
    windows = torch.randint(0, 50, (3, 33), generator=torch.Generator().manual_seed(2))
    got = per_position_loss(model, windows, [8, 16, 32])
    want = []
    with torch.no_grad():
        for lo, hi in ((0, 8), (8, 16), (16, 32)):
            logits = model(windows[:, :hi])[:, lo:hi]  # frequencies for length hi
            loss = F.cross_entropy(
                logits.transpose(1, 2), windows[:, lo + 1 : hi + 1], reduction="none"
            )
            want.append(loss.mean(0))
        single = F.cross_entropy(
            model(windows[:, :-1]).transpose(1, 2), windows[:, 1:], reduction="none"
        )
    torch.testing.assert_close(got.float(), torch.cat(want), rtol=1e-5, atol=1e-5)
    assert (got[:8].float() - single.mean(0)[:8]).abs().max() > 1e-3  # one 32-token pass differs


def test_bucket_means_say_which_positions():
    losses = [float(i) for i in range(1, 8 * L + 1)]  # loss i at 1-based position i
    means = bucket_means(losses, L)
    assert means == {
        "L": np.mean(range(L // 2 + 1, L + 1)),
        "2L": np.mean(range(L + 1, 2 * L + 1)),
        "4L": np.mean(range(2 * L + 1, 4 * L + 1)),
        "8L": np.mean(range(4 * L + 1, 8 * L + 1)),
    }
    assert bucket_means(losses[:L] + [None] * 7 * L, L)["2L"] is None


def test_bad_steps_are_one_clear_error(capsys):
    assert main(["lab", "extrapolate", "--fast", "--steps", "0", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "--steps must be >= 1, got 0" in err and "Traceback" not in err


def test_the_cache_key_follows_the_model_config(monkeypatch, tmp_path):
    """A change to the models' config (here: the sinusoidal model's embedding scale) is a new
    key, so a rerun retrains that model instead of reusing the old checkpoint."""
    exp = Experiment(Extrapolation(fast=True, out=str(tmp_path)), _data(tmp_path))
    before = [exp.model_settings(v) for v in variants()]
    import attnlab.lab.extrapolate as module

    original = module.model_config

    def scaled_none(scheme, *args):
        cfg = original(scheme, *args)
        return replace(cfg, scale_embeddings=True) if scheme == "none" else cfg

    monkeypatch.setattr(module, "model_config", scaled_none)
    after = [exp.model_settings(v) for v in variants()]
    changed = {v.name for v, b, a in zip(variants(), before, after) if a != b}
    assert changed == {"none"}


@pytest.mark.slow
def test_a_fresh_run_reproduces_the_table(fast_run, tmp_path):
    """Seeded: the same settings in a new directory train and measure the same numbers."""
    out, _ = fast_run
    again = run_extrapolation(Extrapolation(fast=True, out=str(tmp_path)), _data(tmp_path))
    assert len(again["trained"]) == 12
    first = json.loads((out / "extrapolation.json").read_text())
    for a, b in zip(first["rows"], again["rows"]):
        assert a["name"] == b["name"]
        for bucket, value in a["loss"].items():
            assert b["loss"][bucket] == (None if value is None else pytest.approx(value, abs=1e-6))
