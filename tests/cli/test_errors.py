"""One error path: every expected failure of a command is ONE stderr line
`attnlab <cmd>: error: ...` naming the file, field or flag, with exit code 2 (1 for a diverged run,
130 for Ctrl-C, 143 for SIGTERM), and no traceback; `--debug` shows the traceback instead.

The table below feeds each bad input to `main` in this process; each case builds its files in
tmp_path and names the text the one line must hold (the culprit)."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnlab.cli.train as cli_train
from attnlab.cli.__main__ import main
from attnlab.training.loop import TrainingDiverged
from tests.data import SHAKESPEARE
from tests.viz.checkpoints import make_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("errors") / "ckpt")


def tiny_train(tmp: Path, *extra: str) -> list[str]:
    text = tmp / "tiny.txt"
    if not text.is_file():
        text.write_text(SHAKESPEARE.read_text()[:5000])
    return [
        "train",
        f"--data.source={text}",
        f"--data.cache_dir={tmp / 'cache'}",
        f"--train.out_dir={tmp / 'run'}",
        "--train.steps=2",
        "--train.batch_size=2",
        "--train.context=16",
        "--train.eval_batches=1",
        "--train.sample_tokens=0",
        "--train.progress=false",
        "--model.n_layers=1",
        "--model.d_model=16",
        *extra,
    ]


def yaml_file(tmp: Path, text: str) -> Path:
    path = tmp / "recipe.yaml"
    path.write_text(text)
    return path


def config(tmp: Path, text: str) -> str:
    return f"--config={yaml_file(tmp, text)}"


def binary(tmp: Path) -> Path:
    path = tmp / "program.bin"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    return path


def broken_copy(ckpt: Path, tmp: Path, edit) -> Path:
    copy = tmp / "broken"
    shutil.copytree(ckpt, copy)
    edit(copy)
    return copy


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def raising(exc: BaseException):
    def fake_train(*args, **kwargs):
        raise exc

    return fake_train


# (id, argv(tmp, ckpt), patch(monkeypatch) or None, exit code, text the line must hold)
CASES = [
    # config files
    ("missing config file", lambda t, c: tiny_train(t, "--config=nope.yaml"), None, 2, "nope.yaml"),
    (
        "yaml syntax error names file and line",
        lambda t, c: tiny_train(t, config(t, "train:\n  steps: [1\n  lr: 2\n")),
        None,
        2,
        "recipe.yaml:3: not valid YAML",
    ),
    (
        "yaml float for an int",
        lambda t, c: tiny_train(t, config(t, "train:\n  steps: 4.5\n")),
        None,
        2,
        "TrainConfig.steps must be an int, got 4.5",
    ),
    (
        "yaml list for an int",
        lambda t, c: tiny_train(t, config(t, "model:\n  n_layers: [1, 2]\n")),
        None,
        2,
        "ModelConfig.n_layers must be an int, got [1, 2]",
    ),
    (
        "yaml bool for an int",
        lambda t, c: tiny_train(t, config(t, "model:\n  n_layers: true\n")),
        None,
        2,
        "ModelConfig.n_layers must be an int, got True",
    ),
    (
        "yaml float for eval_every",
        lambda t, c: tiny_train(t, config(t, "train:\n  eval_every: 2.5\n")),
        None,
        2,
        "TrainConfig.eval_every must be an int, got 2.5",
    ),
    # flags
    ("prefix of a flag", lambda t, c: tiny_train(t, "--model.n_l=3"), None, 2, "--model.n_l=3"),
    (
        "flag not a number",
        lambda t, c: tiny_train(t, "--model.n_layers=abc"),
        None,
        2,
        "--model.n_layers=abc",
    ),
    (
        "lr below min_lr",
        lambda t, c: tiny_train(t, "--train.lr=1e-5"),
        None,
        2,
        "set --train.min_lr too",
    ),
    (
        "threads not a number",
        lambda t, c: tiny_train(t, "--threads=many"),
        None,
        2,
        "--threads=many",
    ),
    ("unknown preset", lambda t, c: tiny_train(t, "--preset=gpt5"), None, 2, "gpt5"),
    # data and tokenizer files
    (
        "data file that is not text",
        lambda t, c: tiny_train(t, f"--data.source={binary(t)}"),
        None,
        2,
        "program.bin holds NUL bytes",
    ),
    (
        "corrupt tokenizer.json",
        lambda t, c: tiny_train(t, f"--data.tokenizer={yaml_file(t, '{oops')}"),
        None,
        2,
        "recipe.yaml is not a readable tokenizer.json",
    ),
    # disk
    (
        "out_dir under a file",
        lambda t, c: tiny_train(t, f"--train.out_dir={SHAKESPEARE}/run"),
        None,
        2,
        str(SHAKESPEARE),
    ),
    (
        "full disk",
        lambda t, c: tiny_train(t),
        lambda m: m.setattr(
            cli_train,
            "train",
            raising(OSError(errno.ENOSPC, "No space left on device", "run/model.safetensors")),
        ),
        2,
        "run/model.safetensors: No space left on device; free some space",
    ),
    (
        "read-only file system",
        lambda t, c: tiny_train(t),
        lambda m: m.setattr(
            cli_train, "train", raising(OSError(errno.EROFS, "Read-only file system", "run"))
        ),
        2,
        "run: Read-only file system; the file system is read-only",
    ),
    # the run itself
    (
        "diverged run",
        lambda t, c: tiny_train(t),
        lambda m: m.setattr(cli_train, "train", raising(TrainingDiverged("loss is nan at step 3"))),
        1,
        "loss is nan at step 3",
    ),
    # checkpoints
    (
        "missing checkpoint",
        lambda t, c: ["generate", "--ckpt", str(t / "nowhere"), "--prompt", "d"],
        None,
        2,
        "nowhere",
    ),
    (
        "truncated weights",
        lambda t, c: [
            "generate",
            "--ckpt",
            str(broken_copy(c, t, lambda d: truncate(d / "model.safetensors"))),
            "--prompt",
            "d",
        ],
        None,
        2,
        "broken",
    ),
    (
        "config.json without model",
        lambda t, c: [
            "generate",
            "--ckpt",
            str(broken_copy(c, t, lambda d: (d / "config.json").write_text(json.dumps({})))),
            "--prompt",
            "d",
        ],
        None,
        2,
        "broken",
    ),
    (
        "corrupt config.json",
        lambda t, c: [
            "generate",
            "--ckpt",
            str(broken_copy(c, t, lambda d: (d / "config.json").write_text("{oops"))),
            "--prompt",
            "d",
        ],
        None,
        2,
        "broken",
    ),
    (
        "corrupt tokenizer.json in a checkpoint",
        lambda t, c: [
            "generate",
            "--ckpt",
            str(broken_copy(c, t, lambda d: truncate(d / "tokenizer.json"))),
            "--prompt",
            "d",
        ],
        None,
        2,
        "tokenizer.json",
    ),
]


def config_edit(section: str, key: str, value):
    def edit(copy: Path) -> None:
        run = json.loads((copy / "config.json").read_text())
        run[section][key] = value
        (copy / "config.json").write_text(json.dumps(run))

    return edit


def wrong_type(t: Path, c: Path, key: str, value) -> list[str]:
    broken = broken_copy(c, t, config_edit("model", key, value))
    return ["generate", f"--ckpt={broken}", "--prompt=to", "--max-new-tokens=2"]


CASES += [  # issue 31: each was a traceback, or a line that did not name the file
    (
        "generate on a BERT MLM checkpoint",
        lambda t, c: [
            "generate",
            f"--ckpt={make_checkpoint(t / 'bert', 'bert-tiny')}",
            "--prompt=a",
        ],
        None,
        2,
        "is an encoder with a masked-LM head (bidirectional: it fills in masked tokens",
    ),
    (
        "serve on port 99999",
        lambda t, c: ["serve", f"--ckpt={c}", "--port=99999"],
        None,
        2,
        "99999",
    ),
    (
        "config.json field of a wrong type",
        lambda t, c: wrong_type(t, c, "d_model", [64]),
        None,
        2,
        "broken/config.json': ModelConfig.d_model",
    ),
    (
        "config.json text for a section",
        lambda t, c: wrong_type(t, c, "rope", "x"),
        None,
        2,
        "broken/config.json': ModelConfig.rope must be a mapping",
    ),
    (
        "binary finetune --data.source",
        lambda t, c: [
            "finetune",
            f"--ckpt={c}",
            "--task=sft",
            f"--data.source={binary(t)}",
            f"--train.out_dir={t / 'ft'}",
        ],
        None,
        2,
        "program.bin' is not a UTF-8 text file",
    ),
]
if not torch.cuda.is_available():
    CASES.append(
        (
            "cuda on a CPU build",
            lambda t, c: tiny_train(t, "--train.device=cuda"),
            None,
            2,
            "--train.device=cuda",
        )
    )


def run_main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's errors exit from inside parse_args
        return e.code


@pytest.mark.parametrize("name, argv, patch, code, culprit", CASES, ids=[c[0] for c in CASES])
def test_one_line_names_the_culprit(
    name, argv, patch, code, culprit, tmp_path, ckpt, capsys, monkeypatch
):
    if patch is not None:
        patch(monkeypatch)
    args = argv(tmp_path, ckpt)
    assert run_main(args) == code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"attnlab {args[0]}"), err[0]
    assert ": error: " in err[0] and "Traceback" not in err[0]
    assert culprit in err[0], err[0]


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli_train, "train", raising(KeyboardInterrupt()))
    assert main(tiny_train(tmp_path)) == 130
    err = capsys.readouterr().err.strip()
    assert err == "attnlab train: interrupted (Ctrl-C)"


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_debug_shows_the_exception(tmp_path, monkeypatch):
    monkeypatch.setattr(cli_train, "train", raising(TrainingDiverged("nan")))
    with pytest.raises(TrainingDiverged):
        main(tiny_train(tmp_path, "--debug"))
    with pytest.raises(ValueError, match="--model.n_layers=abc"):
        main(["--debug", *tiny_train(tmp_path, "--model.n_layers=abc")])


@pytest.mark.slow
def test_debug_prints_a_traceback_from_the_command_line(tmp_path):
    argv = [sys.executable, "-m", "attnlab", *tiny_train(tmp_path, "--model.n_layers=abc")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    kw = dict(capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    quiet = subprocess.run(argv, **kw)
    loud = subprocess.run([*argv, "--debug"], **kw)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    assert len(quiet.stderr.strip().splitlines()) == 1
    assert loud.returncode == 1 and "Traceback (most recent call last)" in loud.stderr


def test_help_shows_defaults_choices_and_presets(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--train.steps V an int; default 2000" in out
    assert "--train.schedule V one of cosine, noam, constant; default 'cosine'" in out
    assert "--model.n_layers V an int; default 4 (preset llama-char)" in out
    assert "gpt2-tiny" in out and "llama-char" in out and "bert-tiny" in out  # --preset's list
    assert "--threads N" in out and "--debug" in out
