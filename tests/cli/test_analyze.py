"""`attnlab analyze rank`: the table, the stated tolerance, reproducibility, --ckpt and --plot."""

import re

import pytest
import torch

from attnlab.cli.__main__ import main
from tests.viz.checkpoints import make_checkpoint


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


ARGS = ["analyze", "rank", "--n", "8", "16", "--d-k", "2", "4", "--heads", "1", "2"]


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_random_weights_table_is_seeded(capsys):
    assert main(ARGS) == 0
    first = capsys.readouterr().out
    assert main(ARGS) == 0
    assert capsys.readouterr().out == first
    assert "tol = max(rows, cols) * eps * sigma_max, eps = 2.2e-16 (float64)" in first
    table = [line for line in first.splitlines() if re.match(r"random +\d", line)]
    assert len(table) == 2 * 2 * 2
    assert "Findings:" in first and "rank(Q K^T) <= d_k held in every row" in first
    assert main([*ARGS, "--seed", "1"]) == 0
    assert capsys.readouterr().out != first


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("analyze") / "ckpt")


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_checkpoint_init_and_trained_rows_and_plot(ckpt, tmp_path, capsys):
    png = tmp_path / "rank.png"
    assert (
        main(
            [
                "analyze",
                "rank",
                "--n",
                "8",
                "12",
                "--d-k",
                "4",
                "--heads",
                "1",
                "--ckpt",
                str(ckpt),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "eps = 1.19e-07 (float32)" in out  # captured matrices: float32 tolerance
    assert "the first n tokens of the stdlib textwrap.py source" in out
    for source in ("init", "trained"):
        assert sum(line.startswith(f"{source} decoder_self") for line in out.splitlines()) == 4
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_errors(ckpt, capsys):
    assert main(["analyze", "rank", "--n", "0"]) == 2
    assert ">= 1" in capsys.readouterr().err
    assert main(["analyze", "rank", "--n", "500", "--ckpt", str(ckpt)]) == 2
    assert "max_seq_len" in capsys.readouterr().err


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_out_names_a_directory_for_the_plot(tmp_path, capsys):
    """README's `attnlab analyze rank --out pictures/` (the flag was only --plot FILE)."""
    out = tmp_path / "pictures"
    assert main([*ARGS, "--out", str(out)]) == 0
    assert (out / "rank.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out / 'rank.png'}" in capsys.readouterr().out
