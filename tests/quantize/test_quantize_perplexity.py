"""Quantizing a trained model barely moves its validation perplexity (slow: trains one).

A 2-layer Llama (d_model 64) learns Tiny Shakespeare characters for 250 steps with attnlab's own
training loop (~25 s on one CPU thread), then is quantized; targets: perplexity rises at most 1%
with int8 and at most 5% with int4 (group 32), on the default (kernel, bf16) path and on the
reference (dequantize + fp32 F.linear) path alike.
"""

import copy
from dataclasses import replace

import pytest
import torch

from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.quantize import quantize_model
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from attnlab.training.loop import train
from attnlab.training.tasks import build_task
from tests.data import SHAKESPEARE

EVAL_BATCHES = 16  # x 16 sequences x 64 characters, the same seeded batches for every model
MAX_RISE = {"int8": 0.01, "int4": 0.05}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(model, task) after 250 steps, on one thread (reproducible, and kind to shared CPUs)."""
    tmp = tmp_path_factory.mktemp("shakespeare")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llama = get_preset("llama-char")
    model_cfg = replace(llama, d_model=64, n_layers=2, d_ff=192, max_seq_len=128)
    data = DataConfig(
        source=str(SHAKESPEARE), tokenizer="char", max_chars=400_000, cache_dir=str(tmp / "cache")
    )
    steps = TrainConfig(
        steps=250,
        batch_size=16,
        context=64,
        lr=3e-3,
        min_lr=3e-4,
        warmup=30,
        eval_every=10**6,
        eval_batches=1,
        log_every=50,
        ckpt_every=10**6,
        sample_tokens=0,
        device="cpu",
        out_dir=str(tmp / "run"),
        progress=False,
    )
    run = RunConfig(model_cfg, steps, data)
    task = build_task(run)
    run = replace(run, model=replace(run.model, vocab_size=task.tokenizer.vocab_size))
    torch.manual_seed(0)
    model = build_model(run.model)
    try:
        train(model, task, run)
    finally:
        torch.set_num_threads(threads)
    return model.eval(), task


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_validation_perplexity_rises_little(trained, scheme):
    model, task = trained
    base = task.evaluate(model, EVAL_BATCHES, "cpu")["val_ppl"]
    assert base < 12  # it learned something (uniform over ~65 characters would be 65)
    quantized = quantize_model(copy.deepcopy(model), scheme, 32)
    rise = task.evaluate(quantized, EVAL_BATCHES, "cpu")["val_ppl"] / base - 1
    for m in quantized.modules():
        if hasattr(m, "use_kernel"):
            m.use_kernel = False
    rise_reference = task.evaluate(quantized, EVAL_BATCHES, "cpu")["val_ppl"] / base - 1
    print(
        f"{scheme}: val ppl {base:.3f}, rise {rise:+.3%} (kernel), "
        f"{rise_reference:+.3%} (reference)"
    )
    assert rise <= MAX_RISE[scheme] and rise_reference <= MAX_RISE[scheme]
