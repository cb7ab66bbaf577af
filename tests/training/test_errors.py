"""Mistakes in a run config fail early, with a ValueError that names the values involved."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attnlab.cli.__main__ import main
from attnlab.models.build import build_model
from attnlab.training.loop import train
from attnlab.training.tasks import build_task


def start(run, **kwargs):
    torch.manual_seed(0)
    return train(build_model(run.model), build_task(run), run, **kwargs)


def test_context_longer_than_the_model_positions(make_run):
    run = make_run("gpt2-tiny", context=200)  # learned positions: max_seq_len 128
    with pytest.raises(ValueError, match=r"train\.context=200.*max_seq_len=128"):
        start(run)


def test_tokenizer_vocabulary_larger_than_the_model_vocabulary(make_run):
    run = make_run("llama-tiny", model={"vocab_size": 20})
    n = build_task(run).tokenizer.vocab_size
    with pytest.raises(ValueError, match=rf"tokenizer has {n} tokens.*vocab_size is 20"):
        start(run)


def test_synthetic_sequences_longer_than_the_model_positions(make_run):
    run = make_run("transformer-tiny", data={"synthetic_max_len": 130})  # 131 > 128 positions
    with pytest.raises(ValueError, match=r"synthetic_max_len=130.* 131 tokens.*max_seq_len=128"):
        start(run)


@pytest.mark.parametrize("name", ["ckpt_every", "eval_every", "log_every", "steps", "grad_accum"])
def test_train_counts_must_be_positive(make_run, name):
    with pytest.raises(ValueError, match=rf"train\.{name} must be >= 1, got 0"):
        make_run(**{name: 0})


@pytest.mark.parametrize("name", ["warmup", "grad_clip", "weight_decay", "sample_tokens"])
def test_train_amounts_must_not_be_negative(make_run, name):
    with pytest.raises(ValueError, match=rf"train\.{name} must be >= 0, got -1"):
        make_run(**{name: -1})


def test_fp16_needs_cuda(make_run):
    with pytest.raises(ValueError, match="fp16.*needs CUDA.*bf16"):
        start(make_run("llama-tiny", precision="fp16", device="cpu"))


def test_task_and_architecture_must_match(make_run):
    run = make_run("llama-tiny")
    run = replace(run, data=replace(run.data, task="mlm"))
    with pytest.raises(ValueError, match=r"'mlm'.*encoder.*model\.arch is 'decoder'"):
        start(run)


def test_a_split_too_short_for_the_context_fails_before_training(make_run, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be, that is the question. " * 20)  # 860 characters
    run = make_run("llama-tiny", context=64, data={"source": str(short), "val_fraction": 0.05})
    state_file = tmp_path / "run" / "metrics.jsonl"
    # 5% of 860 character tokens: a validation split of 43, shorter than one window of 64 + 1.
    with pytest.raises(ValueError, match=r"validation split.* 43 tokens.*context 64.*at least 65"):
        start(run)
    assert not state_file.exists()  # no step was taken before the error


def test_resume_with_another_model_config_names_the_fields(make_run):
    run = make_run("llama-tiny", steps=2)
    start(run)
    changed = replace(run.model, n_layers=1)
    with pytest.raises(ValueError, match=r"n_layers: checkpoint 2 vs now 1"):
        start(replace(run, model=changed), resume=True)
    changed = replace(run.model, attention=replace(run.model.attention, n_kv_heads=4))
    with pytest.raises(ValueError, match=r"attention\.n_kv_heads: checkpoint 2 vs now 4"):
        start(replace(run, model=changed), resume=True)


def test_resume_without_a_run_says_nothing_to_resume(make_run):
    run = make_run("llama-tiny")
    with pytest.raises(ValueError, match="nothing to resume in .*does not exist.*without --resume"):
        start(run, resume=True)
    assert not Path(run.train.out_dir).exists()  # nothing created


class Killed(Exception):
    """A crash part-way through a run (nothing saves on it, unlike Ctrl-C)."""


def killed_at(step: int):
    def callback(state, record):
        if state.step == step:
            raise Killed

    return callback


def test_a_run_killed_before_its_first_checkpoint_is_no_dead_end(make_run):
    """Its metrics.jsonl makes the out_dir a run, with nothing to resume: both a rerun and
    --resume say to pass --overwrite, which starts it afresh (issue 31)."""
    run = make_run("llama-tiny", steps=4, sample_tokens=0)  # one checkpoint: at the end
    with pytest.raises(Killed):
        start(run, callbacks=(killed_at(2),))
    with pytest.raises(ValueError) as rerun:
        start(run)
    assert "--overwrite" in str(rerun.value) and "pass --resume" not in str(rerun.value)
    assert "before its first checkpoint" in str(rerun.value)
    with pytest.raises(ValueError, match=r"nothing to resume in .*first checkpoint.*--overwrite"):
        start(run, resume=True)
    assert start(run, overwrite=True).step == 4


def cli(tmp_path, tiny_text, *extra):
    return main(
        [
            "train",
            "--preset=llama-tiny",
            f"--data.source={tiny_text}",
            f"--data.cache_dir={tmp_path / 'cache'}",
            f"--train.out_dir={tmp_path / 'run'}",
            "--train.progress=false",
            "--train.steps=1",
            *extra,
        ]
    )


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_unknown_field_in_a_config_file(tmp_path, tiny_text, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  lrr: 0.1\n")
    assert cli(tmp_path, tiny_text, f"--config={config}") == 2
    err = capsys.readouterr().err
    assert "TrainConfig has no field 'lrr'" in err and "'lr'" in err
    config.write_text("trian:\n  lr: 0.1\n")
    assert cli(tmp_path, tiny_text, f"--config={config}") == 2
    assert "unknown config sections ['trian']" in capsys.readouterr().err
    config.write_text("model:\n  attention:\n    n_head: 2\n")
    assert cli(tmp_path, tiny_text, f"--config={config}") == 2
    assert "AttentionConfig has no field 'n_head'" in capsys.readouterr().err


def test_badly_typed_value_in_a_config_file(tmp_path, tiny_text, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  steps: many\n")
    assert cli(tmp_path, tiny_text, f"--config={config}") == 2
    err = capsys.readouterr().err
    assert "steps" in err and "'many'" in err


def test_unknown_flag(tmp_path, tiny_text, capsys):
    with pytest.raises(SystemExit) as info:
        cli(tmp_path, tiny_text, "--train.lrr=0.1")
    assert info.value.code == 2
    assert "unrecognized arguments: --train.lrr=0.1" in capsys.readouterr().err


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_bad_flag_values(tmp_path, tiny_text, capsys):
    assert cli(tmp_path, tiny_text, "--train.schedule=linear") == 2
    assert "'linear'" in capsys.readouterr().err
    assert cli(tmp_path, tiny_text, "--train.steps=0") == 2
    assert "train.steps must be >= 1, got 0" in capsys.readouterr().err
    assert cli(tmp_path, tiny_text, "--preset=gpt5") == 2
    assert "unknown preset 'gpt5'" in capsys.readouterr().err
