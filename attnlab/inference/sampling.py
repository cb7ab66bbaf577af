"""Choosing the next token: pure functions, logits in, token ids out, no host syncs.

Each step's logits go through these processors, in this order (transformers' and vLLM's: the
biases and penalties first, on the model's logits; then the temperature; then the filters, on
the tempered distribution), then softmax and a draw:

    logit bias -> banned tokens -> repetition penalty -> presence / frequency penalties
        -> temperature -> top-k -> top-p -> min-p -> softmax -> draw

- logit bias (OpenAI's `logit_bias`): add bias[j] (in [-100, 100]) to token j's logit.
- banned tokens: -inf, e.g. the stop tokens until `min_new_tokens` are out (as transformers'
  MinNewTokensLengthLogitsProcessor).
- repetition penalty (Keskar et al. 2019, CTRL): a token anywhere in prompt + output has its
  logit divided by the penalty if positive, multiplied if negative.
- presence / frequency penalties (OpenAI's formula): logit[j] -= c[j] * frequency + (c[j] > 0)
  * presence, where c[j] counts token j in the output (the prompt does not count).
- temperature: divide logits by t; t = 0 is greedy (argmax).
- top-k (Fan et al. 2018): keep the k most likely tokens.
- top-p, nucleus (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
  probability reaches p (the token that crosses p is kept).
- min-p (Nguyen et al. 2024): keep tokens whose probability is at least min_p times the top one's.

Every row of a batch may have its own settings: `SamplingRows` holds one SamplingConfig per row
as (B, 1) tensors, so each processor is one tensor operation over the whole batch; a row that
does not use a processor holds the value that changes nothing (top_k = V, top_p = 1, ...).

Shapes: B batch, V vocab_size, T prompt tokens.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

# Probabilities are float32 sums: 0.5 + 0.2 may come out as 0.69999999 or 0.70000005 depending on
# a constant added to the logits (which softmax ignores). Mass or probability within this of the
# threshold counts as reaching it, so top-p and min-p keep the same set for any logit shift.
ROUNDING_TOL = 1e-6
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: a bias in [-100, 100]
MAX_PENALTY = 2.0  # OpenAI's range of presence_penalty and frequency_penalty: [-2, 2]


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick tokens. temperature 0 = greedy; None, 1.0 (repetition) and 0.0 (presence,
    frequency) disable a processor. logit_bias: {token id: bias} (a dict, JSON's string keys
    included, is kept as sorted (id, bias) pairs, so the config stays hashable)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(
                    f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}"
                )

    @property
    def needs_counts(self) -> bool:
        """Whether a penalty reads the prompt's and output's tokens (TokenCounts)."""
        return self.repetition_penalty != 1 or bool(self.presence_penalty or self.frequency_penalty)


def bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """{id: bias} or (id, bias) pairs -> sorted (int id, float bias) pairs, each checked."""
    items = bias.items() if isinstance(bias, dict) else bias
    pairs = {}
    for key, value in items:
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)  # JSON object keys are strings: {"50256": -100}
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"logit_bias[{key}] must be a number, got {value!r}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias[{key}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {value}"
            )
        pairs[key] = float(value)
    return tuple(sorted(pairs.items()))


# A chat reply's sampler where neither the user nor the checkpoint sets one: llama.cpp's
# defaults (common/common.h: temp 0.80, top_k 40, top_p 0.95, min_p 0.05). SamplingConfig's own
# (temperature 1, no filter) draw from the whole tail, and a small chat model wanders off:
# SmolLM2-135M-Instruct named "Bâteille Rous" as the capital of France at them.
CHAT_SAMPLING = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


def chat_sampling(saved: dict | None = None) -> SamplingConfig:
    """The sampler of a chat reply that sets nothing: the checkpoint's own defaults (`saved`,
    {SamplingConfig field: value}, e.g. `Loaded.sampling`) over CHAT_SAMPLING."""
    return replace(CHAT_SAMPLING, **(saved or {}))


def describe(cfg: SamplingConfig) -> str:
    """The fields that differ from SamplingConfig's own defaults, as flags read them:
    "temperature 0.8, top_k 40, top_p 0.95, min_p 0.05"."""
    plain = SamplingConfig()
    return ", ".join(
        f"{name} {getattr(cfg, name)}"
        for name in cfg.__dataclass_fields__
        if getattr(cfg, name) != getattr(plain, name)
    )


@dataclass(frozen=True)
class SamplingRows:
    """One SamplingConfig per row, as tensors (see the module docstring).

    Attributes:
        temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
            frequency_penalty: (B, 1), each row's value (top_k: V where the row has none).
        logit_bias: (B, V) added to the logits, or None when no row has one.
        used: the processors some row turns on (known on the host: no step asks the device).
        greedy: per row, whether its temperature is 0.
        top_k_max: the largest top_k (V where a row has none).
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    repetition_penalty: Tensor
    presence_penalty: Tensor
    frequency_penalty: Tensor
    logit_bias: Tensor | None
    used: frozenset[str]
    greedy: tuple[bool, ...]
    top_k_max: int

    @classmethod
    def stack(cls, configs: Sequence[SamplingConfig], vocab_size: int, device) -> "SamplingRows":
        """The rows of `configs` (one per row of the batch) on `device`."""

        def column(values, dtype=torch.float32) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)[:, None]  # (B, 1)

        used = {
            "temperature": any(c.temperature not in (0, 1) for c in configs),  # t=1: logits as is
            "top_k": any(c.top_k is not None for c in configs),
            "top_p": any(c.top_p is not None and c.top_p < 1 for c in configs),
            "min_p": any(c.min_p for c in configs),
            "repetition_penalty": any(c.repetition_penalty != 1 for c in configs),
            "presence_frequency": any(c.presence_penalty or c.frequency_penalty for c in configs),
        }
        top_k = [min(c.top_k or vocab_size, vocab_size) for c in configs]
        return cls(
            temperature=column([c.temperature for c in configs]),
            top_k=column(top_k, torch.long),
            top_p=column([1.0 if c.top_p is None else c.top_p for c in configs]),
            min_p=column([c.min_p or 0.0 for c in configs]),
            repetition_penalty=column([c.repetition_penalty for c in configs]),
            presence_penalty=column([c.presence_penalty for c in configs]),
            frequency_penalty=column([c.frequency_penalty for c in configs]),
            logit_bias=dense_bias(configs, vocab_size, device),
            used=frozenset(name for name, on in used.items() if on),
            greedy=tuple(c.temperature == 0 for c in configs),
            top_k_max=max(top_k),
        )

    @property
    def needs_counts(self) -> bool:
        """Whether a penalty reads the TokenCounts."""
        return bool(self.used & {"repetition_penalty", "presence_frequency"})


def dense_bias(configs: Sequence[SamplingConfig], vocab_size: int, device) -> Tensor | None:
    """(B, V) logit biases, zero where a row sets none; None when no row sets any."""
    if not any(c.logit_bias for c in configs):
        return None
    rows, ids, values = [], [], []
    for b, c in enumerate(configs):
        for token, bias in c.logit_bias:
            if token >= vocab_size:
                raise ValueError(
                    f"logit_bias key {token} is outside the vocabulary [0, {vocab_size})"
                )
            rows.append(b), ids.append(token), values.append(bias)
    bias = torch.zeros(len(configs), vocab_size, device=device)
    at = (torch.tensor(rows, device=device), torch.tensor(ids, device=device))
    bias[at] = torch.tensor(values, device=device)
    return bias


@dataclass
class TokenCounts:
    """What the penalties read, per row: which tokens are in the prompt (B, V) bool, and how
    often each token has been generated (B, V) float."""

    in_prompt: Tensor
    generated: Tensor

    @classmethod
    def empty(cls, B: int, vocab_size: int, device) -> "TokenCounts":
        """B rows of no tokens."""
        in_prompt = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
        return cls(in_prompt, torch.zeros(B, vocab_size, device=device))

    @classmethod
    def of_prompts(cls, ids: Tensor, vocab_size: int) -> "TokenCounts":
        """ids: (B, T) prompt tokens (padding must repeat a token of the row's prompt)."""
        counts = cls.empty(ids.shape[0], vocab_size, ids.device)
        counts.in_prompt.scatter_(1, ids, True)
        return counts

    @classmethod
    def cat(cls, rows: Sequence["TokenCounts"]) -> "TokenCounts":
        """Rows of one-row (or more) counts, stacked into one batch."""
        return cls(torch.cat([r.in_prompt for r in rows]), torch.cat([r.generated for r in rows]))

    def add(self, tokens: Tensor) -> None:
        """Count each row's new token. tokens: (B,)."""
        self.generated.scatter_add_(1, tokens[:, None], self.generated.new_ones(len(tokens), 1))

    @property
    def seen(self) -> Tensor:
        """(B, V) whether each token is anywhere in prompt + output."""
        return self.in_prompt | (self.generated > 0)


# --- the processors, in the order they run ----------------------------------------------------
def add_logit_bias(logits: Tensor, bias: Tensor) -> Tensor:
    """logits + bias. (B, V) and (B, V) or (V,) -> (B, V)."""
    return logits + bias


def ban_tokens(logits: Tensor, banned: Tensor) -> Tensor:
    """-inf where banned: (B, V) or (V,) bool. -> (B, V)."""
    return logits.masked_fill(banned, float("-inf"))


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: Tensor | float) -> Tensor:
    """Seen tokens: logit / penalty if positive, logit * penalty otherwise (CTRL).
    logits, seen: (B, V); penalty: (B, 1) or a float -> (B, V)."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency_penalties(
    logits: Tensor, generated: Tensor, presence: Tensor | float, frequency: Tensor | float
) -> Tensor:
    """OpenAI's formula: logit[j] -= c[j] * frequency + (c[j] > 0) * presence.
    logits, generated (c): (B, V); presence, frequency: (B, 1) or floats -> (B, V)."""
    return logits - generated * frequency - (generated > 0).float() * presence


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """logits / t per row; rows with t = 0 (greedy) are left as they are. t: (B, 1)."""
    return logits / torch.where(temperature > 0, temperature, 1.0)


def top_k_filter(logits: Tensor, k: int | Tensor, k_max: int | None = None) -> Tensor:
    """Set all but the k largest logits of each row to -inf. k: an int, or (B, 1) per row with
    k_max >= every k (known on the host; default V). (B, V) -> (B, V)."""
    V = logits.shape[-1]
    if isinstance(k, int):
        k, k_max = torch.full((logits.shape[0], 1), k, device=logits.device), k
    k_max = V if k_max is None else min(k_max, V)
    largest = torch.topk(logits, k_max, dim=-1).values  # (B, k_max), sorted
    kth = largest.gather(1, k.clamp(max=k_max) - 1)  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float | Tensor) -> Tensor:
    """Keep the smallest most-likely set with total probability >= p; p: a float or (B, 1) per
    row (p = 1 keeps all). (B, V) -> (B, V)."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # (B, V)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens before it already reach p (so the crossing token stays).
    drop_sorted = (probs.cumsum(-1) - probs) >= p - ROUNDING_TOL
    drop_sorted &= p < 1.0  # p = 1: the row keeps all
    drop_sorted[:, 0] = False  # the most likely token always stays (p below the tolerance)
    drop = drop_sorted.scatter(1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: Tensor, min_p: float | Tensor) -> Tensor:
    """Drop tokens with probability below min_p * (top probability); min_p: a float or (B, 1)
    per row. (B, V) -> (B, V)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # (B, 1)
    return logits.masked_fill(probs < threshold * (1 - ROUNDING_TOL), float("-inf"))


def filter_logits(
    logits: Tensor,
    cfg: "SamplingConfig | SamplingRows",
    counts: TokenCounts | None = None,
    banned: Tensor | None = None,
) -> Tensor:
    """Every processor of the module docstring, in its order, before the softmax.

    Args:
        logits: (B, V) float32.
        cfg: one SamplingConfig for every row, or each row's (SamplingRows).
        counts: the tokens of prompt and output (needed by the penalties).
        banned: (B, V) or (V,) bool, tokens no row may choose now (e.g. stop tokens before
            min_new_tokens).
    """
    rows = as_rows(cfg, logits)
    if rows.logit_bias is not None:
        logits = add_logit_bias(logits, rows.logit_bias)
    if banned is not None:
        logits = ban_tokens(logits, banned)
    if rows.needs_counts and counts is None:
        raise ValueError("repetition, presence and frequency penalties need the TokenCounts")
    if "repetition_penalty" in rows.used:
        logits = apply_repetition_penalty(logits, counts.seen, rows.repetition_penalty)
    if "presence_frequency" in rows.used:
        logits = apply_presence_frequency_penalties(
            logits, counts.generated, rows.presence_penalty, rows.frequency_penalty
        )
    if "temperature" in rows.used:
        logits = apply_temperature(logits, rows.temperature)
    if "top_k" in rows.used:
        logits = top_k_filter(logits, rows.top_k, rows.top_k_max)
    if "top_p" in rows.used:
        logits = top_p_filter(logits, rows.top_p)
    if "min_p" in rows.used:
        logits = min_p_filter(logits, rows.min_p)
    return logits


def as_rows(cfg: "SamplingConfig | SamplingRows", logits: Tensor) -> SamplingRows:
    """cfg for each row of logits (B, V)."""
    if isinstance(cfg, SamplingRows):
        return cfg
    B, V = logits.shape
    return SamplingRows.stack([cfg] * B, V, logits.device)


def draw(logits: Tensor, greedy: bool, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of filtered logits (B, V): the argmax, or a draw from their softmax.
    -> (B,) int64."""
    if greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def token_distribution(
    logits: Tensor,
    cfg: "SamplingConfig | SamplingRows",
    counts: TokenCounts | None = None,
    banned: Tensor | None = None,
) -> Tensor:
    """The distribution `sample` draws from, as probabilities: (B, V) logits -> (B, V) fp32.
    A greedy row (temperature 0) is the one-hot of its argmax. Speculative decoding compares
    two of these (speculative.py)."""
    rows = as_rows(cfg, logits)
    logits = filter_logits(logits.float(), rows, counts, banned)
    probs = torch.softmax(logits, dim=-1)
    if any(rows.greedy):
        one_hot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        probs = torch.where(rows.temperature == 0, one_hot, probs)
    return probs


def sample(
    logits: Tensor,
    cfg: "SamplingConfig | SamplingRows",
    counts: TokenCounts | None = None,
    generator: torch.Generator | None = None,
    banned: Tensor | None = None,
) -> Tensor:
    """Pick one token per row: `filter_logits`, then `draw` (greedy rows: the argmax).
    logits: (B, V) -> (B,) int64."""
    rows = as_rows(cfg, logits)
    logits = filter_logits(logits.float(), rows, counts, banned)
    token = draw(logits, all(rows.greedy), generator)
    if any(rows.greedy) and not all(rows.greedy):
        token = torch.where(rows.temperature[:, 0] == 0, logits.argmax(-1), token)
    return token
