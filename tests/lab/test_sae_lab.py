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


def generate_cli(capsys, ckpt, *flags):
    cmd = ["generate", "--ckpt", str(ckpt), "--prompt", "def ", "--max-new-tokens", "8"]
    code = main(cmd + ["--temperature", "0", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_sae_steer_generates_what_cached_and_uncached_steering_give(ckpt, tmp_path, capsys):
    from attnlab.checkpoint import open_checkpoint
    from attnlab.inference.config import GenerationConfig
    from attnlab.inference.generate import generate
    from attnlab.inference.sampling import SamplingConfig
    from attnlab.inference.steering import steering
    from attnlab.lab.sae import SAE, SAEConfig, sae_steers, save_sae

    loaded = open_checkpoint(ckpt)
    model, tok = loaded.model, loaded.tokenizer
    C = model.embed.weight.shape[1]
    torch.manual_seed(0)
    sae_dir = save_sae(SAE(SAEConfig(C, 16, "topk", 4, hook_name=HOOK)), tmp_path / "sae")
    spec = [str(sae_dir), "3", "40"]
    code, out, _ = generate_cli(capsys, ckpt, "--sae-steer", *spec)
    assert code == 0
    _, plain, _ = generate_cli(capsys, ckpt)
    assert out != plain  # a scale this large changes the greedy text
    steers = sae_steers(model, [spec])
    assert steers[0].point == HOOK and torch.equal(steers[0].vector, load_sae(sae_dir).W_dec[3])
    config = GenerationConfig(8, SamplingConfig(temperature=0))
    ids = tok.encode("def ")
    with steering(model, steers):
        new = generate(model, [ids], config)[0]
        assert out == "def " + tok.decode(new) + "\n"
        seq = list(ids)
        for _ in range(len(new)):  # recomputing the whole sequence each step, no cache
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert seq[len(ids) :] == new


def test_sae_steer_bad_input_is_one_line(ckpt, tmp_path, capsys):
    from attnlab.checkpoint import open_checkpoint
    from attnlab.lab.sae import SAE, SAEConfig, save_sae

    torch.manual_seed(0)
    C = open_checkpoint(ckpt).model.embed.weight.shape[1]
    good = save_sae(SAE(SAEConfig(C, 16, "topk", 4, hook_name=HOOK)), tmp_path / "good")
    cases = [
        ([str(tmp_path / "nope"), "0", "1"], "has no cfg.json"),
        ([str(good), "16", "1"], "feature 16 is outside the SAE's 0..15"),
        ([str(good), "x", "1"], "FEATURE (an int)"),
    ]
    elsewhere = SAE(SAEConfig(C, 16, "topk", 4, hook_name="blocks.9.hook_resid_post"))
    cases.append(([str(save_sae(elsewhere, tmp_path / "b9")), "0", "1"], "no hook point"))
    wide = SAE(SAEConfig(C + 1, 16, "topk", 4, hook_name=HOOK))
    cases.append(([str(save_sae(wide, tmp_path / "wide")), "0", "1"], "width"))
    for spec, message in cases:
        code, _, err = generate_cli(capsys, ckpt, "--sae-steer", *spec)
        assert code == 2 and message in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_serve_sae_steer_bad_input_is_one_line(ckpt, tmp_path, capsys):
    """`attnlab serve` reads --sae-steer before it listens: a bad one stops it, in one line."""
    assert main(["serve", "--ckpt", str(ckpt), "--sae-steer", str(tmp_path), "0", "1"]) == 2
    err = capsys.readouterr().err
    assert "has no cfg.json" in err and len(err.strip().splitlines()) == 1
