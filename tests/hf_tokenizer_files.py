"""Pretrained-style tokenizer files, built with the `tokenizers` library as the Hub's are:
tokenizer.json plus tokenizer_config.json (special tokens by HF's names, added tokens,
model_max_length), tiny vocabularies trained on CORPUS.

    gpt2_files(d)   byte-level BPE, <|endoftext|> as bos/eos/unk (GPT-2)
    t5_files(d)     SentencePiece Unigram with Metaspace, "$A </s>" appended, <extra_id_N> (T5)
    bert_files(d)   WordPiece, lower-casing BERT normalizer, "[CLS] $A [SEP]" (BERT)
"""

import json
from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS = [
    "The house is wonderful. The garden is small, but the house is big.",
    "translate English to German: The cat sat on the mat.",
    "Hello world! How are you today? I am fine, thanks.",
    "Attention is all you need: queries, keys and values.",
    "A quick brown fox jumps over the lazy dog 0123456789 times.",
    "das Haus ist wunderbar, der Garten ist klein.",
] * 4
TEXTS = [  # varied: punctuation, spacing, digits, case, specials in running text
    "The house is wonderful.",
    "translate English to German: The house is wonderful.",
    "  Hello   world!  ",
    "the QUICK brown fox, 42 times",
    "keys and values: attention",
]


def _write(directory: Path, backend: Tokenizer, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def _added(backend: Tokenizer, tokens: list[str], special: bool = True) -> dict:
    """tokenizer_config.json's "added_tokens_decoder" for `tokens`, as transformers writes it."""
    vocab = backend.get_vocab(with_added_tokens=True)
    return {
        str(vocab[t]): dict(
            content=t,
            lstrip=False,
            normalized=False,
            rstrip=False,
            single_word=False,
            special=special,
        )
        for t in tokens
    }


def gpt2_files(directory: Path, vocab_size: int = 400) -> Path:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": 1024,
        "add_prefix_space": False,
        "added_tokens_decoder": _added(backend, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
    }
    # a plain (non-special) added token that only tokenizer_config.json lists, at the next id
    config["added_tokens_decoder"][str(backend.get_vocab_size())] = dict(
        content="<tool>",
        lstrip=False,
        normalized=False,
        rstrip=False,
        single_word=False,
        special=False,
    )
    return _write(directory, backend, config)


def t5_files(directory: Path, vocab_size: int = 160, extra_ids: int = 3) -> Path:
    # The pipeline of the Hub's t5-small tokenizer.json (less its SentencePiece charsmap), which
    # is also what transformers' T5Tokenizer rebuilds around the file's vocabulary.
    backend = Tokenizer(models.Unigram())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    extras = [f"<extra_id_{i}>" for i in reversed(range(extra_ids))]
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in extras])
    eos = backend.token_to_id("</s>")
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos)]
    )
    config = {
        "tokenizer_class": "T5Tokenizer",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "extra_ids": extra_ids,
        "additional_special_tokens": extras,
        "model_max_length": 512,
        "added_tokens_decoder": _added(backend, ["<pad>", "</s>", "<unk>", *extras]),
    }
    return _write(directory, backend, config)


def bert_files(directory: Path, vocab_size: int = 200) -> Path:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": True,
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "mask_token": "[MASK]",
        "model_max_length": 512,
        "clean_up_tokenization_spaces": True,
        "added_tokens_decoder": _added(backend, specials),
    }
    return _write(directory, backend, config)
