"""What a checkpoint is, in words, and what runs on it.

`generate`, `chat`, `serve` and `eval --text` each need one kind of model; given another, each
refuses through `require` in one line that says what the checkpoint is and which commands
do run on it, so no command sends the user to another that refuses the same checkpoint.
"""

from attnlab.models.heads import task_head_kind

SCENE_TASKS = ("vqa", "vla")

# kind -> (what it is, what runs on it); {ckpt} is the path the user gave.
KINDS = {
    "decoder": ("a decoder LM", "attnlab generate, chat, serve and eval --text"),
    "encoder_decoder": (
        "an encoder-decoder (it writes a target text for a source text)",
        "`attnlab generate --ckpt {ckpt} --prompt SOURCE` writes its target; "
        "`attnlab eval --ckpt {ckpt}` reports its exact match",
    ),
    "encoder": (
        "an encoder with a masked-LM head (bidirectional: it fills in masked tokens and does "
        "not predict the next one)",
        "`attnlab eval --ckpt {ckpt}` (without --text) reports its masked-token loss and "
        "accuracy; `attnlab finetune --ckpt {ckpt} --task classify|tag` trains a head on it; "
        "`attnlab viz attention --ckpt {ckpt}` shows its attention",
    ),
    "scenes": (
        "a model that answers generated scenes (task {task!r})",
        "`attnlab generate --ckpt {ckpt} --scene S` or `attnlab embodied --ckpt {ckpt} --seed S`",
    ),
    "head": (
        "{head} with no LM head",
        "`attnlab eval --ckpt {ckpt}` scores it on its task; `attnlab viz attention --ckpt "
        "{ckpt}` shows its attention",
    ),
}


def kind_of(loaded) -> str:
    """One of KINDS for a Loaded checkpoint (checkpoint.open_checkpoint's result)."""
    if task_head_kind(loaded.config) is not None:
        return "head"
    if loaded.run.get("data", {}).get("task") in SCENE_TASKS:
        return "scenes"
    return loaded.config.arch  # "decoder" | "encoder" | "encoder_decoder"


def require(ckpt: str, loaded, command: str, kinds: tuple[str, ...], needs: str) -> None:
    """Raise a one-line ValueError unless the checkpoint at `ckpt` is one of `kinds`.

    Args:
        command: the refusing command, e.g. "attnlab chat".
        needs: what it needs, e.g. "a decoder LM with a chat template".
    """
    kind = kind_of(loaded)
    if kind in kinds:
        return
    words = {
        "ckpt": ckpt,
        "task": loaded.run.get("data", {}).get("task"),
        "head": task_head_kind(loaded.config),
    }
    what, uses = (text.format(**words) for text in KINDS[kind])
    raise ValueError(f"{ckpt!r} is {what}; {command} needs {needs}. What runs on it: {uses}")
