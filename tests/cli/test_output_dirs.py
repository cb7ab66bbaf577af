"""Commands that write a checkpoint directory never delete what they did not write: a
non-empty target is refused without --overwrite (exit 2, one line naming the flag), and with it
only the checkpoint's own files change (issue 31: quantize --out and convert --to deleted a
run directory that was there)."""

import pytest

from attnlab.checkpoint import open_checkpoint, save_checkpoint
from attnlab.cli.__main__ import main
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.tokenizer import train_char_tokenizer
from attnlab.training.config import RunConfig


@pytest.fixture
def ckpt(tmp_path):
    model = build_model(get_preset("llama-tiny"))
    tokenizer = train_char_tokenizer(["to be or not to be"])
    run = RunConfig(get_preset("llama-tiny"))
    return save_checkpoint(tmp_path / "float", model, None, run, {"step": 0}, tokenizer=tokenizer)


def a_run_directory(path, ckpt):
    """A directory holding a user's run: metrics, notes and a checkpoint of its own."""
    path.mkdir()
    (path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (path / "notes.txt").write_text("do not lose me\n")
    save_checkpoint(path / "checkpoints" / "step_1", build_model(get_preset("llama-tiny")),
                    None, RunConfig(get_preset("llama-tiny")), {"step": 1})  # fmt: skip
    return {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def untouched(path, before) -> bool:
    return all((path / name).read_bytes() == data for name, data in before.items())


COMMANDS = {
    "quantize": lambda src, dst: ["quantize", "--ckpt", src, "--scheme", "int8", "--out", dst],
    "convert-attnlab": lambda src, dst: ["convert", "--from", "attnlab", src, "--to", "attnlab",
                                         dst],
    "convert-hf": lambda src, dst: ["convert", "--from", "attnlab", src, "--to", "hf", dst],
}  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS)
def test_a_non_empty_target_is_refused_without_overwrite(command, ckpt, tmp_path, capsys):
    target = tmp_path / "run"
    before = a_run_directory(target, ckpt)
    assert main(COMMANDS[command](str(ckpt), str(target))) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--overwrite" in err and str(target) in err
    assert len(err.strip().splitlines()) == 1
    assert untouched(target, before)
    assert sorted(p.name for p in target.iterdir()) == ["checkpoints", "metrics.jsonl", "notes.txt"]


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.parametrize("command", COMMANDS)
def test_overwrite_writes_the_checkpoint_and_keeps_everything_else(command, ckpt, tmp_path):
    target = tmp_path / "run"
    before = a_run_directory(target, ckpt)
    assert main([*COMMANDS[command](str(ckpt), str(target)), "--overwrite"]) == 0
    assert untouched(target, before)  # the user's files, byte for byte
    assert open_checkpoint(target).config == get_preset("llama-tiny")
    assert main([*COMMANDS[command](str(ckpt), str(target)), "--overwrite"]) == 0  # and again
    assert untouched(target, before)


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.parametrize("command", COMMANDS)
def test_an_empty_or_missing_target_needs_no_flag(command, ckpt, tmp_path):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "new"):
        assert main(COMMANDS[command](str(ckpt), str(target))) == 0
        assert (target / "model.safetensors").is_file()
