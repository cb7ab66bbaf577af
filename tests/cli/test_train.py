"""Smoke tests of `attnlab train`: a few steps of a 2-layer model on CPU, config files, flags."""

import json
from pathlib import Path

import pytest
import torch

from attnlab.cli.__main__ import main
from attnlab.cli.options import merge_sections, read_config_file
from attnlab.models.presets import get_preset
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from tests.data import SHAKESPEARE

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread: reproducible, and no threads spinning against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_text(tmp_path) -> Path:
    text = SHAKESPEARE.read_text()[:20_000]
    path = tmp_path / "tiny.txt"
    path.write_text(text)
    return path


def small_run(tmp_path, tiny_text) -> list[str]:
    return [
        "train",
        "--data.source",
        str(tiny_text),
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--train.out_dir",
        str(tmp_path / "run"),
        "--train.progress",
        "false",
        "--train.batch_size",
        "4",
        "--train.context",
        "32",
        "--train.eval_batches",
        "2",
        "--train.sample_tokens",
        "20",
        "--train.device",
        "cpu",
    ]


def saved_config(tmp_path) -> dict:
    root = tmp_path / "run" / "checkpoints"
    return json.loads((root / (root / "latest").read_text().strip() / "config.json").read_text())


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_train_three_steps_writes_everything_and_samples(tmp_path, tiny_text, capsys):
    code = main(small_run(tmp_path, tiny_text) + ["--preset", "llama-tiny", "--train.steps", "3"])
    assert code == 0
    run = tmp_path / "run"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert (run / "checkpoints" / "step_000003" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "best" / "model.safetensors").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 3 and "val_loss" in records[-1]
    assert all(r["train_loss"] > 0 for r in records)
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "trained 3 steps" in out and "--- sample from the evaluation at step 3 ---" in out
    assert f"loss plot: {run / 'loss.png'}" in out and "threads: " in out
    sample = out.split("at step 3 ---\n", 1)[1]
    assert len(sample.strip()) > 0

    cfg = saved_config(tmp_path)
    assert cfg["model"]["n_layers"] == 2 and cfg["train"]["steps"] == 3
    # The preset's placeholder vocabulary was sized to the character tokenizer.
    n_chars = len(set(tiny_text.read_text()))
    assert cfg["model"]["vocab_size"] == n_chars + 7


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_yaml_config_overrides_and_flags_override_the_file(tmp_path, tiny_text):
    config = tmp_path / "run.yaml"
    config.write_text(
        "preset: gpt2-tiny\n"
        "model:\n  n_layers: 1\n  attention:\n    n_heads: 2\n"
        "train:\n  lr: 3e-4\n  min_lr: 1.0e-5\n  steps: 2\n  schedule: constant\n"
    )
    args = small_run(tmp_path, tiny_text) + ["--config", str(config), "--train.steps", "1"]
    assert main(args) == 0
    cfg = saved_config(tmp_path)
    assert cfg["model"]["n_layers"] == 1 and cfg["model"]["attention"]["n_heads"] == 2
    assert cfg["model"]["position"] == "learned"  # from the file's preset, gpt2-tiny
    assert cfg["train"]["lr"] == 3e-4 and isinstance(cfg["train"]["lr"], float)
    assert cfg["train"]["schedule"] == "constant"
    assert cfg["train"]["steps"] == 1  # the flag wins over the file


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_preset_flag_wins_over_the_config_files_preset(tmp_path, tiny_text):
    config = tmp_path / "run.yaml"
    config.write_text("preset: gpt2-tiny\ntrain:\n  steps: 1\n")
    args = small_run(tmp_path, tiny_text) + ["--config", str(config), "--preset", "llama-tiny"]
    assert main(args) == 0
    cfg = saved_config(tmp_path)
    assert cfg["model"]["position"] == "rope" and cfg["train"]["steps"] == 1


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_flags_with_equals_and_nested_fields(tmp_path, tiny_text):
    args = small_run(tmp_path, tiny_text) + [
        "--preset=llama-tiny",
        "--model.n_layers=1",
        "--model.attention.n_kv_heads=1",
        "--train.steps=2",
        "--train.lr=2e-3",
        "--train.schedule=noam",
        "--train.min_lr=0",
    ]
    assert main(args) == 0
    cfg = saved_config(tmp_path)
    assert cfg["model"]["n_layers"] == 1 and cfg["model"]["attention"]["n_kv_heads"] == 1
    assert cfg["train"]["lr"] == 2e-3 and cfg["train"]["schedule"] == "noam"
    assert cfg["train"]["steps"] == 2


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_resume_continues_from_the_latest_checkpoint(tmp_path, tiny_text, capsys):
    base = small_run(tmp_path, tiny_text) + ["--preset", "llama-tiny", "--model.n_layers=1"]
    base += ["--train.log_every=1", "--train.schedule=constant"]
    assert main(base + ["--train.steps=2"]) == 0
    assert main(base + ["--train.steps=4", "--resume"]) == 0
    assert "trained 4 steps" in capsys.readouterr().out
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_are_valid_run_configs(recipe):
    """Every shipped recipe names known fields with well-typed values (no data is read)."""
    file = read_config_file(recipe)
    preset = file.pop("preset")
    configs = {"model": get_preset(preset), "train": TrainConfig(), "data": DataConfig()}
    run = RunConfig(**merge_sections(configs, file))
    for section, fields in file.items():
        for name, value in fields.items():
            if not isinstance(value, dict):
                assert getattr(getattr(run, section), name) == value, (section, name)


def test_a_finite_divergence_stops_the_run_in_one_line(tmp_path, tiny_text, capsys):
    """lr 3 (issue 42): the loss blows up far above ln V but stays finite; the run stops after
    a few steps with one line that says so and what to do, and no traceback."""
    flags = [
        "--train.lr",
        "3",
        "--train.min_lr",
        "0",
        "--train.warmup",
        "2",
        "--model.dropout",
        "0",
    ]
    assert main([*small_run(tmp_path, tiny_text), *flags, "--train.steps", "60"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("attnlab train: error: train loss ")
    assert "ln V = " in err and "steps in a row" in err and "--train.lr" in err
    assert "Traceback" not in err
