"""A model's weights in one contiguous buffer per dtype, so a decode step reads one stream.

A decode step of batch 1 reads every weight once and does little else (accel/gemv.py), so
its speed is the speed at which the weights stream from memory. Each tensor is normally its own
allocation, scattered over the heap; here every parameter and buffer moves into one flat
buffer per (dtype, device), in the order the modules are registered (for our models, nearly the
order a step reads them: the blocks in turn, the projections in turn), each start aligned to
64 bytes:

    flat = [ embed | block 0: q, k, v, o, up, down, norms | block 1: ... | final norm | head ]
    p.data = flat[offset : offset + p.numel()].view(p.shape)

Reading one contiguous stream lets the hardware prefetcher run ahead, so a compiled decode step
of batch 1 is faster (benchmarks/README.md).

The Parameter objects stay the same (tied weights stay tied, hooks and state_dict keys are
untouched); only their storage moves, and the values are copied exactly. `.to()` would move the
tensors out again, so pack after the model reaches its device. While packing, the old and the
new copies coexist: up to twice the model's memory.
"""

import torch
from torch import Tensor, nn

ALIGN_BYTES = 64  # one cache line, one AVX-512 vector


def pack_weights(model: nn.Module) -> int:
    """Move every parameter and buffer of `model` into one flat buffer per (dtype, device).

    Returns the number of tensors moved (a tensor shared by several modules counts once).
    """
    held: dict[int, tuple[Tensor, list[tuple[nn.Module, str]]]] = {}  # id -> (tensor, holders)
    for module in model.modules():
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                held.setdefault(id(t), (t, []))[1].append((module, name))
    groups: dict[tuple[torch.dtype, torch.device], list] = {}
    for t, holders in held.values():
        groups.setdefault((t.dtype, t.device), []).append((t, holders))
    for (dtype, device), members in groups.items():
        align = max(1, ALIGN_BYTES // dtype.itemsize)
        sizes = [-(-t.numel() // align) * align for t, _ in members]  # rounded up to `align`
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)  # (N,)
        offset = 0
        for (t, holders), size in zip(members, sizes):
            view = flat[offset : offset + t.numel()].view(t.shape)
            view.copy_(t.detach())
            offset += size
            for module, name in holders:
                if name in module._parameters:
                    module._parameters[name].data = view  # same Parameter, new storage
                else:
                    module._buffers[name] = view
    return len(held)
