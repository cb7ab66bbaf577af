"""A command that cannot use a checkpoint says what it is and what runs on it (cli/kinds.py),
and what it names does run: issue 42 (eval --text printed a next-token perplexity of a BERT
MLM, chat sent it to generate, which refuses it; serve called it "a encoder")."""

from pathlib import Path

import pytest
import torch

from attnlab.cli.__main__ import main

pytestmark = pytest.mark.slow  # one BERT MLM training run first (about 3 s)


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    """A BERT MLM run, as `attnlab train --preset bert-tiny --data.task mlm` writes one."""
    root = tmp_path_factory.mktemp("bert")
    torch.set_num_threads(1)
    corpus = root / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 40)
    argv = ["train", "--preset", "bert-tiny", "--data.task", "mlm"]
    argv += ["--data.source", str(corpus), "--data.cache_dir", str(root / "cache")]
    argv += ["--model.n_layers=1", "--train.steps=2", "--train.batch_size=2"]
    argv += ["--train.context=32", "--train.eval_every=2", "--train.eval_batches=1"]
    argv += ["--train.progress=false", "--train.device=cpu"]
    assert main([*argv, "--train.out_dir", str(root / "run")]) == 0
    (root / "text.txt").write_text("def g(y):\n    return y\n")
    return root / "run"


def refusal(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--text", "TEXT", "--device", "cpu"],
        ["chat", "--device", "cpu"],
        ["serve"],
        ["generate", "--prompt", "def", "--device", "cpu"],
    ],
    ids=lambda argv: argv[0],
)
def test_an_mlm_encoder_is_refused_with_what_it_is_and_what_runs_on_it(bert, argv, capsys):
    argv = [a.replace("TEXT", str(bert.parent / "text.txt")) for a in argv]
    err = refusal([argv[0], "--ckpt", str(bert), *argv[1:]], capsys)
    assert f"'{bert}' is an encoder with a masked-LM head" in err
    assert "ppl" not in err and "a encoder" not in err
    assert "What runs on it: `attnlab eval --ckpt" in err
    assert "`attnlab generate" not in err  # generate refuses it too


def test_what_the_refusal_names_runs_on_the_encoder(bert, tmp_path, capsys):
    """`attnlab eval --ckpt` (masked-token accuracy) and `attnlab viz attention --ckpt`, named
    by the refusal, both work on the checkpoint."""
    assert main(["eval", "--ckpt", str(bert), "--batches", "1", "--device", "cpu"]) == 0
    assert "val_mlm_accuracy" in capsys.readouterr().out
    viz = ["viz", "attention", "--ckpt", str(bert), "--text", "def f", "--out", str(tmp_path)]
    assert main(viz) == 0
