"""Many LoRA adapters on one frozen base, a different one for each row of a batch: what a server
needs to answer requests for several fine-tuned models in one batched decode step (Punica, Chen
et al. 2023, arXiv:2310.18547; S-LoRA, Sheng et al. 2023).

Every adapter i of a Linear W0 (N, K) is A_i (r_i, K), B_i (N, r_i), s_i = its scale (lora.py). They
are stacked once, zero-padded to the largest rank (a zero column adds exactly nothing), with a
row of zeros in front for the base alone (index 0):

    A (n + 1, r, K)    B (n + 1, N, r)    s (n + 1,)

A batch whose row b asks for adapter rows[b] computes, for every row at once,

    y_b = W0 x_b + s_{rows[b]} * B_{rows[b]} (A_{rows[b]} x_b)

one frozen matmul shared by the whole batch, then a gather of each row's A and B and two batched
matmuls (punica's "BGMV": batched gather matrix-vector). The rows are set for a forward with
`adapter_rows` (a serve engine sets them before each prefill and decode step); a module whose
rows were never set computes the base alone.

Shapes: B batch, T tokens, n adapters, r the largest rank, N out_features, K in_features.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from attnlab.adapters.lora import is_linear_like


class MultiLoRALinear(nn.Module):
    """A frozen Linear-like `base` with n stacked LoRA adapters, one chosen per batch row.

    Args:
        base: nn.Linear, Int8Linear or Int4Linear (frozen).
        adapters: one (A (r_i, K), B (N, r_i), scale) per adapter, or None where an adapter does
            not touch this Linear; adapter i is index i + 1 (index 0: the base alone).
    """

    def __init__(self, base: nn.Module, adapters: list[tuple[Tensor, Tensor, float] | None]):
        super().__init__()
        if not is_linear_like(base):
            raise ValueError(f"LoRA wraps Linear layers, not {type(base).__name__}")
        self.base = base.requires_grad_(False)
        N, K = base.out_features, base.in_features
        r = max([a[0].shape[0] for a in adapters if a is not None], default=1)
        device, n = base.weight.device, len(adapters) + 1
        A, B, s = torch.zeros(n, r, K), torch.zeros(n, N, r), torch.zeros(n)
        for i, adapter in enumerate(adapters, start=1):
            if adapter is not None:
                a, b, scale = adapter
                A[i, : a.shape[0]], B[i, :, : a.shape[0]], s[i] = a, b, scale
        self.register_buffer("A", A.to(device), persistent=False)  # fp32, as LoRALinear's
        self.register_buffer("B", B.to(device), persistent=False)
        self.register_buffer("s", s.to(device), persistent=False)
        self.rows: Tensor | None = None  # (B,) each row's adapter index, set by adapter_rows

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, T, K) -> (B, T, N), row b through adapter self.rows[b]."""
        y = self.base(x)  # (B, T, N): the frozen weight, shared by every row
        if self.rows is None:
            return y
        A, B = self.A[self.rows], self.B[self.rows]  # (B, r, K), (B, N, r): each row's own
        a = x.to(A.dtype) @ A.transpose(1, 2)  # (B, T, r)
        delta = (a @ B.transpose(1, 2)) * self.s[self.rows][:, None, None]  # (B, T, N)
        return y + delta.to(y.dtype)

    def extra_repr(self) -> str:
        return f"adapters={self.A.shape[0] - 1}, max_rank={self.A.shape[1]}"


def add_multi_lora(model: nn.Module, adapters: list[dict[str, tuple[Tensor, Tensor, float]]]):
    """Swap every Linear that one of `adapters` touches for a MultiLoRALinear (in place).

    Args:
        model: any attnlab model (float or quantized), without adapters.
        adapters: per adapter, {Linear name: (A (r, K), B (N, r), scale)}; adapter i is index
            i + 1 in `adapter_rows`.

    Returns:
        the swapped module names, in model order.
    """
    touched = {name for adapter in adapters for name in adapter}
    names = [n for n, m in model.named_modules() if n in touched and is_linear_like(m)]
    missing = sorted(touched - set(names))
    if missing:
        raise ValueError(f"adapters name modules that are no Linear of the model: {missing[:3]}")
    for name in names:
        owner, _, attr = name.rpartition(".")
        parent = model.get_submodule(owner) if owner else model
        stack = [adapter.get(name) for adapter in adapters]
        setattr(parent, attr, MultiLoRALinear(model.get_submodule(name), stack))
    return names


def multi_lora_modules(model: nn.Module) -> list[MultiLoRALinear]:
    return [m for m in model.modules() if isinstance(m, MultiLoRALinear)]


@contextmanager
def adapter_rows(model: nn.Module, rows: Tensor | None) -> Iterator[None]:
    """Run the forwards inside the block with row b of each batch through adapter rows[b]
    (0: the base alone; None: every row the base), then put back the rows set before (none,
    or those of an enclosing block: an engine's job runs the base inside a request's block)."""
    modules = multi_lora_modules(model)
    before = [m.rows for m in modules]
    for m in modules:
        m.rows = rows
    try:
        yield
    finally:
        for m, r in zip(modules, before):
            m.rows = r
