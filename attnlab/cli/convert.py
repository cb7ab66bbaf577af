"""Convert a checkpoint between the HF, attnlab and GGUF formats.

    attnlab convert --from hf ./tiny-llama --to attnlab ./ours
    attnlab convert --from attnlab ./ours --to hf ./exported      (transformers loads it)
    attnlab convert --from gguf model.gguf --to hf ./exported     (dequantized to fp32)
    attnlab convert --from attnlab ./ours --to gguf ours.gguf --gguf-type q8_0   (llama.cpp runs it)
    attnlab convert --from attnlab runs/lora --to peft ./adapter  (a LoRA run's adapters)

HF families: GPT-2, Llama/Mistral/Qwen2, Qwen3, OLMo 2, Phi-3, Gemma 2/3, BLOOM, BERT and T5
(attnlab/interop/hf/). Only safetensors are read and written; the tokenizer.json travels along
when there is one. `--to peft` writes the adapters of an `attnlab finetune --lora.rank R` run
(which opens merged everywhere else) as `peft` reads them, onto the HF export of the run's base
(attnlab/interop/peft.py).
"""

import argparse
import inspect

from attnlab.interop.convert import FORMATS, convert
from attnlab.interop.gguf.writer import TYPES
from attnlab.interop.hf import ARCHITECTURES
from attnlab.interop.peft import save_run_peft

FAMILIES = ", ".join(sorted(ARCHITECTURES))  # the HF architectures config.json may name
DEFAULTS = {k: p.default for k, p in inspect.signature(convert).parameters.items()}
TO_FORMATS = (*FORMATS, "peft")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--from",
        dest="src",
        nargs=2,
        required=True,
        metavar=("FORMAT", "DIR"),
        help=f"the input: a format ({', '.join(FORMATS)}) and a directory or .gguf file "
        f"(HF: {FAMILIES}; GGUF: llama, mistral, qwen2, qwen3, gemma2, gemma3)",
    )
    p.add_argument(
        "--to",
        dest="dst",
        nargs=2,
        required=True,
        metavar=("FORMAT", "DIR"),
        help=f"the output: a format ({', '.join(TO_FORMATS)}) and a directory or .gguf file "
        "(peft: the adapters of a LoRA fine-tuning run, --from attnlab RUN)",
    )
    p.add_argument(
        "--gguf-type",
        choices=TYPES,
        default=DEFAULTS["gguf_type"],
        help="the matrices' type in a GGUF written (q4_1: from an int4 model at group size "
        "32; default %(default)s)",
    )
    p.add_argument(
        "--layout",
        choices=["half", "interleaved"],
        default=DEFAULTS["layout"],
        help="RoPE layout of the attnlab model made from an HF Llama-family "
        "checkpoint (default %(default)s, HF's own)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty output directory (its checkpoint files are replaced, "
        "nothing else)",
    )


def run(args: argparse.Namespace) -> int:
    (src_format, src), (dst_format, dst) = args.src, args.dst
    if dst_format == "peft":
        return write_peft(src_format, src, dst, args.overwrite)
    out = convert(
        src_format,
        src,
        dst_format,
        dst,
        layout=args.layout,
        overwrite=args.overwrite,
        gguf_type=args.gguf_type,
    )
    print(f"wrote {dst_format} checkpoint {out}")
    return 0


def write_peft(src_format: str, src: str, dst: str, overwrite: bool) -> int:
    if src_format != "attnlab":
        raise ValueError(
            f"--to peft writes the adapters of an attnlab fine-tuning run, not of an "
            f"{src_format} checkpoint: give --from attnlab RUN (attnlab finetune --lora.rank R)"
        )
    out = save_run_peft(src, dst, overwrite=overwrite)
    print(
        f"wrote peft adapter {out} (peft loads it onto the HF export of the run's base: "
        "attnlab convert --from attnlab BASE --to hf DIR)"
    )
    return 0
