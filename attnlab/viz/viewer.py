"""An interactive attention viewer: one self-contained HTML file, no network at all.

The captured probabilities are embedded as JSON in the page; the CSS and JavaScript are inline.
Pick the attention kind (encoder self / decoder self / cross), a layer and a head; hover a query
token to shade the keys it attends to (shade proportional to the weight, darkest = the row's
largest) with each weight printed; hover a key to see which queries attend to it; click a token
to pin it. A heatmap of the whole head sits alongside, hoverable cell by cell.

    write_viewer(maps, {"decoder_self": (tokens, tokens)}, "attention.html")
"""

import html
import json
from pathlib import Path

from attnlab.viz.capture import AttentionMaps, display_token

DIGITS = 3  # decimals printed in the page
STORED_DIGITS = 6  # decimals kept in the embedded JSON (so the printed rounding is the true one)

KIND_LABELS = {
    "encoder_self": "encoder self-attention",
    "decoder_self": "decoder self-attention (causal)",
    "cross": "cross-attention (decoder -> encoder)",
}


def viewer_data(
    maps: AttentionMaps,
    tokens: dict[str, tuple[list[str], list[str]]],
    batch: int = 0,
    title: str = "attention",
) -> dict:
    """The JSON the page embeds.

    Args:
        maps: from `capture_attention` / `run_attention`.
        tokens: {kind: (query tokens, key tokens)} for every captured kind.
        batch: which batch row to show.

    Returns:
        {"title", "digits", "kinds": {kind: {"label", "q_tokens", "k_tokens", "layers", "heads",
        "weights": [layer][head][query][key]}}}.
    """
    kinds = {}
    for kind in maps.kinds:
        if kind not in tokens:
            raise ValueError(f"no tokens given for {kind!r}; got tokens for {list(tokens)}")
        q_tokens, k_tokens = tokens[kind]
        layers = sorted(maps[kind])
        w = [maps[kind][i][batch].float().cpu() for i in layers]  # each (H, T, S)
        H, T, S = w[0].shape
        if (len(q_tokens), len(k_tokens)) != (T, S):
            raise ValueError(
                f"{kind}: {len(q_tokens)} x {len(k_tokens)} tokens for maps of {T} x {S}"
            )
        kinds[kind] = {
            "label": KIND_LABELS.get(kind, kind),
            "q_tokens": [display_token(t) for t in q_tokens],
            "k_tokens": [display_token(t) for t in k_tokens],
            "layers": layers,
            "heads": list(range(H)) if maps.heads is None else list(maps.heads),
            "weights": [x.double().round(decimals=STORED_DIGITS).tolist() for x in w],
        }
    return {"title": title, "digits": DIGITS, "kinds": kinds}


def viewer_html(data: dict) -> str:
    """The complete page for `viewer_data(...)`: inline CSS, JS and JSON; nothing fetched."""
    # "</" could close the <script> element early; "<\/" is the same string to JSON.
    payload = json.dumps(data, ensure_ascii=True, separators=(",", ":")).replace("</", "<\\/")
    title = html.escape(data["title"])
    return (
        _PAGE.replace("__TITLE__", title)
        .replace("__STYLE__", _STYLE)
        .replace("__SCRIPT__", _SCRIPT)
        .replace("__DATA__", payload)
    )


def write_viewer(
    maps: AttentionMaps,
    tokens: dict[str, tuple[list[str], list[str]]],
    out: str | Path,
    batch: int = 0,
    title: str = "attention",
) -> Path:
    """Write the viewer page for `maps` to `out` (an .html file); returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(viewer_html(viewer_data(maps, tokens, batch, title)), encoding="utf-8")
    return out


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy"
      content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>__TITLE__</title>
<style>__STYLE__</style>
</head>
<body>
<h1 id="title"></h1>
<div id="controls">
  <label>attention <select id="kind"></select></label>
  <label>layer <select id="layer"></select></label>
  <label>head <select id="head"></select></label>
</div>
<p id="info">Hover a query (left) to see what it attends to, a key (right) to see who attends
to it; click to pin. Shade is proportional to the weight (darkest = the largest in view).</p>
<div id="main">
  <div class="col"><div class="colhead">queries</div><div id="queries"></div></div>
  <div class="col"><div class="colhead">keys</div><div id="keys"></div></div>
  <div id="matrix-wrap"><div class="colhead">this head (rows: queries)</div>
    <table id="matrix"></table></div>
</div>
<script type="application/json" id="attn-data">__DATA__</script>
<script>__SCRIPT__</script>
</body>
</html>
"""

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.2em; color: #1a202c; }
h1 { font-size: 1.25em; margin: 0 0 .6em; }
#controls label { margin-right: 1.2em; }
#info { color: #4a5568; min-height: 2.8em; }
#main { display: flex; gap: 2em; align-items: flex-start; }
.col { min-width: 9em; }
.colhead { font-weight: 600; margin-bottom: .3em; color: #4a5568; }
.tok { display: flex; justify-content: space-between; gap: 1em; padding: 1px 6px;
       border-radius: 3px; cursor: pointer; font-family: ui-monospace, monospace; }
.tok .idx { color: #a0aec0; width: 2em; }
.tok .t { flex: 1; white-space: pre; }
.tok .val { min-width: 3.5em; text-align: right; }
.tok.active { outline: 2px solid #dd6b20; }
.tok.pinned { outline: 2px solid #c53030; }
#matrix { border-collapse: collapse; }
#matrix td { width: 12px; height: 12px; padding: 0; border: 1px solid #fff; }
#matrix tr.active { outline: 2px solid #dd6b20; }
"""

_SCRIPT = r"""
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("attn-data").textContent);
  var el = function (id) { return document.getElementById(id); };
  var state = { kind: null, layer: 0, head: 0, pinned: null };

  function shade(node, alpha) {
    node.style.backgroundColor = alpha > 0 ? "rgba(37, 99, 235, " + alpha + ")" : "";
    node.style.color = alpha > 0.6 ? "#fff" : "";
  }
  function kindData() { return DATA.kinds[state.kind]; }
  function matrix() { return kindData().weights[state.layer][state.head]; }
  function fmt(w) { return w.toFixed(DATA.digits); }

  function fillSelect(select, labels) {
    select.innerHTML = "";
    labels.forEach(function (label, i) {
      var opt = document.createElement("option");
      opt.value = String(i);
      opt.textContent = label;
      select.appendChild(opt);
    });
  }

  function tokenRow(side, i, text) {
    var row = document.createElement("div");
    row.className = "tok " + side;
    row.id = side.charAt(0) + "-" + i;
    row.dataset.index = String(i);
    var idx = document.createElement("span"); idx.className = "idx"; idx.textContent = String(i);
    var t = document.createElement("span"); t.className = "t"; t.textContent = text;
    var val = document.createElement("span"); val.className = "val";
    row.appendChild(idx); row.appendChild(t); row.appendChild(val);
    row.addEventListener("mouseenter", function () { if (state.pinned === null) show(side, i); });
    row.addEventListener("mouseleave", function () { if (state.pinned === null) clear(); });
    row.addEventListener("click", function () { pin(side, i); });
    return row;
  }

  function clear() {
    document.querySelectorAll(".tok").forEach(function (node) {
      shade(node, 0);
      node.classList.remove("active", "pinned");
      node.querySelector(".val").textContent = "";
      node.removeAttribute("data-weight");
    });
    document.querySelectorAll("#matrix tr").forEach(function (tr) {
      tr.classList.remove("active");
    });
    el("info").textContent = "Hover a query (left) or a key (right); click to pin.";
  }

  // side "query": row i of the matrix over the keys; side "key": column i over the queries.
  function show(side, i) {
    clear();
    var W = matrix(), k = kindData();
    var values = side === "query" ? W[i] : W.map(function (row) { return row[i]; });
    var targets = side === "query" ? "#keys .tok" : "#queries .tok";
    var max = Math.max.apply(null, values.concat([1e-12]));
    document.querySelectorAll(targets).forEach(function (node, j) {
      shade(node, values[j] / max);
      node.querySelector(".val").textContent = fmt(values[j]);
      node.dataset.weight = fmt(values[j]);
    });
    var self = el((side === "query" ? "q-" : "k-") + i);
    self.classList.add(state.pinned === null ? "active" : "pinned");
    if (side === "query") { el("matrix").rows[i].classList.add("active"); }
    var tokens = side === "query" ? k.k_tokens : k.q_tokens;
    var order = values.map(function (w, j) { return j; })
      .sort(function (a, b) { return values[b] - values[a]; }).slice(0, 3);
    var top = order.map(function (j) { return "\u201c" + tokens[j] + "\u201d " + fmt(values[j]); });
    var who = side === "query" ? "query" : "key";
    var own = side === "query" ? k.q_tokens[i] : k.k_tokens[i];
    el("info").textContent = who + " " + i + " \u201c" + own + "\u201d" +
      (side === "query" ? " attends most to: " : " is read most by: ") + top.join(", ");
  }

  function pin(side, i) {
    var same = state.pinned && state.pinned.side === side && state.pinned.i === i;
    state.pinned = null;
    if (same) { clear(); return; }
    state.pinned = { side: side, i: i };
    show(side, i);
  }

  function drawMatrix() {
    var W = matrix(), table = el("matrix"), k = kindData();
    var max = Math.max.apply(null, W.map(function (r) { return Math.max.apply(null, r); }));
    table.innerHTML = "";
    W.forEach(function (row, i) {
      var tr = table.insertRow();
      row.forEach(function (w, j) {
        var td = tr.insertCell();
        shade(td, max > 0 ? w / max : 0);
        td.title = "query " + i + " \u201c" + k.q_tokens[i] + "\u201d \u2192 key " + j +
          " \u201c" + k.k_tokens[j] + "\u201d: " + fmt(w);
        td.addEventListener("mouseenter", function () {
          if (state.pinned === null) { show("query", i); }
        });
      });
    });
  }

  function drawTokens() {
    var k = kindData();
    var q = el("queries"), keys = el("keys");
    q.innerHTML = ""; keys.innerHTML = "";
    k.q_tokens.forEach(function (t, i) { q.appendChild(tokenRow("query", i, t)); });
    k.k_tokens.forEach(function (t, j) { keys.appendChild(tokenRow("key", j, t)); });
  }

  function redraw() {
    var pinned = state.pinned;
    drawTokens();
    drawMatrix();
    state.pinned = null;
    clear();
    if (pinned) { pin(pinned.side, pinned.i); }
  }

  function chooseKind(kind) {
    state.kind = kind;
    var k = kindData();
    fillSelect(el("layer"), k.layers.map(function (l) { return "layer " + l; }));
    fillSelect(el("head"), k.heads.map(function (h) { return "head " + h; }));
    state.layer = Math.min(state.layer, k.layers.length - 1);
    state.head = Math.min(state.head, k.heads.length - 1);
    el("layer").value = String(state.layer);
    el("head").value = String(state.head);
    state.pinned = null;
    redraw();
  }

  var kinds = Object.keys(DATA.kinds);
  el("title").textContent = DATA.title;
  fillSelect(el("kind"), kinds.map(function (k) { return DATA.kinds[k].label; }));
  Array.prototype.forEach.call(el("kind").options, function (opt, i) { opt.value = kinds[i]; });
  el("kind").addEventListener("change", function (e) { chooseKind(e.target.value); });
  el("layer").addEventListener("change", function (e) { state.layer = +e.target.value; redraw(); });
  el("head").addEventListener("change", function (e) { state.head = +e.target.value; redraw(); });
  chooseKind(kinds[0]);
})();
"""
