"""attnlab: the Transformer from first principles.

The names most programs need, re-exported from their one home (docs/architecture.md lists
where every concept lives):

    cfg = attnlab.get_preset("gpt2-tiny")            # a ModelConfig (frozen dataclass)
    model = attnlab.build_model(cfg)                 # the network, freshly initialised
    ckpt = attnlab.open_checkpoint("runs/default")   # any checkpoint -> model, config, tokenizer
                                                     # (a LoRA run: adapters merged)
    text = attnlab.generate_text(ckpt.model, ckpt.tokenizer, "def ", max_new_tokens=40)

Each name is imported on first use (PEP 562), so `import attnlab.cli` does not import torch:
the CLI sets the OpenMP wait policy before torch starts its thread pool (cli/threads.py).
"""

import importlib

# name -> the module that is its one home
_HOMES = {
    "Loaded": "attnlab.checkpoint",
    "open_checkpoint": "attnlab.checkpoint",
    "save_pretrained": "attnlab.checkpoint",
    "beam_search": "attnlab.inference.beam",
    "GenerationConfig": "attnlab.inference.config",
    "generate": "attnlab.inference.generate",
    "generate_text": "attnlab.inference.generate",
    "stream_tokens": "attnlab.inference.generate",
    "SamplingConfig": "attnlab.inference.sampling",
    "build_model": "attnlab.models.build",
    "ModelConfig": "attnlab.models.config",
    "count_parameters": "attnlab.models.inspect",
    "PRESETS": "attnlab.models.presets",
    "get_preset": "attnlab.models.presets",
    "Tokenizer": "attnlab.tokenizer",
    "train_bpe_tokenizer": "attnlab.tokenizer",
    "train_char_tokenizer": "attnlab.tokenizer",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
