"""Checkpoints: one directory per save, written atomically, holding only tensors and plain data.

    step_000500/
      config.json          the run config: {"model": ..., "train": ..., "data": ...}
      model.safetensors    weights (tied matrices stored once)
      optimizer.pt         AdamW state: tensors, numbers and lists only
      rng.pt               torch RNG state and the data generator's state (the data position)
      trainer_state.json   step, best validation loss, ...
      tokenizer.json       the tokenizer (HF fast-tokenizer format)

A save goes to `step_000500.tmp/` first and is renamed into place only when complete, then the
`latest` pointer is replaced (os.replace is atomic), so a run killed at any moment leaves the
previous checkpoint loadable. Loading uses safetensors and `torch.load(weights_only=True)`: no
pickled code from a checkpoint ever runs.
"""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from attnlab.configs import to_dict

LATEST = "latest"


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2))


def save_checkpoint(
    path: Path,
    model: nn.Module | dict,
    optimizer: torch.optim.Optimizer | dict | None,
    run,
    trainer_state: dict,
    rng: dict | None = None,
    tokenizer=None,
) -> Path:
    """Write a complete checkpoint directory at `path` atomically (via `path.tmp`).

    `model` and `optimizer` may also be full state dicts (gathered from FSDP shards; a tied
    matrix under one name only). `tokenizer` (with a .save(path)) is stored as tokenizer.json,
    so a checkpoint generates text on its own."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_json(tmp / "config.json", to_dict(run))
    weights = model
    if isinstance(model, nn.Module):
        weights = without_tied_names(model.state_dict(), model)  # a tied matrix stored once
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    if optimizer is not None:
        state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
        torch.save(state, tmp / "optimizer.pt")
    if rng is not None:
        torch.save(rng, tmp / "rng.pt")
    _write_json(tmp / "trainer_state.json", trainer_state)
    if tokenizer is not None:
        tokenizer.save(tmp / "tokenizer.json")
    for f in tmp.iterdir():  # data on disk before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if path.exists():
        old = path.with_name(path.name + ".old")
        os.replace(path, old)
        shutil.rmtree(old)
    os.replace(tmp, path)
    return path


def read_checkpoint(path: Path) -> dict:
    """A checkpoint's files as plain data, read without a model.

    Returns:
        {"run": config dict, "trainer": trainer_state, "rng": dict or None,
         "weights": {name: tensor}, "optimizer": optimizer state dict or None}.
    """
    path = Path(path)
    if not (path / "model.safetensors").is_file():
        raise ValueError(f"{str(path)!r} is not a checkpoint (no model.safetensors)")
    optimizer, rng = path / "optimizer.pt", path / "rng.pt"
    return {
        "run": json.loads((path / "config.json").read_text()),
        "trainer": json.loads((path / "trainer_state.json").read_text()),
        "rng": torch.load(rng, weights_only=True) if rng.is_file() else None,
        "weights": load_file(path / "model.safetensors"),
        "optimizer": torch.load(optimizer, weights_only=True) if optimizer.is_file() else None,
    }


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of names that share one parameter (a tied embedding and LM head), in model order."""
    groups: dict[int, list[str]] = {}  # keyed by id(): tensors compare elementwise
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def without_tied_names(weights: dict, model: nn.Module) -> dict:
    """`weights` with a tied matrix under its first name only, so that it is stored once."""
    drop = {name for names in tied_names(model) for name in names[1:]}
    return {k: v for k, v in weights.items() if k not in drop}


def with_tied_names(weights: dict, model: nn.Module) -> dict:
    """`weights` with a tied matrix under all of its names (it is stored under any one)."""
    weights = dict(weights)
    for names in tied_names(model):
        stored = [n for n in names if n in weights]
        if stored:
            weights.update({n: weights[stored[0]] for n in names if n not in weights})
    return weights


def load_weights(model: nn.Module, weights: dict, where: str = "the checkpoint") -> None:
    """Copy `weights` into `model`, ValueError naming any missing or unexpected names."""
    missing, unexpected = model.load_state_dict(with_tied_names(weights, model), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{where} does not fit this model: "
            f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[dict, dict, dict | None]:
    """Load weights (and optimizer state) into existing objects.

    Returns:
        (run config as a dict, trainer_state, rng dict or None).
    """
    files = read_checkpoint(path)
    load_weights(model, files["weights"], f"checkpoint {str(path)!r}")
    if optimizer is not None:
        optimizer.load_state_dict(files["optimizer"])
    return files["run"], files["trainer"], files["rng"]


class CheckpointDir:
    """The checkpoints of one run: `step_NNNNNN/` directories, a `latest` pointer, and `best/`.

    Args:
        root: the run's checkpoint directory.  keep_last: how many step checkpoints to keep.
    """

    def __init__(self, root: Path, keep_last: int = 2):
        self.root, self.keep_last = Path(root), keep_last
        self.root.mkdir(parents=True, exist_ok=True)
        # A save killed between its two renames leaves `X.old` (complete) and no `X`: put it back.
        for old in self.root.glob("*.old"):
            target = old.with_name(old.name.removesuffix(".old"))
            if target.exists():
                shutil.rmtree(old)
            else:
                os.replace(old, target)
        for leftover in self.root.glob("*.tmp"):  # a save that was interrupted
            shutil.rmtree(leftover, ignore_errors=True)

    def latest(self) -> Path | None:
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        return self.root / pointer.read_text().strip()

    def save(self, step: int, *args, **kwargs) -> Path:
        path = save_checkpoint(self.root / f"step_{step:06d}", *args, **kwargs)
        tmp = self.root / f"{LATEST}.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, self.root / LATEST)
        for old in sorted(self.root.glob("step_*[0-9]"))[: -self.keep_last]:
            shutil.rmtree(old)
        return path

    def save_best(self, *args, **kwargs) -> Path:
        return save_checkpoint(self.root / "best", *args, **kwargs)


def load_pretrained(path: str | Path, device: str = "cpu"):
    """A checkpoint directory -> (model in eval mode, tokenizer or None, run config dict).

    The model is built on the meta device and its weights assigned from model.safetensors. A
    quantized checkpoint (written by `attnlab quantize`) loads with its quantized layers.
    """
    from attnlab.configs import from_dict
    from attnlab.quantize.handler import load_quantized, read_scheme
    from attnlab.models.build import build_model
    from attnlab.models.config import ModelConfig
    from attnlab.models.weights import load_safetensors
    from attnlab.tokenizer import Tokenizer

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ValueError(
            f"{str(path)!r} is not a checkpoint (needs config.json and model.safetensors)"
        )
    if read_scheme(path / "model.safetensors") is not None:  # the scheme is in its metadata
        return load_quantized(path, device=device)
    run = json.loads((path / "config.json").read_text())
    with torch.device("meta"):
        model = build_model(from_dict(ModelConfig, run["model"]))
    load_safetensors(model, path / "model.safetensors", device)
    tokenizer = Tokenizer.from_file(path) if (path / "tokenizer.json").is_file() else None
    return model.to(device).eval(), tokenizer, run
