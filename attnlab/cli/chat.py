"""Chat with a checkpoint in the terminal, through its tokenizer's chat template.

    attnlab chat --ckpt SmolLM2-135M-Instruct.Q4_1.gguf --temperature 0
    attnlab chat --ckpt runs/finetune --system "Answer in one line." --temperature 0

Each line typed is a user turn; the reply streams as it is generated and joins the history
(`inference.chat.Chat`). `/reset` forgets the conversation (the --system message stays);
Ctrl-D (end of input) or Ctrl-C at the prompt leaves. The sampling flags are SamplingConfig's
fields, each under two names (`--sampling.temperature` and `--temperature`), as in generate;
those not given take the checkpoint's own defaults, else llama.cpp's (chat_sampling).
"""

import argparse
import sys

from attnlab.checkpoint import open_checkpoint
from attnlab.cli.kinds import require
from attnlab.cli.options import (
    add_ckpt_flag,
    add_sampling_flags,
    device_from_args,
    sampling_from_args,
)
from attnlab.inference.chat import Chat
from attnlab.inference.config import GenerationConfig
from attnlab.inference.sampling import chat_sampling

DEFAULTS = GenerationConfig()
PROMPT = "> "
RESET = "/reset"


def add_parser(p: argparse.ArgumentParser) -> None:
    add_ckpt_flag(p, "the decoder to chat with")
    p.add_argument("--system", metavar="TEXT", help="a system message that opens the chat")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULTS.max_new_tokens,
        metavar="N",
        help="at most this many tokens a reply (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, metavar="S", help="sampling seed")
    add_sampling_flags(p, chat="always")


def run(args: argparse.Namespace) -> int:
    loaded = open_checkpoint(args.ckpt, device=device_from_args(args))
    require(args.ckpt, loaded, "attnlab chat", ("decoder",), "a decoder LM with a chat template")
    sampling = sampling_from_args(args, chat_sampling(loaded.sampling))
    if loaded.tokenizer is None:
        raise ValueError(f"checkpoint {args.ckpt!r} has no tokenizer to chat with")
    config = GenerationConfig(args.max_new_tokens, sampling, seed=args.seed)
    chat = Chat(loaded.model.eval(), loaded.tokenizer, args.system, config)
    print(f"chatting with {args.ckpt} ({RESET} forgets the conversation, Ctrl-D leaves)")
    while True:
        try:
            message = input(PROMPT)
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if message.strip() == RESET:
            chat.reset()
            print("(conversation cleared)")
            continue
        if not message.strip():
            continue
        chat.reply(
            message,
            on_text=lambda text: print(text, end="", flush=True),
            on_notice=lambda note: print(f"note: {note}", file=sys.stderr),
        )
        print()
