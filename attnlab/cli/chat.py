"""Chat with a checkpoint in the terminal, through its tokenizer's chat template.

    attnlab chat --ckpt SmolLM2-135M-Instruct.Q4_1.gguf --temperature 0
    attnlab chat --ckpt runs/finetune --system "Answer in one line." --load chat.json

Each line typed is a user turn; the reply streams as it is generated and joins the history
(`inference.chat.Chat`), and a line under it gives its tokens and tokens per second (counted
from the first token to the last; the first token's wait, the prompt's prefill, apart). A line
ending in a backslash goes on to the next one, and a message between two lines of three double
quotes (\"\"\") may span many. Commands (`/help` lists them):

    /system TEXT   the system message (the turns stay)     /reset  forget the turns
    /undo          forget the last turn and its reply       /retry  ask for the last reply again
    /save FILE     the conversation as JSON (OpenAI's list of messages)   /load FILE  read one
    /set NAME VALUE  a sampler field (temperature, top_k, ...), max_new_tokens or seed
    /set           the settings now

Ctrl-C during a reply stops it (the turn is left out); Ctrl-D (end of input) or Ctrl-C at the
prompt leaves. The sampling flags are SamplingConfig's
fields, each under two names (`--sampling.temperature` and `--temperature`), as in generate;
those not given take the checkpoint's own defaults, else llama.cpp's (chat_sampling).
"""

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

from attnlab.checkpoint import open_checkpoint
from attnlab.cli.kinds import require
from attnlab.cli.options import (
    add_ckpt_flag,
    add_sampling_flags,
    device_from_args,
    sampling_from_args,
)
from attnlab.configs import override
from attnlab.inference.chat import Chat
from attnlab.inference.config import GenerationConfig
from attnlab.inference.sampling import SamplingConfig, chat_sampling, describe

DEFAULTS = GenerationConfig()
PROMPT, MORE = "> ", ". "
BLOCK = '"""'  # opens and closes a message of many lines
RESET = "/reset"
COMMANDS = {
    "/system TEXT": "set the system message (no TEXT: none); the turns stay",
    "/reset": "forget the conversation (the system message stays)",
    "/undo": "forget the last turn and its reply",
    "/retry": "forget the last reply and generate it again",
    "/save FILE": "write the conversation as JSON (a list of {role, content})",
    "/load FILE": "read a conversation written by /save (or a request's {messages: [...]})",
    "/set NAME VALUE": "change a setting: a sampler field, max_new_tokens or seed",
    "/set": "show the settings",
    "/help": "this list",
}


def add_parser(p: argparse.ArgumentParser) -> None:
    add_ckpt_flag(p, "the decoder to chat with")
    p.add_argument("--system", metavar="TEXT", help="a system message that opens the chat")
    p.add_argument(
        "--load", metavar="FILE", help="start from a conversation saved with /save (JSON)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULTS.max_new_tokens,
        metavar="N",
        help="at most this many tokens a reply (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, metavar="S", help="sampling seed")
    add_sampling_flags(p, chat="always")


def read_message() -> str:
    """One message from the terminal: a line, lines joined by a trailing backslash, or the
    lines between two of \"\"\". Raises EOFError at the end of input."""
    line = input(PROMPT)
    if line.strip() == BLOCK or (line.startswith(BLOCK) and not line.rstrip().endswith(BLOCK)):
        lines = [line.strip()[len(BLOCK) :]]
        while not lines[-1].rstrip().endswith(BLOCK):
            lines.append(input(MORE))
        lines[-1] = lines[-1].rstrip()[: -len(BLOCK)]
        return "\n".join(lines).strip("\n")
    lines = [line]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(input(MORE))
    return "\n".join(lines)


def reply(chat: Chat, message: str) -> None:
    """Stream the reply to `message`, then its figures: tokens and tokens per second."""
    times = []
    try:
        chat.reply(
            message,
            on_text=lambda text: print(text, end="", flush=True),
            on_notice=lambda note: print(f"note: {note}", file=sys.stderr),
            on_token=lambda _: times.append(time.perf_counter()),
        )
    except KeyboardInterrupt:  # Ctrl-C stops the reply, not the chat
        print("\n(stopped: this turn is left out of the conversation)")
        return
    print()
    n, figures = len(times), f"[{len(times)} tokens"
    if n > 1 and times[-1] > times[0]:
        figures += f", {(n - 1) / (times[-1] - times[0]):.1f} tokens/s"
    print(figures + "]", file=sys.stderr)


def settings(chat: Chat) -> str:
    c = chat.config
    sampler = describe(c.sampling) or "SamplingConfig's defaults"
    return f"{sampler}; max_new_tokens {c.max_new_tokens}, seed {c.seed}"


def set_field(chat: Chat, words: list[str]) -> str:
    """`/set NAME VALUE`: the field of the sampler (or max_new_tokens, seed) changed."""
    if not words:
        return settings(chat)
    sampler = {f.name for f in fields(SamplingConfig)}
    if len(words) != 2 or words[0] not in sampler | {"max_new_tokens", "seed"}:
        names = ", ".join(sorted(sampler)) + ", max_new_tokens, seed"
        raise ValueError(f"use /set NAME VALUE, NAME one of {names}")
    name, value = words
    path = f"sampling.{name}" if name in sampler else name
    chat.config = override(chat.config, path, value)
    if chat.config.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {chat.config.max_new_tokens}")
    return f"({name} {value})"


def command(chat: Chat, line: str) -> str | None:
    """Run the command `line` (starting with "/"); what to print, None when it asked for a
    reply (/retry, which streams it). A ValueError or OSError says what went wrong."""
    name, _, rest = line.strip().partition(" ")
    rest = rest.strip()
    if name == "/help":
        return "\n".join(f"  {usage:<16} {what}" for usage, what in COMMANDS.items())
    if name == RESET:
        chat.reset()
        return "(conversation cleared)"
    if name == "/system":
        chat.set_system(rest or None)
        return f"(system message: {rest!r})" if rest else "(no system message)"
    if name in ("/undo", "/retry"):
        message = chat.undo()
        if message is None:
            return "(no turn yet)"
        if name == "/undo":
            return f"(forgot the turn {message[:40]!r} and its reply)"
        reply(chat, message)
        return None
    if name in ("/save", "/load") and not rest:
        raise ValueError(f"{name} needs a file name: {name} chat.json")
    if name == "/save":
        Path(rest).write_text(json.dumps(chat.history, indent=1, ensure_ascii=False) + "\n")
        return f"(saved {len(chat.history)} messages to {rest})"
    if name == "/load":
        load(chat, rest)
        return f"(loaded {len(chat.history)} messages from {rest})"
    if name == "/set":
        return set_field(chat, rest.split())
    raise ValueError(f"unknown command {name!r}: /help lists them")


def load(chat: Chat, path: str) -> None:
    """A conversation from a JSON file: a list of messages, or an object with `messages`."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    chat.load(data["messages"] if isinstance(data, dict) and "messages" in data else data)


def run(args: argparse.Namespace) -> int:
    loaded = open_checkpoint(args.ckpt, device=device_from_args(args))
    require(args.ckpt, loaded, "attnlab chat", ("decoder",), "a decoder LM with a chat template")
    sampling = sampling_from_args(args, chat_sampling(loaded.sampling))
    if loaded.tokenizer is None:
        raise ValueError(f"checkpoint {args.ckpt!r} has no tokenizer to chat with")
    config = GenerationConfig(args.max_new_tokens, sampling, seed=args.seed)
    chat = Chat(loaded.model.eval(), loaded.tokenizer, args.system, config)
    if args.load:
        try:
            load(chat, args.load)
        except (OSError, ValueError) as e:
            raise ValueError(f"--load {args.load}: {e}") from None
        if args.system is not None:  # the flag's system message wins over the file's
            chat.set_system(args.system)
    print(f"chatting with {args.ckpt} (/help lists the commands, Ctrl-D leaves)")
    while True:
        try:
            message = read_message()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if message.startswith("/"):
            try:
                said = command(chat, message)
            except (OSError, ValueError) as e:
                said = f"error: {e}"
            if said is not None:
                print(said)
        elif message.strip():
            reply(chat, message)
