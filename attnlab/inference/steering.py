"""Steering: add a vector to the residual stream at chosen layers while the model runs.

    Steer(layer, vector, scale)          scale * vector added to blocks.<layer>.hook_resid_pre
    Steer(0, vector, scale, point=NAME)  ... added at any hook point instead (an SAE feature's
                                         decoder row at the SAE's point: lab/sae.py's sae_steers)
    difference_vector(model, a, b, layer)   mean activation of prompt a minus that of prompt b
    steering(model, steers)              a `with` block in which every forward is steered
    parse_steer(["6", " Love", " Hate", "4"])   the `attnlab generate --steer` flag

Activation addition (Turner et al. 2023, "Activation Addition: Steering Language Models Without
Optimization"): the difference between two prompts' activations at a layer, scaled and added to
the residual stream of every position there, pushes the generation towards the first prompt.
Here the difference is of each prompt's activations averaged over its positions, so the two
prompts may differ in length.

With the KV cache. The hook adds the vector to every position *of the forward it sees*: during
prefill that is the prompt, during cached decoding only the new token; the positions before are
already steered inside the cache (their keys and values were computed from steered streams). So
cached generation computes what recomputing the whole sequence with the same steering at every
step computes, token for token (tests/inference/test_steering.py checks it on learned
positions, RoPE with GQA, and ALiBi).

Shapes: B batch, T positions of the current forward, C d_model.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnlab.components.hooks import HookPoint, hooks, run_with_cache

POINT = "blocks.{}.hook_resid_pre"  # the residual stream entering block `layer`


@dataclass(frozen=True)
class Steer:
    """One steering vector: `scale * vector` added at every position entering block `layer`.

    Attributes:
        layer: the block index (0 = the embeddings' stream); negative counts from the end.
        vector: (C,).
        scale: its multiplier.
        point: a hook point's name (attnlab's or TransformerLens'): the vector is added there
            instead, and `layer` is not read; its width is the caller's to check.
    """

    layer: int
    vector: Tensor
    scale: float = 1.0
    point: str = ""


def _block_index(model: nn.Module, layer: int) -> int:
    n = len(model.blocks)
    if not -n <= layer < n:
        raise ValueError(f"steering layer {layer} is outside this model's {n} blocks (0..{n - 1})")
    return layer % n


def add_vector(vector: Tensor):
    """A hook adding `vector` (C,) to every position of the stream it sees."""

    def fn(x: Tensor, hook: HookPoint) -> Tensor:
        return x + vector.to(x.dtype)  # (B, T, C)

    return fn


@contextmanager
def steering(model: nn.Module, steers: Sequence[Steer]) -> Iterator[None]:
    """Every forward of `model` inside the block is steered (generation, cached or not, too).

    Args:
        model: a model with `blocks` whose blocks have `hook_resid_pre` (the decoder LMs).
        steers: the vectors; several at one layer add up.
    """
    if not steers:  # nothing to add: the model runs as it is (any family)
        yield
        return
    C = model.embed.weight.shape[1]  # d_model
    fwd = []
    for s in steers:
        if s.point:
            fwd.append((s.point, add_vector(s.scale * s.vector.detach().float())))
            continue
        if tuple(s.vector.shape) != (C,):
            raise ValueError(f"a steering vector of shape {tuple(s.vector.shape)}; give ({C},)")
        point = POINT.format(_block_index(model, s.layer))
        fwd.append((point, add_vector(s.scale * s.vector.detach().float())))
    with hooks(model, fwd):
        yield


@torch.no_grad()
def difference_vector(model: nn.Module, a: Sequence[int], b: Sequence[int], layer: int) -> Tensor:
    """(C,) the mean over positions of prompt a's residual stream entering block `layer`, minus
    prompt b's (each run alone, unsteered)."""
    point = POINT.format(_block_index(model, layer))
    means = []
    for ids in (a, b):
        if len(ids) == 0:
            raise ValueError("a steering prompt is empty; give some text")
        device = next(model.parameters()).device
        _, cache = run_with_cache(model, torch.tensor([list(ids)], device=device), names=[point])
        means.append(cache[point][0].float().mean(0))  # (C,)
    return means[0] - means[1]


def parse_steer(values: Sequence[str]) -> tuple[int, str, str, float]:
    """`--steer LAYER TEXT_A TEXT_B SCALE` -> (layer, text a, text b, scale)."""
    layer, a, b, scale = values
    try:
        return int(layer), a, b, float(scale)
    except ValueError:
        raise ValueError(
            f"--steer {' '.join(repr(v) for v in values)}: give LAYER (an int) TEXT_A TEXT_B "
            "SCALE (a number), e.g. --steer 6 ' Love' ' Hate' 4"
        ) from None


def text_steers(model: nn.Module, tokenizer, specs: Sequence[Sequence[str]]) -> list[Steer]:
    """Steers from `--steer LAYER TEXT_A TEXT_B SCALE` flags: each the difference vector of the
    two texts (through `tokenizer`) at its layer, times its scale."""
    if specs and not hasattr(model, "blocks"):
        raise ValueError(f"steering takes a decoder LM; this model is a {type(model).__name__}")
    steers = []
    for spec in specs:
        layer, a, b = parse_steer(spec)[:3]
        vector = difference_vector(model, tokenizer.encode(a), tokenizer.encode(b), layer)
        steers.append(Steer(layer, vector, parse_steer(spec)[3]))
    return steers
