"""A Linear whose fp32 CPU matmuls go through oneDNN instead of the default BLAS (MKL).

Why: on CPU, PyTorch sends fp32 `nn.Linear` / `torch.mm` to MKL's sgemm. oneDNN (PyTorch's
"mkldnn", which it already uses for bf16 matmuls) can run large fp32 matmuls faster than MKL on
some x86 CPUs (a likely reason, not verified: MKL picks its kernels by CPU vendor, oneDNN by
instruction set). PyTorch exposes oneDNN's fp32 inner product on ordinary dense tensors as
`torch.ops.mkldnn._linear_pointwise`, so every product of a Linear's training step can use it
without converting tensors to oneDNN's own layout:

    forward       y  = x  W^T + b     _linear_pointwise(x, W, b)          x: (N, in)  W: (out, in)
    grad input    gx = gy W           _linear_pointwise(gy, W^T)          W^T: a strided view
    grad weight   gW = gy^T x         _linear_pointwise(gy^T, x^T)        gy^T: one (out, N) copy
    grad bias     gb = sum_N gy

It is the same fp32 math as nn.Linear (only the summation order differs: ~1e-6 relative).

Whether it pays depends on the shapes and the machine: large matmuls gain, small ones lose to
the autograd Function, the custom-op dispatch and the transposing copy (benchmarks/README.md).
So the switch is explicit and deterministic: `enable_fast_linear(model)` swaps every Linear, or
only the (in_features, out_features, bias) shapes it is given. Timing is a separate, explicit
tool (`choose_fast_linear`, for benchmarks): nothing here picks a code path by timing it unless
asked to, so a run's numerics never depend on how busy the machine was.

The swap puts a new `FastLinear` module in place of each nn.Linear, holding the same
Parameters (accel/swap.py): tied weights, optimizer references and state_dict keys all stay as
they were. Under autocast, for non-fp32 inputs, or off the CPU, FastLinear is plain nn.Linear.

Shapes: N rows (all leading dimensions flattened), in = in_features, out = out_features.
"""

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.accel.swap import swap_linears

MIN_SPEEDUP = 1.10  # swap a shape only when oneDNN is >= 10% faster: a busy machine's timing
#                    noise is about 5%, and a near-tie is not worth leaving the default path
MEASURE_REPEATS = 15  # interleaved rounds per shape (after one warm-up call of each path)...
MEASURE_BUDGET_S = 3.0  # ...but a shape stops after MIN_ROUNDS once this much time is spent
MIN_ROUNDS = 3
MIN_STEP_SPEEDUP = 1.03  # the whole forward + backward must gain >= 3% to keep the swap
STEP_REPEATS, STEP_BUDGET_S = 9, 10.0  # its interleaved rounds, and their time budget


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN and its dense-tensor linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@torch.library.custom_op("attnlab::onednn_linear", mutates_args=())
def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T + b through oneDNN's inner product, on dense fp32 CPU tensors.

    A custom op (about 10 us of dispatch per call) so that torch.compile keeps it as one opaque
    call: inductor's own lowering of `_linear_pointwise` expects a frozen, pre-packed weight.

    Args:
        x: (N, in), made contiguous by the op.  weight: (out, in), any strides.  bias: (out,).

    Returns:
        (N, out), contiguous.
    """
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


@onednn_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])  # (N, out)


class OneDNNLinearFunction(torch.autograd.Function):
    """y = x W^T + b with forward and backward matmuls through `onednn_linear`."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        y = onednn_linear(x2, weight, bias)  # (N, out)
        ctx.save_for_backward(x2, weight)
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])  # (..., out)

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x2, weight = ctx.saved_tensors
        gy = grad_y.reshape(-1, grad_y.shape[-1])  # (N, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_linear(gy, weight.t()).view(ctx.x_shape)  # (N, in) -> x's shape
        if ctx.needs_input_grad[1]:
            # oneDNN wants a contiguous left operand; the right one may be a strided view.
            grad_w = onednn_linear(gy.t().contiguous(), x2.t())  # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = gy.sum(0)  # (out,)
        return grad_x, grad_w, grad_b


def fast_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, through oneDNN for fp32 CPU tensors outside autocast (else F.linear itself)."""
    usable = (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
    )
    if not usable:
        return F.linear(x, weight, bias)
    return OneDNNLinearFunction.apply(x, weight, bias)


class FastLinear(nn.Linear):
    """nn.Linear computed by `fast_linear`: same parameters, same state_dict, same results."""

    def forward(self, x: Tensor) -> Tensor:
        return fast_linear(x, self.weight, self.bias)  # (..., in) -> (..., out)


def _step(linear, x: Tensor, weight: Tensor, bias: Tensor | None, grad_y: Tensor) -> None:
    """One forward + backward of a Linear (grads to x, weight, bias), as training does."""
    x.grad = weight.grad = None
    if bias is not None:
        bias.grad = None
    linear(x, weight, bias).backward(grad_y)


def measure_speedup(
    in_features: int,
    out_features: int,
    bias: bool,
    rows: int,
    repeats: int = MEASURE_REPEATS,
    budget_s: float = MEASURE_BUDGET_S,
) -> float:
    """Time forward + backward of F.linear and `fast_linear` on one shape, interleaved.

    One warm-up call of each, then rounds of one call each (default, oneDNN), at least
    MIN_ROUNDS and at most `repeats`, stopping early once `budget_s` is spent.

    Returns:
        the median over rounds of (F.linear time / fast_linear time): > 1 means oneDNN is
        faster. A per-round ratio cancels the load of a busy machine, which both sides share.
    """
    gen = torch.Generator().manual_seed(0)  # its own: the caller's RNG stream stays untouched
    x = torch.randn(rows, in_features, generator=gen, requires_grad=True)  # (N, in)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    weight.requires_grad_()
    b = torch.zeros(out_features, requires_grad=True) if bias else None
    grad_y = torch.randn(rows, out_features, generator=gen)  # (N, out)
    paths = {"default": F.linear, "onednn": fast_linear}
    for linear in paths.values():  # warm-up: kernel selection, thread pools, caches
        _step(linear, x, weight, b, grad_y)
    ratios, start = [], time.perf_counter()
    for i in range(repeats):
        took = {}
        for name, linear in paths.items():
            t0 = time.perf_counter()
            _step(linear, x, weight, b, grad_y)
            took[name] = time.perf_counter() - t0
        ratios.append(took["default"] / took["onednn"])
        if i + 1 >= MIN_ROUNDS and time.perf_counter() - start > budget_s:
            break
    return statistics.median(ratios)


Shape = tuple[int, int, bool]  # (in_features, out_features, bias)


def linear_shapes(model: nn.Module) -> dict[Shape, list[nn.Linear]]:
    """The model's plain nn.Linear modules grouped by (in_features, out_features, bias)."""
    shapes: dict[Shape, list[nn.Linear]] = {}
    for m in model.modules():  # each module once, even if it is reachable twice
        if type(m) is nn.Linear:  # subclasses (FastLinear, quantized, ...) keep their forward
            shapes.setdefault((m.in_features, m.out_features, m.bias is not None), []).append(m)
    return shapes


def _shape(m: nn.Linear) -> Shape:
    return (m.in_features, m.out_features, m.bias is not None)


def enable_fast_linear(model: nn.Module, shapes: list[Shape] | None = None) -> int:
    """Put a FastLinear (sharing the Parameters) in place of the model's plain nn.Linears.

    Args:
        model: any module.
        shapes: only Linears of these (in_features, out_features, bias); None = every one.

    Returns:
        how many modules were swapped (0 without oneDNN; subclasses of nn.Linear, FastLinear
        included, are left alone).
    """
    if not onednn_available():
        return 0
    wanted = None if shapes is None else {tuple(s) for s in shapes}
    return swap_linears(
        model,
        FastLinear,
        lambda m: type(m) is nn.Linear and (wanted is None or _shape(m) in wanted),
    )


def disable_fast_linear(model: nn.Module) -> int:
    """Put a plain nn.Linear (sharing the Parameters) in place of every FastLinear."""
    return swap_linears(model, nn.Linear, lambda m: type(m) is FastLinear)


def measure_step_speedup(
    model: nn.Module,
    shapes: list[Shape] | None,
    check: Callable[[], object],
    repeats: int = STEP_REPEATS,
    budget_s: float = STEP_BUDGET_S,
) -> float:
    """Time `check()` (a forward + backward of the model, or what inference runs) with the
    Linears of `shapes` (None: all) as nn.Linear and as FastLinear, interleaved; leaves them
    nn.Linear, the model's .grad fields None and the RNG state (dropout) as it found them.

    Returns:
        the median over rounds of (time as nn.Linear / time as FastLinear).
    """
    ratios, start = [], time.perf_counter()
    switch = {
        nn.Linear: disable_fast_linear,
        FastLinear: partial(enable_fast_linear, shapes=shapes),
    }
    try:
        with torch.random.fork_rng():
            for cls in (nn.Linear, FastLinear):  # warm-up
                switch[cls](model)
                check()
            for i in range(repeats):
                took = {}
                for cls in (nn.Linear, FastLinear):
                    switch[cls](model)
                    t0 = time.perf_counter()
                    check()
                    took[cls] = time.perf_counter() - t0
                ratios.append(took[nn.Linear] / took[FastLinear])
                if i + 1 >= MIN_ROUNDS and time.perf_counter() - start > budget_s:
                    break
    finally:
        disable_fast_linear(model)
        for p in model.parameters():
            p.grad = None
    return statistics.median(ratios)


def choose_fast_linear(
    model: nn.Module,
    rows: int,
    check: Callable[[], object] | None = None,
    min_speedup: float = MIN_SPEEDUP,
    min_step_speedup: float = MIN_STEP_SPEEDUP,
    verbose: bool = False,
    inference: bool = False,
) -> list[Shape]:
    """Time the model's Linear shapes both ways and return those worth swapping (swaps nothing).

    A tool for benchmarks and for users who want to measure on their own machine; pass the
    result to `enable_fast_linear`. Its answer depends on the machine and on its load.

    1. Screen: each distinct (in_features, out_features, bias) shape is timed alone, forward +
       backward on `rows` rows, default path against oneDNN (`measure_speedup`); shapes with
       default / oneDNN time >= min_speedup are candidates.
    2. Confirm (when `check` is given): `check()`, one forward + backward of the model, is timed
       with the candidates swapped and not (`measure_step_speedup`); they are kept only if the
       whole step is >= min_step_speedup times faster. A Linear timed alone can mislead: on an
       oversubscribed machine, shapes faster alone can make the model's step slower.

    For inference (`inference=True`, e.g. decoding) step 1 is skipped: every shape is a
    candidate and `check` decides. A decode step reads each weight once, from memory, while a
    matrix-vector product timed alone reads its weight from cache.

    Args:
        model: any module.  rows: rows per matmul in training (batch_size * context).
        check: runs one forward + backward of `model` on a representative batch; its gradients
            are discarded. With `inference`, required: what inference runs.
        min_speedup: a shape's speed-up to be a candidate; 0 takes every shape, timing nothing.
        min_step_speedup: the whole step's speed-up needed to keep the candidates.
        verbose: print each measured speed-up.
        inference: choose for inference (see above), not for training.

    Returns:
        the chosen shapes ([] without oneDNN or when the step check says no).
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if inference and check is None:
        raise ValueError("choose_fast_linear(inference=True) needs a check to time")
    if not onednn_available():
        return []
    chosen = []
    for (n_in, n_out, bias), modules in linear_shapes(model).items():
        screen = min_speedup > 0 and not inference
        speedup = measure_speedup(n_in, n_out, bias, rows) if screen else float("inf")
        if verbose:
            print(f"fast_linear: {n_in}->{n_out} bias={bias} x{len(modules)}: {speedup:.2f}x")
        if speedup >= min_speedup:
            chosen.append((n_in, n_out, bias))
    if chosen and check is not None and (min_speedup > 0 or inference):
        speedup = measure_step_speedup(model, chosen, check)
        if verbose:
            print(f"fast_linear: whole step with {chosen} swapped: {speedup:.2f}x")
        if speedup < min_step_speedup:
            return []
    return chosen


__all__ = [
    "FastLinear",
    "OneDNNLinearFunction",
    "choose_fast_linear",
    "disable_fast_linear",
    "enable_fast_linear",
    "fast_linear",
    "measure_speedup",
    "measure_step_speedup",
    "onednn_available",
    "onednn_linear",
]
