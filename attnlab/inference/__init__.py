"""Inference: KV cache, sampling, generation, quantization."""
