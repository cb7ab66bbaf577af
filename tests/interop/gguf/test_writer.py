"""Writing GGUF files: read back bit-exactly by the `gguf` reader and attnlab's, and opened by
transformers' GGUF loader with the same logits."""

import numpy as np
import pytest
import torch

from attnlab.checkpoint import open_checkpoint, save_pretrained
from attnlab.cli.__main__ import main
from attnlab.interop.gguf import load_gguf, save_gguf
from attnlab.quantize import quantize_model
from attnlab.quantize.int4 import Int4Linear
from tests.interop.gguf.files import byte_level_tokenizer, tiny_hf_llama, write_gguf

gguf = pytest.importorskip("gguf")
T = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

IDS = torch.tensor([[5, 17, 200, 33, 101, 7, 250, 64, 12, 99]])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """An attnlab model and tokenizer opened from a llama.cpp-style F32 fixture."""
    tok = byte_level_tokenizer()
    path = write_gguf(tmp_path_factory.mktemp("src") / "src.gguf", tiny_hf_llama(320), tok)
    return open_checkpoint(path)


def state(model):
    return {k: v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_f32_round_trip_is_bit_exact(tmp_path, source, layout):
    src = open_checkpoint(source.path, layout=layout)
    out = save_gguf(src.model, src.config, tmp_path / "out.gguf", src.tokenizer)
    back, cfg, tok, _ = load_gguf(out, layout=layout)
    assert cfg == src.config
    a, b = state(src.model), state(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the file itself: the same tensors, names, types and metadata as the llama.cpp-style one
    ref, ours = gguf.GGUFReader(source.path), gguf.GGUFReader(out)
    ref_t = {t.name: t for t in ref.tensors}
    assert ref_t.keys() == {t.name for t in ours.tensors}
    for t in ours.tensors:
        assert t.tensor_type == ref_t[t.name].tensor_type
        assert np.array_equal(np.asarray(t.data), np.asarray(ref_t[t.name].data)), t.name
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "llama.rope.freq_base"):
        assert ours.fields[key].contents() == ref.fields[key].contents()
    assert tok.encode("hello 2024 ünï") == src.tokenizer.encode("hello 2024 ünï")


def test_f16_and_q8_0_equal_the_gguf_quantizer(tmp_path, source):
    w = source.model.blocks[0].ffn.up_proj.weight.detach().numpy()
    for kind, qtype in (("f16", "F16"), ("q8_0", "Q8_0")):
        out = save_gguf(
            source.model, source.config, tmp_path / f"{kind}.gguf", source.tokenizer, kind
        )
        back, *_ = load_gguf(out)
        q = gguf.GGMLQuantizationType[qtype]
        expected = gguf.quants.dequantize(gguf.quants.quantize(w, q), q)
        assert np.array_equal(back.blocks[0].ffn.up_proj.weight.detach().numpy(), expected)
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
        assert types["blk.0.ffn_up.weight"] == qtype and types["blk.0.attn_norm.weight"] == "F32"


def test_q4_1_round_trip_keeps_the_int4_weights(tmp_path, source):
    """Q4_1 read as int4, written as Q4_1, read again: the same bytes and buffers."""
    q41 = write_gguf(tmp_path / "q41.gguf", tiny_hf_llama(320), byte_level_tokenizer(), "Q4_1")
    kept = open_checkpoint(q41, scheme="int4")
    out = save_gguf(kept.model, kept.config, tmp_path / "out.gguf", kept.tokenizer, "q4_1")
    ref = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(q41).tensors}
    for t in gguf.GGUFReader(out).tensors:
        if t.tensor_type.name == "Q4_1":
            assert np.array_equal(np.asarray(t.data), ref[t.name]), t.name
    back = open_checkpoint(out, scheme="int4")
    a, b = state(kept.model), state(back.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


INFO = {
    "general.license": "apache-2.0",
    "general.languages": ["en", "fr"],
    "general.organization": "HuggingFaceTB",
    "general.size_label": "tiny",
}


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_gguf_to_gguf_keeps_the_source_types_and_metadata(tmp_path, kind):
    """Converting a llama.cpp-style file (Q4_1 or Q8_0 matrices, a Q8_0 token_embd, F32 norms)
    to its own type writes each tensor as the source had it, byte for byte, and carries the
    informational general.* keys; the keys the export writes itself say what it wrote."""
    quant = kind.upper()
    tiny, tok, info = tiny_hf_llama(320), byte_level_tokenizer(), INFO | {"general.name": "Tiny"}
    src = write_gguf(tmp_path / "src.gguf", tiny, tok, quant, embedding="Q8_0", info=info)
    out = tmp_path / "out.gguf"
    assert main(["convert", "--from", "gguf", str(src), "--to", "gguf", str(out),
                 "--gguf-type", kind]) == 0  # fmt: skip
    ref, ours = gguf.GGUFReader(src), gguf.GGUFReader(out)
    ref_t = {t.name: t for t in ref.tensors}
    assert ref_t["token_embd.weight"].tensor_type.name == "Q8_0"
    assert ref_t.keys() == {t.name for t in ours.tensors}
    for t in ours.tensors:
        assert t.tensor_type == ref_t[t.name].tensor_type, t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(ref_t[t.name].data)), t.name
    for key, value in info.items():
        assert ours.fields[key].contents() == value, key
    file_type = ours.fields["general.file_type"].contents()
    assert gguf.LlamaFileType(file_type).name == f"MOSTLY_{quant}"


def test_a_source_tensor_of_another_type_is_written_as_asked(tmp_path):
    """--gguf-type f32 from a Q8_0 file writes F32 (the values the source's bytes decode to)."""
    src = write_gguf(tmp_path / "src.gguf", tiny_hf_llama(320), byte_level_tokenizer(), "Q8_0")
    loaded = open_checkpoint(src)
    out = save_gguf(
        loaded.model, loaded.config, tmp_path / "out.gguf", loaded.tokenizer, source=src
    )
    types = {t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types == {"F32"}


def test_q4_1_from_attnlab_quantize(tmp_path, source):
    import copy

    model = quantize_model(copy.deepcopy(source.model), "int4", 32)
    out = save_gguf(model, source.config, tmp_path / "q.gguf", source.tokenizer, "q4_1")
    back = open_checkpoint(out, scheme="int4")
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            other = back.model.get_submodule(name)
            assert torch.equal(m.weight, other.weight)  # the 4-bit values are kept
            assert torch.equal(m.scales.half().float(), other.scales)  # scales rounded to fp16
    with pytest.raises(ValueError, match="quantize it first"):
        save_gguf(source.model, source.config, tmp_path / "x.gguf", source.tokenizer, "q4_1")


def test_an_int8_model_is_refused_not_written_without_its_linears(tmp_path, source):
    import copy

    model = quantize_model(copy.deepcopy(source.model), "int8")
    with pytest.raises(ValueError, match="int8 Linears"):
        save_gguf(model, source.config, tmp_path / "q.gguf", source.tokenizer, "q8_0")


def test_transformers_opens_the_export_with_our_logits(tmp_path, source):
    out = save_gguf(source.model, source.config, tmp_path / "out.gguf", source.tokenizer)
    ref = T.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    with torch.no_grad():
        assert (ref.eval()(IDS).logits - source.model(IDS)).abs().max() < 1e-5
    tok = T.AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    text = "The quick brown fox, 42 times."
    assert tok(text, add_special_tokens=False)["input_ids"] == source.tokenizer.encode(text)


def test_refusals(tmp_path, source):
    from attnlab.models.presets import get_preset

    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        save_gguf(source.model, source.config, tmp_path / "x.gguf", None)
    with pytest.raises(ValueError, match="'f8' is not one of"):
        save_gguf(source.model, source.config, tmp_path / "x.gguf", source.tokenizer, "f8")
    cfg = get_preset("gpt2-tiny")
    with pytest.raises(ValueError, match="llama-family decoders; this model has .*position"):
        save_gguf(source.model, cfg, tmp_path / "x.gguf", source.tokenizer)
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.tmp").exists()


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_cli_convert_gguf_to_hf_and_attnlab_to_gguf(tmp_path, source, capsys):
    hf_dir = tmp_path / "hf"
    assert main(["convert", "--from", "gguf", str(source.path), "--to", "hf", str(hf_dir)]) == 0
    ref = T.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (ref(IDS).logits - source.model(IDS)).abs().max() < 1e-5
    ours = save_pretrained(tmp_path / "ours", source.model, source.config, source.tokenizer)
    out = tmp_path / "ours.gguf"
    args = [
        "convert",
        "--from",
        "attnlab",
        str(ours),
        "--to",
        "gguf",
        str(out),
        "--gguf-type",
        "q8_0",
    ]
    assert main(args) == 0
    assert "wrote gguf" in capsys.readouterr().out
    assert open_checkpoint(out).config == source.config
