"""Adapters: LoRA / QLoRA Linears swapped into a model (adapters/lora.py) and the run-config
section that records them (adapters/config.py). Like quantize's int8 / int4 Linears, they sit
below the loader, so that `open_checkpoint` opens a LoRA fine-tuning run (merged, or with the
adapters kept)."""
