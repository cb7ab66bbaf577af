"""Decode benchmarks on CPU: tokens/s and peak memory of generation, against the memory roofline.

    .venv/bin/python benchmarks/decode.py            # full: GPT-2-small and a 110M Llama (~17 min)
    .venv/bin/python benchmarks/decode.py --quick    # 2-layer shapes, 32 new tokens, no compile

Batch 1, a 32-token prompt, 256 new tokens, greedy, fp32 activations. Per model shape:

  (i)   recompute   no cache: the whole sequence through the model for every new token
  (ii)  cache       attnlab.inference.generate.generate: prefill, then one decode_step per token
  (ii+) + oneDNN    (ii) after choose_fast_linear(inference=True): the Linears go through
                    oneDNN's inner product (FastLinear) if that makes a short generation faster
  (iii) compiled    stream_tokens(step_fn=compile_decode_step(model)): torch.compile(decode_step)
                    on the same static cache, the Linears as GemvLinear (accel/gemv.py),
                    which inductor turns into fused matrix-vector loops, the weights packed
                    into one buffer (inference/packing.py)
  (iv)  int8        (ii) after quantize_model(model, "int8"): Linears and head int8, embeddings fp32
  (v)   int4        (ii) after quantize_model(model, "int4", 32)
  (vi)  int8 comp.  (iii) on the int8 model: Int8Linear's one-token form fuses into one int8 GEMV
  (vii) HF          transformers' generate(do_sample=False, use_cache=True) on GPT2LMHeadModel /
                    LlamaForCausalLM holding the same weights (skipped without transformers)

Roofline: one decode step must read every weight it uses once (embeddings: one row) plus the
KV-cache buffers (attention reads all S_max slots, the mask hides the unwritten ones). With
B bytes read per token and memory bandwidth W, no implementation beats W / B tokens/s. W is
measured in this run: dst.copy_(src) of 1 GiB (W = 2 * bytes / time: read + write), one copy
right before and one right after every timed call. (A fresh `clone` would also page-fault 1 GiB
of new memory, timing the kernel rather than DRAM.) "of roof" divides a row's median tokens/s
by the roofline at the median W of the whole run; "paired" is the median over rounds of each
call's tokens/s over the roofline at the mean of its own two copies. The host's bandwidth
wanders (the copies of one run ranged 12-53 GB/s), so the paired fraction compares each call
with the memory it actually had; the target uses it, and both are printed.

Time: every variant generates once per round (ABAB...), median over rounds; (i) runs once (it is
slow). Tokens/s = new tokens / wall time of the whole call, prefill included. Peak memory, in
one untimed pass after all timing (see measure_peaks): the resident-set high-water mark above
the level before one call (see _timing.py), i.e. what generation needs on top of the resident
weights, which are listed separately; for (i), its longest forward (S_max - 1 tokens).
"""

import os

# On a busy machine, sleep, don't spin, while waiting at OpenMP barriers: a spinning thread
# whose partner was descheduled burns its time slice, and decode runs ~100 small ops per token
# (measured: 60 ms/token spinning vs 12 ms passive on a busy 2-core box). On quiet cores
# spinning is the faster of the two (compiled GPT-2-small decode: ~44 vs ~36 tok/s), so the
# policy follows the load average at start. Set before torch loads; the header prints it.
if os.getloadavg()[0] >= len(os.sched_getaffinity(0)):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Tensors of 2 MB and more in transparent huge pages (PyTorch's CPU allocator aligns them to
# 2 MB and calls madvise(MADV_HUGEPAGE)): streaming 340 MB of weights through 4 KB pages misses
# the TLB all the time. Measured on the 2-core AMD EPYC, compiled GEMVs over GPT-2-small's 48
# block weights: 25-26 GB/s in 4 KB pages, 30-32 GB/s in huge pages, while the copy that sets
# the roofline moved 30-33 GB/s either way. The setting applies to every variant alike.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import ctypes  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402
from _timing import cpu_name, median_ms, peak_method, peak_rss_mib, use_all_cores  # noqa: E402
from torch import nn  # noqa: E402

from attnlab.accel.fast_linear import choose_fast_linear, enable_fast_linear  # noqa: E402
from attnlab.inference.compiled_step import compile_decode_step  # noqa: E402
from attnlab.inference.config import GenerationConfig  # noqa: E402
from attnlab.inference.generate import generate, stream_tokens  # noqa: E402
from attnlab.inference.sampling import SamplingConfig  # noqa: E402
from attnlab.models.build import build_model  # noqa: E402
from attnlab.models.config import AttentionConfig, ModelConfig  # noqa: E402
from attnlab.models.presets import gpt2, llama2_7b  # noqa: E402
from attnlab.quantize import Int4Linear, quantize_model  # noqa: E402

GREEDY = SamplingConfig(temperature=0.0)
FAST = "(ii+) cache, + oneDNN"
GiB, MB = 2**30, 1e6
TARGET_CACHE_SPEEDUP, TARGET_ROOFLINE, TARGET_INT8 = 10.0, 0.80, 2.0


def llama_110m() -> ModelConfig:
    """Llama layout at GPT-2-small scale: 109.5M parameters without the input embedding."""
    return replace(
        llama2_7b(),
        d_model=768,
        n_layers=12,
        d_ff=2048,
        vocab_size=32000,
        max_seq_len=1024,
        attention=AttentionConfig(n_heads=12, n_kv_heads=12),
    )


def quick(cfg: ModelConfig) -> ModelConfig:
    """The same family, 2 layers of width 256 and an 8192-token vocabulary."""
    ffn = {} if cfg.ffn == "mlp" else {"d_ff": 512}
    return replace(
        cfg,
        d_model=256,
        n_layers=2,
        vocab_size=8192,
        **ffn,
        attention=replace(cfg.attention, n_heads=4, n_kv_heads=None),
    )


# --- the variants: each returns the new tokens of one greedy generation ---------------------
def run_recompute(model: nn.Module, prompt: list[int], n_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n_new):
            nxt = model(ids)[:, -1].argmax(-1, keepdim=True)  # (1, 1): the whole prefix again
            ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt) :].tolist()


def run_cached(model: nn.Module, prompt: list[int], n_new: int) -> list[int]:
    return generate(model, [prompt], GenerationConfig(n_new, GREEDY))[0]


def run_stream(model: nn.Module, prompt: list[int], n_new: int, step_fn=None) -> list[int]:
    with torch.no_grad():
        return [
            int(t)
            for t in stream_tokens(
                model, [prompt], GenerationConfig(n_new, GREEDY), step_fn=step_fn
            )
        ]


def run_hf(hf_model: nn.Module, prompt: list[int], n_new: int) -> list[int]:
    ids = torch.tensor([prompt], device=hf_model.device)
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n_new,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


# --- transformers models with our weights ---------------------------------------------------
def to_hf(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """GPT2LMHeadModel or LlamaForCausalLM holding `model`'s weights (copied)."""
    import transformers

    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if cfg.position == "learned":
        hf_cfg = transformers.GPT2Config(
            n_embd=cfg.d_model,
            n_layer=cfg.n_layers,
            n_head=cfg.attention.n_heads,
            vocab_size=cfg.vocab_size,
            n_positions=cfg.max_seq_len,
            n_inner=cfg.ffn_width,
            activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        hf, new = transformers.GPT2LMHeadModel(hf_cfg), gpt2_state_dict(sd, cfg.n_layers)
    else:
        a = cfg.attention
        hf_cfg = transformers.LlamaConfig(
            hidden_size=cfg.d_model,
            intermediate_size=cfg.ffn_width,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=a.n_heads,
            num_key_value_heads=a.n_kv_heads or a.n_heads,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope.theta,
            tie_word_embeddings=cfg.tie_embeddings,
        )
        hf, new = transformers.LlamaForCausalLM(hf_cfg), llama_state_dict(sd, cfg.n_layers)
    missing, unexpected = hf.load_state_dict(new, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"HF weight copy: missing {missing}, unexpected {unexpected}")
    hf.generation_config.eos_token_id = None  # random weights: never stop early
    hf.generation_config.bos_token_id = None
    return hf.eval()


def gpt2_state_dict(sd: dict, n_layers: int) -> dict:
    """Our names -> HF GPT-2's: fused qkv, Conv1D weights stored (in, out), i.e. transposed."""
    out = {
        "transformer.wte.weight": sd["embed.weight"],
        "transformer.wpe.weight": sd["positions.table.weight"],
        "transformer.ln_f.weight": sd["norm.weight"],
        "transformer.ln_f.bias": sd["norm.bias"],
    }
    for i in range(n_layers):
        ours, hf = f"blocks.{i}.", f"transformer.h.{i}."
        qkv = [f"{ours}self_attn.{p}_proj" for p in "qkv"]
        out[hf + "attn.c_attn.weight"] = torch.cat([sd[f"{n}.weight"] for n in qkv]).T
        out[hf + "attn.c_attn.bias"] = torch.cat([sd[f"{n}.bias"] for n in qkv])
        for hf_name, name in (
            ("attn.c_proj", "self_attn.o_proj"),
            ("mlp.c_fc", "ffn.up_proj"),
            ("mlp.c_proj", "ffn.down_proj"),
        ):
            out[f"{hf}{hf_name}.weight"] = sd[f"{ours}{name}.weight"].T
            out[f"{hf}{hf_name}.bias"] = sd[f"{ours}{name}.bias"]
        for j, ln in enumerate(("ln_1", "ln_2")):
            for p in ("weight", "bias"):
                out[f"{hf}{ln}.{p}"] = sd[f"{ours}residuals.{j}.norm.{p}"]
    return {k: v.contiguous() for k, v in out.items()}


def llama_state_dict(sd: dict, n_layers: int) -> dict:
    """Our names -> HF Llama's: the same matrices (both use the "half" RoPE layout)."""
    out = {
        "model.embed_tokens.weight": sd["embed.weight"],
        "model.norm.weight": sd["norm.weight"],
        "lm_head.weight": sd["head.weight"],
    }
    for i in range(n_layers):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{hf}self_attn.{p}.weight"] = sd[f"{ours}self_attn.{p}.weight"]
        for p in ("gate_proj", "up_proj", "down_proj"):
            out[f"{hf}mlp.{p}.weight"] = sd[f"{ours}ffn.{p}.weight"]
        out[f"{hf}input_layernorm.weight"] = sd[f"{ours}residuals.0.norm.weight"]
        out[f"{hf}post_attention_layernorm.weight"] = sd[f"{ours}residuals.1.norm.weight"]
    return out


# --- bytes: resident, and read per decoded token ---------------------------------------------
def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _own_tensors(m: nn.Module) -> list:
    """A module's own parameters and saved buffers (RoPE tables etc. are non-persistent)."""
    buffers = [
        b for n, b in m.named_buffers(recurse=False) if n not in m._non_persistent_buffers_set
    ]
    tensors = list(m.parameters(recurse=False)) + buffers
    if isinstance(m, Int4Linear) and m._kernel is not None:
        tensors = [t for t in tensors if t is not m.weight] + list(m._kernel)  # what it reads
    return tensors


def resident_bytes(model: nn.Module) -> int:
    """Every weight tensor once (tied ones once), the int4 kernel layout included."""
    seen, total = set(), 0
    for m in model.modules():
        extra = list(m._kernel) if isinstance(m, Int4Linear) and m._kernel is not None else []
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)) + extra:
            if id(t) not in seen:
                seen.add(id(t))
                total += _nbytes([t])
    return total


def bytes_per_token(model: nn.Module, cfg: ModelConfig, S_max: int, kv_bytes: int = 4) -> int:
    """Bytes one decode step reads: weights (embeddings one row; a tied head in full) + cache
    (kv_bytes per cached number: 4 for the fp32 caches here)."""
    total = 0
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            total += m.embedding_dim * m.weight.element_size()  # one row per token
        else:
            total += _nbytes(_own_tensors(m))
    a = cfg.attention
    kv = 2 * cfg.n_layers * (a.n_kv_heads or a.n_heads) * S_max * cfg.head_dim * kv_bytes  # K, V
    return total + kv


def measure_bandwidth(src: torch.Tensor, dst: torch.Tensor) -> float:
    """Bytes per second of one dst.copy_(src): read src + write dst."""
    start = time.perf_counter()
    dst.copy_(src)
    return 2 * src.numel() * src.element_size() / (time.perf_counter() - start)


# --- one model shape -------------------------------------------------------------------------
def timed(fn) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure_peaks(results: list[dict]) -> None:
    """One more, untimed, call of every variant for its peak memory, after all the timing.

    glibc keeps freed memory for reuse, so a call would find the previous call's KV cache and
    logits still resident and read ~0 MiB; malloc_trim(0) first hands free memory back to the
    OS, so every page the call touches counts.
    """
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: the peaks may under-count
        trim = lambda _: None  # noqa: E731
    for res in results:
        for k, fn in res["peak_fns"].items():
            trim(0)
            res["rows"][k]["peak"] = peak_rss_mib(fn)[0]


def compile_decode(model: nn.Module, prompt: list[int], n_new: int):
    """(generate-with-a-compiled-decode_step function or None, what happened in words).

    On a copy: compile_decode_step packs the weights (accel/packing.py), and the eager
    variants keep the model as it was built."""
    model = copy.deepcopy(model)
    step = compile_decode_step(model)  # one-token Linears as fused GEMVs (accel/gemv.py)
    fn = partial(run_stream, model, prompt, step_fn=step)
    try:  # the cache's shapes depend on n: warm up (compile) with the timed n
        _, seconds = timed(lambda: fn(n_new))
    except Exception as e:  # report, don't abort: compile support varies by machine
        return None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return fn, f"first call (compiling + {n_new} tokens) {seconds:.0f} s"


def bench_shape(name: str, cfg: ModelConfig, args, src, dst, bandwidths: list) -> dict:
    """Time every variant on one model shape; returns rows for print_shape."""
    n_new, S_max = args.new_tokens, args.prompt + args.new_tokens
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(cfg.vocab_size, (args.prompt,), generator=gen).tolist()
    models, t0 = {"fp32": model}, time.perf_counter()
    for scheme, group in (("int8", None), ("int4", 32)):
        models[scheme] = quantize_model(copy.deepcopy(model), scheme, group)
    quantize_s = time.perf_counter() - t0
    # name -> (which weights it reads, one generation of n new tokens)
    variants = {"(ii) cache, eager": ("fp32", partial(run_cached, model, prompt))}
    fast = copy.deepcopy(model)
    check = partial(run_cached, fast, prompt, 16)
    swapped = enable_fast_linear(fast, choose_fast_linear(fast, 1, check=check, inference=True))
    variants[FAST] = ("fp32", partial(run_cached, fast, prompt))
    compile_info = {}
    if args.compile:
        compiled, compile_info["fp32"] = compile_decode(model, prompt, n_new)
        if compiled:
            variants["(iii) cache, compiled"] = ("fp32", compiled)
    variants["(iv) int8, eager"] = ("int8", partial(run_cached, models["int8"], prompt))
    variants["(v) int4 g32, eager"] = ("int4", partial(run_cached, models["int4"], prompt))
    if args.compile:
        compiled, compile_info["int8"] = compile_decode(models["int8"], prompt, n_new)
        if compiled:
            variants["(vi) int8, compiled"] = ("int8", compiled)
    try:
        models["hf"] = to_hf(model, cfg)
        variants["(vii) HF transformers"] = ("hf", lambda n: run_hf(models["hf"], prompt, n))
    except ImportError:
        pass
    for k, (_, fn) in variants.items():
        if "compiled" not in k:  # (compiled ones were warmed up with n_new while compiling)
            fn(8)  # warm-up (threads, the int4 kernel layout); eager shapes don't matter

    tokens, times, call_bw = {}, {}, {}  # name -> tokens; seconds per call; W per call

    def bracketed(k: str, fn) -> float:
        """Time one call between two copies; keep both copies' W, and their mean for k."""
        before = measure_bandwidth(src, dst)
        tokens[k], seconds = timed(fn)
        after = measure_bandwidth(src, dst)
        bandwidths.extend((before, after))
        call_bw.setdefault(k, []).append((before + after) / 2)
        times.setdefault(k, []).append(seconds)
        return seconds

    for r in range(args.rounds):  # interleaved: one call of each per round
        for k, (_, fn) in variants.items():
            seconds = bracketed(k, partial(fn, n_new))
            print(f"   [{name}] round {r + 1}: {k} {seconds:.1f} s", file=sys.stderr, flush=True)
    recompute = "(i) recompute, no cache"  # once: it is slow
    bracketed(recompute, partial(run_recompute, model, prompt, n_new))
    # For the memory pass at the end (see main): recompute's peak is its last, longest forward.
    full = torch.tensor([prompt + tokens[recompute][:-1]])  # (1, S_max - 1)
    peak_fns = {k: partial(fn, n_new) for k, (_, fn) in variants.items()}
    peak_fns[recompute] = partial(torch.no_grad()(model), full)

    rows = {}
    for k in [recompute, *variants]:
        weights = "fp32" if k == recompute else variants[k][0]
        read = models["fp32" if weights == "hf" else weights]  # HF reads the same bytes
        same = next(
            (i for i, (a, b) in enumerate(zip(tokens[k], tokens["(ii) cache, eager"])) if a != b),
            n_new,
        )
        per_token = bytes_per_token(read, cfg, S_max)
        paired = [n_new / s / (w / per_token) for s, w in zip(times[k], call_bw[k])]
        rows[k] = dict(
            tok_s=n_new / (median_ms(times[k]) / 1e3),
            paired=statistics.median(paired),  # fraction of the call's own roofline
            peak=None,  # filled in by measure_peaks
            same=same,
            resident=resident_bytes(models[weights]),
            per_token=per_token,
        )
    n_params = sum(p.numel() for p in model.parameters())
    return dict(
        name=name,
        cfg=cfg,
        n_params=n_params,
        rows=rows,
        compile="; ".join(f"{k}: {v}" for k, v in compile_info.items()) or "skipped",
        quantize_s=quantize_s,
        swapped=swapped,
        models=models,
        prompt=prompt,
        peak_fns=peak_fns,
    )


def print_shape(res: dict, args, bandwidth: float) -> None:
    cfg = res["cfg"]
    non_embed = res["n_params"] - cfg.vocab_size * cfg.d_model * (0 if cfg.tie_embeddings else 1)
    print(
        f"{res['name']}: {res['n_params'] / 1e6:.1f}M parameters "
        f"({non_embed / 1e6:.1f}M read per token without the input embedding), "
        f"d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab_size}, "
        f"{'tied' if cfg.tie_embeddings else 'untied'} head"
    )
    print(
        f"   batch 1, prompt {args.prompt}, {args.new_tokens} new tokens, greedy; "
        f"quantizing both schemes took {res['quantize_s']:.1f} s"
    )
    print(f"   torch.compile(decode_step): {res['compile']}")
    print(f"   {FAST}: enable_fast_linear swapped {res['swapped']} Linear modules")
    head = (
        f"   {'variant':<26}{'tok/s':>8}{'ms/tok':>8}{'x recomp':>9}{'weights MiB':>12}"
        f"{'peak+ MiB':>10}{'MB/tok':>8}{'roofline':>9}{'of roof':>8}{'paired':>7}  same tokens"
    )
    print(head)
    for k, r in res["rows"].items():
        roof = bandwidth / r["per_token"]
        rec = r["tok_s"] / res["rows"]["(i) recompute, no cache"]["tok_s"]
        print(
            f"   {k:<26}{r['tok_s']:>8.1f}{1e3 / r['tok_s']:>8.1f}{rec:>9.1f}"
            f"{r['resident'] / 2**20:>12.1f}{r['peak']:>10.1f}{r['per_token'] / MB:>8.1f}"
            f"{roof:>9.1f}{r['tok_s'] / roof:>8.0%}{r['paired']:>7.0%}  "
            f"{r['same']}/{args.new_tokens}"
        )
    print()


def profile_decode(model: nn.Module, prompt: list[int], label: str, steps: int = 16) -> None:
    """Where one decode step's time goes: torch.profiler over `steps` cached decode steps."""
    from torch.profiler import ProfilerActivity, profile

    run_cached(model, prompt, 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_cached(model, prompt, steps)
    print(f"   profile of {label}: generate({steps} new tokens), top ops by self CPU time")
    table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40
    )
    print("\n".join("   " + line for line in table.splitlines()))
    print()


def print_targets(results: list[dict], bandwidth: float, args) -> list[tuple[dict, str]]:
    print("Targets")
    misses = []

    def check(label, value, target, unit, res, what):
        ok = value >= target
        print(f"   {label:<58}{value:>8.2f}{unit}  >= {target:g}{unit}  {'PASS' if ok else 'MISS'}")
        if not ok:
            misses.append((res, what))

    for res in results:
        rows = res["rows"]
        recompute = rows["(i) recompute, no cache"]["tok_s"]
        fp32 = [k for k in ("(ii) cache, eager", FAST, "(iii) cache, compiled") if k in rows]
        for variant in fp32:
            check(
                f"{res['name']}: {variant} / recompute tokens/s",
                rows[variant]["tok_s"] / recompute,
                TARGET_CACHE_SPEEDUP,
                "x",
                res,
                "cache",
            )
        if res["name"].startswith("gpt2"):
            for variant in fp32:
                r = rows[variant]
                whole_run = r["tok_s"] / (bandwidth / r["per_token"])
                check(
                    f"{res['name']}: {variant}, of roofline, paired ({whole_run:.0%} at median W)",
                    r["paired"] * 100,
                    TARGET_ROOFLINE * 100,
                    "%",
                    res,
                    "fp32",
                )
        cache = max(rows["(ii) cache, eager"], rows[FAST], key=lambda r: r["tok_s"])
        int8, eager = rows["(iv) int8, eager"]["tok_s"], cache["tok_s"]
        check(
            f"{res['name']}: int8 / fp32 tokens/s, both eager (fp32: best of ii, ii+)",
            int8 / eager,
            TARGET_INT8,
            "x",
            res,
            "int8",
        )
        if "(vi) int8, compiled" in rows and "(iii) cache, compiled" in rows:
            ratio = rows["(vi) int8, compiled"]["tok_s"] / rows["(iii) cache, compiled"]["tok_s"]
            check(
                f"{res['name']}: int8 / fp32 tokens/s, both compiled",
                ratio,
                TARGET_INT8,
                "x",
                res,
                "int8 compiled",
            )
    print()
    return misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2-layer shapes, 32 new tokens")
    parser.add_argument(
        "--no-compile", dest="compile", action="store_false", help="skip the torch.compile variant"
    )
    parser.add_argument("--profile", action="store_true", help="profile even if targets pass")
    parser.add_argument(
        "--shapes", nargs="+", choices=["gpt2-small", "llama-110m"], help="default: both"
    )
    args = parser.parse_args()
    args.prompt = 8 if args.quick else 32
    args.new_tokens = 32 if args.quick else 256
    args.rounds = 2 if args.quick else 3
    args.compile = args.compile and not args.quick
    shapes = {"gpt2-small": gpt2(), "llama-110m": llama_110m()}
    shapes = {k: v for k, v in shapes.items() if k in (args.shapes or shapes)}
    if args.quick:
        shapes = {f"{k} (quick: 2x256)": quick(v) for k, v in shapes.items()}

    threads = use_all_cores()
    print(
        f"attnlab decode benchmarks: torch {torch.__version__}, {threads} threads "
        f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
        f"THP_MEM_ALLOC_ENABLE={os.environ['THP_MEM_ALLOC_ENABLE']}, load average "
        f"{os.getloadavg()[0]:.1f} at start), {cpu_name()}, "
        f"{platform.system()} {platform.release()}"
    )
    print("Shared machines are noisy: compare the RATIOS, each measured within this one run.")
    print(f"peak memory: {peak_method()}")
    print()
    n = (GiB if not args.quick else GiB // 4) // 4
    src, dst = torch.ones(n), torch.zeros(n)  # both touched: no page faults while timing
    bandwidths: list[float] = []
    results = [bench_shape(name, cfg, args, src, dst, bandwidths) for name, cfg in shapes.items()]
    measure_peaks(results)
    bandwidths.sort()
    bandwidth = bandwidths[len(bandwidths) // 2]
    print(
        f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s = median of {len(bandwidths)} copies of "
        f"{src.numel() * 4 / GiB:.2g} GiB (dst.copy_(src), 2 x bytes / time), one before and "
        f"one after every timed call; range {bandwidths[0] / 1e9:.1f}-"
        f"{bandwidths[-1] / 1e9:.1f} GB/s"
    )
    print(
        "roofline = bandwidth / (MB/tok): bytes one decode step reads (weights, embeddings one "
        "row, KV cache all S_max slots);"
    )
    print(
        "weights MiB = resident weights (the HF row: its own copy); peak+ MiB = memory a call "
        "needs above them; same tokens = leading tokens equal to (ii)"
    )
    print()
    for res in results:
        print_shape(res, args, bandwidth)
    misses = print_targets(results, bandwidth, args)
    if misses or args.profile:
        profiled = set()
        for res, what in misses or [(r, "fp32") for r in results]:
            label = "int8" if what.startswith("int8") else "fp32"
            if (res["name"], label) in profiled:
                continue
            profiled.add((res["name"], label))
            profile_decode(res["models"][label], res["prompt"], f"{res['name']} {label}")


if __name__ == "__main__":
    main()
