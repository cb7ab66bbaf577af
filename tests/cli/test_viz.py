"""`attnlab viz attention|positions|masks|loss --out DIR`: files written, errors reported."""

import json

import pytest
import torch

from attnlab.cli.__main__ import main
from tests.viz.checkpoints import TEXT, make_checkpoint


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def written(capsys) -> list[str]:
    return [line.rsplit("/", 1)[-1] for line in capsys.readouterr().out.split()]


@pytest.mark.slow
def test_attention_default_is_a_tiny_random_encoder_decoder(tmp_path, capsys):
    assert (
        main(
            [
                "viz",
                "attention",
                "--out",
                str(tmp_path),
                "--text",
                "abc",
                "--target",
                "xy",
                "--layer",
                "1",
                "--head",
                "3",
            ]
        )
        == 0
    )
    names = written(capsys)
    assert names == [
        "attention_encoder_self.png",
        "attention_encoder_self_layer1_head3.png",
        "attention_decoder_self.png",
        "attention_decoder_self_layer1_head3.png",
        "attention_cross.png",
        "attention_cross_layer1_head3.png",
        "attention.html",
    ]
    for name in names:
        assert (tmp_path / name).stat().st_size > 1000
    html = (tmp_path / "attention.html").read_text()
    data = json.loads(html.split('id="attn-data">')[1].split("</script>")[0])
    assert data["kinds"]["cross"]["q_tokens"] == ["x", "y"]
    assert data["kinds"]["cross"]["k_tokens"] == ["a", "b", "c"]


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_attention_from_a_checkpoint_uses_its_tokenizer(tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "pics"
    assert (
        main(["viz", "attention", "--ckpt", str(ckpt), "--text", "q @ k", "--out", str(out)]) == 0
    )
    assert written(capsys) == [
        "attention_decoder_self.png",
        "attention_decoder_self_layer0_head0.png",
        "attention.html",
    ]
    data = json.loads(
        (out / "attention.html").read_text().split('id="attn-data">')[1].split("</script>")[0]
    )
    assert data["kinds"]["decoder_self"]["q_tokens"] == ["q", "\u2423", "@", "\u2423", "k"]
    assert set("q @ k") <= set(TEXT)


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_attention_of_a_bert_classifier(tmp_path, capsys):
    """Issue 18: a classifier checkpoint (config.json with n_labels) could not be opened."""
    ckpt = make_checkpoint(tmp_path / "clf", "bert-tiny", n_labels=3)
    out = tmp_path / "pics"
    assert (
        main(["viz", "attention", "--ckpt", str(ckpt), "--text", "q @ k", "--out", str(out)]) == 0
    )
    assert written(capsys) == [
        "attention_encoder_self.png",
        "attention_encoder_self_layer0_head0.png",
        "attention.html",
    ]


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_attention_from_a_run_directory_uses_its_latest_checkpoint(tmp_path, capsys):
    """README: `attnlab viz attention --ckpt runs/default` works as `generate` does."""
    ckpt = make_checkpoint(tmp_path / "run" / "checkpoints" / "step_000004")
    (ckpt.parent / "latest").write_text(ckpt.name)
    out = tmp_path / "pics"
    argv = ["viz", "attention", "--ckpt", str(tmp_path / "run"), "--text", "q @ k"]
    assert main([*argv, "--out", str(out)]) == 0
    assert "attention.html" in written(capsys)


def test_bad_head_is_an_error(tmp_path, capsys):
    assert (
        main(["viz", "attention", "--preset", "gpt2-tiny", "--head", "9", "--out", str(tmp_path)])
        == 2
    )
    assert "--head 9" in capsys.readouterr().err


@pytest.mark.slow
def test_positions_and_masks(tmp_path, capsys):
    assert (
        main(
            [
                "viz",
                "positions",
                "--out",
                str(tmp_path),
                "--dims",
                "0",
                "1",
                "--offsets",
                "0",
                "50",
                "--n-heads",
                "4",
            ]
        )
        == 0
    )
    assert written(capsys) == [
        "sinusoid_table.png",
        "sinusoid_curves.png",
        "rope_distance.png",
        "alibi.png",
        "t5_buckets.png",
    ]
    assert main(["viz", "masks", "--out", str(tmp_path), "--seq-len", "6"]) == 0
    assert written(capsys) == ["masks.png"]
    for name in ("sinusoid_table.png", "alibi.png", "masks.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_loss(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "train_loss": 3.0 / (s + 1), "lr": 1e-3} for s in range(5)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    assert main(["viz", "loss", "--metrics", str(run), "--out", str(tmp_path)]) == 0
    assert written(capsys) == ["loss.png"]
    assert main(["viz", "loss", "--metrics", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "no metrics" in capsys.readouterr().err


def test_out_is_required(capsys):
    with pytest.raises(SystemExit):
        main(["viz", "masks"])
    assert "--out" in capsys.readouterr().err
