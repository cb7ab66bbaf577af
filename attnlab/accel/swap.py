"""Replace Linear modules by other Linear classes that share the same Parameters.

An accelerator that needs another `forward` for a Linear builds a new module object of its own
class and puts it where the old one was (`setattr` on the owner), as quantization's
`swap_modules` does. The Parameters (tied ones included) are the same objects, so optimizer
references, state_dict keys and values stay as they were; nothing changes a live object's class.
Hooks registered on the old module stay with the old module.
"""

from collections.abc import Callable

from torch import nn


def rebuild_linear(old: nn.Linear, cls: type[nn.Linear]) -> nn.Linear:
    """A `cls` module holding `old`'s weight and bias Parameters (the same objects)."""
    new = cls(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
    new.weight = old.weight
    new.bias = old.bias
    new.train(old.training)
    return new


def swap_linears(model: nn.Module, cls: type[nn.Linear], take: Callable[[nn.Linear], bool]) -> int:
    """Put a `cls` twin in place of every Linear of `model` that `take` accepts.

    A module reachable under several names gets one twin, placed under each of them.

    Returns:
        how many modules were replaced.
    """
    twins: dict[int, nn.Linear] = {}
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, nn.Linear) and (id(child) in twins or take(child)):
                twin = twins.setdefault(id(child), rebuild_linear(child, cls))
                setattr(owner, name, twin)
    return len(twins)
