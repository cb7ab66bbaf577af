"""Attention benchmarks on CPU: eager, sdpa, flash and flex (speed, peak memory), module overhead.

    .venv/bin/python benchmarks/attention.py            # full table, a few minutes on 2 cores
    .venv/bin/python benchmarks/attention.py --quick    # T=256 only, few repeats (~20 s)

1. `eager_attention` vs `sdpa_attention` from attnlab.components.backends, on already-projected
   causal q, k, v of shape (B, H, T, D), fp32: forward + backward at T = 256, 1024, 2048 and
   forward only at T = 4096. Time is the median of interleaved repeats in this process; peak
   memory is measured in a fresh subprocess per (backend, T, mode), see benchmarks/_timing.py.
2. The `Attention` module (sdpa backend, causal, no_grad) against the same math done with bare
   `F.linear` x 4 + `F.scaled_dot_product_attention`, to price the module's Python plumbing.
3. Every backend (eager, sdpa, flash: FlashAttention-2 written in PyTorch, flex: compiled
   FlexAttention) under causal attention, ALiBi, and a sliding window of 256: forward + backward
   at T = 1024, 4096, 16384 and forward at T = 32768, on (B=1, H=4, T, D=64) fp32. eager and sdpa
   take today's dense tensors (the (H, T, T) ALiBi bias, the (T, T) window mask); flash and flex
   take the same terms as functions (score_mod, mask_mod); on CPU, flex with gradients runs
   flash.py's tiled forward and backward (PyTorch 2.13 has no FlexAttention backward on CPU).
   Steps whose dense tensors would pass 1 GiB are not timed; their peak is still tried in a
   subprocess. Checks issue 20's bars (flash's
   peak at 16k against eager's and sdpa's; ALiBi through flex at 4k against dense-bias sdpa).

    .venv/bin/python benchmarks/attention.py --backends-only --max-t 4096   # section 3, short
    .venv/bin/python benchmarks/attention.py --backends-only --device cuda  # section 3 on a GPU

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


def print_targets(rows: dict[tuple[int, str], dict], overhead: float) -> None:
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


MATRIX_H, WINDOW = 4, 256  # the ALiBi measurement used 4 heads
VARIANTS = ("causal", "alibi", f"sliding_{WINDOW}")
MATRIX_NAMES = ("eager", "sdpa", "flash", "flex")
DENSE = ("eager", "sdpa")  # take the bias and mask as tensors; flash and flex take functions
# (T, mode, timing repeats): the grid, forward + backward up to 16k, forward at 32k.
MATRIX_CASES = [
    (1024, "fwd+bwd", 3),
    (4096, "fwd+bwd", 2),
    (16384, "fwd+bwd", 1),
    (32768, "fwd", 1),
]
QUICK_MATRIX_CASES = [(256, "fwd+bwd", 2)]
# A step is timed in this process only where its dense (T, S) tensors stay small; past that its
# peak is still tried in a subprocess (an n/a there means it ran out of memory).
TIMED_DENSE_BYTES = 2**30
# Acceptance (issue 20): ALiBi through flex at T = 4096, forward + backward, against today's
# dense-bias SDPA path, which needed +1,123 MiB: at most a tenth of that, at least 2x faster.
TARGET_ALIBI_MIB, TARGET_ALIBI_SPEEDUP = 1123 / 10, 2.0


def dense_bytes(impl: str, variant: str, T: int) -> int:
    """Bytes of the largest (T, S)-sized tensor one step of `impl` builds (0: none)."""
    if impl == "eager":
        return MATRIX_H * T * T * 4  # the fp32 scores
    if impl == "sdpa" and variant == "alibi":
        return MATRIX_H * T * T * 4  # the dense bias
    if impl == "sdpa" and variant != "causal":
        return T * T  # the bool window mask
    return 0


def variant_step(variant: str, impl: str, q: Tensor, k: Tensor, v: Tensor, dout: Tensor | None):
    """One attention call of `impl` under `variant`, with its backward if `dout` is given.

    eager and sdpa get today's dense tensors (the (H, T, S) ALiBi bias, the (T, S) window mask);
    flash and flex get the same terms as functions (ALiBi's score_mod, the window's mask_mod,
    which flex evaluates into a BlockMask). The terms are prepared inside the step, as a model
    prepares them once per forward.
    """
    T, device = q.shape[2], q.device
    args: dict = dict(is_causal=True)
    functions = impl not in DENSE
    if variant == "alibi":
        alibi = ALiBi(MATRIX_H).to(device)
        pos = torch.arange(T, device=device)
        args["bias"] = alibi.score_mod(pos, pos) if functions else alibi.score_bias(pos, pos)
    elif variant != "causal":
        args["is_causal"] = False
        if impl == "flex":
            args["mask"] = block_mask(sliding_window_mask_mod(WINDOW), None, None, T, T, device)
        elif impl == "flash":
            args["mask"] = sliding_window_mask_mod(WINDOW)
        else:
            args["mask"] = sliding_window_mask(T, WINDOW, device=device)  # (T, T) bool
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
    if dout is None:
        return (out,)
    return out.detach(), q.grad, k.grad, v.grad


def variant_inputs(T: int, mode: str, device: str, seed: int = 0) -> tuple:
    """q, k, v (B, MATRIX_H, T, D), and the output gradient for "fwd+bwd" (else None)."""
    gen = torch.Generator().manual_seed(seed)
    grad = mode == "fwd+bwd"
    q, k, v = (torch.randn(B, MATRIX_H, T, D, generator=gen).to(device) for _ in range(3))
    dout = torch.randn(B, MATRIX_H, T, D, generator=gen).to(device) if grad else None
    return q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad), dout


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo."""
    with open("/proc/meminfo") as f:
        line = next(line for line in f if line.startswith("MemAvailable:"))
    return int(line.split()[1]) * 1024


def variant_peak(variant: str, impl: str, T: int, mode: str, device: str) -> float:
    """Peak MiB of one step above its inputs: the CUDA allocator's, or RSS in a subprocess
    (NaN where that subprocess fails, out of memory, or is not tried: it could not fit)."""
    if device == "cuda":
        inputs = variant_inputs(T, mode, device)
        variant_step(variant, impl, *inputs)  # compile and warm up at this very shape
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        variant_step(variant, impl, *inputs)
        return (torch.cuda.max_memory_allocated() - base) / MiB
    if 4 * dense_bytes(impl, variant, T) > available_bytes():
        return float("nan")  # several copies of its dense tensors would not fit: not tried
    cmd = [sys.executable, os.path.abspath(__file__), "--variant-case", variant, impl, str(T), mode]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **MALLOC_ENV))
    if done.returncode:
        return float("nan")
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]


def run_variant_case(variant: str, impl: str, T: int, mode: str) -> None:
    """Subprocess entry (CPU): print one step's peak RSS above the inputs, as JSON."""
    use_all_cores()
    variant_step(variant, impl, *variant_inputs(WARMUP_T, mode, "cpu"))
    inputs = variant_inputs(T, mode, "cpu")
    if impl == "flex":
        variant_step(variant, impl, *inputs)  # compile at this very shape first
    mib, method = peak_rss_mib(lambda: variant_step(variant, impl, *inputs))
    print(json.dumps({"peak_mib": mib, "method": method}))


def compare_variants(cases: list[tuple[int, str, int]], device: str) -> dict:
    """Section 3: every backend under causal / ALiBi / sliding-window attention.

    Returns:
        rows keyed by (variant, T): dict(ms=..., mib=..., diff=...), NaN where not measured.
    """
    print(f"3. every backend: causal, ALiBi, sliding window {WINDOW}")
    print(f"   (B={B}, H={MATRIX_H}, T, D={D}), fp32, {device}; eager and sdpa take dense tensors")
    print("   (the (H, T, T) ALiBi bias, the (T, T) window mask), flash and flex the same terms")
    print("   as functions (score_mod, mask_mod). On CPU, flex runs compiled FlexAttention")
    print("   without gradients and flash.py's tiled forward + backward with them (PyTorch 2.13")
    print("   has no FlexAttention backward on CPU)")
    print("   time: median of `reps` rounds, interleaved, after 2 warm-ups (which compile flex);")
    print(f"   n/a where a step would build a dense tensor over {TIMED_DENSE_BYTES / MiB:.0f} MiB")
    print("   peak: one step in a fresh subprocess (CUDA: the allocator's peak); n/a where it")
    print("   failed (out of memory) or was not tried (4x its dense tensor > MemAvailable)")
    print("   max|diff| = flash and flex against sdpa where both ran, outputs and gradients")
    print()
    head = f"{'case':<12} {'T':>6} {'mode':<7} {'reps':>4}"
    head += "".join(f" {n + ' ms':>9}" for n in MATRIX_NAMES)
    head += "".join(f" {n + ' MiB':>10}" for n in MATRIX_NAMES)
    print(head + f" {'max|diff|':>10}")
    rows = {}
    for T, mode, repeats in cases:
        for variant in VARIANTS:
            inputs = variant_inputs(T, mode, device)
            names = [n for n in MATRIX_NAMES if dense_bytes(n, variant, T) <= TIMED_DENSE_BYTES]
            diff = float("nan")
            if "sdpa" in names:
                want = variant_step(variant, "sdpa", *inputs)
                got = [variant_step(variant, n, *inputs) for n in ("flash", "flex")]
                diff = max(
                    (a - b).abs().max().item() for g in got for a, b in zip(want, g, strict=True)
                )
                del want, got
            steps = {n: partial(variant_step, variant, n, *inputs) for n in names}
            times = interleaved(steps, repeats)
            del inputs, steps
            ms = {n: median_ms(times[n]) if n in times else float("nan") for n in MATRIX_NAMES}
            mib = {n: variant_peak(variant, n, T, mode, device) for n in MATRIX_NAMES}
            rows[(variant, T)] = dict(ms=ms, mib=mib, diff=diff)
            line = f"{variant:<12} {T:>6} {mode:<7} {repeats:>4}"
            line += "".join(f" {ms[n]:>9.1f}" for n in MATRIX_NAMES)
            line += "".join(f" {mib[n]:>10.1f}" for n in MATRIX_NAMES)
            print(line.replace("nan", "n/a") + f" {diff:>10.1e}".replace("nan", "n/a"), flush=True)
    print()
    return rows


def print_variant_targets(rows: dict) -> None:
    """Issue 20's bars on section 3's rows."""

    def check(label: str, value: float, op: str, target: float) -> None:
        if value != value:
            print(f"   {label:<52} {'n/a':>9}    {op} {target:g}")
            return
        ok = value <= target if op == "<=" else value >= target
        print(f"   {label:<52} {value:>9.3f}    {op} {target:g}   {'PASS' if ok else 'MISS'}")

    print("Targets (issue 20)")
    nan = float("nan")
    long_row = rows.get(("causal", FLASH_TARGET_T))
    alibi = rows.get(("alibi", 4096))
    if long_row is None or alibi is None:
        print("   not measured (--quick)")
        return
    mib = long_row["mib"]
    check(
        f"T={FLASH_TARGET_T} causal fwd+bwd: flash peak / eager peak",
        nan_ratio(mib["flash"], mib["eager"]),
        "<=",
        TARGET_FLASH_VS_EAGER,
    )
    check(
        f"T={FLASH_TARGET_T} causal fwd+bwd: flash peak / sdpa peak",
        nan_ratio(mib["flash"], mib["sdpa"]),
        "<=",
        TARGET_FLASH_VS_SDPA,
    )
    check(
        "T=4096 ALiBi fwd+bwd: flex peak MiB", alibi["mib"].get("flex", nan), "<=", TARGET_ALIBI_MIB
    )
    check(
        "T=4096 ALiBi fwd+bwd: speed-up sdpa ms / flex ms",
        nan_ratio(alibi["ms"]["sdpa"], alibi["ms"]["flex"]),
        ">=",
        TARGET_ALIBI_SPEEDUP,
    )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T=256 only, few repeats (smoke test)")
    parser.add_argument(
        "--max-t", type=int, default=None, help="section 3: skip cases with a longer T"
    )
    parser.add_argument(
        "--case",
        nargs=3,
        metavar=("BACKEND", "T", "MODE"),
        help="internal: measure one step's peak memory, e.g. --case eager 2048 fwd+bwd",
    )
    parser.add_argument(
        "--variant-case",
        nargs=4,
        metavar=("VARIANT", "IMPL", "T", "MODE"),
        help="internal: one section-3 step's peak memory on CPU, e.g. alibi flex 4096 fwd+bwd",
    )
    parser.add_argument("--backends-only", action="store_true", help="run section 3 only")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="section 3 only")
    args = parser.parse_args()
    if args.variant_case:
        variant, impl, T, mode = args.variant_case
        run_variant_case(variant, impl, int(T), mode)
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
    if not args.backends_only:
        rows = compare_backends(QUICK_CASES if args.quick else FULL_CASES)
        overhead = module_overhead(QUICK_MODULE_REPEATS if args.quick else MODULE_REPEATS)
        print_targets(rows, overhead)
        print()
    cases = QUICK_MATRIX_CASES if args.quick else MATRIX_CASES
    cases = [c for c in cases if args.max_t is None or c[0] <= args.max_t]
    print_variant_targets(compare_variants(cases, args.device))


if __name__ == "__main__":
    main()
