"""HuggingFace checkpoints in and out: one converter per family, chosen from config.json."""

from attnlab.interop.hf.auto import (
    ARCHITECTURES,
    converter_for,
    converter_for_hf,
    load_hf,
    load_tokenizer,
    save_hf,
    save_tokenizer,
)

__all__ = [
    "ARCHITECTURES",
    "converter_for",
    "converter_for_hf",
    "load_hf",
    "load_tokenizer",
    "save_hf",
    "save_tokenizer",
]
