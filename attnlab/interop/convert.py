"""Whole checkpoint directories in either format, and conversion between them.

    attnlab directory:  config.json {"model": ModelConfig, ["n_labels": N]} + model.safetensors
                        (+ tokenizer.json), as attnlab.checkpoint.save_pretrained writes it
    HF directory:       config.json {"model_type": ..., "architectures": [...]} + model.safetensors
                        (or shards) (+ tokenizer.json)
    GGUF file:          llama.cpp's one-file format (llama family; interop/gguf/): read
                        dequantized to fp32, written as f32, f16, q8_0 or (an int4 model) q4_1;
                        gguf -> gguf keeps the source's tensor types and general.* metadata
                        where the type asked allows (interop/gguf/writer.py)

Both are opened with `attnlab.checkpoint.open_checkpoint`; `convert("hf", src, "attnlab", dst)`
and back are what `attnlab convert` runs.
"""

from pathlib import Path
from typing import Literal

from attnlab.checkpoint import (
    check_output_dir,
    open_checkpoint,
    plain_model,
    resolve_checkpoint,
    save_pretrained,
)
from attnlab.interop.gguf import save_gguf
from attnlab.interop.hf import common
from attnlab.interop.hf.auto import save_hf
from attnlab.quantize import Int4Linear, Int8Linear

QUANTIZED = (Int8Linear, Int4Linear)

Format = Literal["hf", "attnlab", "gguf"]
FORMATS = ("hf", "attnlab", "gguf")


def detect_format(path: str | Path) -> Format:
    """ "attnlab" when config.json holds {"model": ...}, "hf" when it names a model_type,
    "gguf" for a .gguf file."""
    if str(path).endswith(".gguf"):
        return "gguf"
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
    gguf_type: str = "f32",
) -> Path:
    """Convert a checkpoint between the attnlab, HF and GGUF formats.

    Args:
        src_format, dst_format: "hf", "attnlab" or "gguf" (they may be equal: a re-save).
        src, dst: directories (src may be a run directory: its latest checkpoint), or .gguf
            files.
        layout: the RoPE layout of the attnlab model read from or written to an HF Llama-family
            checkpoint or a GGUF file (the q/k rows are permuted; HF itself is always "half").
        overwrite: write into a non-empty dst (refused otherwise); only the files a
            checkpoint is made of are replaced there, nothing else is deleted. An existing
            .gguf file is replaced only with overwrite.
        gguf_type: the matrices' type in a GGUF written (f32, f16, q8_0; q4_1 from an int4
            model).

    Returns:
        dst.
    """
    for name, fmt in (("from", src_format), ("to", dst_format)):
        if fmt not in FORMATS:
            raise ValueError(f"--{name} format {fmt!r} is not one of {FORMATS}")
    if src_format != "gguf":
        src = resolve_checkpoint(src)  # a run directory: its latest checkpoint
    found = detect_format(src)
    if found != src_format:
        raise ValueError(f"{str(src)!r} is an {found} checkpoint, not {src_format}")
    if Path(dst).resolve() == Path(src).resolve():
        raise ValueError(f"the output directory is the input directory ({str(src)!r})")
    if dst_format == "gguf":
        if Path(dst).exists() and not overwrite:
            raise ValueError(
                f"the output {str(dst)!r} exists: choose a new name, or pass --overwrite to"
                " replace it"
            )
    else:
        check_output_dir(dst, overwrite)
    keep = "int4" if src_format == "gguf" and gguf_type == "q4_1" else None  # Q4_1 stays Q4_1
    loaded = open_checkpoint(
        src, layout=layout if src_format in ("hf", "gguf") else "half", scheme=keep
    )
    plain_model(loaded, "its prefix has no place in a model format: convert --to peft writes it")
    if dst_format == "gguf":
        source = src if src_format == "gguf" else None  # its tensor types and metadata stay
        return save_gguf(
            loaded.model, loaded.config, dst, loaded.tokenizer, gguf_type, source=source
        )
    quantized = [n for n, m in loaded.model.named_modules() if isinstance(m, QUANTIZED)]
    if quantized:  # neither hf nor attnlab records a scheme here: it would not open again
        kind = type(loaded.model.get_submodule(quantized[0])).__name__
        raise ValueError(
            f"{str(src)!r} holds quantized weights ({quantized[0]} is an {kind}); convert "
            "writes float weights: convert the float checkpoint it was quantized from"
        )
    if dst_format == "attnlab":
        return save_pretrained(dst, loaded.model, loaded.config, loaded.tokenizer)
    return save_hf(loaded.model, loaded.config, dst, loaded.tokenizer, loaded.sampling)
