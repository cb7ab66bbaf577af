"""GGUF files (llama.cpp's format) in and out, through the `gguf` package (an optional extra)."""

from attnlab.interop.gguf.reader import load_gguf
from attnlab.interop.gguf.writer import save_gguf

__all__ = ["load_gguf", "save_gguf"]
