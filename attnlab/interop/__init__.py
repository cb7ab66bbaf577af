"""Interoperability: HF checkpoints in and out (interop.hf) and a side-by-side checker (check)."""
