"""Tiny GGUF fixtures written with `gguf.GGUFWriter` the way llama.cpp's converter writes them
(tensor names, metadata keys, q/k rows permuted for `llama`), from a tiny random transformers
Llama: the reader is checked against files it did not write itself.
"""

from pathlib import Path

import numpy as np
import torch

TEXTS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "def add(x, y):\n    return x + y  # sum\n",
    "Unicode: café, naïve, 日本語, emoji 🙂 and tabs\tand  spaces.",
]
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


# Gemma's norms under llama.cpp's names (its post_attention_layernorm is a sandwich norm, not
# the pre-FFN norm of a Llama), stored as 1 + w (convert_hf_to_gguf.py `Gemma2Model`).
GEMMA_NAMES = GGUF_NAMES | {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def byte_level_tokenizer(vocab_size: int = 320):
    """A byte-level BPE `tokenizers.Tokenizer` trained on TEXTS, with a ChatML pair of markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 4, trainer)
    return tok


def tiny_hf_llama(vocab_size: int, family: str = "llama", tie: bool = True, seed: int = 0):
    """A tiny random transformers LlamaForCausalLM (or Qwen2 / Qwen3ForCausalLM) in fp32."""
    import transformers

    torch.manual_seed(seed)
    fields = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=128,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        initializer_range=0.2,
    )
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields)).eval()
    if family == "qwen3":
        # head_dim 128 (not 64 / 4): transformers' GGUF loader reads no key_length for qwen3
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields, head_dim=128))
        with torch.no_grad():  # QK-norm weights start at 1: make them matter
            for name, p in model.named_parameters():
                if "_norm." in name:
                    p.add_(0.3 * torch.randn_like(p))
        return model.eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()


def tiny_hf_gemma(vocab_size: int, family: str, seed: int = 0):
    """A tiny random transformers Gemma2 / Gemma3ForCausalLM in fp32 with the layer pattern
    llama.cpp assumes (Gemma 3: six layers, the last one global, scaled RoPE there), its norm
    weights perturbed so that the stored 1 + w matters."""
    import transformers

    torch.manual_seed(seed)
    fields = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        vocab_size=vocab_size,
        max_position_embeddings=128,
        sliding_window=4,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
    )
    if family == "gemma2":
        config = transformers.Gemma2Config(
            **fields, num_hidden_layers=2, attn_logit_softcapping=4.0, final_logit_softcapping=3.0
        )
        model = transformers.Gemma2ForCausalLM(config)
    else:
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
        config = transformers.Gemma3TextConfig(**fields, num_hidden_layers=6, rope_parameters=rope)
        model = transformers.Gemma3ForCausalLM(config)
    config._attn_implementation = "eager"  # the soft-capped attention is written out
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute`: HF's half layout -> interleaved."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str, names: dict = GGUF_NAMES) -> str:
    if hf_name in names:
        return names[hf_name]
    _, _, i, rest = hf_name.split(".", 3)  # model.layers.{i}.rest
    return f"blk.{i}.{names[rest]}"


def _gemma_meta(w, cfg) -> None:
    """What llama.cpp's converter writes for Gemma 2 / 3 beyond a Llama's metadata."""
    w.add_sliding_window(cfg.sliding_window)
    if cfg.attn_logit_softcapping is not None:
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if cfg.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)


def write_gguf(
    path: Path,
    hf_model,
    tokenizer,
    quant: str = "F32",
    arch: str = "llama",
    tokenizer_meta: bool = True,
    pre: str = "gpt-2",
    embedding: str | None = None,
    sampling: dict | None = None,
    info: dict | None = None,
) -> Path:
    """Write `hf_model` (+ `tokenizer`'s vocabulary and merges) as llama.cpp would: 2-D weights
    in `quant` (F32, F16, Q8_0, Q4_0, Q4_1, ...), the token embedding in `embedding` if given
    (llama.cpp's Q4_1 files keep it in Q8_0), norms and biases in F32; `sampling`: {gguf key:
    value} of general.sampling.* defaults (floats, and ints for top_k); `info`: {gguf key:
    string or list of strings} (general.license, general.languages, ...)."""
    import json

    import gguf

    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads or arch.startswith("gemma"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch.startswith("gemma"):
        _gemma_meta(w, cfg)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_vocab_size(cfg.vocab_size)
    for key, value in (sampling or {}).items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(key, value)
    for key, value in (info or {}).items():
        (w.add_array if isinstance(value, list) else w.add_string)(key, value)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":  # Gemma 3's global layers, 4B and up
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if tokenizer_meta:
        data = json.loads(tokenizer.to_str())
        vocab = data["model"]["vocab"]
        tokens = sorted(vocab, key=vocab.get)
        specials = {t["content"] for t in data["added_tokens"]}
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if t in specials else 1 for t in tokens])
        w.add_token_merges(
            [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
        )
        w.add_bos_token_id(vocab["<|im_start|>"])
        w.add_eos_token_id(vocab["<|im_end|>"])
        w.add_pad_token_id(vocab["<|endoftext|>"])
        w.add_chat_template(
            "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
        )
    names = GEMMA_NAMES if arch.startswith("gemma") else GGUF_NAMES
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        x = tensor.detach().float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            x = x + 1.0
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            x = _llama_cpp_permute(x, heads)
        kind = embedding if embedding and name == "model.embed_tokens.weight" else quant
        if x.ndim == 2 and kind != "F32":
            q = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gguf_name(name, names), gguf.quants.quantize(x, q), raw_dtype=q)
        else:
            w.add_tensor(gguf_name(name, names), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rewrite_gguf(src: Path, dst: Path, replace: dict, arch: str | None = None) -> Path:
    """Copy the GGUF `src` to `dst` with tensors replaced: {name: (raw uint8 rows, qtype)}."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = arch or reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = field.types[-1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        if t.name in replace:
            rows, qtype = replace[t.name]
            w.add_tensor(t.name, rows, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


# Where each K-quant block (256 weights) keeps its fp16 scales: byte offsets of d (and dmin).
K_QUANT_SCALES = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def random_k_quant(rows: int, cols: int, kind: str, seed: int = 0) -> np.ndarray:
    """Random K-quant rows (the `gguf` package quantizes no K-quant): random bytes, with each
    block's fp16 scales set to small finite values."""
    size, offsets = K_QUANT_SCALES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for off in offsets:
        scale = rng.uniform(0.001, 0.01, (rows, cols // 256)).astype(np.float16)
        blocks[..., off : off + 2] = scale[..., None].view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def sentencepiece_meta(vocab_size: int = 400) -> dict:
    """Llama-style `tokenizer.ggml.*` metadata: <unk> <s> </s>, the 256 <0xNN> byte tokens, then
    SentencePiece BPE pieces ("▁" for a space) trained on TEXTS, scored by rank."""
    from tokenizers import SentencePieceBPETokenizer

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(TEXTS * 4, vocab_size=vocab_size, show_progress=False)
    learned = sp.get_vocab()
    pieces = [t for t in sorted(learned, key=learned.get)]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]  # unknown, control, byte, normal
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": True,
    }


def write_sentencepiece_gguf(path: Path, meta: dict) -> Path:
    """A GGUF holding only llama tokenizer metadata (enough for transformers' GGUF tokenizer)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
