"""A multi-turn chat with a decoder LM through its tokenizer's chat template.

Each turn renders the whole conversation so far (system message, every user and assistant
turn, then the assistant's generation prompt) with the template, as `transformers` renders it
for `apply_chat_template(messages, add_generation_prompt=True)`, and generates the reply from
that text: the model sees the conversation exactly as it was fine-tuned to see one.

    history ─apply_chat_template─> prompt text ─generate_text─> reply (streamed) ─> history

Generation stops at the template's end of turn (found by rendering a probe reply and reading
what the template writes after it, e.g. "<|im_end|>"), as a token when the marker is one
token, else as a stop string cut from the reply. Each turn re-encodes the conversation and
prefills it afresh (no cache kept between turns: simple, and cheap next to decoding).

    chat = Chat(loaded.model, loaded.tokenizer, system="Be brief.")  # GenerationConfig()
    chat.reply("What is the capital of France?", on_text=print)
    chat.undo()   # -> "What is the capital of France?": the exchange is forgotten
    chat.reset()

The history is OpenAI's list of messages ({"role", "content"}, the system message first, if
any), so a conversation saved as JSON loads back here (`load`) or goes to a server as is.
"""

from collections.abc import Callable
from dataclasses import replace

from torch import nn

from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate_text

ROLES = ("system", "user", "assistant")
_PROBE = "\x00probe\x00"  # a reply no template writes by itself


def end_of_turn(tokenizer) -> str:
    """The text the tokenizer's chat template writes after an assistant reply ("" if none)."""
    turns = [{"role": "user", "content": "p"}, {"role": "assistant", "content": _PROBE}]
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=False)
    return text[text.find(_PROBE) + len(_PROBE) :].strip()


class Chat:
    """One conversation: its history, and the settings each reply is generated with.

    Args:
        model: a decoder LM (eval mode).
        tokenizer: an attnlab Tokenizer with a chat template.
        system: an optional system message, kept across `reset()`.
        config: how each reply is generated (its length, sampling, seed); the template's end
            of turn joins its stop tokens (or stop strings).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        system: str | None = None,
        config: GenerationConfig | None = None,
    ):
        if hasattr(model, "encode"):
            raise ValueError("chat needs a decoder LM; this model is an encoder-decoder")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "this checkpoint's tokenizer has no chat template to write a conversation "
                "with; `attnlab generate --prompt` continues plain text instead"
            )
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.end = end_of_turn(tokenizer)
        end_ids = tokenizer.encode(self.end) if self.end else []
        self.stop_tokens = tuple(end_ids) if len(end_ids) == 1 else ()
        self.stop_strings = (self.end,) if self.end and not self.stop_tokens else ()
        config = config or GenerationConfig(max_new_tokens=256)
        self.config = replace(
            config,
            stop_tokens=config.stop_tokens + self.stop_tokens,
            stop_strings=config.stop_strings + self.stop_strings,
        )
        self.history: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self.history = [] if self.system is None else [{"role": "system", "content": self.system}]

    def set_system(self, text: str | None) -> None:
        """Open the conversation with `text` as the system message (None: none), turns kept."""
        turns = [m for m in self.history if m["role"] != "system"]
        self.system = text
        self.history = ([] if text is None else [{"role": "system", "content": text}]) + turns

    def load(self, messages: list[dict]) -> None:
        """Take `messages` (OpenAI's shape: a system message first, if any, then the turns) as
        the conversation so far; a ValueError names the first message that is not one."""
        if not isinstance(messages, list):
            raise ValueError(f"a conversation is a list of messages, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            ok = (
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            )
            if not ok:
                raise ValueError(f"message {i} is not {{'role': one of {ROLES}, 'content': text}}")
            if m["role"] == "system" and i > 0:
                raise ValueError(f"message {i}: a system message comes first, or not at all")
        self.history = [{"role": m["role"], "content": m["content"]} for m in messages]
        self.system = (
            messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        )

    def undo(self) -> str | None:
        """Forget the last user turn and what came after it (its reply); returns that turn's
        message (None when there is no turn to forget)."""
        users = [i for i, m in enumerate(self.history) if m["role"] == "user"]
        if not users:
            return None
        message = self.history[users[-1]]["content"]
        del self.history[users[-1] :]
        return message

    def prompt(self, message: str) -> str:
        """The text the model reads to answer `message` next: the history, `message` as the
        user's turn, and the assistant's generation prompt."""
        turns = [*self.history, {"role": "user", "content": message}]
        return self.tokenizer.apply_chat_template(turns, add_generation_prompt=True)

    def reply(
        self,
        message: str,
        on_text: Callable[[str], None] | None = None,
        on_notice: Callable[[str], None] | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> str:
        """Answer `message`, streaming the reply's text to `on_text` (and its token ids to
        `on_token`) as it comes; the exchange joins the history. Returns the reply (without
        the end-of-turn marker)."""
        text = generate_text(
            self.model,
            self.tokenizer,
            self.prompt(message),
            self.config,
            on_text=on_text,
            on_notice=on_notice,
            on_token=on_token,
        )
        if self.stop_strings and text.endswith(self.end):
            text = text[: -len(self.end)]
        self.history += [
            {"role": "user", "content": message},
            {"role": "assistant", "content": text.strip()},
        ]
        return text
