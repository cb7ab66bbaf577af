"""Interoperability: HF checkpoints in and out (interop.hf), GGUF files (interop.gguf), PEFT
adapters (interop.peft), the Hub (interop.hub) and a side-by-side checker (interop.reference)."""
