"""Training throughput and MFU on CPU: attnlab's training step against a plain PyTorch GPT.

    .venv/bin/python benchmarks/train.py            # full table: about an hour on 2 busy cores
    .venv/bin/python benchmarks/train.py --quick    # recipe-a, eager, few rounds (< 60 s)

Two shapes, each in fp32 and bf16 autocast, eager and torch.compile'd:
  recipe-a    gpt2-tiny with d_model 128, 4 layers, 4 heads, d_ff 512, vocab 72; batch 12 x 64
  gpt2-small  the "gpt2" preset (124M), dropout 0; batch 4 x 256

Candidates, timed in the same rounds (one step of each per round, the order rotating):
  ours        attnlab's model and the step of attnlab.training.loop.train: lr set, forward and
              clm_loss (LMTask.loss), backward, loss.item(), clip_grad_norm_, fused AdamW over
              one flat buffer per group (build_optimizer(flat=True)); compiled as the loop
              compiles (compile_loss: model and loss in one graph, on CPU with inductor's C++
              wrapper)
  ours+fast   the same after attnlab.accel.fast_linear.enable_fast_linear (fp32 only:
              under autocast FastLinear is nn.Linear)
  plain       the ~100-line single-file GPT below (nanoGPT style: one fused qkv Linear,
              F.scaled_dot_product_attention, tied head, F.cross_entropy, the same clip and
              fused AdamW); compiled with a plain torch.compile
  plain-e     in compiled runs, plain again without torch.compile, so that "ours compiled /
              plain eager" (nanoGPT runs this recipe on CPU with --compile=False) is a ratio
              measured in one process
  peak GEMMs  large square matmuls on all cores, also once per round, so each MFU divides two
              numbers from the same rounds: torch.mm fp32 (the default path, MKL sgemm), oneDNN
              fp32 (the op FastLinear uses) and torch.mm bf16

FLOPs per token (PaLM appendix B, nanoGPT): 6 N + 12 L H D T, N = weights of every matmul (the
LM head included, once, even when tied), T = context. MFU = achieved / peak FLOP/s.
Each case process first calls keep_freed_memory (attnlab/accel/host_memory.py), as the loop
does on CPU: malloc then keeps freed memory instead of page-faulting the large tensors of every
step in again. It is process-wide, so plain and the peak GEMMs run under it too.
Each (shape, precision, mode) runs in a fresh subprocess with an empty inductor cache, so a
compile is cold, a slow or failing one is reported as such, and nothing leaks between them.
Shared machines are noisy: read the ratios, each measured within one run, not the milliseconds.
The header prints the load average: above one per core, PyTorch's OpenMP threads (libgomp)
spin-wait for each other while the OS runs someone else, and a 2-thread step can take 10x its
quiet time; OMP_WAIT_POLICY=PASSIVE in the environment makes them sleep instead.
"""

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from _timing import cpu_name, use_all_cores
from torch import Tensor, nn

from attnlab.accel.fast_linear import choose_fast_linear, enable_fast_linear, onednn_linear
from attnlab.accel.host_memory import keep_freed_memory
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.training.loop import compile_loss, trained_tensors
from attnlab.training.objectives import clm_loss
from attnlab.training.optim import build_optimizer

# name -> (preset, model overrides, attention overrides, batch, context)
SHAPES = {
    "recipe-a": (
        "gpt2-tiny",
        dict(d_model=128, n_layers=4, d_ff=512, max_seq_len=64, vocab_size=72, dropout=0.0),
        dict(n_heads=4),
        12,
        64,
    ),
    "gpt2-small": ("gpt2", dict(dropout=0.0), {}, 4, 256),
}
LR, WEIGHT_DECAY, BETAS, GRAD_CLIP = 1e-3, 0.1, (0.9, 0.99), 1.0  # TrainConfig's defaults
ROUNDS = {"recipe-a": 30, "gpt2-small": 5}  # timed rounds per configuration
QUICK_ROUNDS = 5
WARMUP = {"eager": 1, "compiled": 2}  # untimed steps per candidate (the first compiles), then
#                                       one untimed round of everything
PEAK_N, QUICK_PEAK_N = 2048, 1024  # the in-round peak GEMMs are (n, n) @ (n, n)
PEAK_SIZES = (1024, 2048, 3072)  # section 1 sweeps these
CASE_TIMEOUT_S = 2400  # a configuration (cold compiles included) taking longer is reported so
TARGET_RATIO = 1 / 1.15  # recipe-a fp32 eager: ours / plain step time
TARGET_MFU_DEFAULT, TARGET_MFU_FAST = 0.85, 0.60  # gpt2-small fp32 eager ours / ours+fast
TARGET_MFU_BF16 = 0.55  # gpt2-small bf16 eager ours, of the torch.mm bf16 peak


# --- the plain reference: GPT-2 in bare PyTorch -----------------------------------------------
class PlainBlock(nn.Module):
    def __init__(self, C: int, H: int, d_ff: int):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, d_ff), nn.Linear(d_ff, C)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)
        h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")  # (B, T, F)
        return x + self.mlp_proj(h)  # (B, T, C)


class PlainGPT(nn.Module):
    """Token + learned position embeddings, pre-norm blocks, final LayerNorm, tied head."""

    def __init__(self, V: int, max_T: int, C: int, L: int, H: int, d_ff: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(max_T, C)
        self.blocks = nn.ModuleList(PlainBlock(C, H, d_ff) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # GPT-2's init, scaled residual projections
            if p.dim() >= 2:
                std = 0.02 / (2 * L) ** 0.5 if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def plain_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """nanoGPT's groups (decay every >= 2-D parameter), fused AdamW."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, fused=True)


def autocast(precision: str, device: torch.device):
    """The loop's precision context: none for fp32, autocast to bf16 for bf16."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def plain_loss(forward, batch: dict) -> Tensor:
    return F.cross_entropy(forward(batch["x"]).float().flatten(0, 1), batch["y"].flatten())


def plain_step(loss_of, model: nn.Module, opt, x: Tensor, y: Tensor, precision: str) -> float:
    with autocast(precision, x.device):
        loss = loss_of({"x": x, "y": y})
    loss.backward()
    value = loss.item()
    nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return value


# --- attnlab: one step of attnlab.training.loop.train (grad_accum 1, GradScaler disabled) -----
def lm_loss(model: nn.Module, batch: dict) -> Tensor:
    """LMTask.loss."""
    return clm_loss(model(batch["x"]), batch["y"])


def ours_step(loss_of, model: nn.Module, opt, x: Tensor, y: Tensor, precision: str) -> float:
    for group in opt.param_groups:
        group["lr"] = LR  # the loop sets the schedule's lr every step
    loss_sum = torch.zeros((), device=x.device)
    with autocast(precision, x.device):
        loss = loss_of({"x": x, "y": y})
    loss.backward()
    loss_sum += loss.detach()
    value = loss_sum.item()
    nn.utils.clip_grad_norm_(trained_tensors(opt), GRAD_CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return value


@dataclass
class Candidate:
    """A model with its optimizer and its step function: call it to take one training step."""

    step: Callable
    loss_of: Callable  # batch -> loss, compiled or not
    model: nn.Module
    opt: torch.optim.Optimizer

    def __call__(self, x: Tensor, y: Tensor, precision: str) -> float:
        return self.step(self.loss_of, self.model, self.opt, x, y, precision)


# --- FLOPs and peaks --------------------------------------------------------------------------
def model_config(shape: str):
    preset, overrides, attention, _, _ = SHAPES[shape]
    cfg = get_preset(preset)
    return replace(cfg, attention=replace(cfg.attention, **attention), **overrides)


def matmul_params(model: nn.Module) -> int:
    """N: elements of every Linear weight, each module once (a tied head counts: it is a matmul)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def flops_per_token(n_matmul: int, n_layers: int, d_model: int, context: int) -> int:
    """6 N (forward 2 N, backward 4 N) + 12 L (H D) T (scores and values, forward + backward)."""
    return 6 * n_matmul + 12 * n_layers * d_model * context


def peak_gemms(n: int, layout_too: bool = False) -> dict[str, Callable]:
    """name -> a call doing one (n, n) @ (n, n) product on one of the paths."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a16, b16, bt = a.bfloat16(), b.bfloat16(), b.t().contiguous()  # oneDNN wants (out, in)
    gemms = {
        "mm fp32": lambda: torch.mm(a, b),
        "onednn fp32": lambda: onednn_linear(a, bt),
        "mm bf16": lambda: torch.mm(a16, b16),
    }
    if layout_too:  # oneDNN on its own tensor layout (conversion not timed), for comparison
        a_mk, bt_mk = a.to_mkldnn(), bt.to_mkldnn()
        gemms["mkldnn-layout fp32"] = lambda: torch._C._nn.mkldnn_linear(a_mk, bt_mk)
    return gemms


def timed_rounds(fns: dict[str, Callable], rounds: int) -> dict[str, list[float]]:
    """One untimed call of each, then `rounds` rounds of one timed call each, interleaved.

    Round i starts at the i-th function (A B C, B C A, C A B, ...), so none of them always
    runs first, e.g. straight after the peak GEMMs have flushed the caches.
    """
    for fn in fns.values():
        fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


# --- one configuration, in its own process ----------------------------------------------------
def build_candidates(shape: str, precision: str, mode: str, log: io.StringIO) -> dict:
    """name -> Candidate; each model starts from torch.manual_seed(0)."""
    cfg = model_config(shape)
    _, _, _, B, T = SHAPES[shape]
    models = {}
    names = ["ours", "plain"] + (["ours+fast"] if precision == "fp32" else [])
    names += ["plain-e"] if mode == "compiled" else []  # plain, eager: for the ratio to it
    for name in names:
        torch.manual_seed(0)
        if name.startswith("plain"):
            a = cfg.attention
            models[name] = PlainGPT(
                cfg.vocab_size, cfg.max_seq_len, cfg.d_model, cfg.n_layers, a.n_heads, cfg.ffn_width
            )
        else:
            models[name] = build_model(cfg)
    if "ours+fast" in models:
        fast = models["ours+fast"]
        gen = torch.Generator().manual_seed(1)
        x, y = (torch.randint(0, cfg.vocab_size, (B, T), generator=gen) for _ in range(2))
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(log):
            shapes = choose_fast_linear(
                fast, B * T, check=lambda: clm_loss(fast(x), y).backward(), verbose=True
            )
            swapped = enable_fast_linear(fast, shapes)
        took = time.perf_counter() - t0
        log.write(f"enable_fast_linear swapped {swapped} Linear modules ({took:.0f} s)\n")
    if matmul_params(models["ours"]) != matmul_params(models["plain"]):
        raise RuntimeError("ours and plain have different matmul weights: not the same shape")
    candidates = {}
    for name, model in models.items():
        model.train()
        if name.startswith("plain"):
            forward = torch.compile(model) if name == "plain" and mode == "compiled" else model
            loss_of = partial(plain_loss, forward)
            candidates[name] = Candidate(plain_step, loss_of, model, plain_optimizer(model))
        else:
            opt = build_optimizer(model, LR, WEIGHT_DECAY, BETAS, flat=True)
            if mode == "compiled":
                loss_of = compile_loss(lm_loss, model, torch.device("cpu"))
            else:
                loss_of = partial(lm_loss, model)
            candidates[name] = Candidate(ours_step, loss_of, model, opt)
    return candidates


def run_case(shape: str, precision: str, mode: str, rounds: int, peak_n: int) -> dict:
    """Time one (shape, precision, mode): every candidate and the peak GEMMs, interleaved."""
    threads = use_all_cores()
    keep_freed_memory()  # as train(keep_freed_memory=True) does on CPU; for every candidate
    cfg, (_, _, _, B, T) = model_config(shape), SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (B, T), generator=gen) for _ in range(2))
    log = io.StringIO()
    candidates = build_candidates(shape, precision, mode, log)
    n_matmul = matmul_params(candidates["ours"].model)
    first_s, first_loss = {}, {}
    for name, candidate in candidates.items():
        t0 = time.perf_counter()
        first_loss[name] = candidate(x, y, precision)  # compiles, if compiled
        first_s[name] = time.perf_counter() - t0
        for _ in range(WARMUP[mode] - 1):
            candidate(x, y, precision)
    fns = {name: (lambda c=c: c(x, y, precision)) for name, c in candidates.items()}
    peaks = peak_gemms(peak_n)
    fns.update({f"peak {name}": fn for name, fn in peaks.items()})
    times = timed_rounds(fns, rounds)
    return {
        "shape": shape,
        "precision": precision,
        "mode": mode,
        "threads": threads,
        "flops_per_step": flops_per_token(n_matmul, cfg.n_layers, cfg.d_model, T) * B * T,
        "tokens_per_step": B * T,
        "step_ms": {n: statistics.median(times[n]) * 1e3 for n in candidates},
        "paired_ratio": {  # median of per-round ratios to plain: a check on the ratio of medians
            n: statistics.median(a / b for a, b in zip(times[n], times["plain"]))
            for n in candidates
        },
        "peak_gflops": {
            n: 2 * peak_n**3 / statistics.median(times[f"peak {n}"]) / 1e9 for n in peaks
        },
        "first_step_s": first_s,
        "first_loss": first_loss,
        "log": log.getvalue(),
    }


def run_case_subprocess(shape: str, precision: str, mode: str, rounds: int, peak_n: int) -> dict:
    """run_case in a fresh Python; failures and timeouts come back as {"error": ...}."""
    cmd = [sys.executable, os.path.abspath(__file__), "--case", shape, precision, mode]
    cmd += ["--rounds", str(rounds), "--peak-n", str(peak_n)]
    base = {"shape": shape, "precision": precision, "mode": mode}
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as cache:  # cold compiles, as a first run has
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=CASE_TIMEOUT_S, env=env
            )
    except subprocess.TimeoutExpired:
        return {**base, "error": f"timed out after {CASE_TIMEOUT_S} s (compiles included)"}
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {**base, "error": f"exit {done.returncode}: {last[:200]}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "wall_s": time.perf_counter() - t0}


# --- reporting --------------------------------------------------------------------------------
def print_peaks(sizes: tuple[int, ...], rounds: int) -> None:
    """Section 1: the peak GEMMs at a few sizes, interleaved, with their error against fp64."""
    print(f"1. Peak matmul throughput, (n, n) @ (n, n), GFLOP/s: median of {rounds} rounds")
    print("   mm fp32: torch.mm (MKL sgemm). onednn fp32: torch.ops.mkldnn._linear_pointwise on")
    print("   dense tensors (FastLinear's op). mkldnn-layout fp32: torch._C._nn.mkldnn_linear on")
    print("   x.to_mkldnn() tensors, conversion not timed. mm bf16: torch.mm on bf16 tensors.")
    print("   error: max |C - C_fp64| / max |C_fp64| of each path's product")
    names = list(peak_gemms(8, layout_too=True))
    print(f"   {'n':>5} " + " ".join(f"{n:>18}" for n in names))
    for n in sizes:
        gemms = peak_gemms(n, layout_too=True)
        times = timed_rounds(gemms, rounds)
        gflops = [2 * n**3 / statistics.median(times[k]) / 1e9 for k in names]
        print(f"   {n:>5} " + " ".join(f"{g:>18.1f}" for g in gflops), flush=True)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    exact = a.double() @ b.double()
    products = {
        "mm fp32": torch.mm(a, b),
        "onednn fp32": onednn_linear(a, b.t().contiguous()),
        "mm bf16": torch.mm(a.bfloat16(), b.bfloat16()),
    }
    errors = ", ".join(
        f"{k} {float((c.double() - exact).abs().max() / exact.abs().max()):.0e}"
        for k, c in products.items()
    )
    print(f"   error at n=1024: {errors}")
    print()


def load_line() -> str:
    """The 1-minute load average against the cores: above 1 per core, every number is slower."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def achieved_gflops(r: dict, name: str) -> float:
    return r["flops_per_step"] / r["step_ms"][name] / 1e6


def own_peak(r: dict) -> float:
    """The fastest fp32 peak for fp32 rows, the bf16 peak for bf16 rows."""
    p = r["peak_gflops"]
    return p["mm bf16"] if r["precision"] == "bf16" else max(p["mm fp32"], p["onednn fp32"])


def print_table(results: list[dict]) -> None:
    print("2. Training steps: median ms over interleaved rounds; tok/s = tokens per step / step")
    print("   MFU(mm) = achieved FLOP/s / torch.mm fp32 peak; MFU(own) = / the fastest fp32 peak")
    print("   (fp32 rows) or / the torch.mm bf16 peak (bf16 rows); peaks from the same rounds.")
    print("   /plain = step ms / plain's step ms (paired: median of the per-round ratios).")
    print("   1st step: seconds of the first step; for compiled rows, a cold compile included.")
    print()
    head = (
        f"{'shape':<10} {'prec':<4} {'mode':<8} {'impl':<9} {'step ms':>9} {'tok/s':>7} "
        f"{'GFLOP/s':>7} {'MFU(mm)':>7} {'MFU(own)':>8} {'/plain':>6} {'paired':>6} "
        f"{'1st step':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        lead = f"{r['shape']:<10} {r['precision']:<4} {r['mode']:<8}"
        if "error" in r:
            print(f"{lead} {'(all)':<9} {r['error']}")
            continue
        p = r["peak_gflops"]
        for name, ms in r["step_ms"].items():
            g = achieved_gflops(r, name)
            print(
                f"{lead} {name:<9} {ms:>9.1f} {r['tokens_per_step'] / ms * 1e3:>7.0f} "
                f"{g:>7.1f} {g / p['mm fp32']:>7.0%} {g / own_peak(r):>8.0%} "
                f"{ms / r['step_ms']['plain']:>6.3f} {r['paired_ratio'][name]:>6.3f} "
                f"{r['first_step_s'][name]:>7.1f}s"
            )
        losses = ", ".join(f"{k} {v:.3f}" for k, v in r["first_loss"].items())
        print(
            f"{'':<24} peaks GFLOP/s: mm fp32 {p['mm fp32']:.1f}, onednn fp32 "
            f"{p['onednn fp32']:.1f}, mm bf16 {p['mm bf16']:.1f}; "
            f"{r['flops_per_step'] / 1e9:.2f} GFLOP/step; first losses {losses}"
        )
        for line in r["log"].splitlines():
            print(f"{'':<24} {line}")
    print()


def print_targets(results: list[dict]) -> None:
    def find(shape: str, mode: str = "eager", precision: str = "fp32") -> dict | None:
        return next(
            (
                r
                for r in results
                if (r["shape"], r["precision"], r["mode"]) == (shape, precision, mode)
                and "error" not in r
            ),
            None,
        )

    def line(label: str, value: float | None, target: str, ok: bool, fmt: str) -> None:
        verdict = "not measured" if value is None else ("PASS" if ok else "MISS")
        print(
            f"   {label:<52} {'-' if value is None else fmt.format(value):>7}   "
            f"{target:<8} {verdict}"
        )

    print("Targets (fp32 and eager unless said)")
    a, ac, g = find("recipe-a"), find("recipe-a", "compiled"), find("gpt2-small")
    g16 = find("gpt2-small", precision="bf16")
    pairs = {  # label -> (result, ours, plain): each ratio measured within one process
        "recipe-a ours / plain step time": (a, "ours", "plain"),
        "recipe-a ours+fast / plain step time": (a, "ours+fast", "plain"),
        "recipe-a ours / plain, both compiled": (ac, "ours", "plain"),
        "recipe-a ours compiled / plain eager": (ac, "ours", "plain-e"),
    }
    for label, (r, ours, plain) in pairs.items():
        v = r["step_ms"][ours] / r["step_ms"][plain] if r else None
        line(label, v, f"<= {TARGET_RATIO:.3f}", v is not None and v <= TARGET_RATIO, "{:.3f}")
    mfus = {  # label -> (result, impl, peak of that result, target)
        "gpt2-small ours MFU vs the torch.mm fp32 peak": (
            g,
            "ours",
            lambda r: r["peak_gflops"]["mm fp32"],
            TARGET_MFU_DEFAULT,
        ),
        "gpt2-small ours+fast MFU vs the fastest fp32 peak": (
            g,
            "ours+fast",
            own_peak,
            TARGET_MFU_FAST,
        ),
        "gpt2-small ours bf16 MFU vs the torch.mm bf16 peak": (
            g16,
            "ours",
            own_peak,
            TARGET_MFU_BF16,
        ),
    }
    for label, (r, impl, peak, target) in mfus.items():
        v = achieved_gflops(r, impl) / peak(r) if r else None
        line(label, v, f">= {target:.0%}", v is not None and v >= target, "{:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="recipe-a, eager, few rounds")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument(
        "--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"]
    )
    parser.add_argument("--rounds", type=int, help="timed rounds per configuration")
    parser.add_argument("--peak-n", type=int, default=PEAK_N, help="in-round peak GEMM size")
    parser.add_argument(
        "--case",
        nargs=3,
        metavar=("SHAPE", "PRECISION", "MODE"),
        help="internal: time one configuration, print it as JSON",
    )
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(*args.case, args.rounds, args.peak_n)))
        return
    if args.quick:
        args.shapes, args.modes, args.peak_n = ["recipe-a"], ["eager"], QUICK_PEAK_N
    threads = use_all_cores()
    print(
        f"attnlab training benchmark: torch {torch.__version__}, {threads} threads, "
        f"{cpu_name()}, {platform.system()} {platform.release()}"
    )
    print("Shared machines are noisy: compare the RATIOS, each measured within this one run.")
    print(f"{load_line()}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    print()
    print_peaks((QUICK_PEAK_N,) if args.quick else PEAK_SIZES, 3 if args.quick else 7)
    results = []
    for shape in args.shapes:
        rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS[shape])
        for mode in args.modes:
            for precision in ("fp32", "bf16"):
                r = run_case_subprocess(shape, precision, mode, rounds, args.peak_n)
                results.append(r)
                took = f"{r['wall_s']:.0f} s" if "wall_s" in r else r["error"]
                print(f"   ran {shape} {precision} {mode}: {rounds} rounds, {took}", flush=True)
    print(f"   {load_line()}")
    print()
    print_table(results)
    print_targets(results)


if __name__ == "__main__":
    main()
