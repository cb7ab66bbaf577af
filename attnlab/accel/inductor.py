"""What the compiled steps share (inference/compiled_step.py's decode step for a static cache,
paged_step.py's for the serving engine's pool): inductor's settings, and `compile_unguarded`.

Compiled without Dynamo's guards, a step checks for itself what may change between calls (each
module's docstring says what), so the generated code's own checks are off too; and each form a
step is compiled for gets a copy of the function with a code object of its own (`own_copy`).
"""

import types
from collections.abc import Callable

import torch

# Inductor's generated code also asserts every input's sizes, strides and alignment before each
# call (about a thousand checks for SmolLM2's step: 0.7 ms of a 19 ms int4 token, measured).
# The steps check what can change themselves, so they are off.
NO_ASSERTS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
# 256-bit vectors (AVX2) on every x86 CPU. With AVX-512, torch 2.13's inductor writes some of the
# step's reductions (attention's weights times V, 8 of a 64-wide head at a time) as 16-lane
# stores of 8-lane results: each step wrote 8 floats past a buffer's end, and a run of 128 tokens
# aborted in free() ("double free or corruption"; benchmarks/README.md section 9). A decode step
# waits on memory, not on the vector width.
VECTOR_BITS = {"cpp.simdlen": 256}


def own_copy(fn: types.FunctionType) -> types.FunctionType:
    """A new function equal to `fn`, with a code object of its own (fn itself is untouched):
    graphs Dynamo compiles for it are kept on that object, out of reach of every other caller
    of `fn`. Without guards, every torch.compile(fn) would run the first graph compiled for fn
    (measured: an int8 model's step ran the fp32 model's graph)."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_unguarded(fn: types.FunctionType, options: dict, **compile_kwargs) -> Callable:
    """torch.compile of `own_copy(fn)` with inductor `options` and without Dynamo's guards.

    torch.compile pops "guard_filter_fn" out of the options dict it is given, so each call gets
    a dict of its own here. (Sharing one dropped the filter from every graph after the first: a
    SmolLM2 step compiled second evaluated its full guards, 1.2 ms by Dynamo's own log and
    2.2-2.7 ms a step in the profiler, a fifth of an int8 token.)"""
    options = {**options, "guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    return torch.compile(own_copy(fn), options=options, **compile_kwargs)
