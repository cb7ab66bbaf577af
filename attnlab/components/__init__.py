"""Reusable Transformer parts; each takes explicit arguments, never a ModelConfig."""
