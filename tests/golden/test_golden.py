"""The core's numbers against stored references, without `transformers` installed.

Each `<family>/` folder holds a tiny `transformers` checkpoint (config.json + model.safetensors),
its inputs and the logits `transformers` computed (expected.safetensors); `formulas.safetensors`
holds position tables from the papers' formulas. `make_golden.py` regenerated all of them; see
its docstring for what each one is and where it comes from.
"""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from attnlab.components.positions.alibi import alibi_slopes
from attnlab.components.positions.rope import rope_angles
from attnlab.components.positions.rope_scaling import RopeScaling, rope_inv_freq
from attnlab.components.positions.sinusoidal import sinusoidal_table
from attnlab.components.positions.t5_bias import relative_position_bucket
from attnlab.interop.hf.auto import load_hf

HERE = Path(__file__).parent
FAMILIES = ("gpt2", "llama", "bert", "t5")
ATOL = 1e-5  # fp32 logits of O(1-10); the same computation in another order differs by ~1e-6


@torch.no_grad()
def logits_and_mask(model: torch.nn.Module, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logits for the stored inputs, and the (B, T) positions to compare (the real tokens)."""
    if "decoder_input_ids" in x:  # T5, unpadded
        out = model(x["input_ids"], x["decoder_input_ids"])
        return out, torch.ones(out.shape[:2], dtype=torch.bool)
    extra = {"token_type_ids": x["token_type_ids"]} if "token_type_ids" in x else {}
    out = model(x["input_ids"], attention_mask=x["attention_mask"], **extra)
    return out, x["attention_mask"]


def load(family: str):
    model, _ = load_hf(HERE / family)
    return model, load_file(str(HERE / family / "expected.safetensors"))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_the_stored_transformers_logits(family):
    model, expected = load(family)
    ours, mask = logits_and_mask(model, expected)
    assert ours.shape == expected["logits"].shape
    assert expected["logits"][mask].abs().max() > 1.0  # a reference worth comparing against
    torch.testing.assert_close(ours[mask], expected["logits"][mask], rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_changed_weight_is_caught(family):
    """The comparison above can fail: nudging one entry of the last layer's weights breaks it."""
    model, expected = load(family)
    name, param = [(n, p) for n, p in model.named_parameters() if p.dim() == 2][-2]
    with torch.no_grad():
        param[0, 0] += 0.05
    ours, mask = logits_and_mask(model, expected)
    diff = (ours[mask] - expected["logits"][mask]).abs().max()
    assert diff > 10 * ATOL, f"changing {name} moved the logits by only {diff:.2e}"


def test_the_golden_files_are_small_and_record_their_sources():
    files = sorted(HERE.rglob("*.safetensors"))
    assert len(files) == 2 * len(FAMILIES) + 1
    assert sum(f.stat().st_size for f in files) < 1_000_000
    with safe_open(str(HERE / "formulas.safetensors"), "pt") as f:
        assert {"torch", "transformers"} <= set(f.metadata())


# --- the papers' formulas --------------------------------------------------------------------
@pytest.fixture(scope="module")
def formulas() -> dict[str, torch.Tensor]:
    return load_file(str(HERE / "formulas.safetensors"))


@pytest.mark.parametrize("d_model", [16, 32])
def test_sinusoidal_table_is_vaswani_et_al(formulas, d_model):
    expected = formulas[f"sinusoidal.{d_model}"]  # (100, d_model) float64
    torch.testing.assert_close(sinusoidal_table(100, d_model).double(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("n_heads", range(1, 17))
def test_alibi_slopes_follow_press_et_al(formulas, n_heads):
    """Powers of two and the rule for the others (3, 5, 6, 7, 9, ... heads)."""
    expected = formulas[f"alibi_slopes.{n_heads}"]
    torch.testing.assert_close(alibi_slopes(n_heads).double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 16)])
def test_t5_buckets(formulas, bidirectional, num_buckets, max_distance):
    relative = formulas["t5_buckets.relative_position"]  # -150 .. 150
    name = f"t5_buckets.{'bi' if bidirectional else 'uni'}.{num_buckets}.{max_distance}"
    ours = relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, formulas[name])


@pytest.mark.parametrize("theta", [10000, 500000])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_frequencies_and_angles_follow_su_et_al(formulas, theta, layout):
    inv_freq, _ = rope_inv_freq(16, float(theta), None)
    torch.testing.assert_close(
        inv_freq.double(), formulas[f"rope.{theta}.inv_freq"], rtol=1e-6, atol=0
    )
    cos, sin = rope_angles(16, 64, float(theta), layout=layout)  # (64, 16) each
    pairs = {
        "half": lambda t: torch.cat((t, t), -1),
        "interleaved": lambda t: t.repeat_interleave(2, -1),
    }
    for ours, ref in ((cos, formulas[f"rope.{theta}.cos"]), (sin, formulas[f"rope.{theta}.sin"])):
        torch.testing.assert_close(ours.double(), pairs[layout](ref), rtol=0, atol=1e-5)


# name -> (our scaling, the current length); the same settings as ROPE_SCALINGS in make_golden.
SCALINGS = {
    "linear": (10000.0, RopeScaling("linear", 4.0, 32), None),
    "dynamic": (10000.0, RopeScaling("dynamic", 2.0, 32), 80),
    "yarn": (10000.0, RopeScaling("yarn", 4.0, 16), None),
    "llama3": (500000.0, RopeScaling("llama3", 8.0, 32, low_freq_factor=1.0), None),
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rope_scalings_equal_transformers(formulas, name):
    theta, scaling, seq_len = SCALINGS[name]
    inv_freq, factor = rope_inv_freq(16, theta, scaling, seq_len)
    expected = formulas[f"rope_scaling.{name}.inv_freq"]
    torch.testing.assert_close(inv_freq.double(), expected, rtol=1e-5, atol=0)
    assert factor == pytest.approx(float(formulas[f"rope_scaling.{name}.attention_factor"]))
