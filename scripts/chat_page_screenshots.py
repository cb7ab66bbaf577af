"""The chat page's screenshots in docs/serving/: `attnlab serve` on SmolLM2-135M-Instruct, two
conversations typed into the page in headless Chromium (greedy), a wide and a phone-width window.

    python scripts/chat_page_screenshots.py [--ckpt DIR]   # default: attnlab download's copy

Everything runs on 127.0.0.1; the browser is /usr/bin/chromium (scripts/install-browser.sh).
"""

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "serving"
MODEL = Path.home() / ".cache/attnlab/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
TURNS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server at {url} did not start") from None
            time.sleep(0.5)


def ask(page, text: str) -> None:
    n = page.eval_on_selector_all("#log .assistant[data-state=done]", "e => e.length")
    page.fill("#input", text)
    page.press("#input", "Enter")
    done = "#log .assistant[data-state=done]"
    page.wait_for_function(f"document.querySelectorAll('{done}').length > {n}", timeout=300000)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default=str(MODEL))
    args = p.parse_args()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "attnlab", "serve", "--ckpt", args.ckpt, "--port", str(port)]
    server = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url + "/health", server)
        OUT.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)
            page = browser.new_page(viewport={"width": 1100, "height": 760})
            page.goto(url + "/")
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "200")
            ask(page, TURNS[0])
            page.click("#new")
            ask(page, TURNS[1])
            page.screenshot(path=str(OUT / "chat_page_wide.png"))
            page.set_viewport_size({"width": 390, "height": 760})
            page.screenshot(path=str(OUT / "chat_page_narrow.png"))
            figures = page.eval_on_selector(
                "#log .assistant:last-child .meta", "e => e.textContent"
            )
            print(f"the last reply's figures: {figures}")
            browser.close()
    finally:
        server.terminate()
        server.wait(60)
    print(f"wrote {OUT / 'chat_page_wide.png'} and {OUT / 'chat_page_narrow.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
