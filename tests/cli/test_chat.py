"""attnlab chat: the turn logic (inference.chat.Chat) against generate_text on the rendered
conversation, its commands, and the command driven through a pseudo-terminal as a user types
into it."""

import builtins
import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnlab.checkpoint import open_checkpoint
from attnlab.cli.chat import command, read_message, reply
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
        """Type `line` and Enter (a line ending in a backslash, and the next one); what is
        printed before the next prompt (the echo removed)."""
        os.write(self.master, (line + "\n").encode())
        text = self.read_until("\n> ")
        # the terminal echoes every line typed at once, before the continued line's ". "
        return text.removeprefix(line + "\n").removeprefix(". ").removesuffix("\n> ")

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


FIGURES = re.compile(r"\n\[(\d+) tokens(?:, ([\d.]+) tokens/s)?\]$")


def reply_and_figures(printed: str) -> tuple[str, int, float | None]:
    """A reply as printed, its count of tokens and its tokens/s (the line under it)."""
    m = FIGURES.search(printed)
    assert m, printed
    return printed[: m.start()], int(m[1]), m[2] and float(m[2])


def counted(chat: Chat, message: str) -> tuple[str, int]:
    """The reference: Chat's reply and the number of tokens it generated."""
    tokens = []
    return chat.reply(message, on_token=tokens.append), len(tokens)


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
    assert reply_and_figures(first)[0] == chat.reply("hello cat")
    assert reply_and_figures(second)[0] == chat.reply("the dog")
    assert cleared == "(conversation cleared)"
    assert reply_and_figures(again)[0] == reply_and_figures(first)[0]


@pytest.fixture
def chat(ckpt):
    loaded = open_checkpoint(ckpt)
    return Chat(loaded.model, loaded.tokenizer, "be brief", GREEDY)


def test_undo_system_and_load_keep_openai_messages(chat):
    first = chat.reply("hello cat")
    chat.reply("the dog")
    assert chat.undo() == "the dog"
    history = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello cat"},
        {"role": "assistant", "content": first.strip()},
    ]
    assert chat.history == history
    chat.set_system("be long")
    assert chat.history == [{"role": "system", "content": "be long"}, *history[1:]]
    chat.set_system(None)
    assert chat.history == history[1:] and chat.system is None
    chat.load(history)
    assert chat.history == history and chat.system == "be brief"
    assert chat.undo() == "hello cat" and chat.undo() is None
    with pytest.raises(ValueError, match="message 1 is not"):
        chat.load([history[1], {"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="message 1: a system message comes first"):
        chat.load([history[1], history[0]])


def test_the_commands(chat, tmp_path, monkeypatch):
    chat.reply("hello cat")
    saved = tmp_path / "chat.json"
    assert command(chat, f"/save {saved}") == f"(saved 3 messages to {saved})"
    assert json.loads(saved.read_text()) == chat.history
    assert command(chat, "/set temperature 0.7") == "(temperature 0.7)"
    assert chat.config.sampling.temperature == 0.7
    assert command(chat, "/set top_k none") == "(top_k none)" and chat.config.sampling.top_k is None
    command(chat, "/set max_new_tokens 3")
    assert chat.config.max_new_tokens == 3 and chat.config.stop_tokens == GREEDY.stop_tokens + (
        chat.stop_tokens
    )  # the end of turn stays a stop token
    assert command(chat, "/set").startswith("temperature 0.7")
    for line, error in [
        ("/set top_p 2", "top_p must be in (0, 1], got 2.0"),
        ("/set temperature warm", "cannot read 'warm'"),
        ("/set colour blue", "use /set NAME VALUE, NAME one of"),
        ("/set max_new_tokens 0", "max_new_tokens must be >= 1"),
        ("/load", "/load needs a file name"),
        ("/frobnicate", "unknown command '/frobnicate': /help lists them"),
    ]:
        with pytest.raises(ValueError, match=re.escape(error)):
            command(chat, line)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not JSON"):
        command(chat, f"/load {tmp_path / 'bad.json'}")
    with pytest.raises(OSError):
        command(chat, f"/load {tmp_path / 'missing.json'}")
    (tmp_path / "request.json").write_text(json.dumps({"messages": chat.history[1:]}))
    assert command(chat, f"/load {tmp_path / 'request.json'}") == (
        f"(loaded 2 messages from {tmp_path / 'request.json'})"
    )
    assert chat.system is None
    assert "/retry" in command(chat, "/help")


def test_ctrl_c_stops_a_reply_and_leaves_the_turn_out(chat, monkeypatch, capsys):
    chat.reply("hello cat")
    before = list(chat.history)

    def interrupted(model, tokenizer, prompt, config, on_text, **kw):
        on_text("half a")
        raise KeyboardInterrupt

    monkeypatch.setattr("attnlab.inference.chat.generate_text", interrupted)
    reply(chat, "the dog")
    assert (
        capsys.readouterr().out == "half a\n(stopped: this turn is left out of the conversation)\n"
    )
    assert chat.history == before


def test_multi_line_messages(monkeypatch):
    def typed(lines):
        it = iter(lines)
        monkeypatch.setattr(builtins, "input", lambda prompt="": next(it))
        return read_message()

    assert typed(["one line"]) == "one line"
    assert typed(["first \\", "second\\", "third"]) == "first \nsecond\nthird"
    assert typed(['"""', "def f():", "    return 1", '"""']) == "def f():\n    return 1"
    assert typed(['"""a', "b", 'c"""']) == "a\nb\nc"
    assert typed(['"""one line"""']) == '"""one line"""'  # opened and closed: as typed


@pytest.mark.slow
def test_the_commands_in_a_terminal(ckpt, tmp_path):
    """/system, a message of two lines, /retry, /save, /undo, /set, /load and --load through
    a pty, each reply equal to Chat's on the same conversation, with its count of tokens."""
    saved = tmp_path / "chat.json"
    typed = [
        "/system be brief",
        "hello cat",
        "/retry",
        "the dog\\\nand the mat",
        f"/save {saved}",
        "/undo",
        "/set top_p 2",
        f"/load {saved}",
        "more",
    ]
    flags = ["--temperature", "0", "--max-new-tokens", "6"]
    out = chat_through_a_terminal(ckpt, typed, flags)
    loaded = open_checkpoint(ckpt)
    chat = Chat(loaded.model, loaded.tokenizer, "be brief", GREEDY)
    assert out[0] == "(system message: 'be brief')"
    first, n = counted(chat, "hello cat")
    for printed in out[1:3]:  # the reply, and /retry's (greedy: the same)
        text, tokens, speed = reply_and_figures(printed)
        assert (text, tokens) == (first, n) and (speed is None or speed > 0)
    second, n = counted(chat, "the dog\nand the mat")
    assert reply_and_figures(out[3])[:2] == (second, n)
    assert out[4] == f"(saved 5 messages to {saved})"
    assert json.loads(saved.read_text()) == chat.history
    assert out[5] == "(forgot the turn 'the dog\\nand the mat' and its reply)"
    assert out[6] == "error: top_p must be in (0, 1], got 2.0"
    assert out[7] == f"(loaded 5 messages from {saved})"
    third, n = counted(chat, "more")
    assert reply_and_figures(out[8])[:2] == (third, n)

    again = chat_through_a_terminal(ckpt, ["more"], [*flags, "--load", str(saved)])
    assert reply_and_figures(again[0])[0] == third
