"""`attnlab data`: register a local copy, no-op when cached, one-line errors; never downloads."""

import hashlib
from dataclasses import replace

import pytest

from attnlab.cli.__main__ import main
from attnlab.training import datasets
from tests.data import SHAKESPEARE


@pytest.fixture(autouse=True)
def data_home(tmp_path, monkeypatch):
    """An empty data home; 'shakespeare' is the fixture, at a dead local URL."""
    monkeypatch.setenv("ATTNLAB_DATA", str(tmp_path / "home"))
    sha = hashlib.sha256(SHAKESPEARE.read_bytes()).hexdigest()
    fake = replace(datasets.DATASETS["shakespeare"], url="http://127.0.0.1:9/x", sha256=sha)
    monkeypatch.setitem(datasets.DATASETS, "shakespeare", fake)
    return tmp_path / "home"


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_get_from_a_local_copy_then_get_again_is_a_no_op(data_home, capsys):
    assert main(["data", "get", "shakespeare", "--from", str(SHAKESPEARE)]) == 0
    assert (data_home / "tinyshakespeare.txt").read_bytes() == SHAKESPEARE.read_bytes()
    assert main(["data", "get", "shakespeare"]) == 0  # the URL is dead: it must not be used
    assert "already in" in capsys.readouterr().out
    assert main(["data", "list"]) == 0
    assert "(cached)" in capsys.readouterr().out


def test_without_network_one_line_says_what_to_do(capsys):
    assert main(["data", "get", "shakespeare"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab data: error: dataset 'shakespeare' is not in ")
    assert "--from PATH" in err and "\n" not in err and "Traceback" not in err


def test_a_wrong_local_copy_is_refused(tmp_path, capsys):
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("not Shakespeare")
    assert main(["data", "get", "shakespeare", "--from", str(wrong)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{wrong} is not the expected tinyshakespeare.txt" in err and "\n" not in err


def test_an_unknown_dataset_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["data", "get", "wikitext"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab data get: error:") and "shakespeare" in err
    assert "\n" not in err
