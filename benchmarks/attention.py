"""Attention benchmarks on CPU: eager vs sdpa (speed and peak memory), and Attention's overhead.

    .venv/bin/python benchmarks/attention.py            # full table, a few minutes on 2 cores
    .venv/bin/python benchmarks/attention.py --quick    # T=256 only, few repeats (~20 s)
    .venv/bin/python benchmarks/attention.py --long     # also flash at T=16384 (slow on CPU)

1. `eager_attention` vs `sdpa_attention` from attnlab.components.backends, on already-projected
   causal q, k, v of shape (B, H, T, D), fp32: forward + backward at T = 256, 1024, 2048 and
   forward only at T = 4096. Time is the median of interleaved repeats in this process; peak
   memory is measured in a fresh subprocess per (backend, T, mode), see benchmarks/_timing.py.
2. The `Attention` module (sdpa backend, causal, no_grad) against the same math done with bare
   `F.linear` x 4 + `F.scaled_dot_product_attention`, to price the module's Python plumbing.
3. The written-out FlashAttention-2 (`flash_attention`, attnlab.components.flash) against sdpa
   and eager: causal forward + backward at T = 1024, 4096 (and 16384 with --long), time and
   peak memory as in section 1. Eager is timed up to T = 4096 only; its peak memory is tried at
   every T and reported as n/a where the subprocess fails.

4. The flex backend (compiled FlexAttention) against sdpa with today's dense tensors: ALiBi as a
   score_mod vs SDPA with the dense (H, T, S) ALiBi bias at T = 4096, and causal and
   sliding-window-256 masks at T = 1024 and 4096. Each step includes the once-per-forward
   preparation (the bias or score_mod, the dense mask or BlockMask). FlexAttention has no
   backward on CPU (PyTorch 2.13), so on CPU the section times the forward only; with
   `--device cuda` it times forward + backward and reads peak memory from the CUDA allocator.

    .venv/bin/python benchmarks/attention.py --flex-only --device cuda   # section 4 on a GPU

Shared machines are noisy: read the ratios, each measured within one run, not the milliseconds.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from functools import partial

import torch
import torch.nn.functional as F
from _timing import (
    MiB,
    cpu_name,
    interleaved,
    median_ms,
    peak_method,
    peak_rss_mib,
    use_all_cores,
)
from torch import Tensor

from attnlab.components.attention import Attention
from attnlab.components.backends import BACKENDS
from attnlab.components.context import AttentionContext
from attnlab.components.flex import block_mask
from attnlab.components.masks import sliding_window_mask, sliding_window_mask_mod
from attnlab.components.positions import ALiBi

B, H, D = 1, 8, 64  # backend comparison: one sequence, 8 heads of 64
CAUSAL = AttentionContext(is_causal=True)  # the module benchmark: causal, nothing else
BACKEND_NAMES = ("eager", "sdpa")
WARMUP_T = 64  # a tiny step first, so one-time costs (thread pools, kernel code) stay out
# (T, mode, timing repeats): fewer repeats where one eager step takes seconds on 2 cores.
FULL_CASES = [(256, "fwd+bwd", 20), (1024, "fwd+bwd", 10), (2048, "fwd+bwd", 7), (4096, "fwd", 5)]
QUICK_CASES = [(256, "fwd+bwd", 5)]
MODULE = dict(B=4, T=512, d_model=512, n_heads=8)  # the module-overhead shape
MODULE_REPEATS, QUICK_MODULE_REPEATS = 30, 10
# Hand the big frees back to the OS at once (glibc would otherwise raise its mmap threshold
# to up to 32 MiB after the first frees and keep freed tensors resident), so RSS tracks
# what is really live.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}

TARGET_T, TARGET_SPEEDUP, TARGET_MEMORY, TARGET_OVERHEAD_PCT = 2048, 2.0, 4.0, 10.0

# Section 3, flash: (T, timing repeats), causal forward + backward.
FLASH_NAMES = ("eager", "sdpa", "flash")
FLASH_CASES, LONG_FLASH_CASES, QUICK_FLASH_CASES = [(1024, 3), (4096, 2)], [(16384, 1)], [(256, 2)]
FLASH_EAGER_MAX_T = 4096  # eager's (T, T) tensors grow past a small machine beyond this
# Issue 20's bars at T = 16384: flash's extra memory <= 1/8 of eager's and <= 2x sdpa's.
FLASH_TARGET_T, TARGET_FLASH_VS_EAGER, TARGET_FLASH_VS_SDPA = 16384, 1 / 8, 2.0


def make_inputs(T: int, mode: str, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Random q, k, v (B, H, T, D), and the output gradient for "fwd+bwd" (else None)."""
    gen = torch.Generator().manual_seed(seed)
    grad = mode == "fwd+bwd"
    q, k, v = (torch.randn(B, H, T, D, generator=gen, requires_grad=grad) for _ in range(3))
    dout = torch.randn(B, H, T, D, generator=gen) if grad else None
    return q, k, v, dout


def attention_step(backend: str, q: Tensor, k: Tensor, v: Tensor, dout: Tensor | None) -> tuple:
    """One causal attention call; with `dout`, its backward too.

    Returns:
        (out,) for forward only, (out, dq, dk, dv) with a backward.
    """
    attend = BACKENDS[backend]
    if dout is None:
        with torch.no_grad():
            return (attend(q, k, v, is_causal=True)[0],)
    q.grad = k.grad = v.grad = None  # fresh gradients each step, nothing accumulates
    out = attend(q, k, v, is_causal=True)[0]  # (B, H, T, D)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def run_case(backend: str, T: int, mode: str) -> None:
    """Subprocess entry: print one step's peak memory above the inputs, as JSON."""
    use_all_cores()
    attention_step(backend, *make_inputs(WARMUP_T, mode))
    inputs = make_inputs(T, mode)
    mib, method = peak_rss_mib(lambda: attention_step(backend, *inputs))
    print(json.dumps({"peak_mib": mib, "method": method}))


def measure_peak(backend: str, T: int, mode: str) -> float:
    """Peak MiB of one step, measured in a fresh Python process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--case", backend, str(T), mode]
    env = dict(os.environ, **MALLOC_ENV)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def time_case(T: int, mode: str, repeats: int) -> tuple[dict[str, float], float]:
    """Median ms per backend (interleaved), and the largest difference between their results."""
    inputs = make_inputs(T, mode)
    results = [attention_step(name, *inputs) for name in BACKEND_NAMES]
    diff = max((a - b).abs().max().item() for a, b in zip(*results, strict=True))
    del results
    steps = {name: partial(attention_step, name, *inputs) for name in BACKEND_NAMES}
    times = interleaved(steps, repeats)
    return {name: median_ms(t) for name, t in times.items()}, diff


def compare_backends(cases: list[tuple[int, str, int]]) -> dict[tuple[int, str], dict]:
    """Section 1: print one row per case as it finishes; return the rows keyed by (T, mode)."""
    print(f"1. eager vs sdpa: causal attention on projected q, k, v (B={B}, H={H}, T, D={D}), fp32")
    print("   fwd = forward under no_grad; fwd+bwd = forward + backward to q, k, v (grads reset)")
    print("   time: median of `reps` rounds, eager and sdpa alternating (ABAB), after 2 warm-ups")
    print("   peak: resident-memory high-water mark above the level after the inputs exist,")
    print(f"         one step in a fresh subprocess after a T={WARMUP_T} warm-up step;")
    print(f"         {peak_method()};")
    print("         MALLOC_MMAP_THRESHOLD_=65536, so freed tensors leave RSS at once")
    print("   speed x = eager ms / sdpa ms; memory x = eager MiB / sdpa MiB; max|diff| = outputs")
    print("   (and gradients) of the two backends compared elementwise")
    print()
    head = f"{'T':>5}  {'mode':<7} {'reps':>4} {'eager ms':>9} {'sdpa ms':>8} {'speed x':>8}"
    print(head + f" {'eager MiB':>10} {'sdpa MiB':>9} {'memory x':>9} {'max|diff|':>10}")
    rows = {}
    for T, mode, repeats in cases:
        ms, diff = time_case(T, mode, repeats)
        mib = {name: measure_peak(name, T, mode) for name in BACKEND_NAMES}
        row = dict(
            eager_ms=ms["eager"],
            sdpa_ms=ms["sdpa"],
            speedup=ratio(ms["eager"], ms["sdpa"]),
            eager_mib=mib["eager"],
            sdpa_mib=mib["sdpa"],
            memory=ratio(mib["eager"], mib["sdpa"]),
        )
        rows[(T, mode)] = row
        print(
            f"{T:>5}  {mode:<7} {repeats:>4} {row['eager_ms']:>9.1f} {row['sdpa_ms']:>8.1f}"
            f" {row['speedup']:>8.2f} {row['eager_mib']:>10.1f} {row['sdpa_mib']:>9.1f}"
            f" {row['memory']:>9.1f} {diff:>10.1e}",
            flush=True,
        )
    print()
    return rows


def module_overhead(repeats: int) -> float:
    """Section 2: print Attention vs the same bare ops; return the overhead in percent."""
    Bm, T, C, Hm = MODULE["B"], MODULE["T"], MODULE["d_model"], MODULE["n_heads"]
    Dm = C // Hm
    attn = Attention(d_model=C, n_heads=Hm, backend="sdpa").eval()
    x = torch.randn(Bm, T, C)
    Wq, Wk, Wv, Wo = (p.weight for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))

    def project(W: Tensor) -> Tensor:
        return F.linear(x, W).view(Bm, T, Hm, Dm).transpose(1, 2)  # (B, H, T, D)

    def bare() -> Tensor:
        q, k, v = project(Wq), project(Wk), project(Wv)  # (B, H, T, D) each
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return F.linear(out.transpose(1, 2).reshape(Bm, T, C), Wo)  # (B, T, C)

    with torch.no_grad():
        q, k, v = project(Wq), project(Wk), project(Wv)  # the same (strided) layout bare() feeds
        diff = (attn(x, CAUSAL) - bare()).abs().max().item()
        steps = {
            "module": lambda: attn(x, CAUSAL),
            "bare": bare,
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        }
        times = interleaved(steps, repeats, warmup=3)
    ms = {name: median_ms(t) for name, t in times.items()}
    overhead = (ms["module"] / ms["bare"] - 1) * 100
    pairs = zip(times["module"], times["bare"], strict=True)
    paired = (statistics.median(m / b for m, b in pairs) - 1) * 100

    print(f"2. Attention module overhead: Attention(d_model={C}, n_heads={Hm}), sdpa backend,")
    print(f"   causal, forward under no_grad, x of shape (B={Bm}, T={T}, C={C}), fp32")
    print("   bare = F.linear x 3 -> view/transpose -> F.scaled_dot_product_attention(is_causal)")
    print("          -> transpose/reshape -> F.linear, with the module's own weights")
    print(f"   median of {repeats} rounds, module / bare / sdpa-only alternating, after 3 warm-ups")
    print(f"   max|module - bare| = {diff:.1e}")
    print()
    print(f"   Attention module   {ms['module']:8.2f} ms")
    print(f"   bare ops           {ms['bare']:8.2f} ms")
    print(f"   sdpa only          {ms['sdpa']:8.2f} ms   (already-projected q, k, v; context)")
    print(f"   overhead           {overhead:+8.2f} %    = (module / bare - 1) * 100, from medians")
    print(f"                      {paired:+8.2f} %    median of per-round ratios, for comparison")
    print()
    return overhead


def nan_ratio(a: float, b: float) -> float:
    """a / b, NaN where b is missing (NaN) or not positive: a ratio that was not measured."""
    return a / b if b > 0 else float("nan")


def try_peak(backend: str, T: int, mode: str) -> float:
    """`measure_peak`, or NaN where the subprocess fails (out of memory at a long T)."""
    try:
        return measure_peak(backend, T, mode)
    except RuntimeError:
        return float("nan")


def compare_flash(cases: list[tuple[int, int]]) -> dict[int, dict]:
    """Section 3: flash against sdpa and eager, causal fwd+bwd; return the rows keyed by T."""
    mode = "fwd+bwd"
    print("3. flash (FlashAttention-2 written in PyTorch) vs sdpa and eager: causal attention,")
    print(f"   forward + backward on projected q, k, v (B={B}, H={H}, T, D={D}), fp32")
    print("   time and peak measured as in section 1 (interleaved medians; fresh subprocess);")
    print(f"   eager timed for T <= {FLASH_EAGER_MAX_T}, its peak n/a where the subprocess fails")
    print("   slow x = flash ms / sdpa ms; mem/eager, mem/sdpa = flash MiB over that backend's;")
    print("   max|diff| = flash against sdpa, outputs and gradients elementwise")
    print()
    head = f"{'T':>6} {'reps':>4} {'eager ms':>9} {'sdpa ms':>8} {'flash ms':>9} {'slow x':>7}"
    print(
        head + f" {'eager MiB':>10} {'sdpa MiB':>9} {'flash MiB':>10} {'mem/eager':>10}"
        f" {'mem/sdpa':>9} {'max|diff|':>10}"
    )
    rows = {}
    for T, repeats in cases:
        names = [n for n in FLASH_NAMES if n != "eager" or T <= FLASH_EAGER_MAX_T]
        inputs = make_inputs(T, mode)
        flash, sdpa = attention_step("flash", *inputs), attention_step("sdpa", *inputs)
        diff = max((a - b).abs().max().item() for a, b in zip(flash, sdpa, strict=True))
        del flash, sdpa
        steps = {name: partial(attention_step, name, *inputs) for name in names}
        times = interleaved(steps, repeats)
        del inputs, steps
        ms = {
            name: median_ms(times[name]) if name in times else float("nan") for name in FLASH_NAMES
        }
        mib = {name: try_peak(name, T, mode) for name in FLASH_NAMES}
        row = dict(
            ms=ms,
            mib=mib,
            slowdown=ratio(ms["flash"], ms["sdpa"]),
            vs_eager=nan_ratio(mib["flash"], mib["eager"]),
            vs_sdpa=nan_ratio(mib["flash"], mib["sdpa"]),
        )
        rows[T] = row
        print(
            f"{T:>6} {repeats:>4} {ms['eager']:>9.1f} {ms['sdpa']:>8.1f} {ms['flash']:>9.1f}"
            f" {row['slowdown']:>7.2f} {mib['eager']:>10.1f} {mib['sdpa']:>9.1f}"
            f" {mib['flash']:>10.1f} {row['vs_eager']:>10.3f} {row['vs_sdpa']:>9.2f}"
            f" {diff:>10.1e}",
            flush=True,
        )
    print()
    return rows


def print_targets(
    rows: dict[tuple[int, str], dict], overhead: float, flash_rows: dict[int, dict]
) -> None:
    print("Targets")
    row = rows.get((TARGET_T, "fwd+bwd"))
    checks = [
        (f"T={TARGET_T} fwd+bwd: sdpa speed-up (eager/sdpa)", "speedup", TARGET_SPEEDUP, "x"),
        (f"T={TARGET_T} fwd+bwd: peak memory (eager/sdpa)", "memory", TARGET_MEMORY, "x"),
    ]
    for label, key, target, unit in checks:
        if row is None:
            print(f"   {label:<46} {'not measured (--quick)':>12}   >= {target:g}{unit}")
            continue
        verdict = "PASS" if row[key] >= target else "MISS"
        print(f"   {label:<46} {row[key]:>11.2f}{unit}   >= {target:g}{unit}   {verdict}")
    verdict = "PASS" if overhead <= TARGET_OVERHEAD_PCT else "MISS"
    label = "Attention module overhead over bare ops"
    print(f"   {label:<46} {overhead:>11.2f}%   <= {TARGET_OVERHEAD_PCT:g}%   {verdict}")
    T = FLASH_TARGET_T
    for label, key, target in (
        (f"T={T} fwd+bwd: flash peak / eager peak", "vs_eager", TARGET_FLASH_VS_EAGER),
        (f"T={T} fwd+bwd: flash peak / sdpa peak", "vs_sdpa", TARGET_FLASH_VS_SDPA),
    ):
        if T not in flash_rows:
            print(f"   {label:<46} {'not measured (--long)':>12}   <= {target:g}x")
            continue
        value = flash_rows[T][key]
        verdict = "n/a" if value != value else ("PASS" if value <= target else "MISS")
        print(f"   {label:<46} {value:>11.3f}x   <= {target:g}x   {verdict}")


FLEX_H, FLEX_WINDOW = 4, 256  # the ALiBi measurement used 4 heads
FLEX_CASES = [("alibi", 4096), ("causal", 1024), ("causal", 4096)]
FLEX_CASES += [("sliding_256", 1024), ("sliding_256", 4096)]
QUICK_FLEX_CASES = [("alibi", 256), ("causal", 256), ("sliding_256", 256)]
FLEX_REPEATS, QUICK_FLEX_REPEATS = 5, 2
# Acceptance (issue 20): ALiBi through flex at T = 4096, forward + backward, against today's
# dense-bias SDPA path, which needed +1,123 MiB: at most a tenth of that, at least 2x faster.
TARGET_ALIBI_MIB, TARGET_ALIBI_SPEEDUP = 1123 / 10, 2.0


def flex_step(variant: str, impl: str, q: Tensor, k: Tensor, v: Tensor, dout: Tensor | None):
    """One attention call (sdpa with dense tensors, or flex with functions), backward if `dout`.

    The bias or mask is prepared inside the step, as a model prepares it once per forward.
    """
    T, device = q.shape[2], q.device
    args: dict = dict(is_causal=True)
    if variant == "alibi":
        alibi = ALiBi(FLEX_H).to(device)
        pos = torch.arange(T, device=device)
        args["bias"] = alibi.score_mod(pos, pos) if impl == "flex" else alibi.score_bias(pos, pos)
    elif variant == "sliding_256":
        args["is_causal"] = False
        if impl == "flex":
            mod = sliding_window_mask_mod(FLEX_WINDOW)
            args["mask"] = block_mask(mod, None, None, T, T, device)
        else:
            args["mask"] = sliding_window_mask(T, FLEX_WINDOW, device=device)  # (T, T) bool
    attend = BACKENDS[impl]
    if dout is None:
        with torch.no_grad():
            out = attend(q, k, v, **args)[0]
    else:
        q.grad = k.grad = v.grad = None
        out = attend(q, k, v, **args)[0]  # (B, H, T, D)
        out.backward(dout)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out


def flex_inputs(T: int, device: str, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """q, k, v (B, FLEX_H, T, D) and, where flex has a backward (CUDA), the output gradient."""
    gen = torch.Generator().manual_seed(seed)
    grad = device == "cuda"
    q, k, v = (torch.randn(B, FLEX_H, T, D, generator=gen).to(device) for _ in range(3))
    dout = torch.randn(B, FLEX_H, T, D, generator=gen).to(device) if grad else None
    return q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad), dout


def flex_peak(variant: str, impl: str, T: int, device: str) -> float:
    """Peak MiB of one step above its inputs: the CUDA allocator's, or RSS in a subprocess."""
    if device == "cuda":
        inputs = flex_inputs(T, device)
        flex_step(variant, impl, *inputs)  # compile and warm up at this very shape
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        flex_step(variant, impl, *inputs)
        return (torch.cuda.max_memory_allocated() - base) / MiB
    cmd = [sys.executable, os.path.abspath(__file__), "--flex-case", variant, impl, str(T)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **MALLOC_ENV))
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]


def run_flex_case(variant: str, impl: str, T: int) -> None:
    """Subprocess entry (CPU): print one forward step's peak RSS above the inputs, as JSON."""
    use_all_cores()
    inputs = flex_inputs(T, "cpu")
    flex_step(variant, impl, *inputs)  # compile and warm up at this very shape
    mib, method = peak_rss_mib(lambda: flex_step(variant, impl, *inputs))
    print(json.dumps({"peak_mib": mib, "method": method}))


def compare_flex(cases: list[tuple[str, int]], repeats: int, device: str) -> dict:
    """Section 4: sdpa with dense tensors vs flex with functions; return rows by (variant, T)."""
    mode = "fwd+bwd" if device == "cuda" else "fwd (no flex backward on CPU)"
    print(f"4. flex vs sdpa (B={B}, H={FLEX_H}, T, D={D}), fp32, {device}, {mode}")
    print("   alibi: sdpa + dense (H, T, T) ALiBi bias vs flex + ALiBi score_mod, causal")
    print("   causal: sdpa is_causal vs flex causal BlockMask; sliding_256: sdpa + dense (T, T)")
    print(f"   window-{FLEX_WINDOW} mask vs flex BlockMask; each step prepares its bias / mask")
    print(f"   time: median of {repeats} rounds, interleaved, after compiling at the same shape")
    print("   speed x = sdpa ms / flex ms; memory: peak MiB of one step above its inputs")
    print()
    print(f"{'case':<12} {'T':>5} {'sdpa ms':>9} {'flex ms':>9} {'speed x':>8}", end="")
    print(f" {'sdpa MiB':>9} {'flex MiB':>9} {'max|diff|':>10}")
    rows = {}
    for variant, T in cases:
        inputs = flex_inputs(T, device)
        outs = [flex_step(variant, impl, *inputs).detach() for impl in ("sdpa", "flex")]
        diff = (outs[0] - outs[1]).abs().max().item()
        del outs
        steps = {impl: partial(flex_step, variant, impl, *inputs) for impl in ("sdpa", "flex")}
        ms = {name: median_ms(t) for name, t in interleaved(steps, repeats).items()}
        mib = {impl: flex_peak(variant, impl, T, device) for impl in ("sdpa", "flex")}
        rows[(variant, T)] = dict(ms=ms, mib=mib, speedup=ratio(ms["sdpa"], ms["flex"]))
        print(
            f"{variant:<12} {T:>5} {ms['sdpa']:>9.1f} {ms['flex']:>9.1f}"
            f" {rows[(variant, T)]['speedup']:>8.2f} {mib['sdpa']:>9.1f} {mib['flex']:>9.1f}"
            f" {diff:>10.1e}",
            flush=True,
        )
    print()
    row = rows.get(("alibi", 4096))
    label = f"ALiBi T=4096 {mode}"
    if row is None:
        print(f"   {label}: not measured (--quick)")
    else:
        ok_mib = "PASS" if row["mib"]["flex"] <= TARGET_ALIBI_MIB else "MISS"
        ok_speed = "PASS" if row["speedup"] >= TARGET_ALIBI_SPEEDUP else "MISS"
        print(
            f"   {label}: flex peak {row['mib']['flex']:.1f} MiB <= {TARGET_ALIBI_MIB:.1f} {ok_mib}"
        )
        print(f"   {label}: speed-up {row['speedup']:.2f}x >= {TARGET_ALIBI_SPEEDUP:g}x {ok_speed}")
    print()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T=256 only, few repeats (smoke test)")
    parser.add_argument("--long", action="store_true", help="also flash vs sdpa at T=16384")
    parser.add_argument(
        "--case",
        nargs=3,
        metavar=("BACKEND", "T", "MODE"),
        help="internal: measure one step's peak memory, e.g. --case eager 2048 fwd+bwd",
    )
    parser.add_argument(
        "--flex-case",
        nargs=3,
        metavar=("VARIANT", "IMPL", "T"),
        help="internal: one flex-section step's peak memory on CPU, e.g. alibi flex 4096",
    )
    parser.add_argument("--flex-only", action="store_true", help="run section 4 (flex) only")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="section 4 only")
    args = parser.parse_args()
    if args.flex_case:
        variant, impl, T = args.flex_case
        run_flex_case(variant, impl, int(T))
        return
    if args.case:
        backend, T, mode = args.case
        if backend not in BACKENDS or mode not in ("fwd", "fwd+bwd"):
            parser.error(f"--case wants BACKEND in {list(BACKENDS)} and MODE in fwd, fwd+bwd")
        run_case(backend, int(T), mode)
        return

    threads = use_all_cores()
    print(f"attnlab attention benchmarks: torch {torch.__version__}, {threads} threads", end="")
    print(f", {cpu_name()}, {platform.system()} {platform.release()}")
    print("Shared machines are noisy: compare the RATIOS, each measured within this one run.")
    print()
    if not args.flex_only:
        rows = compare_backends(QUICK_CASES if args.quick else FULL_CASES)
        overhead = module_overhead(QUICK_MODULE_REPEATS if args.quick else MODULE_REPEATS)
        flash_cases = QUICK_FLASH_CASES if args.quick else FLASH_CASES
        flash_rows = compare_flash(flash_cases + (LONG_FLASH_CASES if args.long else []))
        print_targets(rows, overhead, flash_rows)
        print()
    flex_cases = QUICK_FLEX_CASES if args.quick else FLEX_CASES
    compare_flex(flex_cases, QUICK_FLEX_REPEATS if args.quick else FLEX_REPEATS, args.device)


if __name__ == "__main__":
    main()
