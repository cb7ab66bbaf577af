"""The two sides of a check, from directories: `attnlab check --model A --reference B`.

An attnlab checkpoint directory loads as an attnlab model. An HF directory loads as an attnlab
model through the converter when it is the model under test, and as the `transformers` model
itself (safetensors only, no remote code) when it is the reference, so that
`--model hf_dir --reference hf_dir` checks the converter against transformers.
"""

import re
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.checkpoint import open_checkpoint, plain_model, resolve_checkpoint
from attnlab.interop.check import Report, check
from attnlab.interop.convert import detect_format
from attnlab.interop.hf import common
from attnlab.tokenizer import Tokenizer

IDS = re.compile(r"^\s*\d+(?:[\s,]+\d+)*\s*$")


def load_transformers(path: str | Path) -> nn.Module:
    """The `transformers` model of an HF directory, by its config.json architecture, in fp32."""
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "the reference is an HF directory but transformers is not installed "
            "(pip install 'attnlab[hf]')"
        ) from None
    common.read_state_dict(path)  # the same safetensors-only rule, with the same errors
    archs = common.read_config(path).get("architectures") or []
    cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), None)
    if cls is None:
        raise ValueError(f"{str(path)!r}: transformers has no class for architectures {archs}")
    return cls.from_pretrained(str(path), use_safetensors=True, dtype=torch.float32).eval()


def parse_inputs(texts: list[str], tokenizer: Tokenizer | None) -> tuple[Tensor, Tensor]:
    """Each text is token ids ("12 7 99" or "12,7,99") or text for `tokenizer`; right-padded.

    Returns:
        ids (B, T) int64, mask (B, T) bool.
    """
    rows = []
    for text in texts:
        if IDS.match(text):
            rows.append([int(t) for t in re.split(r"[\s,]+", text.strip())])
        elif tokenizer is None:
            raise ValueError(
                f"input {text!r} is text but neither directory has a tokenizer.json;"
                " pass token ids such as '12 7 99'"
            )
        else:
            rows.append(tokenizer.encode(text))
        if not rows[-1]:
            raise ValueError(f"input {text!r} has no tokens")
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), True
    return ids, mask


def check_dirs(
    model_dir: str | Path,
    reference_dir: str | Path,
    inputs: list[str],
    atol: float = 1e-4,
    layout: str = "half",
) -> Report:
    """Load both directories (see the module docstring) and `check` them on `inputs`."""
    under_test = plain_model(open_checkpoint(model_dir, layout=layout), "check takes a plain model")
    reference_dir = resolve_checkpoint(reference_dir)  # a run directory: its latest checkpoint
    if detect_format(reference_dir) == "hf":
        reference = load_transformers(reference_dir)
        ref_tokenizer = None
        if (Path(reference_dir) / "tokenizer.json").is_file():
            ref_tokenizer = Tokenizer.from_file(reference_dir)
    else:
        loaded = open_checkpoint(reference_dir)
        reference, ref_tokenizer = loaded.model, loaded.tokenizer
    ids, mask = parse_inputs(inputs, under_test.tokenizer or ref_tokenizer)
    return check(under_test.model, reference, ids, mask, atol=atol)
