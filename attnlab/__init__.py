"""attnlab: the Transformer from first principles.

The names most programs need, re-exported from their one home (docs/architecture.md lists
where every concept lives):

    cfg = attnlab.get_preset("gpt2-tiny")            # a ModelConfig (frozen dataclass)
    model = attnlab.build_model(cfg)                 # the network, freshly initialised
    ckpt = attnlab.open_checkpoint("runs/default")   # any checkpoint -> model, config, tokenizer
    text = attnlab.generate_text(ckpt.model, ckpt.tokenizer, "def ", max_new_tokens=40)
"""

from attnlab.checkpoint import Loaded, open_checkpoint, save_pretrained
from attnlab.inference.beam import beam_search
from attnlab.inference.generate import generate, generate_text, stream_tokens
from attnlab.inference.sampling import SamplingConfig
from attnlab.models.build import build_model
from attnlab.models.config import ModelConfig
from attnlab.models.inspect import count_parameters
from attnlab.models.presets import PRESETS, get_preset
from attnlab.tokenizer import Tokenizer, train_bpe_tokenizer, train_char_tokenizer

__all__ = [
    "PRESETS",
    "Loaded",
    "ModelConfig",
    "SamplingConfig",
    "Tokenizer",
    "beam_search",
    "build_model",
    "count_parameters",
    "generate",
    "generate_text",
    "get_preset",
    "open_checkpoint",
    "save_pretrained",
    "stream_tokens",
    "train_bpe_tokenizer",
    "train_char_tokenizer",
]
