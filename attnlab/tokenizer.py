"""Tokenizers, all stored as a standard HF `tokenizer.json` (the `tokenizers` library's format).

- character level: every distinct character is a token (a BPE model with no merges, so the file
  loads anywhere `tokenizer.json` does);
- byte-level BPE (Radford et al. 2019), trained with the `tokenizers` library's BpeTrainer.

Both carry the special tokens every family needs: <pad> <unk> <bos> <eos> <mask> <cls> <sep>.

Unknown characters are replaced visibly, never dropped: a character the tokenizer never saw
encodes to <unk>, and `decode` writes every <unk> as U+FFFD, the Unicode replacement character
("ab\ufffdc" for "abxc" when "x" was never seen).
"""

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>", "<mask>", "<cls>", "<sep>"]
UNKNOWN_CHAR = "\ufffd"  # what decode writes for <unk>: visible, where a skipped token would vanish


class Tokenizer:
    """A thin wrapper around `tokenizers.Tokenizer` with the special-token ids named.

    Args:
        backend: the `tokenizers.Tokenizer`.
    """

    def __init__(self, backend: HFTokenizer):
        self.backend = backend
        vocab = backend.get_vocab(with_added_tokens=True)
        self.special_ids = {t: vocab[t] for t in SPECIAL_TOKENS if t in vocab}
        # transformers' own files name their specials differently; map the common ones.
        for ours, theirs in (
            ("<pad>", "[PAD]"),
            ("<unk>", "[UNK]"),
            ("<mask>", "[MASK]"),
            ("<cls>", "[CLS]"),
            ("<sep>", "[SEP]"),
            ("<eos>", "</s>"),
            ("<bos>", "<s>"),
            ("<eos>", "<|endoftext|>"),
        ):
            if ours not in self.special_ids and theirs in vocab:
                self.special_ids[ours] = vocab[theirs]

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """Load a tokenizer.json (ours or one written by `transformers`)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer.json at {str(path)!r}")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(
                f"{path} is not a readable tokenizer.json ({reason}): write it again, or point "
                "to another one"
            ) from None
        return cls(backend)

    def save(self, path: str | Path) -> None:
        self.backend.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, name: str) -> int | None:
        """Id of a special token by our name ("<pad>", "<eos>", ...), or None if absent."""
        return self.special_ids.get(name)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`; special tokens are skipped (if asked), except <unk>, written as U+FFFD."""
        ids = list(ids)
        unk = self.special_ids.get("<unk>")
        if not skip_special or unk is None or unk not in ids:
            return self.backend.decode(ids, skip_special_tokens=skip_special)
        pieces, start = [], 0
        for i, t in enumerate(ids + [unk]):  # decode the runs between <unk>s, join with U+FFFD
            if t == unk:
                pieces.append(self.backend.decode(ids[start:i], skip_special_tokens=True))
                start = i + 1
        return UNKNOWN_CHAR.join(pieces)


def train_char_tokenizer(texts: Iterable[str]) -> Tokenizer:
    """One token per distinct character (sorted), after the special tokens."""
    chars = Counter()
    for text in texts:
        chars.update(text)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(chars):
        vocab.setdefault(ch, len(vocab))
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.decoder = decoders.Fuse()  # characters join with nothing between them
    return Tokenizer(backend)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with `vocab_size` tokens (specials included), GPT-2 style."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"byte-level BPE needs vocab_size >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}"
        )
    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(backend)
