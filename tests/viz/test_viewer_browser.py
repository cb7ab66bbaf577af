"""The attention viewer in a real headless Chromium (Debian's, driven by Playwright).

Picks every attention kind and a few layer/head pairs, hovers query and key tokens, and reads the
printed weights and the highlight intensity back from the DOM: they must equal the captured
probabilities to the printed precision, and the shade must be proportional to the weight. The
page must load without console errors and request nothing but itself.

The browser: /usr/bin/chromium, installed by scripts/install-browser.sh when missing (root and
apt needed); `playwright install` is never run. Without a browser or Playwright the test skips.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.viz.attention_maps import run_attention
from attnlab.viz.viewer import DIGITS, write_viewer

CHROMIUM = Path("/usr/bin/chromium")
INSTALL = Path(__file__).resolve().parents[2] / "scripts" / "install-browser.sh"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PRINTED = 0.5 * 10**-DIGITS + 1e-6  # a value printed with DIGITS decimals is this close


def find_browser() -> Path | None:
    """/usr/bin/chromium, after running the install script once if it is missing."""
    if not CHROMIUM.is_file() and INSTALL.is_file() and shutil.which("apt-get"):
        if os.geteuid() == 0 or shutil.which("sudo"):
            subprocess.run(["bash", str(INSTALL)], capture_output=True, timeout=900)
    return CHROMIUM if CHROMIUM.is_file() else None


@pytest.fixture(scope="module")
def browser_page(tmp_path_factory):
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="Playwright is not installed (pip install -e '.[dev]')"
    )
    browser = find_browser()
    if browser is None:
        pytest.skip(
            f"no Chromium at {CHROMIUM} and {INSTALL.name} could not install one "
            "(it needs root and Debian's apt); the page was not tested in a browser"
        )
    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh --user-data-dir
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=str(browser), headless=True, args=FLAGS
        )
        try:
            yield context.new_page()
        finally:
            context.close()


@pytest.fixture(scope="module")
def viewer(tmp_path_factory):
    """A viewer of a tiny encoder-decoder: encoder self, decoder self (causal) and cross."""
    torch.manual_seed(0)
    model = build_model(get_preset("transformer-tiny")).eval()
    src_text, tgt_text = "attend to me", "sure"
    src = torch.tensor([[ord(c) for c in src_text]])
    tgt = torch.tensor([[ord(c) for c in tgt_text]])
    maps = run_attention(model, src, tgt)
    s, t = list(src_text), list(tgt_text)
    tokens = {"encoder_self": (s, s), "decoder_self": (t, t), "cross": (t, s)}
    path = write_viewer(maps, tokens, tmp_path_factory.mktemp("viewer") / "attention.html")
    return path, maps, tokens


READ_TOKENS = """els => els.map(e => [e.querySelector('.val').textContent,
                                      getComputedStyle(e).backgroundColor])"""


def alpha(css_color: str) -> float:
    """The alpha of 'rgba(r, g, b, a)' (1 for 'rgb(...)')."""
    parts = re.findall(r"[\d.]+", css_color)
    return float(parts[3]) if len(parts) == 4 else 1.0


def check_highlight(page, selector: str, expected: torch.Tensor) -> None:
    """Printed values equal `expected` to the printed precision; shade = weight / max."""
    cells = page.eval_on_selector_all(selector, READ_TOKENS)
    assert len(cells) == len(expected)
    peak = float(expected.max())
    for (text, color), w in zip(cells, expected.tolist()):
        assert abs(float(text) - w) <= PRINTED, (text, w)
        assert alpha(color) == pytest.approx(w / peak if w > 0 else 0.0, abs=0.01), (color, w)


@pytest.mark.slow
def test_viewer_shows_the_captured_weights(browser_page, viewer):
    path, maps, tokens = viewer
    page = browser_page
    errors, requests = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri())
    page.wait_for_selector("#q-0")
    assert page.title() == "attention"
    assert [o for o in page.eval_on_selector_all("#kind option", "os => os.map(o => o.value)")] == [
        "encoder_self",
        "decoder_self",
        "cross",
    ]

    for kind, picks in {
        "encoder_self": [(0, 0), (1, 3)],
        "decoder_self": [(1, 2)],
        "cross": [(0, 1), (1, 0)],
    }.items():
        page.select_option("#kind", kind)
        q_tokens, k_tokens = tokens[kind]
        assert page.eval_on_selector_all("#keys .tok", "els => els.length") == len(k_tokens)
        for layer, head in picks:
            page.select_option("#layer", str(layer))
            page.select_option("#head", str(head))
            w = maps[kind][layer][0, head]  # (T, S)
            rows = page.eval_on_selector_all("#matrix tr", "rs => rs.map(r => r.cells.length)")
            assert rows == [len(k_tokens)] * len(q_tokens)
            for i in sorted({0, len(q_tokens) // 2, len(q_tokens) - 1}):
                page.hover(f"#q-{i}")  # what query i attends to
                check_highlight(page, "#keys .tok", w[i])
                assert f"query {i}" in page.text_content("#info")
            page.hover("#k-0")  # who attends to key 0
            check_highlight(page, "#queries .tok", w[:, 0])

    # Causal: a decoder query prints exactly 0 for every future key.
    page.select_option("#kind", "decoder_self")
    page.select_option("#layer", "0")
    page.select_option("#head", "0")
    page.hover("#q-1")
    values = page.eval_on_selector_all("#keys .tok .val", "vs => vs.map(v => v.textContent)")
    assert values[2:] == [f"{0:.{DIGITS}f}"] * (len(values) - 2)

    # A click pins the highlight: it stays when the mouse leaves.
    page.click("#q-2")
    page.hover("#title")
    check_highlight(page, "#keys .tok", maps["decoder_self"][0][0, 0][2])
    page.click("#q-2")  # unpin
    page.hover("#title")
    assert (
        page.eval_on_selector_all("#keys .tok .val", "vs => vs.map(v => v.textContent)") == [""] * 4
    )

    assert errors == []
    assert requests == [path.as_uri()]  # the page fetched nothing but itself
