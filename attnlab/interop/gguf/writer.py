"""Write a llama-family DecoderLM as a GGUF file llama.cpp runs, with the `gguf` package's writer.

Tensor names and metadata keys are llama.cpp's (reader.py has the name table); q/k rows go in
llama.cpp's interleaved order for `llama` (its converter's permutation) and in HF's for
`qwen2`. Norms and biases are always F32; the matrices are written as

    f32    as they are (a round trip through the reader is bit-exact)
    f16    rounded to fp16
    q8_0   `gguf.quants.quantize` (blocks of 32: an fp16 scale and 32 int8)
    q4_1   from an int4 model (group size 32): each Int4Linear's q, scale and min become a Q4_1
           block (d = scale, m = min, rounded to fp16; exact for a model read from Q4_1);
           the float matrices (the embedding) are written F32

A model read from a GGUF file (`source`) keeps what that file had: a float tensor whose source
bytes decode to exactly its values is copied byte for byte where the source type is the one
written, or where q4_1 would write it F32 (llama.cpp's Q4_1 files keep token_embd at Q8_0);
and the file's informational general.* keys (license, languages, organization, ...) are
carried, all but those written here (INFO_WRITTEN).

The tokenizer must be a byte-level BPE (attnlab's own, or one read from a GGUF): its tokens,
merges, special ids and chat template go into the `tokenizer.ggml.*` keys.
"""

import json
from pathlib import Path

import numpy as np
from torch import nn

from attnlab.interop.gguf.reader import BLOCK_NAMES, NAMES, import_gguf, open_reader
from attnlab.interop.gguf.tokenizer import CONTROL, PRE_SPLITS, SPECIAL_KEYS
from attnlab.models.config import ModelConfig
from attnlab.quantize.int4 import Int4Linear, unpack_int4
from attnlab.quantize.int8 import Int8Linear
from attnlab.tokenizer import Tokenizer

TYPES = ("f32", "f16", "q8_0", "q4_1")
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_1": "MOSTLY_Q4_1"}
NORMAL = 1  # tokenizer.ggml.token_type of an ordinary token
# The general.* keys save_gguf writes from what it writes, never copied from a source (its
# general.name is kept unless save_gguf is given another).
INFO_WRITTEN = (
    "general.architecture",
    "general.file_type",
    "general.quantization_version",
    "general.alignment",
)


def gguf_arch(cfg: ModelConfig) -> str:
    """ "llama" or "qwen2", the llama.cpp architecture of `cfg`; ValueError naming what is not."""
    a = cfg.attention
    wrong = {
        "arch": (cfg.arch, "decoder"),
        "position": (cfg.position, "rope"),
        "norm": (cfg.norm, "rmsnorm"),
        "norm_placement": (cfg.norm_placement, "pre"),
        "ffn": (cfg.ffn, "swiglu"),
        "ffn_bias": (cfg.ffn_bias, False),
        "attention.out_bias": (a.out_bias, False),
        "attention.qk_norm": (a.qk_norm, False),
        "attention.sliding_window": (a.sliding_window, None),
        "attention.kind": (a.kind, "standard"),
        "attention.softmax_scale": (a.softmax_scale, None),
        "rope.scaling": (cfg.rope.scaling, None),
        "rope.partial_rotary": (cfg.rope.partial_rotary, 1.0),
        "scale_embeddings": (cfg.scale_embeddings, False),
        "norm_unit_offset": (cfg.norm_unit_offset, False),
        "logit_softcap": (cfg.logit_softcap, None),
        "attention.logit_softcap": (a.logit_softcap, None),
        "head": (cfg.head, None),
    }
    wrong = {k: v for k, (v, want) in wrong.items() if v != want}
    if wrong:
        raise ValueError(f"GGUF export covers llama-family decoders; this model has {wrong}")
    return "qwen2" if a.qkv_bias else "llama"


def gguf_names(cfg: ModelConfig) -> dict[str, str]:
    """{attnlab name: GGUF name} for every tensor of a model of `cfg`."""
    table = {ours: theirs for theirs, ours in NAMES.items()}
    for i in range(cfg.n_layers):
        table |= {f"blocks.{i}.{ours}": f"blk.{i}.{theirs}" for theirs, ours in BLOCK_NAMES.items()}
    return table


def _rows_for_gguf(x: np.ndarray, name: str, cfg: ModelConfig, arch: str) -> np.ndarray:
    """q/k rows in the file's order: llama interleaved (llama.cpp's permute), qwen2 half."""
    heads = {"q_proj": cfg.attention.n_heads, "k_proj": cfg.n_kv_heads}
    proj = name.split(".")[-2]
    if proj not in heads or (arch == "llama") == (cfg.rope.layout == "interleaved"):
        return x
    n = heads[proj]
    if arch == "llama":  # half -> interleaved
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
    return x.reshape(n, x.shape[0] // n // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def int4_to_q4_1(module: Int4Linear) -> np.ndarray:
    """An Int4Linear (group size 32) -> Q4_1 rows (N, K/32 * 20) uint8: d, m (fp16), then 16
    bytes, low nibbles q[0..15] and high nibbles q[16..31] of each block."""
    if module.group_size != 32:
        raise ValueError(f"Q4_1 holds int4 at group_size 32, not {module.group_size}")
    q = unpack_int4(module.weight).numpy()  # (N, K)
    N, K = q.shape
    q = q.reshape(N, K // 32, 32)
    qs = q[..., :16] | (q[..., 16:] << 4)  # (N, G, 16)
    d = module.scales.numpy().astype(np.float16).view(np.uint8).reshape(N, K // 32, 2)
    m = module.mins.numpy().astype(np.float16).view(np.uint8).reshape(N, K // 32, 2)
    return np.concatenate([d, m, qs.astype(np.uint8)], axis=-1).reshape(N, -1)


def _from_source(t, x: np.ndarray, qtype: str | None, kind: str):
    """The source file's tensor `t` as (bytes, type) where it may stand for `x`, else None: its
    bytes decode to exactly x, and its type is the one x is written as, or any where kind q4_1
    writes a float matrix F32. (F32 sources are skipped: their bytes are x itself.)"""
    if t is None or t.tensor_type.name == "F32":
        return None
    if not (t.tensor_type.name == qtype or (kind == "q4_1" and x.ndim == 2)):
        return None
    data = np.asarray(t.data)
    if not np.array_equal(import_gguf().quants.dequantize(data, t.tensor_type), x):
        return None  # the model is not the file's any more: write it as asked
    return data, t.tensor_type


def _tensors(model: nn.Module, cfg: ModelConfig, arch: str, kind: str, source: dict):
    """(GGUF name, array, raw qtype or None) for every tensor of `model`, in llama.cpp's order;
    `source`: {GGUF name: ReaderTensor} of the file it was read from ({} for none)."""
    gguf = import_gguf()
    int4 = {name for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    if kind == "q4_1" and not int4:
        raise ValueError(
            "q4_1 is written from an int4 model: quantize it first (attnlab quantize --scheme "
            "int4 --group-size 32), or choose f32, f16 or q8_0"
        )
    if kind != "q4_1" and int4:
        raise ValueError(f"this model holds int4 Linears: write it as q4_1, not {kind}")
    int8 = [n for n, m in model.named_modules() if isinstance(m, Int8Linear) and n != "head"]
    if int8:  # (an int8 head is a tied embedding's copy: see below)
        raise ValueError(
            f"this model holds int8 Linears ({int8[0]}, ...), which GGUF export does not write: "
            "export the float model with kind q8_0 instead"
        )
    # A quantized head of a tied model is a copy of the embedding (quantize/handler.py; the
    # head of a Q4_1 file opened with scheme="int4", reader.py): llama.cpp ties it to token_embd
    # again, which is written from an int4 head's Q4_1 rows (the very bytes such a file had).
    copy = cfg.tie_embeddings and isinstance(model.head, (Int4Linear, Int8Linear))
    names, tied = gguf_names(cfg), model.head.weight is model.embed.weight or copy
    qtype = {"f16": "F16", "q8_0": "Q8_0"}.get(kind)
    out = []
    for ours, theirs in names.items():
        module_name = ours.rpartition(".")[0]
        if ours == "head.weight" and tied:
            continue  # llama.cpp ties the head to token_embd when output.weight is absent
        if ours == "embed.weight" and tied and "head" in int4:
            out.append((theirs, int4_to_q4_1(model.head), gguf.GGMLQuantizationType.Q4_1))
            continue
        if module_name in int4 and ours.endswith(".weight"):
            rows = int4_to_q4_1(model.get_submodule(module_name))
            rows = _rows_for_gguf(rows, ours, cfg, arch)
            out.append((theirs, rows, gguf.GGMLQuantizationType.Q4_1))
            continue
        try:
            tensor = model.get_parameter(ours)
        except AttributeError:
            continue  # a bias this model does not have
        x = _rows_for_gguf(tensor.detach().float().cpu().numpy(), ours, cfg, arch)
        kept = _from_source(source.get(theirs), x, qtype if x.ndim == 2 else None, kind)
        if kept is not None:
            out.append((theirs, *kept))
        elif x.ndim == 2 and qtype is not None:
            q = gguf.GGMLQuantizationType[qtype]
            out.append((theirs, gguf.quants.quantize(x, q), q))
        else:
            out.append((theirs, np.ascontiguousarray(x), None))
    return out


def _pre_name(backend) -> str:
    """llama.cpp's tokenizer.ggml.pre for a byte-level BPE's pre-tokenizer."""
    pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    if [s.get("type") for s in steps] == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if [s.get("type") for s in steps] == ["Digits", "ByteLevel"]:
        return "smollm"
    splits = tuple(s["pattern"].get("Regex") for s in steps if s.get("type") == "Split")
    for name, regexes in PRE_SPLITS.items():
        if splits == regexes:
            return name
    raise ValueError(f"no llama.cpp pre-tokenizer matches this tokenizer's ({steps})")


def add_tokenizer(writer, tokenizer: Tokenizer, vocab_size: int) -> None:
    """The tokenizer.ggml.* keys of a byte-level BPE (ValueError for any other tokenizer)."""
    data = json.loads(tokenizer.backend.to_str())
    model, decoder = data.get("model") or {}, data.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel":
        raise ValueError(
            "GGUF export needs a byte-level BPE tokenizer (attnlab's BPE, or one read from a "
            f"GGUF); this one is {model.get('type')} with a {decoder.get('type')} decoder"
        )
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    if len(vocab) > vocab_size:
        raise ValueError(f"the tokenizer has {len(vocab)} tokens, the model only {vocab_size}")
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]  # llama.cpp wants V tokens
    special = {t["content"] for t in data.get("added_tokens", []) if t.get("special")}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_name(tokenizer.backend))
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in special else NORMAL for t in tokens])
    merges = model.get("merges", [])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for ours, key in SPECIAL_KEYS.items():
        if ours in tokenizer.special_ids:
            writer.add_uint32(key, tokenizer.special_ids[ours])
    writer.add_add_bos_token(False)  # attnlab's encode adds no BOS
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)


def _info_fields(reader) -> dict:
    """{key: ReaderField} of the source's general.* keys that save_gguf does not write itself."""
    return {
        k: f for k, f in reader.fields.items() if k.startswith("general.") and k not in INFO_WRITTEN
    }


def save_gguf(
    model: nn.Module,
    cfg: ModelConfig,
    path: str | Path,
    tokenizer: Tokenizer | None,
    kind: str = "f32",
    name: str | None = None,
    source: str | Path | None = None,
) -> Path:
    """Write `model` as the GGUF file `path` (llama.cpp's names and keys; see the module doc).

    Args:
        kind: f32, f16, q8_0, or q4_1 (an int4 model at group size 32).
        tokenizer: a byte-level BPE (required: llama.cpp reads the vocabulary from the file).
        name: general.name (default: the source's, else "attnlab model").
        source: the GGUF file `model` was read from: its tensors' types and bytes and its
            informational metadata are kept (see the module doc).

    Returns:
        path.
    """
    gguf = import_gguf()
    if kind not in TYPES:
        raise ValueError(f"GGUF type {kind!r} is not one of {TYPES}")
    arch = gguf_arch(cfg)
    if tokenizer is None:
        raise ValueError(
            "GGUF export needs the model's tokenizer: llama.cpp reads it from the file"
        )
    reader = open_reader(source) if source is not None else None
    source_tensors = {t.name: t for t in reader.tensors} if reader else {}
    tensors = _tensors(model, cfg, arch, kind, source_tensors)
    info = _info_fields(reader) if reader else {}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")  # renamed in when complete: nothing half-written
    w = gguf.GGUFWriter(str(tmp), arch)
    source_name = info.pop("general.name", None)
    w.add_name(name or (source_name.contents() if source_name else "attnlab model"))
    for key, field in info.items():
        sub = field.types[-1] if len(field.types) > 1 else None  # an array's element type
        w.add_key_value(key, field.contents(), field.types[0], sub)
    w.add_file_type(gguf.LlamaFileType[FILE_TYPES[kind]])
    if kind != "f32":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.ffn_width)
    w.add_head_count(cfg.attention.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    add_tokenizer(w, tokenizer, cfg.vocab_size)
    for tensor_name, data, raw in tensors:
        w.add_tensor(tensor_name, data, raw_dtype=raw)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    tmp.replace(path)
    return path
