"""Whole checkpoint directories in either format, and conversion between them.

    attnlab directory:  config.json {"model": ModelConfig, ["n_labels": N]} + model.safetensors
                        (+ tokenizer.json), as checkpoint.py writes it
    HF directory:       config.json {"model_type": ..., "architectures": [...]} + model.safetensors
                        (or shards) (+ tokenizer.json)

`convert("hf", src, "attnlab", dst)` and back are what `attnlab convert` runs.
"""

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_model
from torch import nn

from attnlab.configs import from_dict, to_dict
from attnlab.interop.hf import common
from attnlab.interop.hf.auto import load_hf, load_tokenizer, save_hf
from attnlab.models.build import build_model
from attnlab.models.config import ModelConfig
from attnlab.models.encoder import EncoderForClassification
from attnlab.models.weights import load_weights
from attnlab.tokenizer import Tokenizer

Format = Literal["hf", "attnlab"]
FORMATS = ("hf", "attnlab")


def detect_format(path: str | Path) -> Format:
    """ "attnlab" when config.json holds {"model": ...}, "hf" when it names a model_type."""
    hf = common.read_config(path)
    if isinstance(hf.get("model"), dict):
        return "attnlab"
    if "model_type" in hf or "architectures" in hf:
        return "hf"
    raise ValueError(
        f"{str(path)!r}: config.json is neither an attnlab checkpoint config "
        "(a 'model' section) nor an HF one (model_type / architectures)"
    )


def load_attnlab(path: str | Path, device: str = "cpu"):
    """An attnlab checkpoint directory -> (model in eval mode, ModelConfig, Tokenizer or None)."""
    path = Path(path)
    run = common.read_config(path)
    if not isinstance(run.get("model"), dict):
        raise ValueError(f"{str(path / common.CONFIG)!r} has no 'model' section")
    if not (path / common.WEIGHTS).is_file():
        raise ValueError(f"{str(path)!r} has no {common.WEIGHTS}")
    cfg = from_dict(ModelConfig, run["model"])
    with torch.device("meta"):
        model = build_model(cfg, n_labels=run.get("n_labels"))
    load_weights(model, load_file(str(path / common.WEIGHTS), device=device))
    return model.eval(), cfg, _tokenizer_or_none(path)


def save_attnlab(
    model: nn.Module, cfg: ModelConfig, path: str | Path, tokenizer: Tokenizer | None = None
) -> Path:
    """Write an attnlab checkpoint directory that `attnlab.checkpoint.load_pretrained` reads
    (a classifier also records its n_labels)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    run: dict = {"model": to_dict(cfg)}
    if isinstance(model, EncoderForClassification):
        run["n_labels"] = model.classifier.out_features
    (path / common.CONFIG).write_text(json.dumps(run, indent=2) + "\n")
    save_model(model, str(path / common.WEIGHTS))  # tied tensors stored once
    if tokenizer is not None:
        tokenizer.save(path / "tokenizer.json")
    return path


def load_any(path: str | Path, layout: str = "half", dtype: torch.dtype | None = None):
    """Either kind of directory -> (attnlab model, ModelConfig, Tokenizer or None)."""
    if detect_format(path) == "attnlab":
        if layout != "half":
            raise ValueError("layout applies to HF checkpoints (an attnlab one records its own)")
        model, cfg, tok = load_attnlab(path)
        return (model if dtype is None else model.to(dtype)), cfg, tok
    model, cfg = load_hf(path, layout=layout, dtype=dtype)
    return model, cfg, _tokenizer_or_none(path)


def _tokenizer_or_none(path: Path) -> Tokenizer | None:
    return load_tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None


def convert(
    src_format: Format, src: str | Path, dst_format: Format, dst: str | Path, layout: str = "half"
) -> Path:
    """Convert a checkpoint directory between the attnlab and HF formats.

    Args:
        src_format, dst_format: "hf" or "attnlab" (they may be equal: a re-save).
        src, dst: directories.
        layout: the RoPE layout of the attnlab model read from or written to an HF Llama-family
            checkpoint (the q/k rows are permuted; HF itself is always "half").

    Returns:
        dst.
    """
    for name, fmt in (("from", src_format), ("to", dst_format)):
        if fmt not in FORMATS:
            raise ValueError(f"--{name} format {fmt!r} is not one of {FORMATS}")
    found = detect_format(src)
    if found != src_format:
        raise ValueError(f"{str(src)!r} is an {found} checkpoint, not {src_format}")
    if Path(dst).resolve() == Path(src).resolve():
        raise ValueError(f"the output directory is the input directory ({str(src)!r})")
    model, cfg, tokenizer = load_any(src, layout=layout if src_format == "hf" else "half")
    if dst_format == "attnlab":
        return save_attnlab(model, cfg, dst, tokenizer)
    return save_hf(model, cfg, dst, tokenizer)
