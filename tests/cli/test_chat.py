"""attnlab chat: the turn logic (inference.chat.Chat) against generate_text on the rendered
conversation, and the command driven through a pseudo-terminal as a user types into it."""

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnlab.checkpoint import open_checkpoint
from attnlab.inference.chat import Chat, end_of_turn
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate_text
from attnlab.inference.sampling import SamplingConfig
from tests.serve.server_helpers import write_checkpoint

GREEDY = GenerationConfig(max_new_tokens=6, sampling=SamplingConfig(temperature=0.0))
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("chat") / "tiny")


def test_each_reply_reads_the_whole_conversation_through_the_template(ckpt):
    """A reply is generate_text's on the template's rendering of system + every turn + the
    generation prompt, stopping at the template's end of turn; the streamed pieces join to it;
    reset forgets the turns and keeps the system message."""
    loaded = open_checkpoint(ckpt)
    tok = loaded.tokenizer
    chat = Chat(loaded.model, tok, system="be brief", config=GREEDY)
    assert chat.end == "<|end|>" and chat.config.stop_tokens == (tok.token_id("<|end|>"),)
    pieces = []
    first = chat.reply("hello cat", on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == first
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello cat"}]
    expected = generate_text(loaded.model, tok, tok.apply_chat_template(turns), chat.config)
    assert first == expected
    turns += [{"role": "assistant", "content": first.strip()}, {"role": "user", "content": "dog"}]
    assert chat.prompt("dog") == tok.apply_chat_template(turns, add_generation_prompt=True)
    chat.reply("dog")
    assert len(chat.history) == 5
    chat.reset()
    assert chat.history == [{"role": "system", "content": "be brief"}]
    assert chat.reply("hello cat") == first


def test_end_of_turn_is_what_the_template_writes_after_a_reply(ckpt):
    tok = open_checkpoint(ckpt).tokenizer
    tok.chat_template = CHATML
    assert end_of_turn(tok) == "<|im_end|>"


def test_a_tokenizer_without_a_template_is_one_clear_error(ckpt):
    loaded = open_checkpoint(ckpt)
    loaded.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        Chat(loaded.model, loaded.tokenizer)


class Terminal:
    """`attnlab chat ...` on a pseudo-terminal: type lines, read what appears until the prompt."""

    def __init__(self, argv: list[str]):
        master, slave = pty.openpty()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "attnlab", "chat", *argv]
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env)
        os.close(slave)
        self.master = master

    def read_until(self, end: str, timeout: float = 300) -> str:
        out, deadline = b"", time.monotonic() + timeout
        while not out.decode(errors="replace").endswith(end):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {end!r} after {timeout}s; got {out!r}")
            ready, _, _ = select.select([self.master], [], [], 1)
            if ready:
                try:
                    out += os.read(self.master, 4096)
                except OSError:  # the child closed the terminal
                    break
        return out.decode(errors="replace").replace("\r\n", "\n")

    def say(self, line: str) -> str:
        """Type `line` and Enter; the reply printed before the next prompt (echo removed)."""
        os.write(self.master, (line + "\n").encode())
        text = self.read_until("\n> ")
        return text.removeprefix(line + "\n").removesuffix("\n> ")

    def close(self) -> int:
        os.write(self.master, b"\x04")  # Ctrl-D at an empty prompt: end of input
        code = self.proc.wait(120)
        os.close(self.master)
        return code


def chat_through_a_terminal(ckpt, lines: list[str], extra: list[str] = ()) -> list[str]:
    """What `attnlab chat` prints for each typed line; asserts it starts and leaves cleanly."""
    term = Terminal(["--ckpt", str(ckpt), "--device", "cpu", *extra])
    try:
        assert "Ctrl-D leaves" in term.read_until("> ")
        replies = [term.say(line) for line in lines]
    finally:
        code = term.close()
    assert code == 0
    return replies


@pytest.mark.slow
def test_chat_in_a_terminal_streams_replies_resets_and_leaves_on_ctrl_d(ckpt):
    """Typed turns through a pty: each reply equals Chat's (which test above checks against
    generate_text on the rendered conversation), the second turn sees the first, /reset
    starts over, Ctrl-D exits 0."""
    flags = ["--temperature", "0", "--max-new-tokens", "6", "--system", "be brief"]
    typed = ["hello cat", "the dog", "/reset", "hello cat"]
    first, second, cleared, again = chat_through_a_terminal(ckpt, typed, flags)
    loaded = open_checkpoint(ckpt)
    chat = Chat(loaded.model, loaded.tokenizer, "be brief", GREEDY)
    assert first == chat.reply("hello cat")
    assert second == chat.reply("the dog")
    assert cleared == "(conversation cleared)"
    assert again == first
