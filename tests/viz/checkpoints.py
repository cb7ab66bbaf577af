"""A tiny checkpoint directory for tests, written in the format `open_checkpoint` reads
(config.json with the model config, model.safetensors, tokenizer.json)."""

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_model

from attnlab.configs import to_dict
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.tokenizer import train_char_tokenizer

TEXT = "def attention(q, k, v):\n    return softmax(q @ k.T) @ v\n"


def make_checkpoint(
    path: Path, preset: str = "llama-tiny", seed: int = 0, n_labels: int | None = None
) -> Path:
    """Random weights of `preset` sized to a character tokenizer of TEXT, saved at `path`
    (with `n_labels`: an encoder preset as a sequence classifier)."""
    tokenizer = train_char_tokenizer([TEXT])
    cfg = replace(get_preset(preset), vocab_size=tokenizer.vocab_size)
    torch.manual_seed(seed)
    model = build_model(cfg, n_labels=n_labels)
    path.mkdir(parents=True, exist_ok=True)
    run = {"model": to_dict(cfg)} | ({} if n_labels is None else {"n_labels": n_labels})
    (path / "config.json").write_text(json.dumps(run))
    save_model(model, str(path / "model.safetensors"))
    tokenizer.save(path / "tokenizer.json")
    return path
