"""Putting weights into a model built on the meta device, ties included.

Build on "meta" (shapes only, no memory), read the tensors (safetensors, memory-mapped), then
`load_state_dict(assign=True)` adopts them without a copy. Assigning replaces Parameters one
name at a time, which would silently untie shared ones (embedding = LM head, the encoder and
decoder embedding of T5), so the groups of names that share a tensor are recorded first and
re-linked after. A safetensors file stores a shared tensor once, under one of its names.

`shared_groups` is the one place that finds tied names; `with_tied_names` / `without_tied_names`
spread a stored tensor to all of them or keep it under one (attnlab.checkpoint reads and writes
files with them, and opens checkpoints through `load_weights`).
"""

from torch import Tensor, nn


def shared_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor, grouped (only groups of two or more)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def without_tied_names(weights: dict, model: nn.Module) -> dict:
    """`weights` with a tied matrix under its first name only, so that it is stored once."""
    drop = {name for names in shared_groups(model) for name in names[1:]}
    return {k: v for k, v in weights.items() if k not in drop}


def with_tied_names(weights: dict, model: nn.Module) -> dict:
    """`weights` with a tied matrix under all of its names (it is stored under any one)."""
    weights = dict(weights)
    for names in shared_groups(model):
        stored = [n for n in names if n in weights]
        if stored:
            weights.update({n: weights[stored[0]] for n in names if n not in weights})
    return weights


def load_weights(model: nn.Module, state_dict: dict[str, Tensor]) -> nn.Module:
    """Assign `state_dict` to `model` (possibly on meta); every parameter must be given once.

    Raises:
        ValueError listing missing and unexpected names, or a name with its two shapes.
    """
    groups = shared_groups(model)
    state_dict = with_tied_names(state_dict, model)  # a tied tensor may be stored under any name
    expected = model.state_dict()  # parameters (tied ones under every name) and saved buffers
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"weights do not fit the model: missing {missing}, unexpected {unexpected}"
        )
    for name, tensor in state_dict.items():
        if tuple(expected[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"shape mismatch for {name!r}: the model has "
                f"{tuple(expected[name].shape)}, the weights {tuple(tensor.shape)}"
            )
    model.load_state_dict(state_dict, strict=True, assign=True)
    for names in groups:
        first = model.get_parameter(names[0])
        for n in names[1:]:
            owner, _, attr = n.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
    return model
