"""Both ISA levels on one x86 host, for the llama.cpp comparisons (llamacpp.py, serve_llamacpp.py).

    --isa native   what this CPU has (AVX-512, AVX512-BF16, AMX where present), both sides
    --isa avx2     an AVX2-only CPU (a laptop, a first-generation Zen) reproduced on this one:
                   torch with ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 (PyTorch's
                   and oneDNN's AVX2 code; attnlab's int4/int8 Linears then pick their AVX2
                   integer kernels, attnlab/accel/qdot.py), llama.cpp from a build without any
                   AVX-512, VNNI or AMX code (benchmarks/build_llamacpp.sh avx2), loaded by
                   llama-cpp-python through LLAMA_CPP_LIB_PATH

The settings must be in the environment before torch and llama_cpp are imported, so `--isa
avx2` re-runs the script with them set. Each header prints the CPU model, its flags that
matter here, the ISA torch runs and the llama.cpp build it loaded (its own system line).
"""

import os
import subprocess
import sys
from pathlib import Path

FLAGS = "avx2 fma f16c avx_vnni avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8".split()
ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
BUILD = Path(__file__).parent / "build_llamacpp.sh"


def add_isa_args(parser) -> None:
    parser.add_argument(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="native: this CPU; avx2: an AVX2-only CPU reproduced on it (benchmarks/_isa.py)",
    )
    parser.add_argument(
        "--threads", type=int, help="threads for both sides (default: every core this may use)"
    )


def llama_lib_dir(isa: str) -> Path:
    import importlib.metadata

    version = importlib.metadata.version("llama_cpp_python")
    return Path.home() / ".cache" / "attnlab" / "llamacpp" / f"{version}-{isa}"


def apply_isa(args) -> None:
    """Re-run this script under --isa avx2's environment (once), before torch is imported."""
    if args.isa != "avx2" or os.environ.get("ATTNLAB_BENCH_ISA") == "avx2":
        return
    lib = llama_lib_dir("avx2")
    if not (lib / "libllama.so").exists():
        sys.exit(f"no AVX2-only llama.cpp build in {lib}: run `bash {BUILD} avx2` (~10 min)")
    env = {**os.environ, **ENV, "LLAMA_CPP_LIB_PATH": str(lib), "ATTNLAB_BENCH_ISA": "avx2"}
    sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))


def isa_header(isa: str) -> str:
    """Lines for a benchmark's header: the CPU, its flags, what each side runs."""
    import torch

    from attnlab.accel import qdot

    have = qdot.cpu_flags()
    flags = " ".join(f if f in have else f"-{f}" for f in FLAGS)
    lines = [f"CPU flags: {flags}  (-x: absent)"]
    lines.append(
        f"--isa {isa}: torch runs {torch.backends.cpu.get_cpu_capability()} code"
        f" (ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}); "
        f"attnlab's int4/int8 kernel: {qdot.choice()}"
    )
    try:
        import llama_cpp

        where = os.environ.get("LLAMA_CPP_LIB_PATH", "llama-cpp-python's own build")
        system = llama_cpp.llama_print_system_info().decode().strip()
        lines.append(f"llama.cpp from {where}: {system}")
    except ImportError:
        pass
    return "\n".join(lines)
