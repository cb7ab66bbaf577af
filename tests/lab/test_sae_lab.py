"""`attnlab lab sae` on a tiny random model: it trains, saves SAELens' files, reports the
metrics and the feature page; bad input is one line naming the culprit."""

import json

import pytest
import torch

from attnlab.cli.__main__ import main
from attnlab.lab.sae import load_sae
from tests.viz.checkpoints import make_checkpoint

HOOK = "blocks.1.hook_resid_post"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("sae") / "lm")


def lab(ckpt, out, *extra):
    cmd = ["lab", "sae", "--ckpt", str(ckpt), "--hook", HOOK, "--tokens", "4096"]
    cmd += ["--eval-tokens", "512", "--context", "32", "--batch", "256", "--lr", "1e-2"]
    return main(cmd + ["--out", str(out), *extra])


@pytest.mark.parametrize("kind", ["topk", "relu"])
def test_lab_sae_trains_saves_and_measures(ckpt, tmp_path, capsys, kind):
    torch.set_num_threads(1)
    extra = ["--kind", kind, "--features", "64", "--k", "4", "--l1", "0.01"]
    assert lab(ckpt, tmp_path, *extra) == 0
    printed = capsys.readouterr().out
    assert "explained variance" in printed and "CE loss score" in printed
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["steps"] == 4096 // 256 and m["features"] == 64
    if kind == "topk":
        assert m["l0"] <= 4
    assert 0.5 < m["explained_variance"] <= 1  # an untrained SAE explains about 0
    assert m["ce_loss_without_sae"] > 0 and m["ce_loss_with_sae"] > 0
    want = (m["ce_loss_with_ablation"] - m["ce_loss_with_sae"]) / (
        m["ce_loss_with_ablation"] - m["ce_loss_without_sae"]
    )
    assert m["ce_loss_score"] == pytest.approx(want)
    sae = load_sae(tmp_path / "sae")
    assert sae.cfg.kind == kind and sae.cfg.hook_name == HOOK and sae.cfg.d_sae == 64
    page = (tmp_path / "features.md").read_text()
    assert page.startswith("# SAE features") and "## Feature" in page and "**" in page


def test_lab_sae_bad_input_is_one_line(ckpt, tmp_path, capsys):
    cmd = ["lab", "sae", "--ckpt", str(ckpt), "--out", str(tmp_path)]
    assert main(cmd + ["--hook", "blocks.7.hook_resid_post"]) == 2
    err = capsys.readouterr().err
    assert "no hook point 'blocks.7.hook_resid_post'" in err and "Traceback" not in err
    assert main(cmd + ["--hook", HOOK, "--kind", "jump"]) == 2
    assert "--kind 'jump'" in capsys.readouterr().err
    assert main(cmd + ["--hook", HOOK, "--features", "8", "--k", "9"]) == 2
    assert "k=9" in capsys.readouterr().err
    assert main(["lab", "sae", "--hook", HOOK]) == 2
    assert "--ckpt" in capsys.readouterr().err
