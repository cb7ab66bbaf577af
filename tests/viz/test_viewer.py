"""viz/viewer.py without a browser: the embedded data is the captured maps, and the page is
self-contained (nothing to fetch). tests/viz/test_viewer_browser.py drives it in Chromium."""

import json
import re

import pytest
import torch

from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.viz.attention_maps import run_attention
from attnlab.viz.viewer import STORED_DIGITS, viewer_data, viewer_html, write_viewer


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model = build_model(get_preset("transformer-tiny")).eval()
    src_text, tgt_text = "a <b> c", "xy z"
    src = torch.tensor([[ord(c) for c in src_text]])
    tgt = torch.tensor([[ord(c) for c in tgt_text]])
    maps = run_attention(model, src, tgt)
    s, t = list(src_text), list(tgt_text)
    s[2] = "</script>"  # a token label that would end the data block if left unescaped
    return maps, {"encoder_self": (s, s), "decoder_self": (t, t), "cross": (t, s)}


def embedded(html: str) -> dict:
    match = re.search(r'<script type="application/json" id="attn-data">(.*?)</script>', html, re.S)
    return json.loads(match.group(1))


def test_embedded_data_is_the_captured_probabilities(captured, tmp_path):
    maps, tokens = captured
    path = write_viewer(maps, tokens, tmp_path / "v.html", title="tiny <model>")
    html = path.read_text()
    data = embedded(html)
    assert data == json.loads(json.dumps(viewer_data(maps, tokens, title="tiny <model>")))
    assert list(data["kinds"]) == ["encoder_self", "decoder_self", "cross"]
    cross = data["kinds"]["cross"]
    assert cross["q_tokens"] == ["x", "y", "\u2423", "z"]
    assert cross["layers"] == [0, 1] and cross["heads"] == [0, 1, 2, 3]
    for layer in (0, 1):
        got = torch.tensor(cross["weights"][layer], dtype=torch.float64)  # (H, T, S)
        want = maps["cross"][layer][0].double()
        assert (got - want).abs().max() <= 0.5 * 10**-STORED_DIGITS + 1e-9
    assert "<title>tiny &lt;model&gt;</title>" in html


def test_page_is_self_contained(captured):
    maps, tokens = captured
    html = viewer_html(viewer_data(maps, tokens))
    assert not re.search(r"\b(src|href)\s*=", html)  # no external script, style or image
    assert "http://" not in html and "https://" not in html
    assert "@import" not in html and "url(" not in html
    assert "default-src 'none'" in html  # and the CSP forbids fetching anything anyway
    # The token "</script>" must not end the data block early.
    assert html.count("</script>") == 2


def test_missing_tokens_or_wrong_lengths_are_errors(captured):
    maps, tokens = captured
    with pytest.raises(ValueError, match="cross"):
        viewer_data(maps, {k: v for k, v in tokens.items() if k != "cross"})
    bad = dict(tokens, cross=(tokens["cross"][0][:2], tokens["cross"][1]))
    with pytest.raises(ValueError, match="tokens for maps"):
        viewer_data(maps, bad)
