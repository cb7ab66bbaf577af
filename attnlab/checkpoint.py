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

`open_checkpoint` is the one way to get a model from disk: every command and library call that
opens a checkpoint uses it, for every kind (a training checkpoint, a model-only one written by
`save_pretrained`, a quantized one, a classifier, a vision model, an HF directory, or a run
directory resolved to its latest checkpoint), and gets the same `Loaded` back.
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from attnlab.configs import from_dict, to_dict
from attnlab.interop.hf.auto import load_hf, load_tokenizer
from attnlab.models.build import build_model
from attnlab.models.config import ModelConfig
from attnlab.models.encoder import EncoderForClassification
from attnlab.models.weights import load_weights, with_tied_names, without_tied_names
from attnlab.quantize.handler import (
    QuantScheme,
    linear_names,
    make_scheme,
    read_heads_quantized,
    read_scheme,
    swap_modules,
)
from attnlab.tokenizer import Tokenizer

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


def copy_weights(model: nn.Module, weights: dict, where: str = "the checkpoint") -> None:
    """Copy `weights` into the existing parameters of `model` (an optimizer keeps pointing at
    them; compare models.weights.load_weights, which adopts the tensors of a model built on
    the meta device). ValueError naming any missing or unexpected names."""
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
    copy_weights(model, files["weights"], f"checkpoint {str(path)!r}")
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


# --- opening a checkpoint as a model: the one loader --------------------------------------------
CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"


@dataclass(frozen=True)
class Loaded:
    """What `open_checkpoint` returns.

    Attributes:
        model: in eval mode, on the device asked for (quantized layers where the file says so).
        config: its ModelConfig.
        tokenizer: from tokenizer.json beside the weights, or None.
        run: the run config dict of config.json ({"model": ..., and "train", "data" for a
            training checkpoint, "n_labels" for a classifier}).
        path: the checkpoint directory that was read (a run directory resolved to it).
    """

    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer | None
    run: dict
    path: Path


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or the latest one under a run's out_dir or checkpoints/."""
    path = Path(path)
    if (path / CONFIG).is_file():
        return path
    for root in (path, path / "checkpoints"):
        if (root / LATEST).is_file():
            return root / (root / LATEST).read_text().strip()
    return path  # open_checkpoint says what is missing


def is_hf_config(config: dict) -> bool:
    """Whether a config.json is an HF one (model_type / architectures, no attnlab "model")."""
    return not isinstance(config.get("model"), dict) and (
        "model_type" in config or "architectures" in config
    )


def open_checkpoint(
    path: str | Path,
    device: str | torch.device = "cpu",
    *,
    scheme: str | None = None,
    group_size: int | None = None,
    layout: str = "half",
    dtype: torch.dtype | None = None,
) -> Loaded:
    """Open any checkpoint directory as a model (built on meta, weights assigned, eval mode).

    Args:
        path: a checkpoint directory (attnlab or HF), or a run's out_dir or checkpoints/.
        device: where the weights go.
        scheme, group_size: the quantization the caller expects (ValueError naming both when
            the file holds another); None accepts what the file holds, float included.
        layout: the RoPE layout of a model read from an HF Llama-family directory.
        dtype: cast floating-point weights to this dtype (default: as stored).

    Returns:
        Loaded(model, config, tokenizer, run, path).
    """
    path = resolve_checkpoint(path)
    if not (path / CONFIG).is_file():
        raise ValueError(
            f"{str(path)!r} is not a checkpoint (no {CONFIG}; give a checkpoint directory, "
            "or a run directory whose checkpoints/latest names one)"
        )
    try:
        config = json.loads((path / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path / CONFIG)!r} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path / CONFIG)!r} must hold a JSON object")
    if is_hf_config(config):
        if scheme is not None:
            raise ValueError(f"{str(path)!r} is an HF directory, but {scheme} was asked for")
        return _open_hf(path, device, layout, dtype)
    if layout != "half":
        raise ValueError(
            f"layout={layout!r} applies to HF checkpoints; {str(path)!r} records its own"
        )
    if not isinstance(config.get("model"), dict):
        raise ValueError(f"{str(path / CONFIG)!r} has no 'model' section (nor an HF model_type)")
    if not (path / WEIGHTS).is_file():
        raise ValueError(f"{str(path)!r} is not a checkpoint (no {WEIGHTS})")
    found = _expected_scheme(path / WEIGHTS, scheme, group_size)
    return _open_attnlab(path, config, found, device, dtype)


def _open_hf(path: Path, device, layout: str, dtype: torch.dtype | None) -> Loaded:
    """An HF directory through its family converter (interop.hf); run = {"model": ...}."""
    model, cfg = load_hf(path, layout=layout, dtype=dtype)
    run: dict = {"model": to_dict(cfg)}
    if isinstance(model, EncoderForClassification):
        run["n_labels"] = model.classifier.out_features
    tokenizer = load_tokenizer(path) if (path / TOKENIZER).is_file() else None
    return Loaded(model.to(device).eval(), cfg, tokenizer, run, path)


def _open_attnlab(
    path: Path, run: dict, scheme: QuantScheme | None, device, dtype: torch.dtype | None
) -> Loaded:
    """Build the model of `run` on meta (a classifier when it has n_labels; the quantized
    Linears of `scheme`), then assign the tensors of model.safetensors."""
    cfg = from_dict(ModelConfig, run["model"])
    with torch.device("meta"):
        model = build_model(cfg, n_labels=run.get("n_labels"))
    if scheme is not None:  # the same Linears as when it was quantized, still empty
        heads = read_heads_quantized(path / WEIGHTS)
        names = linear_names(model, heads, scheme.group_size)
        swap_modules(model, scheme.name, scheme.group_size, names)
    load_weights(model, load_file(str(path / WEIGHTS), device=str(device)))
    if dtype is not None:
        model = model.to(dtype)
    tokenizer = Tokenizer.from_file(path) if (path / TOKENIZER).is_file() else None
    return Loaded(model.to(device).eval(), cfg, tokenizer, run, path)


def _expected_scheme(file: Path, scheme: str | None, group_size: int | None) -> QuantScheme | None:
    """The scheme in `file`'s metadata (None: float weights), checked against the one asked
    for (if any)."""
    found = read_scheme(file)
    if scheme is None:
        return found
    if group_size is None and found is not None:
        group_size = found.group_size  # "int4" without a group size accepts the file's
    wanted = make_scheme(scheme, group_size)
    if found is None:
        raise ValueError(
            f"{str(file)!r} holds unquantized (float) weights, but {wanted} was asked for"
        )
    if wanted != found:
        raise ValueError(f"{str(file)!r} holds {found} weights, but {wanted} was asked for")
    return found


def save_pretrained(
    path: str | Path,
    model: nn.Module,
    config: ModelConfig,
    tokenizer: Tokenizer | None = None,
    run: dict | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write a model-only checkpoint directory that `open_checkpoint` reads.

    config.json holds `run` (default: none but the model) with its "model" section set to
    `config` and, for a classifier, "n_labels"; model.safetensors stores a tied tensor once
    (under its first name, as save_checkpoint does), with `metadata` (a quantized model's
    scheme); tokenizer.json is written when given.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    run = {**(run or {}), "model": to_dict(config)}
    if isinstance(model, EncoderForClassification):
        run["n_labels"] = model.classifier.out_features
    _write_json(path / CONFIG, run)
    weights = without_tied_names(model.state_dict(), model)  # a tied matrix stored once
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / WEIGHTS), metadata)
    if tokenizer is not None:
        tokenizer.save(path / TOKENIZER)
    return path
