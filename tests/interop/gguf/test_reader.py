"""Reading GGUF files: fixtures written as llama.cpp writes them (files.py), checked against
the transformers model they came from and transformers' own GGUF loader."""

import sys

import numpy as np
import pytest
import torch

from attnlab.checkpoint import open_checkpoint
from attnlab.quantize.int4 import Int4Linear
from attnlab.quantize.int8 import Int8Linear
from tests.interop.gguf.files import (
    TEXTS,
    byte_level_tokenizer,
    random_k_quant,
    rewrite_gguf,
    tiny_hf_gemma,
    tiny_hf_llama,
    write_gguf,
)

gguf = pytest.importorskip("gguf")
T = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

IDS = torch.tensor([[5, 17, 200, 33, 101, 7, 250, 64, 12, 99]])
FP32_NOISE = 1e-5


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def hf_model(tokenizer):
    return tiny_hf_llama(tokenizer.get_vocab_size())


def hf_gguf_logits(path):
    """transformers' GGUF loader on `path` (the reference), fp32 logits on IDS."""
    ref = T.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        return ref.eval()(IDS).logits


def logits(loaded):
    with torch.no_grad():
        return loaded.model(IDS)


def test_f32_file_is_the_model_it_came_from(tmp_path, tokenizer, hf_model):
    path = write_gguf(tmp_path / "tiny.gguf", hf_model, tokenizer)
    loaded = open_checkpoint(path)
    with torch.no_grad():
        expected = hf_model(IDS).logits
    assert (logits(loaded) - expected).abs().max() < FP32_NOISE
    assert loaded.config.max_seq_len == 128 and loaded.config.rope.theta == 50000.0
    assert loaded.config.tie_embeddings
    # layout="interleaved" keeps llama.cpp's rows and gives the same logits
    interleaved = open_checkpoint(path, layout="interleaved")
    assert (logits(interleaved) - expected).abs().max() < FP32_NOISE


@pytest.mark.parametrize("quant", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_files_equal_transformers_gguf_loader(tmp_path, tokenizer, hf_model, quant):
    path = write_gguf(tmp_path / f"tiny-{quant}.gguf", hf_model, tokenizer, quant=quant)
    assert (logits(open_checkpoint(path)) - hf_gguf_logits(path)).abs().max() < FP32_NOISE


@pytest.mark.parametrize("quant", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_equal_transformers_gguf_loader(tmp_path, tokenizer, quant):
    """K-quants work on rows of 256: a wider model, its ffn_up in random K-quant blocks;
    transformers dequantizes them with its own code (integrations/gguf/dequant.py)."""
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=tokenizer.get_vocab_size(),
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    dense = write_gguf(tmp_path / "dense.gguf", hf, tokenizer)
    rows = random_k_quant(256, 256, quant)
    qtype = gguf.GGMLQuantizationType[quant]
    path = rewrite_gguf(dense, tmp_path / f"k-{quant}.gguf", {"blk.0.ffn_up.weight": (rows, qtype)})
    expected = hf_gguf_logits(path)
    assert (
        logits(open_checkpoint(path)) - expected
    ).abs().max() < FP32_NOISE * expected.abs().max()


def test_qwen2_file_keeps_hf_rows_and_biases(tmp_path, tokenizer):
    hf = tiny_hf_llama(tokenizer.get_vocab_size(), family="qwen2", tie=False)
    path = write_gguf(tmp_path / "qwen.gguf", hf, tokenizer, arch="qwen2")
    loaded = open_checkpoint(path)
    assert loaded.config.attention.qkv_bias and not loaded.config.tie_embeddings
    with torch.no_grad():
        expected = hf(IDS).logits
    assert (logits(loaded) - expected).abs().max() < FP32_NOISE
    assert (logits(loaded) - hf_gguf_logits(path)).abs().max() < FP32_NOISE


def test_qwen3_file_reads_its_qk_norms(tmp_path, tokenizer):
    hf = tiny_hf_llama(tokenizer.get_vocab_size(), family="qwen3")
    path = write_gguf(tmp_path / "qwen3.gguf", hf, tokenizer, arch="qwen3")
    loaded = open_checkpoint(path)
    assert loaded.config.attention.qk_norm and not loaded.config.attention.qkv_bias
    with torch.no_grad():
        expected = hf(IDS).logits
    assert (logits(loaded) - expected).abs().max() < FP32_NOISE


@pytest.mark.slow  # a 6-layer transformers model written and read back: about 0.4 s each
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_file_is_the_model_it_came_from(tmp_path, tokenizer, family):
    """Norms stored as 1 + w, sandwich norms, the window pattern llama.cpp fixes in code, Gemma
    2's soft-caps and Gemma 3's QK-norms and two RoPE bases."""
    hf = tiny_hf_gemma(tokenizer.get_vocab_size(), family)
    path = write_gguf(tmp_path / f"{family}.gguf", hf, tokenizer, arch=family)
    loaded = open_checkpoint(path)
    a = loaded.config.attention
    assert (a.sliding_window, a.global_every) == (4, 2 if family == "gemma2" else 6)
    with torch.no_grad():
        expected = hf(IDS).logits
    assert (logits(loaded) - expected).abs().max() < FP32_NOISE


def test_kept_int4_equals_the_dequantized_model(tmp_path, tokenizer, hf_model):
    """Q4_1 is attnlab's int4 at group size 32: the kept model holds the very same weights."""
    path = write_gguf(tmp_path / "q41.gguf", hf_model, tokenizer, quant="Q4_1")
    dense, kept = open_checkpoint(path), open_checkpoint(path, scheme="int4")
    int4 = [m for m in kept.model.modules() if isinstance(m, Int4Linear)]
    # every block's q, k, v, o, gate, up, down, and the tied head (from the Q4_1 embedding,
    # which itself stays fp32 for its lookups)
    assert len(int4) == 2 * 7 + 1 and isinstance(kept.model.head, Int4Linear)
    assert isinstance(kept.model.embed.weight, torch.nn.Parameter)
    for m in int4:
        m.use_kernel = False  # the reference path: fp32 (the CPU kernel runs in bf16)
    assert (logits(kept) - logits(dense)).abs().max() < FP32_NOISE
    q_proj = kept.model.blocks[0].self_attn.q_proj
    assert torch.equal(
        q_proj.reference_forward(torch.eye(64)).T, dense.model.blocks[0].self_attn.q_proj.weight
    )
    with pytest.raises(ValueError, match="group_size 32"):
        open_checkpoint(path, scheme="int4", group_size=64)


def test_kept_int4_makes_a_q8_0_head_int8(tmp_path, tokenizer, hf_model):
    """llama.cpp's Q4_1 files keep token_embd in Q8_0: the tied head becomes per-row int8 of
    its values (the embedding keeps them in fp32), and the rest of the model is the file's."""
    path = write_gguf(tmp_path / "q41.gguf", hf_model, tokenizer, quant="Q4_1", embedding="Q8_0")
    dense, kept = open_checkpoint(path), open_checkpoint(path, scheme="int4")
    assert isinstance(kept.model.head, Int8Linear)
    w = dense.model.embed.weight.detach()  # the file's Q8_0 values
    assert torch.equal(kept.model.embed.weight, w)
    scales = w.abs().amax(dim=1, keepdim=True) / 127  # symmetric per row
    rounded = (w / scales).round().clamp(-127, 127) * scales
    for m in kept.model.modules():
        if isinstance(m, (Int4Linear, Int8Linear)):
            m.use_kernel = False  # fp32 reference paths
    dense.model.head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    dense.model.head.weight.data = rounded
    assert (logits(kept) - logits(dense)).abs().max() < FP32_NOISE


def test_kept_int4_refused_without_q4_1(tmp_path, tokenizer, hf_model):
    path = write_gguf(tmp_path / "q8.gguf", hf_model, tokenizer, quant="Q8_0")
    with pytest.raises(ValueError, match="no Q4_1"):
        open_checkpoint(path, scheme="int4")


def reference_tokenizer(tokenizer, path, pre):
    """gpt-2: transformers' GGUF tokenizer. smollm: the `tokenizers` pipeline of SmolLM2's own
    tokenizer.json (Digits(individual_digits) then ByteLevel), which llama.cpp's smollm rule
    reproduces; transformers' GGUF loader ignores the smollm rule (it splits 2024 whole), which
    shows with a vocabulary that merges digits, and where two or more whitespace characters
    precede a digit ("12345  007": the rule's lone digit leaves "  " whole, GPT-2's splits it)."""
    if pre == "gpt-2":
        ref = T.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return lambda text: ref(text, add_special_tokens=False)["input_ids"]
    from tokenizers import Tokenizer, pre_tokenizers

    ref = Tokenizer.from_str(tokenizer.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    return lambda text: ref.encode(text).ids


@pytest.mark.parametrize("pre", ["gpt-2", "smollm"])
def test_tokenizer_ids_equal_the_reference(tmp_path, tokenizer, hf_model, pre):
    path = write_gguf(tmp_path / "tok.gguf", hf_model, tokenizer, pre=pre)
    ours, ref = open_checkpoint(path).tokenizer, reference_tokenizer(tokenizer, path, pre)
    texts = [*TEXTS, "<|im_start|>user\nhi 2024!<|im_end|>", "x = [1, 22, 333]\n\n\tz"]
    for text in [*texts, "12345  007", "a \t 1\n\n2"]:  # whitespace runs before digits
        assert ours.encode(text) == ref(text), text
        assert ours.decode(ours.encode(text), skip_special=False) == text
    assert ours.token_id("<bos>") == tokenizer.token_to_id("<|im_start|>")
    assert ours.token_id("<eos>") == tokenizer.token_to_id("<|im_end|>")
    assert ours.token_id("<pad>") == tokenizer.token_to_id("<|endoftext|>")
    assert "<|im_start|>" in ours.chat_template


def test_unknown_pre_tokenizer_is_refused(tmp_path, tokenizer, hf_model):
    path = write_gguf(tmp_path / "tok.gguf", hf_model, tokenizer, pre="made-up")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'made-up' is not supported"):
        open_checkpoint(path)


def test_smollm_pre_tokenizer_splits_digits(tmp_path, tokenizer, hf_model):
    """llama.cpp's smollm pre-tokenizer isolates each digit before GPT-2's rule."""
    path = write_gguf(tmp_path / "tok.gguf", hf_model, tokenizer, pre="smollm")
    backend = open_checkpoint(path).tokenizer.backend
    pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("abc 2024")]
    assert pieces == ["abc", "Ġ", "2", "0", "2", "4"]


# --- bad input: one line naming the culprit ----------------------------------------------------
def test_truncated_file(tmp_path, tokenizer, hf_model):
    path = write_gguf(tmp_path / "full.gguf", hf_model, tokenizer)
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    for size in (len(data) // 2, 100):
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match="cut.gguf.*truncated") as e:
            open_checkpoint(cut)
        assert "\n" not in str(e.value)


def test_not_a_gguf_and_missing_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="bad.gguf.*not a readable GGUF"):
        open_checkpoint(bad)
    with pytest.raises(ValueError, match="does not exist"):
        open_checkpoint(tmp_path / "absent.gguf")


def test_unsupported_architecture(tmp_path, tokenizer, hf_model):
    path = write_gguf(tmp_path / "phi.gguf", hf_model, tokenizer, arch="phi3")
    with pytest.raises(ValueError, match="architecture 'phi3' is not supported"):
        open_checkpoint(path)


def test_without_tokenizer_metadata(tmp_path, tokenizer, hf_model):
    path = write_gguf(tmp_path / "notok.gguf", hf_model, tokenizer, tokenizer_meta=False)
    with pytest.raises(ValueError, match="notok.gguf' has no tokenizer metadata"):
        open_checkpoint(path)


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_unsupported_quantization_type(tmp_path, tokenizer, hf_model):
    path = write_gguf(tmp_path / "f32.gguf", hf_model, tokenizer)
    rows = np.zeros((96, 64 // 32 * 18), np.uint8)  # IQ4_NL: 18 bytes per 32 weights
    iq4 = {"blk.0.ffn_up.weight": (rows, gguf.GGMLQuantizationType.IQ4_NL)}
    rewrite_gguf(path, tmp_path / "iq4.gguf", iq4)
    with pytest.raises(ValueError, match="'blk.0.ffn_up.weight' is IQ4_NL, a quantization type"):
        open_checkpoint(tmp_path / "iq4.gguf")


def test_missing_gguf_package_says_how_to_install(tmp_path, monkeypatch):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ValueError, match=r"pip install 'attnlab\[gguf\]'"):
        open_checkpoint(path)


def test_sentencepiece_tokenizer_equals_transformers(tmp_path):
    """tokenizer.ggml.model "llama": the ids of transformers' GGUF (SentencePiece) tokenizer.

    Except on text that starts with a space: SentencePiece (add_dummy_prefix) and llama.cpp
    always prepend "▁", so " x" is "▁▁x"; transformers 5's Metaspace(prepend_scheme="first")
    skips the prefix when the text already starts with one. attnlab follows llama.cpp."""
    from attnlab.interop.gguf.tokenizer import tokenizer_from_metadata
    from tests.interop.gguf.files import sentencepiece_meta, write_sentencepiece_gguf

    meta = sentencepiece_meta()
    path = write_sentencepiece_gguf(tmp_path / "sp.gguf", meta)
    ours = tokenizer_from_metadata(meta, "sp.gguf")
    ref = T.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [*TEXTS, "Hello  world", "zebra quux ß ☃", "a\nb"]:
        expected = ref(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == expected, text
        assert ours.decode(ours.encode(text)) == ref.decode(expected), text
    assert (ours.token_id("<bos>"), ours.token_id("<eos>")) == (1, 2)
    tokens = meta["tokenizer.ggml.tokens"]
    assert [tokens[i] for i in ours.encode(" e")] == ["▁", "▁", "e"]  # llama.cpp's dummy prefix


def test_every_ckpt_takes_a_gguf(tmp_path, tokenizer, hf_model, capsys):
    from attnlab.cli.__main__ import main

    path = write_gguf(tmp_path / "tiny.gguf", hf_model, tokenizer)
    args = ["generate", "--ckpt", str(path), "--prompt", "The quick", "--max-new-tokens", "4"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("The quick")


def test_kept_int4_saves_and_opens_with_its_int8_head(tmp_path, tokenizer, hf_model):
    """save_quantized of such a model records the int8 head; open_checkpoint rebuilds it."""
    from attnlab.inference.quantized import save_quantized

    path = write_gguf(tmp_path / "q41.gguf", hf_model, tokenizer, quant="Q4_1", embedding="Q8_0")
    kept = open_checkpoint(path, scheme="int4")
    out = save_quantized(kept.model, tmp_path / "ckpt", "int4", 32, kept.run, kept.tokenizer)
    back = open_checkpoint(out, scheme="int4")
    assert isinstance(back.model.head, Int8Linear)
    a, b = kept.model.state_dict(), back.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(logits(kept), logits(back))
