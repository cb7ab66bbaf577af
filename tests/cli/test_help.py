"""Every command's help is generated from its parser, so it names what the parser has."""

import argparse
import importlib

import pytest

from attnlab.cli.__main__ import COMMANDS, main
from attnlab.cli.lab import EXPERIMENTS
from attnlab.cli.options import CLIParser


def command_parser(name: str) -> argparse.ArgumentParser:
    """The subparser `attnlab NAME` builds, as main() builds it."""
    sub = CLIParser(prog="attnlab").add_subparsers()
    p = sub.add_parser(name, help=COMMANDS[name], description=COMMANDS[name])
    importlib.import_module(f"attnlab.cli.{name}").add_parser(p)
    return p


def help_text(argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping (it breaks words at hyphens)
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_top_level_help_names_every_command(capsys, monkeypatch):
    out = help_text([], capsys, monkeypatch)
    for name, summary in COMMANDS.items():
        assert f"{name} {summary}" in out


def test_lab_help_names_every_experiment(capsys, monkeypatch):
    out = help_text(["lab"], capsys, monkeypatch)
    assert f"claims: {' | '.join(EXPERIMENTS)}." in out
    assert len(EXPERIMENTS) >= 4  # extrapolate, heads, patch, moe


@pytest.mark.parametrize("name", ["train", "finetune"])
def test_usage_line_names_every_own_flag(name):
    p = command_parser(name)
    usage = p.format_usage()
    own = [  # each flag of the command's own, by its option strings (-h, --help)
        action.option_strings
        for action in p._actions
        if action.option_strings and "." not in action.option_strings[-1]  # not --section.field
    ]
    assert ["--overwrite"] in own and ["--resume"] in own
    for flags in own:
        assert any(f in usage for f in flags), f"{name}'s usage line leaves out {flags[-1]}"
    if name == "train":
        assert "--nproc" in usage
    assert "[--SECTION.FIELD=V ...]" in usage


@pytest.mark.parametrize("name", ["generate", "serve", "eval", "chat"])
def test_ckpt_help_names_every_kind_open_checkpoint_reads(name):
    ckpt = next(a for a in command_parser(name)._actions if "--ckpt" in a.option_strings)
    for kind in ("directory", "out_dir", ".gguf", "hf:ORG/NAME"):
        assert kind in ckpt.help, f"{name} --ckpt help: {ckpt.help!r} leaves out {kind}"
