"""The two sides of a check: a model, where to hook it, and how to run it.

A side is an attnlab model or a `transformers` one (recognised by its `config.model_type`;
transformers is never imported here). Each side names the same points: the input of the first
block ("embed"), each block's output ("block.0", ...), the final norm ("norm"), and the logits;
an encoder-decoder has "encoder.*" and "decoder.*" points. HF module paths are mapped per
family in HF_STACKS.

Shapes: B batch, T tokens, C d_model, V vocab_size.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnlab.models.decoder import DecoderLM
from attnlab.models.encoder import EncoderForClassification, EncoderForMLM
from attnlab.models.encoder_decoder import EncoderDecoder

# HF module paths per model_type: (blocks, final norm) of each stack.
HF_STACKS = {
    "gpt2": {"": ("transformer.h", "transformer.ln_f")},
    "llama": {"": ("model.layers", "model.norm")},
    "mistral": {"": ("model.layers", "model.norm")},
    "qwen2": {"": ("model.layers", "model.norm")},
    **{  # the newer dense families (interop/hf/families.py) and the Mixture-of-Experts ones
        family: {"": ("model.layers", "model.norm")}
        for family in ("qwen3", "olmo2", "phi3", "gemma2", "gemma3_text")
        + ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
    },
    "bert": {"": ("bert.encoder.layer", None)},
    "t5": {
        "encoder.": ("encoder.block", "encoder.final_layer_norm"),
        "decoder.": ("decoder.block", "decoder.final_layer_norm"),
    },
}


@dataclass
class Inputs:
    """What both models are run on (decoder_* only for encoder-decoders)."""

    ids: Tensor  # (B, T)
    mask: Tensor | None  # (B, T) bool, True = real token
    decoder_ids: Tensor | None = None
    decoder_mask: Tensor | None = None


@dataclass
class Side:
    """One model and where to hook it: (point name, module, "in" = its input | "out")."""

    model: nn.Module
    label: str
    ours: bool
    kind: str  # "decoder" | "encoder" | "classifier" | "encoder_decoder"
    points: list[tuple[str, nn.Module, str]]


def _stack_points(prefix: str, blocks, norm: nn.Module | None) -> list:
    points = [(f"{prefix}embed", blocks[0], "in")]
    points += [(f"{prefix}block.{i}", b, "out") for i, b in enumerate(blocks)]
    if norm is not None and not isinstance(norm, nn.Identity):
        points.append((f"{prefix}norm", norm, "out"))
    return points


def _attnlab_side(model: nn.Module) -> Side:
    label = f"attnlab {type(model).__name__}"
    if isinstance(model, DecoderLM):
        return Side(model, label, True, "decoder", _stack_points("", model.blocks, model.norm))
    if isinstance(model, EncoderForMLM | EncoderForClassification):
        kind = "classifier" if isinstance(model, EncoderForClassification) else "encoder"
        enc = model.encoder
        return Side(model, label, True, kind, _stack_points("", enc.blocks, enc.norm))
    if isinstance(model, EncoderDecoder):
        points = _stack_points("encoder.", model.encoder.blocks, model.encoder.norm)
        points += _stack_points("decoder.", model.decoder.blocks, model.decoder.norm)
        return Side(model, label, True, "encoder_decoder", points)
    raise ValueError(f"the checker does not know {type(model).__name__}")


def _hf_side(model: nn.Module) -> Side:
    model_type = model.config.model_type
    if model_type not in HF_STACKS:
        raise ValueError(
            f"the checker maps transformers model types {sorted(HF_STACKS)}, not {model_type!r}"
        )
    points = []
    for prefix, (blocks, norm) in HF_STACKS[model_type].items():
        norm_module = None if norm is None else model.get_submodule(norm)
        points += _stack_points(prefix, model.get_submodule(blocks), norm_module)
    if model_type == "t5":
        kind = "encoder_decoder"
    elif model_type == "bert":
        kind = (
            "classifier" if type(model).__name__.endswith("SequenceClassification") else "encoder"
        )
    else:
        kind = "decoder"
    return Side(model, f"transformers {type(model).__name__}", False, kind, points)


def make_side(model: nn.Module) -> Side:
    is_hf = hasattr(getattr(model, "config", None), "model_type")
    return _hf_side(model) if is_hf else _attnlab_side(model)


def _first(x):
    return x[0] if isinstance(x, tuple | list) else x


@torch.no_grad()
def run(side: Side, inputs: Inputs) -> dict[str, Tensor]:
    """Forward `inputs` through the model; return every point's tensor (and "logits")."""
    seen: dict[str, Tensor] = {}
    handles = []

    def keep(name):
        def hook_in(module, args, kwargs):
            seen.setdefault(name, (args[0] if args else kwargs["hidden_states"]).detach().float())

        def hook_out(module, args, output):
            seen.setdefault(name, _first(output).detach().float())

        return hook_in, hook_out

    for name, module, where in side.points:
        hook_in, hook_out = keep(name)
        if where == "in":
            handles.append(module.register_forward_pre_hook(hook_in, with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(hook_out))
    try:
        side.model.eval()
        logits = _forward(side, inputs)
    finally:
        for h in handles:
            h.remove()
    seen["logits"] = logits.detach().float()
    return seen


def _forward(side: Side, x: Inputs) -> Tensor:
    if side.ours:
        if side.kind == "encoder_decoder":
            return side.model(
                x.ids, x.decoder_ids, attention_mask=x.mask, decoder_attention_mask=x.decoder_mask
            )
        return side.model(x.ids, x.mask)
    kwargs = {"input_ids": x.ids}
    if x.mask is not None:
        kwargs["attention_mask"] = x.mask.long()
    if side.kind == "encoder_decoder":
        kwargs["decoder_input_ids"] = x.decoder_ids
        if x.decoder_mask is not None:
            kwargs["decoder_attention_mask"] = x.decoder_mask.long()
    return side.model(**kwargs).logits
