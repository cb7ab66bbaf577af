"""Generate text from a checkpoint: sampling, beam search, stop strings, streaming.

    attnlab generate --ckpt runs/default --prompt "ROMEO:" --temperature 0.8 --top-k 50 --stream
    attnlab generate --ckpt runs/finetune --chat --prompt "Write the signature of ..."
    attnlab generate --ckpt model.gguf --prompt "def f(" --temperature 0 --speculative ngram

--chat reads the prompt as one user message: the checkpoint's chat template (stored with its
tokenizer) writes it as the model was fine-tuned on, with the assistant's generation prompt,
and generation stops at the template's end of turn; only the reply is printed. A LoRA
fine-tuning checkpoint opens with its adapters merged (`open_checkpoint`).

The sampling flags are SamplingConfig's fields, each under two names (`--sampling.top_k` and
`--top-k`; `--logit-bias '{"5": -100}'` reads JSON); their defaults live in the dataclass, the
others in GenerationConfig's. With --chat the flags not given take the checkpoint's own
defaults, else llama.cpp's (inference.sampling.chat_sampling).
An encoder-decoder checkpoint reads the prompt as its source text. A checkpoint trained on
generated scenes ("vqa" / "vla") answers a new scene instead of a prompt:

    attnlab generate --ckpt runs/vqa_cups --scene 7     # as `attnlab embodied --seed 7`

--speculative ngram|draft drafts tokens (by prompt lookup, or with a draft model: --draft-ckpt,
or --draft-quantize int4 for the model's own int4 copy) and checks them in one forward of the
model (docs/generation.md); --verbose prints the acceptance rate and tokens/s.
"""

import argparse
import sys
import time
from pathlib import Path

from attnlab.checkpoint import open_checkpoint
from attnlab.cli.kinds import require
from attnlab.cli.options import (
    add_ckpt_flag,
    add_kv_cache_dtype_flag,
    add_sampling_flags,
    add_speculative_flags,
    add_steer_flags,
    device_from_args,
    kv_cache_dtype_from_args,
    sampling_from_args,
    speculative_from_args,
    steers_from_args,
)
from attnlab.finetune.sequences import ChatFormat
from attnlab.inference.config import GenerationConfig
from attnlab.inference.constraints import Constraint
from attnlab.inference.generate import generate_text
from attnlab.inference.sampling import chat_sampling
from attnlab.inference.steering import steering

GENERATORS = ("decoder", "encoder_decoder")  # cli/kinds.py
DEFAULTS = GenerationConfig()  # the defaults of the flags that are not SamplingConfig's


def add_parser(p: argparse.ArgumentParser) -> None:
    add_ckpt_flag(p)
    p.add_argument(
        "--prompt",
        metavar="TEXT",
        help="text to continue (encoder-decoder: the source text); required unless --scene",
    )
    p.add_argument(
        "--scene",
        type=int,
        metavar="S",
        help="vqa/vla checkpoints: answer generated scene S (pictures go to embodied_demo/)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULTS.max_new_tokens,
        metavar="N",
        help="at most this many new tokens (default %(default)s)",
    )
    p.add_argument(
        "--min-new-tokens",
        type=int,
        default=DEFAULTS.min_new_tokens,
        metavar="N",
        help="the stop tokens (<eos>, a chat's end of turn) cannot come before N new tokens",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past <eos> (until --max-new-tokens or a stop string)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=DEFAULTS.seed,
        metavar="S",
        help="seed of the sampling generator (default: unseeded)",
    )
    p.add_argument(
        "--stop",
        nargs="+",
        action="extend",
        default=[],
        metavar="STR",
        help="stop once the text contains one of these (kept in the output)",
    )
    p.add_argument(
        "--num-beams",
        type=int,
        default=DEFAULTS.num_beams,
        metavar="W",
        help="beam search with W beams instead of sampling (default %(default)s)",
    )
    p.add_argument(
        "--length-penalty",
        type=float,
        default=DEFAULTS.length_penalty,
        metavar="A",
        help="beam search: score / length**A (default %(default)s)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="--prompt is a user message, formatted by the tokenizer's chat template; stop at "
        "its end of turn and print the reply only",
    )
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode through the compiled step (inference/compiled_step.py; needs a C "
        "compiler): several times faster per token on a CPU, after compiling for 1-3 min the "
        "first time (later runs: ~15 s, from torch inductor's disk cache)",
    )
    only = p.add_mutually_exclusive_group()  # constrained decoding (inference/constraints.py)
    only.add_argument(
        "--json-schema", metavar="FILE", help="the output is JSON valid against this schema"
    )
    only.add_argument("--regex", metavar="R", help="the output fully matches this regex")
    only.add_argument(
        "--choice", action="append", metavar="TEXT", help="the output is one of these (repeat)"
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print the generation's speed to stderr (with --speculative: its acceptance rate)",
    )
    add_steer_flags(p)
    add_kv_cache_dtype_flag(p)
    add_sampling_flags(p)
    add_speculative_flags(p)


def run(args: argparse.Namespace) -> int:
    device = device_from_args(args)
    if args.scene is not None:
        from attnlab.lab.embodied import answer_scene  # (imports matplotlib)

        print(answer_scene(args.ckpt, args.scene, device=device).report())
        return 0
    if args.prompt is None:
        raise ValueError("--prompt is required (or --scene S for a vqa/vla checkpoint)")
    loaded = open_checkpoint(args.ckpt, device)
    model, tokenizer, saved = loaded.model, loaded.tokenizer, loaded.run
    refuse_non_generators(args.ckpt, loaded)
    base = chat_sampling(loaded.sampling) if args.chat else None  # None: SamplingConfig()
    sampling = sampling_from_args(args, base)
    decoder_only = not hasattr(model, "encode")
    prompt, stop_tokens, stop = args.prompt, [], list(args.stop)
    if args.chat:
        prompt, stop_tokens, stop = chat_prompt(tokenizer, args.prompt, args.ckpt, decoder_only)
        stop += args.stop
    note_extrapolation(saved, len(tokenizer.encode(prompt)) + args.max_new_tokens, decoder_only)

    def show(text: str) -> None:
        print(text, end="", flush=True)

    echo = decoder_only and not args.chat  # a continuation shows the prompt it continues
    if args.stream and echo:
        show(args.prompt)
    config = GenerationConfig(
        args.max_new_tokens,
        sampling,
        seed=args.seed,
        stop_strings=stop,
        num_beams=args.num_beams,
        length_penalty=args.length_penalty,
        stop_tokens=stop_tokens,
        min_new_tokens=args.min_new_tokens,
        ignore_eos=args.ignore_eos,
        constraint=constraint_of(args),
        kv_cache_dtype=kv_cache_dtype_from_args(args),
    )
    speculative = speculative_from_args(args, device, tokenizer)
    step_fn = compiled_step(model, args, speculative)
    start = time.perf_counter()
    steers = steers_from_args(model, tokenizer, args)
    with steering(model, steers):  # no --steer / --sae-steer: no hooks
        text = generate_text(
            model,
            tokenizer,
            prompt,
            config,
            on_text=show if args.stream else None,
            on_notice=lambda message: print(f"note: {message}", file=sys.stderr),
            speculative=speculative,
            step_fn=step_fn,
        )
    seconds = time.perf_counter() - start
    if not args.stream:
        show(args.prompt + text if echo else text)
    print()
    if args.verbose:
        line = f"generated in {seconds:.2f} s"  # the prefill and the text's decoding included
        print(line if speculative is None else speculative.stats.line(), file=sys.stderr)
    return 0


def compiled_step(model, args: argparse.Namespace, speculative):
    """--compile's decode step (None without the flag), with a line on stderr: the first call
    compiles."""
    if not args.compile:
        return None
    if args.num_beams != 1 or speculative is not None or hasattr(model, "encode"):
        raise ValueError(
            "--compile is for sampling or greedy decoding of a decoder-only model "
            "(no --num-beams, no --speculative)"
        )
    from attnlab.inference.compiled_step import compile_decode_step

    print(
        "attnlab: compiling the decode step on its first call (the first time for this "
        "model here: 1-3 min; later runs read torch inductor's disk cache)",
        file=sys.stderr,
    )
    return compile_decode_step(model)


def refuse_non_generators(ckpt: str, loaded) -> None:
    """One line for a checkpoint `generate` cannot continue text with: a task head, an encoder
    (MLM), a scene-answering vqa/vla model (cli/kinds.py), or no tokenizer."""
    require(
        ckpt, loaded, "attnlab generate --prompt", GENERATORS, "a decoder or encoder-decoder LM"
    )
    if loaded.tokenizer is None:
        raise ValueError(f"checkpoint {ckpt!r} has no tokenizer.json to read the prompt with")


def note_extrapolation(saved: dict, total: int, decoder_only: bool) -> None:
    """A note on stderr when prompt + new tokens (`total`) pass the trained window."""
    trained = saved.get("train", {}).get("context")
    if decoder_only and trained and total > trained:
        print(
            f"note: this model was trained on windows of {trained} tokens; prompt + "
            f"--max-new-tokens is {total}, so text past token {trained} is extrapolation "
            "(it may lose coherence)",
            file=sys.stderr,
        )


def constraint_of(args: argparse.Namespace) -> Constraint | None:
    """The constraint of --json-schema / --regex / --choice (None without one)."""
    try:
        if args.json_schema is not None:
            return Constraint.json_schema(Path(args.json_schema).read_text())
        if args.regex is not None:
            return Constraint.regex(args.regex)
        if args.choice:
            return Constraint.choice(args.choice)
    except OSError as err:
        raise ValueError(f"--json-schema {args.json_schema}: {err.strerror}") from None
    except ValueError as err:
        flag = "--json-schema" if args.json_schema else "--regex" if args.regex else "--choice"
        raise ValueError(f"{flag}: {err}") from None
    return None


def chat_prompt(tokenizer, message: str, ckpt: str, decoder_only: bool):
    """(prompt text, stop token ids, stop strings) of one user `message` through the
    tokenizer's chat template (finetune.sequences.ChatFormat, as SFT formats prompts)."""
    if not decoder_only:
        raise ValueError(f"--chat needs a decoder LM; checkpoint {ckpt!r} is an encoder-decoder")
    fmt = ChatFormat(tokenizer)
    if not fmt.templated:
        raise ValueError(
            f"checkpoint {ckpt!r} has no chat template: its tokenizer was trained without the "
            "chat markers (attnlab train --data.special_tokens chat); leave out --chat"
        )
    # the end of turn as a token when it is one (decoded text leaves special tokens out)
    return fmt.prompt_text(message), fmt.stop_tokens, [] if fmt.stop_tokens else [fmt.end]
