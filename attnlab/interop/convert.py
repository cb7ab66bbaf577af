"""Whole checkpoint directories in either format, and conversion between them.

    attnlab directory:  config.json {"model": ModelConfig, ["n_labels": N]} + model.safetensors
                        (+ tokenizer.json), as attnlab.checkpoint.save_pretrained writes it
    HF directory:       config.json {"model_type": ..., "architectures": [...]} + model.safetensors
                        (or shards) (+ tokenizer.json)

Both are opened with `attnlab.checkpoint.open_checkpoint`; `convert("hf", src, "attnlab", dst)`
and back are what `attnlab convert` runs.
"""

from pathlib import Path
from typing import Literal

from attnlab.checkpoint import (
    check_output_dir,
    open_checkpoint,
    resolve_checkpoint,
    save_pretrained,
)
from attnlab.interop.hf import common
from attnlab.interop.hf.auto import save_hf
from attnlab.quantize import Int4Linear, Int8Linear

QUANTIZED = (Int8Linear, Int4Linear)

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


def convert(
    src_format: Format,
    src: str | Path,
    dst_format: Format,
    dst: str | Path,
    layout: str = "half",
    overwrite: bool = False,
) -> Path:
    """Convert a checkpoint directory between the attnlab and HF formats.

    Args:
        src_format, dst_format: "hf" or "attnlab" (they may be equal: a re-save).
        src, dst: directories (src may be a run directory: its latest checkpoint).
        layout: the RoPE layout of the attnlab model read from or written to an HF Llama-family
            checkpoint (the q/k rows are permuted; HF itself is always "half").
        overwrite: write into a non-empty dst (refused otherwise); only the files a
            checkpoint is made of are replaced there, nothing else is deleted.

    Returns:
        dst.
    """
    for name, fmt in (("from", src_format), ("to", dst_format)):
        if fmt not in FORMATS:
            raise ValueError(f"--{name} format {fmt!r} is not one of {FORMATS}")
    src = resolve_checkpoint(src)  # a run directory: its latest checkpoint
    found = detect_format(src)
    if found != src_format:
        raise ValueError(f"{str(src)!r} is an {found} checkpoint, not {src_format}")
    if Path(dst).resolve() == Path(src).resolve():
        raise ValueError(f"the output directory is the input directory ({str(src)!r})")
    check_output_dir(dst, overwrite)
    loaded = open_checkpoint(src, layout=layout if src_format == "hf" else "half")
    quantized = [n for n, m in loaded.model.named_modules() if isinstance(m, QUANTIZED)]
    if quantized:  # neither format written here records a scheme: it would not open again
        kind = type(loaded.model.get_submodule(quantized[0])).__name__
        raise ValueError(
            f"{str(src)!r} holds quantized weights ({quantized[0]} is an {kind}); convert "
            "writes float weights: convert the float checkpoint it was quantized from"
        )
    if dst_format == "attnlab":
        return save_pretrained(dst, loaded.model, loaded.config, loaded.tokenizer)
    return save_hf(loaded.model, loaded.config, dst, loaded.tokenizer)
