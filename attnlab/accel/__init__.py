"""Accelerators: speed tricks kept beside the core, each its own module, each off unless asked for.

The components and models compute the textbook way. Each module here makes one thing faster
without changing what is computed (each is tested equal to the plain path), and each is one
switch that a user, a recipe or the compiled decode step turns on:

    module           switch                       what it does
    short_attention  use_short_attention(model)   compiled: attention written out for one
                                                  query or a few keys (fuses with its neighbours)
    sigmoid_gelu     use_sigmoid_gelu(model)      compiled: GPT-2's GELU as x * sigmoid(2u)
    fast_linear      enable_fast_linear(model)    fp32 CPU Linears through oneDNN
    gemv             use_gemv(model)              compiled: one-row Linears as fused GEMVs
    packing          pack_weights(model)          every weight in one buffer per dtype
    flat_adamw       TrainConfig.flat_adamw       AdamW over one flat buffer per group
    host_memory      TrainConfig.keep_freed_memory  glibc keeps freed memory in the process
    paged_attention  use_compiled_decode(cache)   compiled: a paged cache's decode attention
                                                  reads keys in place through the block table
    paged_step       CompiledPagedDecode(decoder, compiled: the serving engine's whole decode
                     cache)                       step as one graph over the pool
    qdot             qdot.choice() (automatic,    int4/int8 Linears as llama.cpp's integer dot
                     ATTNLAB_QUANT_KERNEL)        products (AVX2), on x86 CPUs

The compiled decode step (`attnlab.inference.compiled_step.compile_decode_step`) turns on
short_attention, gemv and packing; the compiled training step (`train.compile`) short_attention
and sigmoid_gelu; `attnlab serve` has a flag for each of fast_linear, host_memory,
paged_attention and paged_step (`--compile`); inductor.py holds what the compiled steps share.
qdot is the one chosen by the machine: quantize/int4.py and int8.py ask it once per layer
whether the kernels run on this CPU (the C++ source is compiled on first use).
What each buys, measured, is in benchmarks/README.md.

A module swap never changes a live object's class: the new module objects share the old ones'
Parameters (`swap.swap_linears`), as quantization's `swap_modules` does.

Imports: torch and attnlab.components only, so inference and training can build on it.
"""
