"""The rewards GRPO learns from (finetune/grpo.py): a verifiable function (RLVR) or a reward
model (RLHF), behind one call that checks what comes back.

    "signature"        built in: the completion parses (`ast`) as `def name(args):` with the
                       prompt's function name and argument names (`signature_reward`)
    "module:function"  any Python function, called as trl calls its reward functions:
                       f(prompts=[...], completions=[...], **fields) -> one number per
                       completion, where fields are the examples' other fields as lists
    a directory        a reward model trained by `attnlab finetune --task reward`: the score
                       of prompt + completion (`RewardModelScore`)

A reward function that raises, returns the wrong number of values, or a value that is not a
finite number stops the run with one line naming the function (`score`): a skipped batch
would hide a bug in the reward, which is what the run optimises.
"""

import ast
import importlib
import math
import numbers
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from attnlab.checkpoint import open_checkpoint
from attnlab.finetune.heads_tasks import pad
from attnlab.finetune.sequences import ChatFormat
from attnlab.finetune.signatures import all_args

RewardFn = Callable[..., list]


def signature_reward(
    prompts: list[str], completions: list[str], name: list[str], args: list[list[str]], **fields
) -> list[float]:
    """The built-in verifiable reward of the signature tasks, per completion:

        0     the completion is not one `def ...(...):` line that parses with `ast`
        0.25  it parses
        +0.25 the function's name is `name`
        +0.5  its argument names are `args`, in order (`*args`, `**kwargs` by their names)

    so a completion scores 1 exactly when it has the documented name and argument names.
    """
    out = []
    for text, want_name, want_args in zip(completions, name, args):
        node = _parse_def(text)
        if node is None:
            out.append(0.0)
            continue
        right_args = [a.arg for a in all_args(node.args)] == list(want_args)
        out.append(0.25 + 0.25 * (node.name == want_name) + 0.5 * right_args)
    return out


def _parse_def(text: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function header `text` holds alone (with a body added to parse it), or None."""
    try:
        body = ast.parse(text.strip() + " ...").body
    except (SyntaxError, ValueError):
        return None
    if len(body) != 1 or not isinstance(body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return body[0]


class RewardModelScore:
    """A reward model's score r(x, y) of each prompt + completion, as a reward function.

    The text is formatted as the reward model was trained (`ChatFormat` of its tokenizer:
    the prompt's turn, the completion, its end marker) and cut to its last max_seq_len tokens.

    Args:
        path: a checkpoint of `attnlab finetune --task reward` (a one-output sequence head).
        chat_template: use its tokenizer's chat template (data.chat_template).
        device: where it runs (the policy's: train.device).
    """

    def __init__(self, path: str | Path, chat_template: bool = True, device=None):
        loaded = open_checkpoint(path, device)
        head = loaded.config.head
        if loaded.config.arch != "decoder" or head is None or head.num_labels != 1:
            raise ValueError(
                f"grpo.reward {str(path)!r} is not a reward model (a decoder with a one-output "
                "sequence head): train one with `attnlab finetune --task reward`"
            )
        self.model = loaded.model.eval().requires_grad_(False)
        self.format = ChatFormat(loaded.tokenizer, chat_template)
        self.max_len = loaded.config.max_seq_len
        self.pad = loaded.tokenizer.token_id("<pad>") or 0
        self.__name__ = f"the reward model {str(path)!r}"

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], **fields) -> list[float]:
        device = next(self.model.parameters()).device
        rows = [self.format.encode(p, c)[0][-self.max_len :] for p, c in zip(prompts, completions)]
        out = []
        for i in range(0, len(rows), 16):
            part = rows[i : i + 16]
            ids = pad(part, self.pad).to(device)
            mask = pad([[1] * len(r) for r in part], 0).bool().to(device)
            out += self.model(ids, mask)[:, 0].float().tolist()
        return out


def load_reward(spec: str, chat_template: bool = True, device=None) -> RewardFn:
    """The reward function grpo.reward names: "signature", a reward model's directory (opened
    on `device`), or "module:function" (imported; the module from sys.path, as `python -c`
    would find it)."""
    if spec == "signature":
        return signature_reward
    if Path(spec).is_dir():
        return RewardModelScore(spec, chat_template, device)
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(
            f"grpo.reward={spec!r} is neither 'signature', a reward model's directory nor "
            "module:function (a Python function f(prompts, completions, **fields))"
        )
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"grpo.reward={spec!r}: cannot import it ({e})") from None
    if not callable(fn):
        raise ValueError(f"grpo.reward={spec!r} is not a function")
    return fn


def reward_name(fn: RewardFn) -> str:
    """How errors name a reward function: module:function, or what it calls itself."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    if isinstance(fn, RewardModelScore) or module is None:
        return name or repr(fn)
    return f"{module}:{name}"


def score(fn: RewardFn, prompts: list[str], completions: list[str], fields: dict) -> Tensor:
    """fn's rewards of the completions, (N,) fp32, checked: a function that raises or returns
    anything but N finite numbers is a ValueError naming it (the run stops)."""
    who = reward_name(fn)
    try:
        got = fn(prompts=prompts, completions=completions, **fields)
    except Exception as e:  # any failure of the user's code: say whose, in one line
        raise ValueError(
            f"the reward function {who} raised {type(e).__name__}: {e}; the run stopped"
        ) from None
    try:
        got = list(got)
    except TypeError:
        raise ValueError(
            f"the reward function {who} returned {type(got).__name__} {got!r}: expected a list "
            f"of {len(completions)} numbers, one per completion"
        ) from None
    if len(got) != len(completions):
        raise ValueError(
            f"the reward function {who} returned {len(got)} values for {len(completions)} "
            "completions: return one number per completion"
        )
    for i, value in enumerate(got):
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise ValueError(
                f"the reward function {who} returned {value!r} for completion {i} "
                f"({completions[i][:40]!r}): expected a finite number"
            )
    return torch.tensor(got, dtype=torch.float32)
