"""Read a GGUF file (llama.cpp's format) into a DecoderLM, with the `gguf` package's reader.

    GGUF name (llama.cpp)          attnlab name
    token_embd.weight              embed.weight
    blk.{i}.attn_norm.weight       blocks.{i}.residuals.0.norm.weight
    blk.{i}.attn_{q,k,v}.{weight,bias}   blocks.{i}.self_attn.{q,k,v}_proj.*
    blk.{i}.attn_output.weight     blocks.{i}.self_attn.o_proj.weight
    blk.{i}.ffn_norm.weight        blocks.{i}.residuals.1.norm.weight
    blk.{i}.ffn_{gate,up,down}.weight    blocks.{i}.ffn.{gate,up,down}_proj.weight
    output_norm.weight             norm.weight
    output.weight                  head.weight (absent: the head is tied to the embedding)

Every tensor type the `gguf` package dequantizes (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
the K-quants) becomes fp32. With scheme="int4", Q4_1 matrices stay 4-bit instead, exactly: a
Q4_1 block is 32 weights w = d*q + m with q in 0..15 and d, m in fp16, which is attnlab's
asymmetric int4 at group size 32 (scale d, min m; quantize/int4.py), so `Int4Linear` holds the
very same weights. A Q4_1 block (20 bytes) is d, m, then 16 bytes whose low nibbles are
q[0..15] and high nibbles q[16..31].

The LM head of such a file is rarely Q4_1: llama.cpp's Q4_1 files keep `token_embd` (which a
tied head reads) in Q8_0, the logits being the most sensitive output. Dequantized to fp32 it would
be half of every decoded token's bytes (SmolLM2-135M: 113 of 206 MB, against llama.cpp's 97), so
with scheme="int4" the head is kept quantized too: a Q4_1 one (or a tied head's Q4_1 embedding)
as an Int4Linear of the same weights, any other as an `Int8Linear` (quantize/int8.py: per-row
int8 of its values, the nearest the int8 kernel takes to Q8_0's blocks of 32), untied from the
embedding, which keeps the fp32 matrix for its lookups. On SmolLM2 (384 tokens of Python) the
KL of the int4 model's next-token distribution from the dequantized model's is 0.0004 nats per
token with an fp32 head, 0.004 with the int8 head, 0.057 with an int4 head.

llama.cpp's converter permutes q/k rows of `llama` files from HF's "half" RoPE layout to the
interleaved one (convert_hf_to_gguf.py, `LlamaModel.permute`); qwen2 and qwen3 files keep HF's
rows (a qwen3 file adds blk.{i}.attn_{q,k}_norm.weight, the per-head QK-norm). The
rows are put back for layout="half" (per row, so it works on quantized rows too) and kept for
layout="interleaved".

Gemma 2 and 3 files (convert_hf_to_gguf.py `Gemma2Model`, `Gemma3Model`) store every RMSNorm
weight as 1 + w, HF's w plus the one its (1 + w) norm adds; the reader subtracts it again, as
transformers' GGUF loader does, so the model is the HF one. What llama.cpp does not store it
fixes in code (llama-model.cpp), and so does the reader: the sliding window on every other
layer (Gemma 2) or on five layers of six (Gemma 3), local layers rotated with base 10,000
(Gemma 3), and the query scale 1/sqrt(head_dim), or 1/sqrt(d_model / n_heads) for the 27B
models (46 layers for Gemma 2, 62 for Gemma 3).
"""

import functools
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from attnlab.components.positions.rope import LAYOUTS, RopeScaling
from attnlab.interop.gguf.tokenizer import tokenizer_from_metadata
from attnlab.models.build import build_model
from attnlab.models.config import AttentionConfig, ModelConfig, RopeConfig
from attnlab.models.weights import load_weights
from attnlab.quantize.int4 import Int4Linear
from attnlab.quantize.int8 import Int8Linear
from attnlab.tokenizer import Tokenizer

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")  # read here
GEMMA = {"gemma2": (2, 46), "gemma3": (6, 62)}  # global_every, the 27B model's layer count
PERMUTED = ("llama", "mistral")  # q/k rows interleaved by llama.cpp's converter
INSTALL = "pip install 'attnlab[gguf]'"
NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "head.weight",
}
BLOCK_NAMES = {
    "attn_norm.weight": "residuals.0.norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "residuals.1.norm.weight",
    "post_attention_norm.weight": "residuals.0.out_norm.weight",  # Gemma's sandwich norms
    "post_ffw_norm.weight": "residuals.1.out_norm.weight",
    "ffn_gate.weight": "ffn.gate_proj.weight",
    "ffn_up.weight": "ffn.up_proj.weight",
    "ffn_down.weight": "ffn.down_proj.weight",
}


def import_gguf():
    """The `gguf` package, or a ValueError saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise ValueError(f"GGUF files need the gguf package: {INSTALL}") from None
    return gguf


def open_reader(path: str | Path):
    """A `gguf.GGUFReader` on `path`, or a ValueError naming the file (missing, truncated or
    not a GGUF at all)."""
    gguf = import_gguf()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    try:
        return _plain_reader(gguf)(path)
    except Exception as e:  # numpy/struct errors on a cut file; ValueError on bad magic
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"{str(path)!r} is not a readable GGUF file (truncated or damaged: {reason}); "
            "download or convert it again"
        ) from None


@functools.cache
def _plain_reader(gguf):
    """gguf.GGUFReader reading its memory map through a plain ndarray view of it (the same
    bytes): the reader slices the map once per value, ~250,000 times for SmolLM2's vocabulary,
    and each slice of an np.memmap costs a subclass's bookkeeping (2.6-3.2 s -> 1.1 s)."""

    class PlainReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):
            self._mapped, self._plain = mapped, mapped.view(np.ndarray)

    return PlainReader


def metadata(reader) -> dict:
    """{key: plain Python value} of every metadata field (arrays as lists)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def config_from_gguf(meta: dict, layout: str = "half", tied: bool = True) -> ModelConfig:
    """A GGUF file's `{arch}.*` metadata -> ModelConfig (RoPE in `layout`; `tied`: the file has
    no output.weight)."""
    arch = meta["general.architecture"]

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata has no {arch}.{key}")
        return value

    d_model, n_heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", d_model // n_heads)
    rotary = get("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(f"partial rotary ({arch}.rope.dimension_count={rotary}) is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" and (arch, scaling) != ("gemma3", "linear"):
        raise ValueError(f"{arch}.rope.scaling.type={scaling!r} is not supported yet")
    qwen = arch == "qwen2"
    cfg = ModelConfig(
        arch="decoder",
        d_model=d_model,
        n_layers=get("block_count"),
        vocab_size=get("vocab_size", len(meta.get("tokenizer.ggml.tokens", []))),
        max_seq_len=get("context_length"),
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=get("attention.head_count_kv", n_heads),
            head_dim=None if head_dim == d_model // n_heads else head_dim,
            qkv_bias=qwen,
            out_bias=False,
            qk_norm=arch == "qwen3",
        ),
        position="rope",
        rope=RopeConfig(theta=float(get("rope.freq_base", 10000.0)), layout=layout),
        norm="rmsnorm",
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        ffn="swiglu",
        d_ff=get("feed_forward_length"),
        tie_embeddings=tied,
        init="gpt2",
    )
    return _gemma(cfg, arch, get) if arch in GEMMA else cfg


def _gemma(cfg: ModelConfig, arch: str, get) -> ModelConfig:
    """A Gemma 2 / 3 file's config: the llama-shaped `cfg` with Gemma's components, from the
    metadata and from what llama.cpp fixes in code (see the module docstring)."""
    every, layers_27b = GEMMA[arch]
    per_head = cfg.d_model // cfg.attention.n_heads if cfg.n_layers == layers_27b else None
    softcap = get("attn_logit_softcapping", 0.0) or None if arch == "gemma2" else None
    attention = replace(
        cfg.attention,
        qk_norm=arch == "gemma3",
        softmax_scale=None if per_head is None else per_head**-0.5,
        sliding_window=get("attention.sliding_window"),
        global_every=every,
        logit_softcap=softcap,
        backend="eager" if softcap else "sdpa",
    )
    rope = cfg.rope
    if arch == "gemma3":
        factor = get("rope.scaling.factor", 0.0)
        scaling = RopeScaling("linear", factor, cfg.max_seq_len) if factor else None
        rope = replace(rope, local_theta=10000.0, scaling=scaling)
    final_cap = get("final_logit_softcapping", 0.0) or None if arch == "gemma2" else None
    return replace(cfg, attention=attention, rope=rope, ffn="geglu", activation="gelu_tanh",
                   norm_placement="sandwich", norm_unit_offset=True, scale_embeddings=True,
                   logit_softcap=final_cap)  # fmt: skip


def attnlab_name(name: str) -> str | None:
    """The attnlab parameter a GGUF tensor name maps to (None: not one of ours)."""
    if name in NAMES:
        return NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in BLOCK_NAMES:
        return f"blocks.{parts[1]}.{BLOCK_NAMES[parts[2]]}"
    return None


def _unpermute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation on (n_heads * D, ...) rows: interleaved -> half."""
    w = rows.reshape(n_heads, rows.shape[0] // n_heads // 2, 2, *rows.shape[1:])
    return w.swapaxes(1, 2).reshape(rows.shape)


def q4_1_to_int4(rows: np.ndarray, n_cols: int) -> dict[str, Tensor]:
    """Q4_1 rows (N, K/32 * 20) uint8 -> Int4Linear's buffers: weight (N, K/2) packed, scales and
    mins (N, K/32) fp32. Exact: every weight is the same number after as before."""
    N, G = rows.shape[0], n_cols // 32
    blocks = rows.reshape(N, G, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, G)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]  # (N, G, 16)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(N, n_cols)  # (N, K) in 0..15
    packed = q[:, 0::2] | (q[:, 1::2] << 4)  # attnlab's packing: even columns in the low nibble
    return {
        "weight": torch.from_numpy(np.ascontiguousarray(packed)),
        "scales": torch.from_numpy(d),
        "mins": torch.from_numpy(m),
    }


DEQUANTIZED = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip


def read_tensors(reader, cfg: ModelConfig, arch: str, where: str, keep_q4_1: bool):
    """The file's tensors under attnlab names: fp32 tensors, and (keep_q4_1) the Int4Linear
    buffers of each Q4_1 matrix (a Q4_1 embedding's also as the tied head's). Returns (state,
    names of the Linears kept in int4)."""
    gguf = import_gguf()
    state, kept = {}, []
    heads = {"self_attn.q_proj": cfg.attention.n_heads, "self_attn.k_proj": cfg.n_kv_heads}
    for t in reader.tensors:
        name = attnlab_name(t.name)
        if name is None:
            raise ValueError(f"{where}: tensor {t.name!r} has no place in a {arch} model")
        kind = t.tensor_type.name
        if kind not in DEQUANTIZED:
            raise ValueError(
                f"{where}: tensor {t.name!r} is {kind}, a quantization type attnlab does not "
                f"read (it reads {', '.join(DEQUANTIZED)})"
            )
        data = np.asarray(t.data)
        module, _, param = name.rpartition(".")
        n_heads = next((h for k, h in heads.items() if module.endswith(k)), None)
        if n_heads is not None and arch in PERMUTED and cfg.rope.layout == "half":
            data = _unpermute_rows(data, n_heads)
        if keep_q4_1 and kind == "Q4_1" and name == "embed.weight" and cfg.tie_embeddings:
            for key, value in q4_1_to_int4(data, int(t.shape[0])).items():
                state[f"head.{key}"] = value  # the tied head: the same 4-bit weights
            kept.append("head")  # (and the embedding is dequantized below, for its lookups)
        elif keep_q4_1 and kind == "Q4_1" and param == "weight" and name != "embed.weight":
            for key, value in q4_1_to_int4(data, int(t.shape[0])).items():
                state[f"{module}.{key}"] = value
            kept.append(module)
            continue
        values = gguf.quants.dequantize(data, t.tensor_type).astype(np.float32, copy=False)
        if arch in GEMMA and name.endswith("norm.weight"):
            values = values - 1.0  # the file holds 1 + w (see the module docstring)
        state[name] = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
    return state, kept


def load_gguf(
    path: str | Path, layout: str = "half", scheme: str | None = None
) -> tuple[torch.nn.Module, ModelConfig, Tokenizer, dict]:
    """Open a llama-family, Qwen3 or Gemma 2 / 3 GGUF file as a DecoderLM in eval mode.

    Args:
        path: the .gguf file.  layout: the RoPE layout of the model made ("half" or
            "interleaved"; the logits are the same).
        scheme: None dequantizes every tensor to fp32; "int4" keeps each Q4_1 matrix as an
            Int4Linear (group size 32; the same weights, 4 bits each), makes the head int8 where
            it is not Q4_1 (see the module docstring) and dequantizes the rest.

    Returns:
        (model, ModelConfig, Tokenizer from the metadata, metadata {key: value}).

    Raises:
        ValueError, one line naming the file and what is wrong: missing `gguf` package, a
        truncated file, an architecture other than the llama family, a quantization type not
        read here, no tokenizer metadata.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown RoPE layout {layout!r}; expected one of {LAYOUTS}")
    if scheme not in (None, "int4"):
        raise ValueError(
            f"a GGUF file keeps only its Q4_1 matrices quantized (scheme='int4'), not {scheme!r}"
        )
    where = repr(str(path))
    reader = open_reader(path)
    meta = metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{where}: architecture {arch!r} is not supported; attnlab reads "
            f"{', '.join(ARCHITECTURES)}"
        )
    tokenizer = tokenizer_from_metadata(meta, where)
    tied = "output.weight" not in {t.name for t in reader.tensors}
    cfg = config_from_gguf(meta, layout, tied)
    state, kept = read_tensors(reader, cfg, arch, where, keep_q4_1=scheme == "int4")
    if scheme == "int4" and not kept:
        raise ValueError(f"{where} holds no Q4_1 matrices to keep as int4; open it without scheme")
    with torch.device("meta"):
        model = build_model(cfg)
    for name in kept:
        old = model.get_submodule(name)
        parent, _, child = name.rpartition(".")
        new = Int4Linear(old.in_features, old.out_features, old.bias is not None, 32, "meta")
        setattr(model.get_submodule(parent), child, new)
    load_weights(model, state)
    if scheme == "int4" and "head" not in kept:
        model.head = Int8Linear.from_linear(model.head)  # untied: the embedding keeps fp32
    return model.eval(), cfg, tokenizer, meta
