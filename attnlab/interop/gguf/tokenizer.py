"""A GGUF file's tokenizer metadata -> attnlab's `Tokenizer` (built with the `tokenizers` library).

A GGUF has no tokenizer.json: llama.cpp keeps the vocabulary under `tokenizer.ggml.*` keys.

    tokenizer.ggml.model   "gpt2": byte-level BPE with `merges`; "llama": SentencePiece-style BPE
                           (tokens with scores, "▁" for a space, <0xNN> byte fallback)
    tokenizer.ggml.pre     how text is split before BPE (llama.cpp's pre-tokenizer names)
    tokenizer.ggml.{bos,eos,padding,unknown}_token_id      the special tokens
    tokenizer.ggml.token_type   3 = control (<|im_start|>): matched whole, never split
    tokenizer.chat_template     HF's Jinja chat template

The pre-tokenizer regexes are llama.cpp's (llama-vocab.cpp, `regex_exprs` per pre type): each
`tokenizer.ggml.pre` the table names splits text exactly as llama.cpp does; any other is refused.
"""

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from attnlab.tokenizer import Tokenizer

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regexes llama.cpp applies one after the other.
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (GPT2_SPLIT,),
    "gpt-2": (GPT2_SPLIT,),
    "smollm": (r"\p{N}", GPT2_SPLIT),  # digits one by one, then GPT-2's rule
    "starcoder": (r"\p{N}", GPT2_SPLIT),
    "llama-bpe": (LLAMA3_SPLIT,),
    "llama3": (LLAMA3_SPLIT,),
    "qwen2": (QWEN2_SPLIT,),
}
CONTROL = 3  # tokenizer.ggml.token_type of a control token (<|im_start|>, <s>)
SPECIAL_KEYS = {
    "<bos>": "tokenizer.ggml.bos_token_id",
    "<eos>": "tokenizer.ggml.eos_token_id",
    "<pad>": "tokenizer.ggml.padding_token_id",
    "<unk>": "tokenizer.ggml.unknown_token_id",
}


def tokenizer_from_metadata(meta: dict, where: str) -> Tokenizer:
    """Build the tokenizer a GGUF file's metadata `meta` ({key: value}) describes.

    Raises:
        ValueError naming `where` (the file) when the metadata has no tokenizer, or one of a
        model or pre-tokenizer this reader does not build.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise ValueError(
            f"{where} has no tokenizer metadata (tokenizer.ggml.model / tokens): attnlab needs "
            "the vocabulary to run it; convert the model again with its tokenizer"
        )
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, where)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta)
    else:
        raise ValueError(
            f"{where}: tokenizer.ggml.model {kind!r} is not supported (attnlab builds gpt2 "
            "byte-level BPE and llama SentencePiece-style BPE)"
        )
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    control = [t for t, k in zip(tokens, types) if k == CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer = Tokenizer(backend, meta.get("tokenizer.chat_template"))
    for ours, key in SPECIAL_KEYS.items():
        if key in meta:
            tokenizer.special_ids[ours] = int(meta[key])
    return tokenizer


def _byte_level_bpe(meta: dict, where: str) -> HFTokenizer:
    """GPT-2-style BPE: tokens are already in the byte-to-unicode alphabet, merges "a b"."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise ValueError(
            f"{where}: tokenizer.ggml.pre {pre!r} is not supported; attnlab knows "
            f"{sorted(PRE_SPLITS)}"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = HFTokenizer(models.BPE(vocab, merges, ignore_merges=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[pre]]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: dict) -> HFTokenizer:
    """Llama-style SentencePiece BPE: merges ranked by score, "▁" for spaces, <0xNN> bytes."""
    tokens, scores = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {t: (scores[i] if scores is not None else -i) for t, i in vocab.items()}
    merges = []
    for token in sorted(vocab, key=lambda t: -rank[t]):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token))]
        pairs = [(a, b) for a, b in pairs if a in vocab and b in vocab]
        merges += sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = HFTokenizer(
        models.BPE(
            vocab,
            merges,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return backend
