"""Quantized checkpoints: write one, and quantize a float checkpoint into a new directory.

    float checkpoint ──open_checkpoint──> model ──quantize_model──> model ──save_quantized──> dir

The quantization itself (which layers, the two steps) lives in attnlab/quantize; opening a
quantized checkpoint is `attnlab.checkpoint.open_checkpoint`, which reads the scheme from the
safetensors metadata that `save_quantized` writes. This module sits above both, so that the
quantization package never imports the checkpoint layer.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from attnlab.checkpoint import (
    WEIGHTS,
    check_output_dir,
    open_checkpoint,
    plain_model,
    resolve_checkpoint,
    save_pretrained,
)
from attnlab.configs import from_dict
from attnlab.models.config import ModelConfig
from attnlab.quantize.handler import (
    DEFAULT_GROUP_SIZE,
    LogitError,
    Scheme,
    float_misfits,
    head_names,
    linear_names,
    logit_error,
    make_scheme,
    quantize_model,
    random_inputs,
    read_scheme,
    scheme_metadata,
)
from attnlab.quantize.int8 import Int8Linear
from attnlab.tokenizer import Tokenizer


def save_quantized(
    model: nn.Module,
    path: str | Path,
    scheme: Scheme,
    group_size: int | None,
    run: dict,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write a quantized checkpoint directory: config.json, model.safetensors, tokenizer.json.

    Args:
        model: already quantized with this scheme.  run: the run config dict (config.json).
        tokenizer: saved beside the weights as tokenizer.json, or None.
    """
    s = make_scheme(scheme, group_size)
    # A float Linear the scheme could have quantized is a head kept in float (heads=False);
    # an int4 model may hold int8 heads (a Q4_1 GGUF opened with scheme="int4").
    heads = not linear_names(model, group_size=s.group_size)
    int8_heads = [isinstance(model.get_submodule(n), Int8Linear) for n in head_names(model)]
    if s.name == "int4" and int8_heads and all(int8_heads):
        heads = "int8"
    config = from_dict(ModelConfig, run["model"])
    return save_pretrained(path, model, config, tokenizer, run, scheme_metadata(s, heads))


@dataclass(frozen=True)
class QuantizeReport:
    scheme: str
    error: LogitError
    float_bytes: int  # the float checkpoint's model.safetensors
    quantized_bytes: int  # the quantized checkpoint's model.safetensors
    n_quantized: int  # Linear layers quantized
    kept_float: dict[str, int]  # {name: in_features} of Linears int4's group size does not fit


def quantize_checkpoint(
    ckpt: str | Path,
    out: str | Path,
    scheme: Scheme,
    group_size: int | None = DEFAULT_GROUP_SIZE,
    n_inputs: int = 4,
    seq_len: int = 64,
    seed: int = 0,
    heads: bool = True,
    overwrite: bool = False,
) -> QuantizeReport:
    """Quantize a float checkpoint directory into `out`, measuring the logit error.

    The error is measured on `n_inputs` random sequences of min(seq_len, max_seq_len) tokens.
    A non-empty `out` is refused unless `overwrite` (then only its checkpoint files change).
    """
    ckpt = resolve_checkpoint(ckpt)
    if Path(out).resolve() == ckpt.resolve():
        raise ValueError(f"--out must differ from --ckpt (both {str(ckpt)!r})")
    check_output_dir(out, overwrite)
    s = make_scheme(scheme, group_size)
    found = read_scheme(ckpt / WEIGHTS) if (ckpt / WEIGHTS).is_file() else None
    if found is not None:
        raise ValueError(f"{str(ckpt)!r} is already quantized ({found}); quantize a float one")
    loaded = plain_model(open_checkpoint(ckpt), "quantize its base checkpoint instead")
    model, cfg = loaded.model, loaded.config
    if (ckpt / WEIGHTS).is_file():
        float_bytes = (ckpt / WEIGHTS).stat().st_size
    else:  # a file of another format (GGUF): the float tensors' own bytes
        tensors = {t.data_ptr(): t for t in model.state_dict().values()}  # a tied head once
        float_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    ids = random_inputs(cfg.vocab_size, n_inputs, min(seq_len, cfg.max_seq_len), seed)
    # An encoder-decoder reads the same ids as source and target.
    args = (ids, ids) if cfg.arch == "encoder_decoder" else (ids,)
    with torch.no_grad():
        reference = model(*args)  # (n, T, V)
        names = linear_names(model, heads, s.group_size)
        kept_float = float_misfits(model, heads, s.group_size)
        quantize_model(model, s.name, s.group_size, heads)
        error = logit_error(reference, model(*args))
    save_quantized(model, out, s.name, s.group_size, loaded.run, loaded.tokenizer)
    return QuantizeReport(
        str(s),
        error,
        float_bytes,
        (Path(out) / WEIGHTS).stat().st_size,
        len(names),
        kept_float,
    )
