"""Pick the family converter from config.json (loading) or from a ModelConfig (saving), and move
tokenizers, which are already in HF's format (tokenizer.json), in and out of HF directories.

    load_hf(dir)              config.json architectures (or model_type) -> gpt2|llama|bloom|bert|t5
                              |families (Qwen3, OLMo 2, Phi-3, Gemma 2/3)|moe (Mixtral,
                              Qwen2-MoE, Qwen3-MoE)|deepseek (DeepSeek-V3)
    save_hf(model, cfg, dir)  cfg -> the one family that can hold it; a decoder's config.json
                              and generation_config.json name the tokenizer's bos/eos/pad ids
                              (transformers' `generate` stops at that eos, as attnlab's does)
"""

import errno
import json
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch
from safetensors import SafetensorError
from torch import nn

from attnlab.interop.hf import bert, bloom, common, deepseek, families, gpt2, llama, moe, t5
from attnlab.models.config import ModelConfig
from attnlab.tokenizer import Tokenizer

# HF architecture name -> the module that converts it.
ARCHITECTURES: dict[str, ModuleType] = {
    **{a: gpt2 for a in gpt2.ARCHITECTURES},
    **{a: llama for a in llama.ARCHITECTURES},
    **{a: bloom for a in bloom.ARCHITECTURES},
    **{a: bert for a in bert.ARCHITECTURES},
    **{a: t5 for a in t5.ARCHITECTURES},
    **{a: families for a in families.ARCHITECTURES},
    **{a: moe for a in moe.ARCHITECTURES},
    **{a: deepseek for a in deepseek.ARCHITECTURES},
}
MODEL_TYPES: dict[str, ModuleType] = {
    "gpt2": gpt2,
    "llama": llama,
    "mistral": llama,
    "qwen2": llama,
    "bloom": bloom,
    "bert": bert,
    "t5": t5,
    **{m: families for m in families.MODEL_TYPES},
    **{family: moe for family in moe.DENSE},
    "deepseek_v3": deepseek,
}
TOKENIZER = "tokenizer.json"
GENERATION_CONFIG = "generation_config.json"
SPECIAL_IDS = {"<bos>": "bos_token_id", "<eos>": "eos_token_id", "<pad>": "pad_token_id"}


def converter_for_hf(hf: dict) -> ModuleType:
    """The family module for an HF config.json dict.

    Raises:
        ValueError naming the architecture and listing the supported ones.
    """
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if archs:
        raise ValueError(
            f"architecture {', '.join(archs)} is not supported; attnlab converts "
            f"{sorted(ARCHITECTURES)}"
        )
    if hf.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    raise ValueError(
        f"model_type {hf.get('model_type')!r} (no architectures listed) is not "
        f"supported; attnlab converts {sorted(ARCHITECTURES)}"
    )


def converter_for(cfg: ModelConfig) -> ModuleType:
    """The family module whose HF checkpoints can hold `cfg`."""
    if cfg.arch == "encoder":
        return bert
    if cfg.arch == "encoder_decoder":
        if cfg.position != "t5_bias":
            raise ValueError(
                f"only T5-style encoder-decoders (position='t5_bias') have an HF "
                f"family here, not position={cfg.position!r}"
            )
        return t5
    if cfg.arch != "decoder":
        raise ValueError(f"no supported HF family holds arch={cfg.arch!r}")
    if cfg.position == "learned":
        return gpt2
    if cfg.moe is not None:
        return deepseek if cfg.attention.kind == "mla" else moe
    if cfg.position == "rope":
        return llama if families.family_of(cfg) is None else families
    if cfg.position == "alibi":
        return bloom
    raise ValueError(
        f"no supported HF family holds a decoder with position={cfg.position!r}; "
        "GPT-2 has learned positions, the Llama family RoPE, BLOOM ALiBi"
    )


def load_hf(
    path: str | Path, layout: str = "half", dtype: torch.dtype | None = None
) -> tuple[nn.Module, ModelConfig]:
    """Load an HF checkpoint directory (config.json + safetensors) into an attnlab model.

    Args:
        path: the directory.  layout: RoPE layout for the Llama family ("half" or "interleaved").
        dtype: cast floating-point weights to this dtype (default: as stored).

    Returns:
        (model in eval mode, its ModelConfig).
    """
    return converter_for_hf(common.read_config(path)).load_hf(path, layout=layout, dtype=dtype)


def save_hf(
    model: nn.Module,
    cfg: ModelConfig,
    path: str | Path,
    tokenizer: Tokenizer | None = None,
    sampling: dict | None = None,
) -> Path:
    """Write `model` as an HF checkpoint directory that `transformers` loads (and a tokenizer).

    A decoder's config.json gets the tokenizer's bos/eos/pad ids where its family writes none,
    and a generation_config.json the same ids and `sampling` ({SamplingConfig field: value},
    `Loaded.sampling`: a GGUF's general.sampling.*), with do_sample, where there is any.

    The files are written into `path.tmp` and moved into `path` only when all are complete (a
    rename: it needs no space), so a failed write leaves no partial directory or file behind;
    the error is an OSError naming the file it was writing (a full disk: ENOSPC)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        converter_for(cfg).save_hf(model, cfg, tmp)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        if cfg.arch == "decoder":
            save_generation_config(tmp, tokenizer, sampling or {})
    except (OSError, SafetensorError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back
        raise _write_error(e, path) from e
    if not path.exists():
        os.replace(tmp, path)
        return path
    for file in sorted(tmp.iterdir()):  # into an existing directory (--overwrite)
        os.replace(file, path / file.name)
    tmp.rmdir()
    return path


def save_generation_config(path: Path, tokenizer: Tokenizer | None, sampling: dict) -> None:
    """Fill config.json's missing bos/eos/pad ids from `tokenizer` and write them, with
    `sampling` (do_sample where there is any), as generation_config.json (transformers takes
    its `generate` defaults from there)."""
    file = path / common.CONFIG
    hf = json.loads(file.read_text())
    found = tokenizer.special_ids if tokenizer is not None else {}
    for ours, key in SPECIAL_IDS.items():
        if hf.get(key) is None and ours in found:
            hf[key] = found[ours]
    file.write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    generation = {k: hf[k] for k in SPECIAL_IDS.values() if hf.get(k) is not None}
    if sampling:
        generation |= {"do_sample": True, **sampling}
    if generation:
        (path / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")


def _write_error(e: Exception, path: Path) -> Exception:
    """The error of a failed write into `path`: an OSError naming the file, for a full disk also
    where a writer reports it without an errno (safetensors' SafetensorError, torch's
    RuntimeError); any other exception as it is (a bug)."""
    file = getattr(e, "filename", None)
    name = Path(file).name if file else "its files"
    if isinstance(e, OSError) and e.errno is not None:
        return OSError(e.errno, f"{e.strerror or e} writing {name} in {path}")
    if "No space left" in str(e):
        return OSError(errno.ENOSPC, f"No space left on device writing {name} in {path}")
    return e


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of an HF (or attnlab) directory, from its tokenizer.json."""
    path = Path(path)
    file = path / TOKENIZER if path.is_dir() else path
    if not file.is_file():
        others = (
            sorted(p.name for p in path.glob("*vocab*") | path.glob("*.model"))
            if path.is_dir()
            else []
        )
        hint = f" (found {others}: only the tokenizers-library format is read)" if others else ""
        raise ValueError(f"no {TOKENIZER} in {str(path)!r}{hint}")
    tokenizer = Tokenizer.from_pretrained(file.parent)
    start = _decoder_start(file.parent)
    if start is not None and tokenizer.token_id("<bos>") is None:
        # attnlab's encoder-decoders start decoding from <bos>; T5 has none and starts from
        # the token its config.json names (its pad), so that one is <bos> here.
        tokenizer.special_ids["<bos>"] = start
    return tokenizer


def _decoder_start(directory: Path) -> int | None:
    """The decoder_start_token_id of an encoder-decoder directory (T5: 0, its pad), from
    config.json or generation_config.json (where newer transformers keep it), else None."""
    found = {}
    for name in ("generation_config.json", "config.json"):  # config.json's wins
        file = directory / name
        try:
            data = json.loads(file.read_text()) if file.is_file() else {}
        except json.JSONDecodeError:
            data = {}
        found.update(data if isinstance(data, dict) else {})
    start = found.get("decoder_start_token_id")
    seq2seq = found.get("is_encoder_decoder") or found.get("model_type") == "t5"
    return start if isinstance(start, int) and seq2seq else None


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """Write tokenizer.json and a tokenizer_config.json naming its special tokens for HF."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(path / TOKENIZER)
    names = {
        "<bos>": "bos_token",
        "<eos>": "eos_token",
        "<pad>": "pad_token",
        "<unk>": "unk_token",
        "<mask>": "mask_token",
        "<cls>": "cls_token",
        "<sep>": "sep_token",
    }
    vocab = {i: t for t, i in tokenizer.backend.get_vocab(with_added_tokens=True).items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    config.update({names[k]: vocab[i] for k, i in tokenizer.special_ids.items()})
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
