"""Fixtures for the training tests: a tiny corpus, one CPU thread, and a small-run factory.

Everything runs on one CPU thread: the results are then bit-reproducible, and a shared machine
does not slow the tests down with threads spinning against each other.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attnlab.models.presets import get_preset
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from tests.data import SHAKESPEARE

TASK_OF_ARCH = {"decoder": "clm", "encoder": "mlm", "encoder_decoder": "seq2seq"}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_text(tmp_path) -> Path:
    """The first 20k characters of Tiny Shakespeare (the fixture in tests/data) in tmp_path."""
    text = SHAKESPEARE.read_text()[:20_000]
    path = tmp_path / "tiny.txt"
    path.write_text(text)
    return path


@pytest.fixture
def make_run(tmp_path, tiny_text):
    """make_run(preset, out="run", model={...}, data={...}, **train) -> a small CPU RunConfig."""

    def make(preset: str = "llama-tiny", out: str = "run", model=None, data=None, **train):
        model_cfg = replace(get_preset(preset), **(model or {}))
        task = TASK_OF_ARCH[model_cfg.arch]
        source = str(tiny_text) if task != "seq2seq" else "synthetic:reverse"
        data_kw = dict(task=task, source=source, cache_dir=str(tmp_path / "cache"))
        data_kw.update(synthetic_n_val=16, synthetic_max_len=8)
        train_kw = dict(
            steps=4,
            batch_size=4,
            context=16,
            warmup=2,
            eval_every=1000,
            eval_batches=1,
            log_every=1,
            ckpt_every=1000,
            sample_tokens=8,
            device="cpu",
            out_dir=str(tmp_path / out),
            progress=False,
        )
        train_kw.update(train)
        data_kw.update(data or {})
        return RunConfig(model_cfg, TrainConfig(**train_kw), DataConfig(**data_kw))

    return make
