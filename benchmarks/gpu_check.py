"""The GPU checks of the training, inference and attention issues, one script for a CUDA machine:

    python benchmarks/gpu_check.py                      # all checks, ~6 min on one H100/H200
    python benchmarks/gpu_check.py --device cpu --smoke # tiny shapes on CPU: the code paths only

1. Training MFU: the GPT-2-small shape (124M) at batch B x 1024 (default 16, enough to fill the
   GPU's SMs), bf16 autocast, torch.compile, attnlab's step as benchmarks/train.py times it
   (its `ours_step`: FlatAdamW, clip, fused AdamW). MFU = model FLOP/s (6 N + 12 L C T per
   token, PaLM appendix B) / the bf16 torch.mm peak of an (8192, 8192) product measured in the
   same run. Target 50%.
2. Decode: a ~1.1B Llama (TinyLlama's shape: d_model 2048, 22 layers, 32 heads, 4 kv heads,
   d_ff 5632, vocab 32000) in bf16, batch 1, 32-token prompt, 256 new tokens, greedy: our static
   cache with `compile_decode_step` and CUDA graphs (inductor's `triton.cudagraphs`, what
   mode="reduce-overhead" turns on; plain torch.compile if that fails), against transformers'
   `generate` on the same weights and the memory roofline: bandwidth of a 1 GiB device copy
   (2 x bytes / time), one before and one after every timed call, over the bytes one decode
   step reads. Targets: >= 2x transformers, >= 70% of the roofline.

3. Triton attention: attnlab's FlashAttention-2 kernel (components/triton_attention.py, backend
   "triton") against SDPA's flash kernel (`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`), forward +
   backward, bf16, causal, B 4 x H 16, head_dim 128, T = 4096, 8192, 16384. Both do the same
   work, so the kernel's throughput as a fraction of SDPA's is t_sdpa / t_triton; the smallest
   over the three lengths is the figure. Before timing, the bf16 output and gradients are checked
   against fp32 SDPA at T = 1024 (the CPU tests cannot check bf16: the interpreter's bf16 dot is
   wrong). Target 70%. On CPU (--smoke) it needs TRITON_INTERPRET=1 and runs fp32 tiny shapes.

Every timed call ends with torch.cuda.synchronize(); medians over interleaved rounds.
Prints each figure with its target; exits 1 if one is missed, 2 if a check fails to run.
Inductor skips CUDA graphs silently when it cannot use them (e.g. an input it would have to
copy is mutated): TORCH_LOGS=perf_hints prints why. Written and smoke-tested on CPU (--smoke);
not yet run on a GPU.
"""

import argparse
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from functools import partial

import torch
from decode import bytes_per_token, llama_110m, quick, run_hf, run_stream, to_hf
from train import (
    BETAS,
    LR,
    WEIGHT_DECAY,
    flops_per_token,
    lm_loss,
    matmul_params,
    model_config,
    ours_step,
)

from attnlab.inference.compiled_step import compile_decode_step
from attnlab.models.build import build_model
from attnlab.training.loop import compile_loss
from attnlab.training.optim import build_optimizer

TARGET_MFU, TARGET_VS_HF, TARGET_ROOFLINE, TARGET_TRITON = 0.50, 2.0, 0.70, 0.70
GiB = 2**30


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[object, float]:
    """(fn(), seconds), the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def bf16_peak(device: torch.device, n: int, rounds: int = 10) -> float:
    """FLOP/s of torch.mm on (n, n) bf16 matrices: the median of `rounds` products."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    torch.mm(a, b)
    times = [timed(partial(torch.mm, a, b), device)[1] for _ in range(rounds)]
    return 2 * n**3 / statistics.median(times)


def check_training(device: torch.device, batch: int, context: int, smoke: bool) -> float:
    """Return the MFU of attnlab's compiled bf16 training step on the GPT-2-small shape."""
    cfg = replace(model_config("gpt2-small"), max_seq_len=context)
    if smoke:
        cfg = replace(quick(cfg), attention=replace(cfg.attention, n_heads=4))
    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    opt = build_optimizer(model, LR, WEIGHT_DECAY, BETAS, flat=True)  # after .to(): see FlatAdamW
    loss_of = compile_loss(lm_loss, model, device)  # as the training loop compiles
    x, y = (torch.randint(0, cfg.vocab_size, (batch, context), device=device) for _ in range(2))
    step = partial(ours_step, loss_of, model, opt, x, y, "bf16")

    (first, compile_s) = timed(step, device)
    for _ in range(2):
        step()
    times, peaks = [], []
    for _ in range(3 if smoke else 10):  # interleaved: a step, then the peak GEMM
        times.append(timed(step, device)[1])
        peaks.append(bf16_peak(device, 1024 if smoke else 8192, rounds=3))
    per_token = flops_per_token(matmul_params(model), cfg.n_layers, cfg.d_model, context)
    achieved = per_token * batch * context / statistics.median(times)
    peak = statistics.median(peaks)
    print(
        f"training: {cfg.n_layers} layers, d_model {cfg.d_model}, batch {batch} x {context}, "
        f"bf16 autocast, torch.compile; first step {compile_s:.0f} s (loss {first:.3f}); "
        f"step {statistics.median(times) * 1e3:.1f} ms, {achieved / 1e12:.1f} TFLOP/s, "
        f"bf16 mm peak {peak / 1e12:.1f} TFLOP/s"
    )
    return achieved / peak


def llama_1b():
    """TinyLlama-1.1B's shape: the 110M Llama of decode.py, widened and deepened."""
    small = llama_110m()
    attention = replace(small.attention, n_heads=32, n_kv_heads=4)
    return replace(
        small, d_model=2048, n_layers=22, d_ff=5632, max_seq_len=2048, attention=attention
    )


def check_decode(device: torch.device, n_new: int, smoke: bool) -> tuple[float, float]:
    """Return (ours / transformers tokens/s, ours as a fraction of the roofline)."""
    cfg = quick(llama_1b()) if smoke else llama_1b()
    torch.manual_seed(0)
    model = build_model(cfg).to(device, torch.bfloat16).eval()
    hf = to_hf(model, cfg).to(device, torch.bfloat16)
    prompt = torch.randint(cfg.vocab_size, (32,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    try:
        step = compile_decode_step(model, options={"triton.cudagraphs": True})  # reduce-overhead
        how = "CUDA graphs"
        _, compile_s = timed(partial(run_stream, model, prompt, n_new, step), device)
    except Exception as e:  # CUDA graphs refused: say so, and use plain torch.compile
        print(f"decode: with CUDA graphs: {type(e).__name__}: {e}; plain torch.compile instead")
        torch._dynamo.reset()
        step, how = compile_decode_step(model), "default"
        _, compile_s = timed(partial(run_stream, model, prompt, n_new, step), device)
    run_hf(hf, prompt, 8)  # warm-up
    n = (GiB // 16 if smoke else GiB) // 4
    src, dst = torch.ones(n, device=device), torch.zeros(n, device=device)
    dst.copy_(src)

    def bandwidth() -> float:  # the median of 5 copies (one takes < 1 ms on a GPU)
        seconds = statistics.median(timed(partial(dst.copy_, src), device)[1] for _ in range(5))
        return 2 * n * 4 / seconds  # read + write

    per_token = bytes_per_token(model, cfg, 32 + n_new, kv_bytes=2)
    ours, theirs, fractions, tokens = [], [], [], {}
    for _ in range(3):
        before = bandwidth()
        tokens["ours"], seconds = timed(partial(run_stream, model, prompt, n_new, step), device)
        fractions.append(n_new / seconds / ((before + bandwidth()) / 2 / per_token))
        ours.append(n_new / seconds)
        tokens["hf"], seconds = timed(partial(run_hf, hf, prompt, n_new), device)
        theirs.append(n_new / seconds)
    same = next((i for i, (a, b) in enumerate(zip(tokens["ours"], tokens["hf"])) if a != b), n_new)
    ours_s, hf_s = statistics.median(ours), statistics.median(theirs)
    print(
        f"decode: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, bf16, "
        f"{per_token / 1e9:.2f} GB read per token; compile ({how}) + {n_new} tokens "
        f"{compile_s:.0f} s; ours {ours_s:.1f} tok/s, transformers {hf_s:.1f} tok/s; "
        f"leading tokens equal: {same}/{n_new}"
    )
    return ours_s / hf_s, statistics.median(fractions)


def check_triton(device: torch.device, smoke: bool) -> float:
    """Return min over T of t_sdpa / t_triton, forward + backward, causal (bf16 on CUDA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnlab.components.triton_attention import triton_attention

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the triton check needs CUDA, or TRITON_INTERPRET=1 with --smoke")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's bf16 dot is wrong
    B, H, D = (4, 16, 128) if not smoke else (1, 2, 16)
    lengths = (4096, 8192, 16384) if not smoke else (64, 96)

    def sdpa(q, k, v):
        if not cuda:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def ours(q, k, v):
        return triton_attention(q, k, v, is_causal=True)[0]

    def inputs(T):
        return [
            torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        ]

    # Correctness first: bf16 kernel vs fp32 SDPA (the math kernel), output and gradients.
    q, k, v = inputs(64 if smoke else 1024)
    dout = torch.randn_like(q)
    out = ours(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    out_err = (out.float() - ref).abs().max().item()
    grad_err = max((a.float() - b).abs().max().item() for a, b in zip(grads, ref_grads))
    print(f"triton attention vs fp32 SDPA: output {out_err:.2e}, gradients {grad_err:.2e}")
    if out_err > 5e-2 or grad_err > 2e-1:
        raise RuntimeError("the triton kernel disagrees with SDPA; not timing it")

    def step(fn, q, k, v, dout):
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(dout)

    fractions = []
    for T in lengths:
        q, k, v = inputs(T)
        dout = torch.randn_like(q)
        for fn in (sdpa, ours):  # warm up: autotune / compile
            step(fn, q, k, v, dout)
        ours_s, sdpa_s = [], []
        for _ in range(2 if smoke else 10):  # interleaved rounds
            ours_s.append(timed(partial(step, ours, q, k, v, dout), device)[1])
            sdpa_s.append(timed(partial(step, sdpa, q, k, v, dout), device)[1])
        fraction = statistics.median(sdpa_s) / statistics.median(ours_s)
        print(
            f"   T={T:>6}: triton {statistics.median(ours_s) * 1e3:8.2f} ms, "
            f"sdpa flash {statistics.median(sdpa_s) * 1e3:8.2f} ms, fraction {fraction:.2f}"
        )
        fractions.append(fraction)
        del q, k, v, dout
    return min(fractions)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: the code paths only")
    parser.add_argument("--batch", type=int, default=16, help="training sequences per step")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--only", choices=["training", "decode", "triton"])
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"attnlab GPU checks: torch {torch.__version__}, {name}")
    results, failed = [], False
    if args.only in (None, "training"):
        try:
            batch, context = (2, 64) if args.smoke else (args.batch, 1024)
            mfu = check_training(device, batch, context, args.smoke)
            results.append(("training MFU vs the bf16 mm peak", mfu, TARGET_MFU))
        except Exception:  # report it, and still run the other check
            traceback.print_exc()
            failed = True
    if args.only in (None, "decode"):
        try:
            vs_hf, roof = check_decode(device, 16 if args.smoke else args.new_tokens, args.smoke)
            results.append(("decode tokens/s, ours / transformers", vs_hf, TARGET_VS_HF))
            results.append(("decode, fraction of the roofline", roof, TARGET_ROOFLINE))
        except Exception:
            traceback.print_exc()
            failed = True
    if args.only in (None, "triton"):
        try:
            fraction = check_triton(device, args.smoke)
            results.append(("triton attention, fraction of SDPA flash", fraction, TARGET_TRITON))
        except Exception:
            traceback.print_exc()
            failed = True
    for label, value, target in results:
        print(
            f"   {label:<42}{value:>8.2f}  >= {target:g}  {'PASS' if value >= target else 'MISS'}"
        )
    return 2 if failed else int(any(value < target for _, value, target in results))


if __name__ == "__main__":
    sys.exit(main())
