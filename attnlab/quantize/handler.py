"""Quantizing a model in two steps, and quantized checkpoints that say what they hold.

    float state dict ──quantize_state_dict──> quantized state dict ──┐
    model (built on meta) ──swap_modules──> Int8Linear / Int4Linear ─┴─ load_weights(assign=True)

`quantize_model` runs both steps on a model in memory; `attnlab.checkpoint.open_checkpoint` runs
the second on a model built on the meta device, from a quantized checkpoint (and
`attnlab.inference.quantized` writes one).

What is quantized: every nn.Linear, the LM heads included; embeddings never (a lookup reads one
row per token, so they cost nothing per decoded token). The head is the largest single matrix a
decode step reads (GPT-2-small: its 154 MB fp32 head is 31% of the model's bytes per token), so
leaving it in float would keep a third of the traffic at 4 bytes a weight. A head tied to the
embedding (GPT-2, T5, BERT's MLM decoder) is untied by quantizing it: the embedding keeps the
float matrix for its lookups, the head gets the quantized copy (int8: 1 more byte per weight of
memory, and 4x fewer bytes read per token). `heads=False` keeps the heads in float, tied as they
were (AutoGPTQ and AWQ skip `lm_head` by default, the logits being the most sensitive output);
the checkpoint's metadata records which was done.

A quantized checkpoint is a directory like a training checkpoint, loadable on its own:

    config.json         the run config, as saved by training (the model is rebuilt from it)
    tokenizer.json      the float checkpoint's tokenizer, when it has one
    model.safetensors   quantized tensors; the scheme lives in the file's metadata:
                        {"quantization": "int8"} or {"quantization": "int4", "group_size": "32"},
                        and {"heads": "quantized"} or {"heads": "float"} (absent: float),
                        or {"heads": "int8"}: an int4 model whose heads are int8 (a Q4_1
                        GGUF's, interop/gguf/reader.py, saved with save_quantized)

The file name is the same as a float checkpoint's: the metadata, not the name, says what is
inside, and `open_checkpoint(path, scheme=...)` refuses a file whose scheme is not the one asked
for.
"""

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from torch import Tensor, nn

from attnlab.models.decoder import DecoderLM
from attnlab.models.weights import load_weights, shared_groups
from attnlab.quantize.int4 import GROUP_SIZES, Int4Linear, pack_int4, quantize_int4
from attnlab.quantize.int8 import Int8Linear, quantize_int8

Scheme = Literal["int8", "int4"]
SCHEMES: tuple[str, ...] = ("int8", "int4")
DEFAULT_GROUP_SIZE = 32  # int4 only; int8 has one scale per output channel
METADATA_KEY = "quantization"
HEADS_KEY = "heads"  # metadata: "quantized" or "float" (files written before it: float)


@dataclass(frozen=True)
class QuantScheme:
    """A scheme and, for int4, its group size (None for int8)."""

    name: str
    group_size: int | None = None

    def __str__(self) -> str:
        return (
            self.name if self.group_size is None else f"{self.name} (group_size {self.group_size})"
        )


def make_scheme(scheme: str, group_size: int | None = DEFAULT_GROUP_SIZE) -> QuantScheme:
    """Validate a scheme name; the group size is kept for int4 only."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose from {list(SCHEMES)}")
    if scheme == "int8":
        return QuantScheme("int8")
    group_size = DEFAULT_GROUP_SIZE if group_size is None else int(group_size)
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"int4 group_size must be one of {GROUP_SIZES}, got group_size={group_size}"
        )
    return QuantScheme("int4", group_size)


def linear_names(model: nn.Module, heads: bool = True, group_size: int | None = None) -> list[str]:
    """Names of the nn.Linear modules to quantize: all of them, or (heads=False) all but the
    LM heads and the Linears tied to another module's weight (BERT's MLM decoder). With an int4
    `group_size`, only those whose in_features it divides: the others stay in float."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if group_size is not None:
        linears = [n for n in linears if model.get_submodule(n).in_features % group_size == 0]
    if heads:
        return linears
    head_ids = {id(m.head) for m in model.modules() if isinstance(m, DecoderLM)}
    tied = {name.rpartition(".")[0] for group in shared_groups(model) for name in group}
    return [n for n in linears if id(model.get_submodule(n)) not in head_ids and n not in tied]


def float_misfits(model: nn.Module, heads: bool, group_size: int | None) -> dict[str, int]:
    """{name: in_features} of the Linears left in float because `group_size` does not divide
    their in_features (int4 only; a Llama with d_ff 350 has four)."""
    fits = set(linear_names(model, heads, group_size))
    return {
        n: model.get_submodule(n).in_features for n in linear_names(model, heads) if n not in fits
    }


@torch.no_grad()
def quantize_state_dict(
    state_dict: dict[str, Tensor], scheme: Scheme, group_size: int | None, names: list[str]
) -> dict[str, Tensor]:
    """Replace the `{name}.weight` of each Linear in `names` by the scheme's tensors.

    A weight stored under two names (a tied head) is quantized under the Linear's name and kept
    in float under the other (the embedding's).
    int8: `weight` (N, K) int8 + `scales` (N,).  int4: `weight` (N, K/2) uint8 (packed) +
    `scales` and `mins` (N, K/group_size). Biases and all other entries are kept as they are.
    """
    s = make_scheme(scheme, group_size)
    missing = [n for n in names if f"{n}.weight" not in state_dict]
    if missing:
        raise ValueError(f"no weights for the Linear layers {missing} in the state dict")
    if s.name == "int4":
        misfits = {n: state_dict[f"{n}.weight"].shape[1] for n in names}
        misfits = {n: k for n, k in misfits.items() if k % s.group_size}
        if misfits:
            raise ValueError(
                f"int4 group_size={s.group_size} does not divide in_features of "
                f"{misfits}; choose a group size that divides them"
            )
    out = dict(state_dict)
    for name in names:
        w = out.pop(f"{name}.weight")
        if s.name == "int8":
            out[f"{name}.weight"], out[f"{name}.scales"] = quantize_int8(w)
        else:
            q, out[f"{name}.scales"], out[f"{name}.mins"] = quantize_int4(w, s.group_size)
            out[f"{name}.weight"] = pack_int4(q)
    return out


def swap_modules(
    model: nn.Module,
    scheme: Scheme,
    group_size: int | None = DEFAULT_GROUP_SIZE,
    names: list[str] | None = None,
) -> nn.Module:
    """Replace each Linear in `names` (default: linear_names(model)) by an empty quantized one
    (a tied head becomes a module of its own: the embedding keeps its float Parameter).

    The new modules live on the meta device (no memory) until their weights are assigned with
    `load_weights(model, quantized_state_dict)` (load_state_dict(assign=True)).
    """
    s = make_scheme(scheme, group_size)
    for name in linear_names(model, group_size=s.group_size) if names is None else names:
        old = model.get_submodule(name)
        args = (old.in_features, old.out_features, old.bias is not None)
        if s.name == "int8":
            new = Int8Linear(*args, device="meta")
        else:
            new = Int4Linear(*args, group_size=s.group_size, device="meta")
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, new)
    return model


def quantize_model(
    model: nn.Module,
    scheme: Scheme,
    group_size: int | None = DEFAULT_GROUP_SIZE,
    heads: bool = True,
) -> nn.Module:
    """Quantize a float model in place: both steps, on its own weights (heads: see above).

    int4: Linears whose in_features the group size does not divide stay in float
    (`float_misfits`); a ValueError if that leaves none to quantize.
    """
    s = make_scheme(scheme, group_size)
    names = linear_names(model, heads, s.group_size)
    if s.group_size is not None and not names:
        misfits = float_misfits(model, heads, s.group_size)
        raise ValueError(
            f"int4 group_size={s.group_size} divides the in_features of none of the Linear "
            f"layers {misfits}; choose a group size that divides some of them, or int8"
        )
    state_dict = quantize_state_dict(model.state_dict(), scheme, group_size, names)
    swap_modules(model, scheme, group_size, names)
    return load_weights(model, state_dict)


def quantized_like(model: nn.Module, base: nn.Module) -> nn.Module:
    """`model` (a fresh model, e.g. one with a new task head) with a copy of each of `base`'s
    quantized Linears (Int8Linear, Int4Linear) in place of its float Linear of the same name,
    so that copying `base`'s weights in then keeps a quantized body as it is (QLoRA with a
    task head). Modules `base` does not have (the head) stay float."""
    own = dict(model.named_modules())
    for name, module in base.named_modules():
        if name in own and isinstance(module, (Int8Linear, Int4Linear)):
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, copy.deepcopy(module))
    return model


@contextmanager
def without_kernels(*models: nn.Module | None) -> Iterator[None]:
    """For the length of a `with` block, every Int8Linear / Int4Linear of `models` (None: none)
    takes its reference path (dequantize, then F.linear in the activations' dtype: exact fp32)
    in place of the CPU kernel, which rounds to bf16.

    A quantized layer picks its path per call: the kernel when no gradient flows through its
    input, the reference path otherwise (the kernel has no backward). So two forwards of one
    model round differently when one of them needs gradients and the other does not: DPO's
    reference (no_grad: the kernel in every layer) and its QLoRA policy (the reference path
    from the first adapter on) would differ at step 0, where they are the same model. Both
    forwards inside this block compute the same thing.
    """
    layers = [
        m
        for model in models
        if model is not None
        for m in model.modules()
        if isinstance(m, (Int8Linear, Int4Linear))
    ]
    kept = [m.use_kernel for m in layers]
    for m in layers:
        m.use_kernel = False
    try:
        yield
    finally:
        for m, use in zip(layers, kept):
            m.use_kernel = use


def scheme_metadata(scheme: QuantScheme, heads: bool | str = True) -> dict[str, str]:
    """The safetensors metadata recording `scheme` and whether the heads are quantized
    (heads: True, False, or "int8" for int8 heads on an int4 model; values must be strings)."""
    heads = heads if isinstance(heads, str) else "quantized" if heads else "float"
    meta = {METADATA_KEY: scheme.name, HEADS_KEY: heads}
    if scheme.group_size is not None:
        meta["group_size"] = str(scheme.group_size)
    return meta


def read_scheme(path: str | Path) -> QuantScheme | None:
    """The scheme in a .safetensors file's metadata, or None for float weights."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if METADATA_KEY not in meta:
        return None
    return make_scheme(meta[METADATA_KEY], meta.get("group_size"))


def read_heads(path: str | Path) -> str:
    """What a quantized .safetensors file holds as LM heads (see HEADS_KEY): "quantized" (in
    the file's scheme), "float", or "int8" (on an int4 model)."""
    with safe_open(str(path), framework="pt") as f:
        heads = (f.metadata() or {}).get(HEADS_KEY, "float")
    return heads if heads in ("quantized", "int8") else "float"


def head_names(model: nn.Module) -> list[str]:
    """Names of the LM heads (each DecoderLM's `head`) in `model`."""
    heads = {id(m.head) for m in model.modules() if isinstance(m, DecoderLM)}
    return [name for name, m in model.named_modules() if id(m) in heads]


@dataclass(frozen=True)
class LogitError:
    """How far a quantized model's logits are from the float model's on the same inputs."""

    max_abs: float  # max |quantized - float| over every logit
    mean_abs: float  # mean |quantized - float|
    logit_std: float  # std of the float logits, for scale
    top1_agreement: float  # fraction of positions where both models' argmax agree


@torch.no_grad()
def logit_error(reference: Tensor, quantized: Tensor) -> LogitError:
    """Compare logits (..., V) of the float and the quantized model."""
    diff = (quantized.float() - reference.float()).abs()
    agree = (quantized.argmax(-1) == reference.argmax(-1)).float().mean()
    return LogitError(
        diff.max().item(), diff.mean().item(), reference.float().std().item(), agree.item()
    )


def random_inputs(vocab_size: int, n: int, T: int, seed: int = 0) -> Tensor:
    """(n, T) token ids drawn uniformly (seeded) for logit comparisons."""
    return torch.randint(vocab_size, (n, T), generator=torch.Generator().manual_seed(seed))
