"""`attnlab serve` as its own process: SIGTERM lets the request in flight finish, then the
server exits 0."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from attnlab.serve.sequential import SequentialEngine
from tests.serve.server_helpers import engines, write_checkpoint

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def start(ckpt: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`python -m attnlab serve` on a free port; returns the process and its base URL."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "attnlab",
            "--threads",
            "1",
            "serve",
            "--ckpt",
            str(ckpt),
            "--port",
            "0",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()  # "attnlab serve: NAME on http://127.0.0.1:PORT/v1 (Engine)"
    if " on http://" not in line:
        proc.kill()
        raise AssertionError(f"the server did not start: {line}{proc.stderr.read()}")
    return proc, line.split(" on ", 1)[1].split("/v1")[0]


class Stream:
    """A streaming completion read on a thread of its own: its `data:` payloads (`chunks`),
    `first` set at the first, and the HTTP error that cut it at the connection, if any."""

    def __init__(self, url: str, body: dict):
        self.chunks, self.first, self.errors = [], threading.Event(), []
        self.thread = threading.Thread(target=self._read, args=(url, body))
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.chunks.append(line[6:])
                        self.first.set()
        except httpx.HTTPError as e:
            self.errors.append(e)


@pytest.mark.parametrize(
    "engine", ["sequential" if e is SequentialEngine else "batched" for e in engines()]
)
def test_sigterm_finishes_the_request_in_flight_and_exits_0(tmp_path, engine):
    ckpt = write_checkpoint(tmp_path / "tiny")
    proc, url = start(ckpt, "--engine", engine, "--stop-timeout", "60")
    try:
        body = {
            "model": "tiny",
            "prompt": "the cat",
            "max_tokens": 100,
            "temperature": 0,
            "stream": True,
        }
        stream = Stream(url, body)
        assert stream.first.wait(60), "no first token"
        proc.send_signal(signal.SIGTERM)
        stream.thread.join(60)
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not stream.errors and stream.chunks[-1] == "[DONE]", stream.errors
    events = [json.loads(c) for c in stream.chunks[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # ran to the end, not cut
    out = proc.stdout.read()
    assert "attnlab serve: stopped" in out
    if engine == "batched":  # the start-up line that says what the KV pool holds
        assert re.search(r"KV pool of [\d,]+ tokens \([\d,]+ MiB, torch.float32", out), out
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


@pytest.mark.parametrize(
    "engine", ["sequential" if e is SequentialEngine else "batched" for e in engines()]
)
def test_sigterm_past_the_stop_timeout_ends_streams_with_an_error_chunk_and_done(tmp_path, engine):
    """A stream that outlives --stop-timeout ends with the 503-style error chunk and [DONE],
    not cut at the connection, and no traceback reaches stderr (issue 31)."""
    ckpt = write_checkpoint(tmp_path / "tiny")
    proc, url = start(ckpt, "--engine", engine, "--stop-timeout", "1", "--max-context", "4096")
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 4000, "stream": True}
    body |= {"temperature": 0, "stop_token_ids": []}
    try:
        stream = Stream(url, body)
        assert stream.first.wait(60), "no first token"
        proc.send_signal(signal.SIGTERM)
        stream.thread.join(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert not stream.errors and stream.chunks[-1] == "[DONE]", (stream.errors, stream.chunks[-3:])
    last = json.loads(stream.chunks[-2])
    assert "error" in last and "stopping" in last["error"]["message"], last
    assert "Traceback" not in stderr, stderr


@pytest.mark.parametrize(
    "engine", ["sequential" if e is SequentialEngine else "batched" for e in engines()]
)
def test_sigterm_answers_503_after_the_signal_and_exits_within_the_stop_timeout(tmp_path, engine):
    """After SIGTERM every request gets a 503, even on a keep-alive connection and before
    uvicorn's next tick; and a client that never finishes its request (a body half sent) holds
    the exit no longer than --stop-timeout + 2 s, with no traceback (issue "Found from
    outside", 14)."""
    stop = 2.0
    ckpt = write_checkpoint(tmp_path / "tiny")
    proc, url = start(
        ckpt, "--engine", engine, "--stop-timeout", str(stop), "--max-context", "4096"
    )
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 4000, "stream": True}
    body |= {"temperature": 0, "stop_token_ids": []}
    small = {"model": "tiny", "prompt": "the cat", "max_tokens": 2, "temperature": 0}
    statuses = []

    try:
        client = httpx.Client(timeout=30)  # one keep-alive connection
        assert client.post(f"{url}/v1/completions", json=small).status_code == 200
        host, port = url.removeprefix("http://").split(":")
        half = socket.create_connection((host, int(port)))  # a body that never arrives whole
        half.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        stream = Stream(url, body)
        assert stream.first.wait(60), "no first token"
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        statuses.append(client.post(f"{url}/v1/completions", json=small).status_code)
        while time.monotonic() - signalled < stop:  # fresh connections, until the port closes
            try:
                statuses.append(httpx.post(f"{url}/v1/completions", json=small).status_code)
            except httpx.TransportError:  # refused, or reset in the closed socket's backlog
                break
            time.sleep(0.05)
        proc.wait(30)
        took = time.monotonic() - signalled
        stream.thread.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert set(statuses) == {503}, statuses
    assert took < stop + 2, f"exited {took:.1f} s after SIGTERM (--stop-timeout {stop})"
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr
    assert not stream.errors and stream.chunks[-1] == "[DONE]", stream.errors
    assert "stopping" in json.loads(stream.chunks[-2])["error"]["message"]


def test_serve_steer_completes_what_generate_steer_generates(tmp_path, capsys):
    """`attnlab serve --steer` (its default engine) steers every request as `attnlab generate
    --steer` does (greedy), and the steering changes the text (else the comparison would hold
    unsteered too)."""
    from attnlab.cli.__main__ import main

    ckpt = write_checkpoint(tmp_path / "tiny")
    steer = ["--steer", "0", "the cat", "a dog", "30"]
    flags = ["--ckpt", str(ckpt), "--prompt", "the cat", "--max-new-tokens", "12"]
    expected = []
    for extra in (steer, []):
        assert main(["generate", *flags, "--temperature", "0", *extra]) == 0
        expected.append(capsys.readouterr().out)
    assert expected[0] != expected[1]
    proc, url = start(ckpt, *steer)
    try:
        body = {"model": "tiny", "prompt": "the cat", "max_tokens": 12, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    finally:
        proc.kill()
    assert "the cat" + reply["choices"][0]["text"] + "\n" == expected[0]


def test_the_server_does_not_import_the_plotting_libraries():
    """The attention button's data need no figures: a server holds no matplotlib or PIL (about
    0.5 s of start-up and their memory in every serving process)."""
    code = "import sys, attnlab.cli.serve; print(sorted({'matplotlib', 'PIL'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
