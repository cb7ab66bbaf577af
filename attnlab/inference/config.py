"""GenerationConfig: what to generate, passed whole to `stream_tokens`, `generate`,
`generate_text` and `beam_search` (as SamplingConfig is passed whole to `sample`).

What is configuration lives here (numbers, ids, strings, switches); what is not (the model, the
prompts, source tensors, callbacks) stays an argument of the function that uses it.
"""

from dataclasses import dataclass, field
from typing import Literal

import torch

from attnlab.inference.constraints import Constraint
from attnlab.inference.sampling import SamplingConfig


@dataclass(frozen=True)
class GenerationConfig:
    """How many tokens, how to choose them and when to stop.

    Args:
        max_new_tokens: at most this many new tokens per row (>= 1).
        sampling: how each token is drawn (temperature 0: greedy); ignored by beam search.
        stop_tokens: a row ends at (and keeps) the first of these ids.
        stop_strings: a row ends once its text contains one of these (needs a decoder: see
            `generate`; `generate_text` uses the tokenizer's).
        min_new_tokens: the stop tokens cannot be chosen before this many new tokens (as
            transformers' MinNewTokensLengthLogitsProcessor; stop strings still end a row).
        ignore_eos: `generate_text` keeps going past the tokenizer's <eos> (it is not added to
            the stop tokens; `stop_tokens` still stop).
        seed: seeds the draws (None: torch's global generator).
        max_total_len: also stop when prompt + new tokens reach this length.
        max_context: feed the model at most this many tokens (default: its position table);
            see inference/generate.py's docstring for the crop.
        crop_to: when the text outgrows the window, continue from its last `crop_to` tokens
            (default: the whole window, as nanoGPT).
        num_beams: > 1 runs beam search (`generate_text`, `beam_search`); 1 is greedy there.
        length_penalty: beam search's length exponent (> 0 favours longer outputs).
        early_stopping: beam search's rule for closing a prompt (see beam.py).
        num_return_sequences: beam hypotheses returned per prompt (<= num_beams).
        constraint: every row's text must be JSON of a schema, match a regex or be one of some
            choices (constraints.py); needs the tokenizer (`generate(..., tokenizer=)`) and a
            stop token, and ends the row only where the text is complete. One that no text
            of max_new_tokens tokens can finish is refused (a ValueError) before generating.
        kv_cache_dtype: the KV cache's dtype (None: the model's; torch.int8 or
            torch.float8_e4m3fn: 8-bit codes with per-token, per-head scales, dequantized for
            attention: components/kv_cache.py).
    """

    max_new_tokens: int = 200
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    min_new_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    max_total_len: int | None = None
    max_context: int | None = None
    crop_to: int | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    num_return_sequences: int = 1
    constraint: Constraint | None = None
    kv_cache_dtype: torch.dtype | None = None

    def __post_init__(self):
        # Lists are accepted and kept as tuples, so the config stays hashable and frozen.
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {self.max_context}")
        if self.num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {self.num_beams}")
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise ValueError(
                f"num_return_sequences must be in [1, num_beams={self.num_beams}], "
                f"got {self.num_return_sequences}"
            )
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )

    def new_tokens_for(self, longest_prompt: int) -> int:
        """max_new_tokens, lowered so that the longest prompt + new tokens fit max_total_len."""
        if self.max_total_len is None:
            return self.max_new_tokens
        n = min(self.max_new_tokens, self.max_total_len - longest_prompt)
        if n < 1:
            raise ValueError(f"max_total_len={self.max_total_len} leaves no room after the prompt")
        return n
