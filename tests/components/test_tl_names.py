"""components/tl_names.py against TransformerLens itself: every hook point TransformerLens'
TransformerBridge defines on a tiny GPT-2 and a tiny Llama (GQA, RoPE), read through attnlab's
run_with_cache under the same name, on the same weights (attnlab's model exported with
save_hf and opened offline by the bridge). Every parameter is drawn at random first, so that a
norm's weight or a bias that starts at one or zero cannot hide a point taken on the wrong side.

The table of docs/hooks.md is this test's output: `ATTNLAB_WRITE_DOCS=1 pytest ...` writes it,
a plain run checks that the page holds what the run found."""

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attnlab.components.hooks import run_with_cache, run_with_hooks, tl_points
from attnlab.components.tl_names import get_act_name
from attnlab.interop.hf import save_hf
from attnlab.models.presets import get_preset
from tests.hf_tokenizer_files import bert_files, gpt2_files, t5_files
from tests.lab.helpers import tiny_lm

T = pytest.importorskip("transformers")
tl_utils = pytest.importorskip("transformer_lens.utilities")
pytestmark = [pytest.mark.hf, pytest.mark.slow]

IDS = torch.tensor([[5, 17, 30, 44, 9, 12, 3, 60], [7, 1, 99, 23, 54, 8, 2, 41]])
TOL = 1e-5
DOC = Path(__file__).parents[2] / "docs" / "hooks.md"
FAMILIES = {
    "gpt2-tiny": "GPT2LMHeadModel",
    "llama-tiny": "LlamaForCausalLM",
    "bert-tiny": "BertForMaskedLM",
}
ENCODER_DECODER = {"t5-tiny": "T5ForConditionalGeneration"}  # its own table: other names
DECODER_IDS = torch.tensor([[0, 5, 6, 9], [0, 7, 3, 2]])
# TransformerBridge's switches that make its optional points fire (each off by default):
# per-head results, per-head copies of the residual stream for q/k/v (or for attention as a
# whole: the two cannot be on together), the FFN's input. With split inputs on, the plain
# q/k/v inputs do not fire, hence a run with every switch off as well.
RUNS = [
    (),
    ("set_use_attn_result", "set_use_split_qkv_input", "set_use_hook_mlp_in"),
    ("set_use_attn_in",),
]


def _randomise(model: torch.nn.Module) -> None:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            one = p.dim() == 1 and bool(p.mean() == 1)  # a norm's weight
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.05) + one)


def _pair(preset: str, tmp: Path):
    from transformer_lens.model_bridge import TransformerBridge

    model = tiny_lm(preset, n_layers=2)
    _randomise(model)
    save_hf(model, replace(get_preset(preset), n_layers=2), tmp)
    tokenizer = {"bert-tiny": bert_files, "t5-tiny": t5_files}.get(preset, gpt2_files)
    tokenizer(tmp)  # a tokenizer for the bridge to load (the ids are given directly)
    cls = getattr(T, {**FAMILIES, **ENCODER_DECODER}[preset])
    hf = cls.from_pretrained(tmp, attn_implementation="eager").eval()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        bridge = TransformerBridge.boot_transformers(str(tmp), hf_model=hf)
    return model, bridge


def _differ(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b|; scores compare where both are finite (masked: attnlab -inf, the bridge
    float32's lowest), and the masked entries must match."""
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return float("inf")
    masked = (~torch.isfinite(a)) | (a < -1e30)
    if masked.any():
        if not torch.equal(masked, b < -1e30):
            return float("inf")
        a, b = a[~masked], b[~masked]
    return (a - b).abs().max().item() if a.numel() else 0.0


def _t5_norm(ours, theirs, name):
    """TransformerBridge 4.3's T5 norms show LayerNorm's statistics (the centred input) at
    hook_scale / hook_normalized, though T5's norm is an RMSNorm (its hook_out is right): the
    check is that the bridge's value is that formula on its own input; attnlab's points hold
    the RMS ones (tests/components/test_hooks.py)."""
    x = theirs[name.rsplit(".", 1)[0] + ".hook_in"]
    centred = x - x.mean(-1, keepdim=True)
    scale = (centred.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    return _differ(scale if name.endswith("scale") else centred / scale, theirs[name])


# Where TransformerBridge 4.3 shows something else than its name says: (the table's note, the
# check). BERT's attention (its generic AttentionBridge) shows the softmaxed pattern at
# hook_attn_scores; attnlab's scores are checked there through their softmax.
QUIRKS = {
    "bert-tiny": {
        "attn.hook_attn_scores": (
            "TL shows the pattern: compared after softmax",
            lambda ours, theirs, name: _differ(ours.softmax(-1), theirs[name]),
        )
    },
    "t5-tiny": {
        **{
            end: ("TL shows LayerNorm's statistic of an RMSNorm: TL checked against that", _t5_norm)
            for end in ("hook_scale", "hook_normalized")
        },
        "self_attn.hook_attn_scores": (
            "TL shows the scores before the causal mask: compared where attnlab's are finite",
            lambda ours, theirs, name: (ours - theirs[name])[ours.isfinite()].abs().max().item(),
        ),
    },
}


def _compare(model, bridge, preset) -> dict[str, tuple[str, float, str]]:
    """{TL name: (attnlab point, max|diff|, shape)} over every name the bridge defines; a name
    that never fires in the bridge has diff None."""
    aliases = tl_points(model)
    enc_dec = preset in ENCODER_DECODER
    theirs = {}
    for switches in RUNS:
        try:
            for s in switches:
                getattr(bridge, s)(True)
        except NotImplementedError:  # BERT's and T5's attention bridges have none of them
            continue
        kw = dict(decoder_input=DECODER_IDS) if enc_dec else {}
        _, cache = bridge.run_with_cache(IDS, **kw)
        theirs.update({k: v for k, v in cache.items()})
        for s in switches:
            getattr(bridge, s)(False)
    inputs = (IDS, DECODER_IDS) if enc_dec else (IDS,)
    _, ours = run_with_cache(model, *inputs, names=list(aliases))
    rows = {}
    for name in bridge.hook_dict:
        point = aliases[name].point if name in aliases else None
        if name not in theirs:
            rows[name] = (point, None, "")
            continue
        quirk = [check for end, (_, check) in QUIRKS.get(preset, {}).items() if name.endswith(end)]
        if name not in ours:
            diff = float("inf")
        elif quirk:
            diff = quirk[0](ours[name], theirs, name)
        else:
            diff = _differ(ours[name], theirs[name])
        rows[name] = (point, diff, tuple(theirs[name].shape))
    return rows


@pytest.fixture(scope="module", params=list(FAMILIES))
def compared(request, tmp_path_factory):
    model, bridge = _pair(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, model, bridge, _compare(model, bridge, request.param)


def test_every_transformer_lens_point_is_there_and_equal(compared):
    preset, _, _, rows = compared
    fired = {n: r for n, r in rows.items() if r[1] is not None}
    assert len(fired) > 40
    wrong = {n: r for n, r in fired.items() if r[0] is None or not r[1] <= TOL}
    assert not wrong, wrong


def test_pre_and_post_rotation_queries(compared):
    """RoPE: attn.hook_q before the rotation, hook_rot_q after; they differ (so each is the
    one it claims to be)."""
    preset, model, _, rows = compared
    if preset != "llama-tiny":
        pytest.skip("GPT-2 has no rotation")
    _, ours = run_with_cache(model, IDS, names=["blocks.0.attn.hook_q", "blocks.0.attn.hook_rot_q"])
    assert (ours["blocks.0.attn.hook_q"] - ours["blocks.0.attn.hook_rot_q"]).abs().max() > 0.1
    for name in ("hook_q", "hook_rot_q", "hook_k", "hook_rot_k"):
        assert rows[f"blocks.1.attn.{name}"][1] <= TOL


def test_edits_through_transformer_lens_names_match(compared):
    """A hook written for TransformerLens (B, T, H, D) edits the same activation in both."""
    _, model, bridge, _ = compared

    def zero_head(z, hook):
        z = z.clone()
        z[:, :, 1] = 0.0  # head 1, every position, TransformerLens' axis order
        return z

    def scale_post(x, hook):
        return x * 0.5

    fwd = [(get_act_name("z", 0), zero_head), (get_act_name("post", 1), scale_post)]
    ref = bridge.run_with_hooks(IDS, fwd_hooks=fwd)
    ours = run_with_hooks(model, IDS, fwd_hooks=fwd)
    assert (ours - ref).abs().max() < TOL
    assert (ours - model(IDS)).abs().max() > 1e-3


def test_read_only_views_refuse_edits(compared):
    _, model, _, _ = compared
    with pytest.raises(ValueError, match="read-only.*blocks.0.attn.hook_in"):
        run_with_hooks(model, IDS, fwd_hooks=[("blocks.0.hook_q_input", lambda x, h: x * 2)])


def test_get_act_name_is_transformer_lens():
    cases = [("k", 6, "a"), ("pre", 2), ("embed",), ("normalized", 27, "ln2"), ("k6",)]
    cases += [("scale4ln1",), ("pre5",), ("pattern", 0), ("attn", 1), ("resid_mid", 3)]
    cases += [("scale",), ("rot_q", 2), ("result", 1), ("blocks.0.hook_resid_pre",)]
    for case in cases:
        assert get_act_name(*case) == tl_utils.get_act_name(*case), case


def _table(results: dict[str, dict]) -> str:
    """The coverage table of docs/hooks.md: every name of the model and of block 0."""
    heads = " | ".join(f"{p.removesuffix('-tiny')} max\\|diff\\|" for p in results)
    lines = [
        f"| TransformerLens name | attnlab point | {heads} |",
        "|---|---|" + "---|" * len(results),
    ]
    names = []
    for rows in results.values():
        names += [n for n in rows if n not in names and "blocks.1." not in n]

    def cell(preset, rows, n):
        if n not in rows:
            return "not in TL"
        if rows[n][1] is None:
            return "TL never fires it"
        notes = [note for end, (note, _) in QUIRKS.get(preset, {}).items() if n.endswith(end)]
        return f"{rows[n][1]:.1e}" + (f" ({notes[0]})" if notes else "")

    for n in names:
        found = [r[n][0] for r in results.values() if n in r and r[n][0]]
        point = " / ".join(f"`{x}`" for x in dict.fromkeys(found)) or "-"
        lines.append(
            f"| `{n}` | {point} | " + " | ".join(cell(p, r, n) for p, r in results.items()) + " |"
        )
    return "\n".join(lines) + "\n"


def _write_or_check(marker: str, table: str) -> None:
    """docs/hooks.md's table between its `marker` comments: written with ATTNLAB_WRITE_DOCS=1,
    checked otherwise."""
    begin, end = f"<!-- {marker} begin -->\n", f"<!-- {marker} end -->"
    page = DOC.read_text()
    if os.environ.get("ATTNLAB_WRITE_DOCS"):
        head, rest = page.split(begin) if begin in page else (page + "\n", end + "\n")
        DOC.write_text(head + begin + table + end + rest.split(end, 1)[1])
        page = DOC.read_text()
    assert begin + table + end in page, "docs/hooks.md's table is stale: ATTNLAB_WRITE_DOCS=1"


def test_docs_table(tmp_path_factory):
    results = {}
    for preset in FAMILIES:
        model, bridge = _pair(preset, tmp_path_factory.mktemp(preset))
        results[preset] = _compare(model, bridge, preset)
    _write_or_check("tl-table", _table(results))


def test_t5_every_transformer_lens_point_and_docs_table(tmp_path_factory):
    """T5 (encoder, decoder, cross attention) as the bridge names it: every name that fires is
    there and equal (the bridge's own norm statistics and unmasked decoder scores through
    QUIRKS)."""
    model, bridge = _pair("t5-tiny", tmp_path_factory.mktemp("t5"))
    rows = _compare(model, bridge, "t5-tiny")
    fired = {n: r for n, r in rows.items() if r[1] is not None}
    assert len(fired) > 150
    wrong = {n: r for n, r in fired.items() if (r[0] is None or not r[1] <= TOL)}
    assert not wrong, wrong
    _write_or_check("tl-t5-table", _table({"t5-tiny": rows}))
