"""The compiled decode step: `compile_decode_step(model)`, a user-facing opt-in for faster
decoding, bound to one model, which checks its inputs itself instead of letting Dynamo check
thousands of guards before every token.

`compile_decode_step` turns on three accelerators (attnlab/accel/) before compiling: one-row
Linears as fused GEMVs (gemv.py), every weight in one buffer (packing.py), and attention written
out for the one query (short_attention.py). What each buys is in benchmarks/README.md.

Before each call of a torch.compile'd function, Dynamo evaluates the guards that make the
compiled graph valid. For a decode step these cover the whole model: every module's type,
attributes and (empty) hook dictionaries, every weight's dtype, shape and strides (thousands
for GPT-2-small), a measurable share of a step.

`BoundDecodeStep` compiles `decode_step` with those checks off
(`torch.compiler.skip_all_guards_unsafe`) and checks what can change between calls at the
cost of a few tuple comparisons:

    the model     must be the object it was made for (a ValueError names the mismatch)
    the inputs    token and slot shapes, the cache's layout (every buffer's shape and dtype,
                  which cross-attention K/V are computed), the memory mask's shape, grad mode:
                  each distinct signature gets its own torch.compile, so no graph ever runs on
                  inputs of another shape

What it cannot see is a change to the model itself after it was made (quantizing it, moving
it to another dtype or device, adding hooks): make a new one then.

Dynamo keeps compiled graphs per code object, and finds one for any caller whose guards pass:
without guards, every torch.compile(decode_step) would run the first graph compiled for it
(measured: an int8 model's step ran the fp32 model's graph). So each signature compiles its own
copy of decode_step, with a code object of its own (tested: steps for two models, and for new
shapes, give the eager tokens).
"""

from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnlab.accel.gemv import use_gemv
from attnlab.accel.inductor import NO_ASSERTS, VECTOR_BITS, compile_unguarded
from attnlab.accel.packing import pack_weights
from attnlab.accel.short_attention import use_short_attention
from attnlab.components.kv_cache import ModelCache
from attnlab.inference.steps import decode_step

# Inductor inlines a cheap elementwise producer into the loop of each consumer. Feeding a GEMV,
# that recomputes it once per output row: a LayerNorm's output (~12 ops per element) 3072 times
# in GPT-2's up projection and 50257 times in its head. With this threshold (inductor's CPU
# default is 50) such producers are written out once (a few KB per token) and each GEMV loop is
# one multiply-add per weight.
REALIZE_OPCOUNT = 8
# The generated code's wrapper (what calls each kernel and each int4/int8 matmul in turn) in C++
# instead of Python: SmolLM2's step makes over 300 calls (210 matmuls). At the AVX2 level, one
# thread, its int8 step ran 97.8 tok/s against 85.6 with the Python wrapper (benchmarks/README.md
# section 9a). Its first compile takes longer (153 against 64 s, the C++ compiler's 114 s of it),
# once: inductor caches the library on disk.
CPP_WRAPPER = {"cpp_wrapper": True}


def compile_decode_step(model: nn.Module, **compile_kwargs) -> "BoundDecodeStep":
    """`use_gemv`, `pack_weights` and `use_short_attention` on `model` (attnlab/accel/), then
    decode_step compiled for this model: a step_fn for stream_tokens (see the module docstring
    for what must not change in the model afterwards).

    compile_kwargs go to torch.compile; `options` (inductor settings) are merged over
    {"realize_opcount_threshold": REALIZE_OPCOUNT, **NO_ASSERTS, **VECTOR_BITS, **CPP_WRAPPER}.
    """
    use_gemv(model)
    pack_weights(model)
    use_short_attention(model)
    defaults = {
        "realize_opcount_threshold": REALIZE_OPCOUNT,
        **NO_ASSERTS,
        **VECTOR_BITS,
        **CPP_WRAPPER,
    }
    options = {**defaults, **compile_kwargs.pop("options", {})}
    return BoundDecodeStep(model, options, **compile_kwargs)


class BoundDecodeStep:
    """`decode_step` for one model, compiled once per input signature, without Dynamo guards.

    Args:
        model: the model every call must pass (already prepared: see compile_decode_step).
        options: inductor options for torch.compile.  compile_kwargs: torch.compile's others.
    """

    def __init__(self, model: nn.Module, options: dict, **compile_kwargs):
        self.model = model
        self.options = options
        self.compile_kwargs = compile_kwargs
        self.compiled: dict[tuple, Callable] = {}  # signature -> its own compiled decode_step

    def __call__(
        self,
        model: nn.Module,
        token: Tensor,
        slot: Tensor,
        cache: ModelCache,
        memory_mask: Tensor | None = None,
    ) -> Tensor:
        """decode_step's signature: token (B, 1), slot (1,) -> logits (B, V)."""
        if model is not self.model:
            raise ValueError(
                f"this compiled decode step was made for another model (a "
                f"{type(self.model).__name__}); call compile_decode_step on this "
                f"{type(model).__name__} first"
            )
        mask = None if memory_mask is None else (memory_mask.shape, memory_mask.dtype)
        grad = torch.is_grad_enabled()
        signature = (token.shape, token.device, slot.shape, cache.layout(), mask, grad)
        step = self.compiled.get(signature)
        if step is None:
            step = compile_unguarded(decode_step, self.options, **self.compile_kwargs)
            self.compiled[signature] = step
        return step(model, token, slot, cache, memory_mask)
