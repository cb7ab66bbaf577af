"""Command-line flags derived from the config dataclasses, so each default exists exactly once.

Every leaf field of a section becomes a flag `--section.path.to.field` (for example
`--model.attention.n_heads 4`, `--train.lr=3e-4`) whose default is "not given"; given flags
override the dataclass (or preset, or YAML) value through `dataclasses.replace`.
"""

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Literal, get_args, get_origin

import yaml

from attnlab.configs import leaf_fields, merge, override, type_name


class CLIParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`attnlab train: error: ...`, exit 2) and
    that never guesses: prefix matching is off, so `--model.n_l=3` is an error, not n_layers."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        # A subcommand's parser names the flags it does not know itself (argparse would leave
        # them to the top-level parser, whose message then names no command).
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def add_config_flags(
    parser: argparse.ArgumentParser,
    sections: dict[str, type],
    defaults: dict | None = None,
    notes: dict[str, str] | None = None,
) -> None:
    """Add one `--section.field` flag per leaf field of each section's dataclass.

    Args:
        defaults: {section: instance} whose values the help shows as defaults.
        notes: {section: words} said after a section's defaults, e.g. "of the llama-char
            preset" for a model section whose defaults come from the preset.
    """
    defaults, notes = defaults or {}, notes or {}
    for section, cls in sections.items():
        group = parser.add_argument_group(f"{section} ({cls.__name__} fields)")
        for path, annotation in leaf_fields(cls):
            name = f"{section}.{path}"
            if section in defaults:
                default = _dotted_value(defaults[section], path)
                note = f" {notes[section]}" if section in notes else ""
                help_text = f"{_short_type(annotation)}; default {default!r}{note}"
            else:
                help_text = _short_type(annotation)
            group.add_argument(f"--{name}", dest=name, default=None, metavar="V", help=help_text)


def _short_type(annotation) -> str:
    args = get_args(annotation) if get_origin(annotation) is not Literal else (annotation,)
    lits = [a for a in args if get_origin(a) is Literal]
    if lits:  # the choices, written as they are typed on the command line
        return "one of " + ", ".join(str(c) for c in get_args(lits[0]))
    return type_name(annotation)


def _dotted_value(cfg, path: str):
    for part in path.split("."):
        if cfg is None or not dataclasses.is_dataclass(cfg):
            return None
        cfg = getattr(cfg, part)
    return cfg


def apply_config_flags(configs: dict, args: argparse.Namespace) -> tuple[dict, set[str]]:
    """Apply the given flags to {section: config}; also return the dotted names that were given.

    A flag whose config check fails is tried again once the others are in: the check may
    compare it with a field another flag sets (--train.lr 1e-5 is below the default min_lr
    until --train.min_lr 1e-6 is applied too, whatever their order).
    """
    given = {
        name: value
        for name, value in vars(args).items()
        if value is not None and name.partition(".")[0] in configs and name.partition(".")[2]
    }
    pending = list(given.items())
    while pending:
        failed = []
        for name, value in pending:
            section, _, path = name.partition(".")
            try:
                configs[section] = override(configs[section], path, value)
            except ValueError as e:
                failed.append((name, value, e))
        if len(failed) == len(pending):  # no progress: the first failure is the user's to fix
            name, value, e = failed[0]
            raise ValueError(f"--{name}={value}: {e}") from None
        pending = [(name, value) for name, value, _ in failed]
    return configs, set(given)


def read_config_file(path: str | Path) -> dict:
    """A YAML or JSON file of `{section: {field: value}}` overrides."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such config file {str(path)!r}")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); fix that line") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{where}: not valid YAML ({problem}); fix that line") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{str(path)!r} must hold a mapping of sections, got {type(data).__name__}"
        )
    return data


def merge_sections(configs: dict, data: dict, source: str | Path | None = None) -> dict:
    """Merge {section: {field: value}} into {section: config}; unknown sections are errors.

    Args:
        source: the file `data` came from, named in error messages.
    """
    where = f"{source}: " if source is not None else ""
    unknown = sorted(set(data) - set(configs))
    if unknown:
        raise ValueError(f"{where}unknown config sections {unknown}; valid: {sorted(configs)}")
    merged = {}
    for k, v in configs.items():
        section = data.get(k) or {}
        if not isinstance(section, dict):
            raise ValueError(f"{where}section {k!r} must be a mapping of fields, got {section!r}")
        try:
            merged[k] = merge(v, section)
        except ValueError as e:
            raise ValueError(f"{where}section {k!r}: {e}") from None
    return merged


def require_device(device: str, flag: str) -> None:
    """Raise a ValueError naming `flag` when `device` is CUDA and torch has no CUDA device."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"{flag}={device}: {why}; use {flag}=cpu (or auto)")


CKPT_KINDS = (
    "a checkpoint directory (attnlab or HF), a run's out_dir or checkpoints/ (its latest), "
    "a .gguf file, or hf:ORG/NAME[@REV] (a Hub model, fetched once)"
)  # what open_checkpoint opens: every --ckpt that goes through it says so in these words


def add_ckpt_flag(p: argparse.ArgumentParser, what: str = "") -> None:
    """`--ckpt PATH` (required), its help naming every kind open_checkpoint reads.

    Args:
        what: what the checkpoint is for, said first (e.g. "the decoder to serve").
    """
    p.add_argument(
        "--ckpt", required=True, metavar="PATH", help=(f"{what}: " if what else "") + CKPT_KINDS
    )


def freeze_usage(p: argparse.ArgumentParser, tail: str = "[--SECTION.FIELD=V ...]") -> None:
    """Write the usage line from the flags added so far, then `tail` for the config flags that
    come next (too many to list): a flag added before this call is in the usage line, always."""
    usage = " ".join(p.format_usage().removeprefix("usage:").split())
    p.usage = usage.replace(p.prog, "%(prog)s", 1) + " " + tail


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--field-name` flag per field of `cls`; defaults stay in the dataclass (None here)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f.metadata.get("help", "") + (
            "" if default is None else f" (default: {default})"
        )
        if kind is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(
                flag,
                dest=f.name,
                nargs="+",
                type=typing.get_args(kind)[0],
                default=None,
                metavar="V",
                help=help_text,
            )
        else:
            parser.add_argument(
                flag, dest=f.name, type=kind, default=None, metavar="V", help=help_text
            )


def options_from_args(cls: type, args: argparse.Namespace):
    """The dataclass with every given flag applied (tuples from lists)."""
    given = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is not None:
            given[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**given)


SAMPLING = "sampling"  # the flags' section: --sampling.top_p, also spelled --top-p


def add_sampling_flags(p: argparse.ArgumentParser, chat: str = "--chat") -> None:
    """`--device` and one flag per SamplingConfig field (`generate` and `chat` share them).

    Args:
        chat: when a reply samples at the chat defaults (inference.sampling.chat_sampling):
            "--chat" (generate: with that flag) or "always" (chat).
    """
    from attnlab.inference.sampling import CHAT_SAMPLING, SamplingConfig, describe

    p.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda if available)")
    when = "a reply" if chat == "always" else f"with {chat}, a reply"
    group = p.add_argument_group(
        f"{SAMPLING} ({SamplingConfig.__name__} fields)",
        f"{when} samples at the checkpoint's own defaults where it has them (an HF "
        "generation_config.json that samples, a GGUF's general.sampling.*), else at "
        f"llama.cpp's: {describe(CHAT_SAMPLING)}; a flag given wins over both",
    )
    plain = SamplingConfig()
    for path, annotation in leaf_fields(SamplingConfig):
        name = getattr(annotation, "__name__", str(annotation)).replace("typing.", "")
        default, for_chat = getattr(plain, path), getattr(CHAT_SAMPLING, path)
        if chat == "always":
            help_text = f"{name} (default {for_chat})"
        elif for_chat != default:
            help_text = f"{name} (default {default}; {chat}: {for_chat})"
        else:
            help_text = f"{name} (default {default})"
        if get_origin(annotation) is tuple:  # logit_bias: read as JSON (configs.parse_value)
            help_text = """JSON {token id: bias in [-100, 100]}, e.g. '{"5": -100}'"""
        group.add_argument(
            f"--{SAMPLING}.{path}",
            f"--{path.replace('_', '-')}",
            dest=f"{SAMPLING}.{path}",
            default=None,
            metavar="V",
            help=help_text,
        )


def device_from_args(args: argparse.Namespace) -> str:
    """The device add_sampling_flags' `--device` names (`auto`: cuda if available)."""
    import torch

    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def sampling_from_args(args: argparse.Namespace, base=None):
    """The SamplingConfig add_sampling_flags' flags name, over `base` (default SamplingConfig(),
    or a chat's: inference.sampling.chat_sampling)."""
    from attnlab.inference.sampling import SamplingConfig

    configs, _ = apply_config_flags({SAMPLING: base or SamplingConfig()}, args)
    return configs[SAMPLING]


def add_steer_flags(p: argparse.ArgumentParser) -> None:
    """`--steer LAYER TEXT_A TEXT_B SCALE` and `--sae-steer SAE_DIR FEATURE SCALE`, each
    repeatable (`generate` and `serve` share them; `steers_from_args` reads them)."""
    p.add_argument(
        "--steer",
        nargs=4,
        action="append",
        default=[],
        metavar=("LAYER", "TEXT_A", "TEXT_B", "SCALE"),
        help="add SCALE x (mean activation of TEXT_A - that of TEXT_B) to the residual stream "
        "entering block LAYER at every position (activation addition); repeatable, e.g. "
        "--steer 3 ' love' ' hate' 4",
    )
    p.add_argument(
        "--sae-steer",
        nargs=3,
        action="append",
        default=[],
        metavar=("SAE_DIR", "FEATURE", "SCALE"),
        help="add SCALE x the decoder row of FEATURE of the SAE in SAE_DIR (SAELens' format, "
        "e.g. from `attnlab lab sae`) at the SAE's hook point, every position; repeatable, "
        "e.g. --sae-steer runs/sae/sae 12 8",
    )


def steers_from_args(model, tokenizer, args: argparse.Namespace) -> list:
    """The Steers `add_steer_flags`' flags name (inference.steering.text_steers, then
    lab.sae.sae_steers); empty without them."""
    from attnlab.inference.steering import text_steers
    from attnlab.lab.sae import sae_steers

    return text_steers(model, tokenizer, args.steer) + sae_steers(model, args.sae_steer)


def add_kv_cache_dtype_flag(p: argparse.ArgumentParser) -> None:
    """`--kv-cache-dtype auto|int8|fp8` (`generate` and `serve` share it)."""
    from attnlab.components.kv_cache import KV_CACHE_DTYPES

    p.add_argument(
        "--kv-cache-dtype",
        choices=tuple(KV_CACHE_DTYPES),
        default="auto",
        help="keep the KV cache in the model's dtype (auto), or as 8-bit codes with one scale "
        "per token and head: int8 or fp8 (e4m3), a quarter of fp32's memory (default auto)",
    )


def kv_cache_dtype_from_args(args: argparse.Namespace):
    """--kv-cache-dtype as a torch dtype (None: the model's); refused with --speculative, whose
    caches are the model's."""
    from attnlab.components.kv_cache import kv_cache_dtype

    dtype = kv_cache_dtype(args.kv_cache_dtype)
    if dtype is not None and getattr(args, "speculative", None):
        raise ValueError(
            f"--kv-cache-dtype {args.kv_cache_dtype} is for plain decoding: drop it or "
            "--speculative"
        )
    return dtype


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    """The flags of speculative decoding (`generate` and `serve` share them; off by default)."""
    from attnlab.inference.speculative import DEFAULT_DRAFT_TOKENS

    group = p.add_argument_group("speculative decoding (inference/speculative.py)")
    group.add_argument(
        "--speculative",
        choices=("ngram", "draft"),
        help="draft tokens by prompt lookup (ngram) or with a draft model (draft) and check "
        "them in one forward of the model; greedy output is unchanged (default: off)",
    )
    group.add_argument(
        "--draft-ckpt",
        metavar="DIR",
        help="--speculative draft: the draft model, with the model's tokenizer (default: "
        "--ckpt itself, quantized with --draft-quantize)",
    )
    group.add_argument(
        "--draft-quantize",
        choices=("int4", "int8"),
        help="quantize the draft model (a .gguf file keeps its own Q4_1 matrices for int4)",
    )
    group.add_argument(
        "--num-draft-tokens",
        type=int,
        default=DEFAULT_DRAFT_TOKENS,
        metavar="K",
        help="drafts per round (default %(default)s)",
    )


def speculative_from_args(args: argparse.Namespace, device, tokenizer):
    """The `Speculative` that add_speculative_flags' flags name, or None (--speculative not
    given). The draft model opens on `device`, checked against the model's `tokenizer`."""
    from attnlab.inference.speculative import (
        ModelDrafter,
        NgramDrafter,
        Speculative,
        open_draft_model,
    )

    if args.speculative != "draft" and (args.draft_ckpt or args.draft_quantize):
        raise ValueError("--draft-ckpt and --draft-quantize need --speculative draft")
    if args.speculative is None:
        return None
    if args.speculative == "ngram":
        return Speculative(NgramDrafter(), args.num_draft_tokens)
    if args.draft_ckpt is None and args.draft_quantize is None:
        raise ValueError(
            "--speculative draft needs a smaller model: --draft-ckpt DIR, or --draft-quantize "
            "int4 for the model's own int4 copy"
        )
    path = args.draft_ckpt or args.ckpt
    draft = open_draft_model(path, device, args.draft_quantize, tokenizer)
    return Speculative(ModelDrafter(draft), args.num_draft_tokens)
