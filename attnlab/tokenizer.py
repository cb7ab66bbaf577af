"""Tokenizers, all stored as a standard HF `tokenizer.json` (the `tokenizers` library's format).

- character level: every distinct character is a token (a BPE model with no merges, so the file
  loads anywhere `tokenizer.json` does);
- byte-level BPE (Radford et al. 2019), trained with the `tokenizers` library's BpeTrainer.

Both carry the special tokens every family needs: <pad> <unk> <bos> <eos> <mask> <cls> <sep>
(ids 0-6), then the user's own (`special_tokens=`, e.g. `<|endoftext|>` or the chat markers
CHAT_TOKENS), each encoded as one id and never split by BPE.

A chat template (a Jinja string, as in HF's `tokenizer_config.json`) turns a list of messages into
the text a chat model reads; `apply_chat_template` renders it as `transformers` does, and
DEFAULT_CHAT_TEMPLATE is the format of attnlab's own chat models (<|user|> ... <|end|>).
`save_config` writes it to tokenizer_config.json, and `from_file` reads it back from there.

`encode_file` encodes a file of any size as a stream, in chunks cut where no token can cross.

`from_pretrained` opens a pretrained tokenizer as the Hub ships it (byte-level BPE as GPT-2,
SentencePiece Unigram as T5, WordPiece as BERT): tokenizer.json with the special and added
tokens of tokenizer_config.json (and special_tokens_map.json) marked special, bos/eos/pad/...
mapped to our names, and model_max_length; `encode_with_specials` adds what the tokenizer's
post-processor adds ([CLS] ... [SEP], ... </s>), as `transformers`' `tokenizer(text)` does.

Unknown characters are replaced visibly, never dropped: a character the tokenizer never saw
encodes to <unk>, and `decode` writes every <unk> as U+FFFD, the Unicode replacement character
("ab\ufffdc" for "abxc" when "x" was never seen).
"""

import functools
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>", "<mask>", "<cls>", "<sep>"]
UNKNOWN_CHAR = "\ufffd"  # what decode writes for <unk>: visible, where a skipped token would vanish
CONFIG_FILE = "tokenizer_config.json"  # where HF keeps chat_template, beside tokenizer.json

# attnlab's chat format: one marker per role, <|end|> closes every message (the stop token).
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# The names a template sees our specials by (HF passes its special_tokens_map the same way).
TEMPLATE_NAMES = {
    "<bos>": "bos_token",
    "<eos>": "eos_token",
    "<pad>": "pad_token",
    "<unk>": "unk_token",
    "<mask>": "mask_token",
    "<cls>": "cls_token",
    "<sep>": "sep_token",
}
HF_SPECIALS = {theirs: ours for ours, theirs in TEMPLATE_NAMES.items()}  # "bos_token" -> "<bos>"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # older HF files name the specials here too
NO_MAX_LENGTH = 10**18  # transformers writes int(1e30) for "no limit"


class Tokenizer:
    """A thin wrapper around `tokenizers.Tokenizer` with the special-token ids named.

    Args:
        backend: the `tokenizers.Tokenizer`.
        chat_template: a Jinja chat template (HF's format); None: DEFAULT_CHAT_TEMPLATE when
            the vocabulary has CHAT_TOKENS, else no template.
    """

    def __init__(self, backend: HFTokenizer, chat_template: str | None = None):
        self.backend = backend
        vocab = backend.get_vocab(with_added_tokens=True)
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        if chat_template is None and all(t in added for t in CHAT_TOKENS):
            chat_template = DEFAULT_CHAT_TEMPLATE  # attnlab's markers bring attnlab's format
        self.chat_template = chat_template
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
        """Load a tokenizer.json (ours or one written by `transformers`), with the chat
        template of the tokenizer_config.json (or HF's chat_template.jinja) beside it."""
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
        return cls(backend, read_chat_template(path.parent))

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json to `path` (the chat template goes to `save_config`)."""
        self.backend.save(str(path))

    def save_config(self, path: str | Path) -> None:
        """Write tokenizer_config.json to `path`: the chat template and the special tokens by
        HF's names, so `transformers` and `from_file` both find the template."""
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        config.update(self._template_specials())
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        Path(path).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, name: str) -> int | None:
        """Id of a special token by our name ("<pad>", "<eos>", ...) or by its own text (a
        user's "<|end|>"), or None if absent."""
        if name in self.special_ids:
            return self.special_ids[name]
        added = {t.content: i for i, t in self.backend.get_added_tokens_decoder().items()}
        return added.get(name)

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
        return _decode_marking_unknown(self.backend, ids, unk)

    # --- chat -----------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The text of a conversation in this tokenizer's chat format, rendered as
        `transformers`' `apply_chat_template(..., tokenize=False)` renders the same template
        (a sandboxed Jinja environment with trim_blocks and lstrip_blocks; the template sees
        `messages`, `add_generation_prompt`, `tools` and `documents` (None), `raise_exception`,
        `strftime_now` and bos_token, eos_token, ... by HF's names).

        Args:
            messages: [{"role": "user" | "assistant" | "system", "content": str}, ...].
            add_generation_prompt: end with the assistant's opening marker, so that what the
                model writes next is the reply.
            tools: the functions the model may call, as JSON schemas (OpenAI's
                {"type": "function", "function": {...}}), passed to the template as
                transformers passes them; only templates that read `tools` show them
                (`takes_tools`).

        Returns:
            the rendered text (encode it with `encode`: the markers are single ids).
        """
        if self.chat_template is None:
            missing = [t for t in CHAT_TOKENS if self.token_id(t) is None]
            raise ValueError(
                f"this tokenizer has no chat_template and lacks the chat markers {missing}: "
                "train it with special_tokens=CHAT_TOKENS, or set tokenizer.chat_template"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not {"role", "content"} <= m.keys():
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        return _compile_template(self.chat_template).render(
            messages=messages,
            tools=tools,  # None when none are given, as transformers passes them
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._template_specials(),
        )

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template reads the `tools` variable (Qwen's, Llama 3's, Hermes'
        do; attnlab's DEFAULT_CHAT_TEMPLATE does not)."""
        if self.chat_template is None:
            return False
        import jinja2.meta

        env = _compile_template(self.chat_template).environment
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(self.chat_template))

    def _template_specials(self) -> dict[str, str]:
        """{"bos_token": "<bos>", ...}: our specials under HF's names."""
        vocab = {i: t for t, i in self.backend.get_vocab(with_added_tokens=True).items()}
        return {TEMPLATE_NAMES[k]: vocab[i] for k, i in self.special_ids.items()}

    # --- streaming ------------------------------------------------------------------------------
    def iter_encode_file(self, path: str | Path, chunk_chars: int = 1 << 20) -> Iterator[list[int]]:
        """Encode a text file chunk by chunk: the concatenated chunks are `encode(whole text)`.

        A chunk ends just before a line break ("\\n" or "\\r") that follows a non-space
        character. No token crosses such a point: the byte-level pre-tokenizer's pieces never
        hold both a non-space character and a line break, and a character tokenizer has no
        pieces at all. (Special tokens that contain a line break, and tokenizers that add a
        prefix to every piece of text, such as SentencePiece's "▁", are not covered.) The
        file is read as is, line endings untouched (newline="").

        Args:
            path: a UTF-8 text file.
            chunk_chars: characters read at a time; memory is bounded by this plus the
                longest stretch of the file with no such line break.

        Yields:
            the ids of each chunk.
        """
        if chunk_chars < 1:
            raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
        with open(path, encoding="utf-8", newline="") as fh:
            pending = ""
            while block := fh.read(chunk_chars):
                pending += block
                cut = _last_safe_cut(pending)
                if cut > 0:
                    yield self.encode(pending[:cut])
                    pending = pending[cut:]
            if pending:
                yield self.encode(pending)

    def encode_file(self, path: str | Path, out: str | Path, chunk_chars: int = 1 << 20) -> int:
        """Encode the text file `path` into `out` as raw token ids, in bounded memory.

        `out` holds uint16 ids when the vocabulary fits (else uint32), the format of the
        training data cache (`np.fromfile(out, dtype)` or `np.memmap` read it back).

        Returns:
            the number of tokens written.
        """
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        n = 0
        with open(out, "wb") as fh:
            for ids in self.iter_encode_file(path, chunk_chars):
                np.asarray(ids, dtype=dtype).tofile(fh)
                n += len(ids)
        return n

    # --- pretrained files: tokenizer.json + tokenizer_config.json, as the Hub ships them -------
    model_max_length: int | None = None  # tokenizer_config.json's, when it names a real one

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "Tokenizer":
        """Open a pretrained tokenizer directory (the Hub's GPT-2, T5, BERT, Llama ... files):
        tokenizer.json, with tokenizer_config.json's (and special_tokens_map.json's) tokens.

        Every token tokenizer_config.json lists (added_tokens_decoder, bos/eos/pad/unk/...,
        additional special tokens) is added to the tokenizer as it says, special or not, so
        that encoding and decoding (`skip_special`) treat it as `transformers` does; the named
        ones become our "<bos>", "<eos>", ... (`token_id`). An unk that is also the eos (GPT-2's
        <|endoftext|>) is not our "<unk>": byte-level BPE has no unknown bytes, and decode would
        write its eos as U+FFFD.

        Args:
            directory: holds tokenizer.json; tokenizer_config.json is optional.
        """
        tokenizer = cls.from_file(directory)
        config = read_tokenizer_config(directory)
        _add_config_tokens(tokenizer.backend, config)
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        named = {ours: _content(config.get(theirs)) for theirs, ours in HF_SPECIALS.items()}
        for ours, content in named.items():
            if content is not None and content in vocab:
                tokenizer.special_ids[ours] = vocab[content]
        if named["<unk>"] is not None and named["<unk>"] in (named["<eos>"], named["<bos>"]):
            tokenizer.special_ids.pop("<unk>", None)
        limit = config.get("model_max_length")
        if isinstance(limit, int | float) and 0 < limit < NO_MAX_LENGTH:
            tokenizer.model_max_length = int(limit)
        return tokenizer

    def encode_with_specials(self, text: str) -> list[int]:
        """The ids of `text` with the specials the tokenizer's post-processor adds (BERT's
        [CLS] ... [SEP], T5's ... </s>, none for GPT-2): `transformers`' `tokenizer(text)`."""
        return self.backend.encode(text, add_special_tokens=True).ids


def _decode_marking_unknown(backend: HFTokenizer, ids: list[int], unk: int) -> str:
    """Decode `ids` in one piece, the other specials left out and every <unk> written as
    U+FFFD. (One piece, not the runs between <unk>s: a SentencePiece decoder drops the "▁" that
    starts a run, which would glue words together.)"""
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special} - {unk}
    text = backend.decode([i for i in ids if i not in special], skip_special_tokens=False)
    return text.replace(backend.id_to_token(unk), UNKNOWN_CHAR)


def read_tokenizer_config(directory: str | Path) -> dict:
    """tokenizer_config.json over special_tokens_map.json (either may be absent) of `directory`."""
    config = {}
    for name in (SPECIAL_TOKENS_MAP, CONFIG_FILE):
        file = Path(directory) / name
        if file.is_file():
            try:
                data = json.loads(file.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                data = None
            if not isinstance(data, dict):
                raise ValueError(f"{str(file)!r} is not a JSON object: write it again")
            config.update(data)
    return config


def _content(token) -> str | None:
    """A token as HF's configs write it: "<s>", or {"content": "<s>", ...} (an AddedToken)."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _add_config_tokens(backend: HFTokenizer, config: dict) -> None:
    """Add the tokens `config` lists to `backend`, as transformers does when it loads one:
    added_tokens_decoder with their flags, then the named and additional specials as special
    (a token already in the vocabulary keeps its id and is only marked; a new one is
    appended, as transformers appends it)."""
    for entry in (config.get("added_tokens_decoder") or {}).values():
        if not isinstance(entry, dict) or _content(entry) is None:
            continue
        token = AddedToken(
            entry["content"],
            single_word=bool(entry.get("single_word", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", not entry.get("special", False))),
            special=bool(entry.get("special", False)),
        )
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    if isinstance(extra, dict):  # transformers 5 names them: {"image_token": "<image>", ...}
        extra = list(extra.values())
    named = [config.get(theirs) for theirs in HF_SPECIALS]
    specials = [t for t in map(_content, [*named, *extra]) if t is not None]
    added = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    backend.add_special_tokens([t for t in dict.fromkeys(specials) if t not in added])


def _last_safe_cut(text: str) -> int:
    """The last index i with text[i] a line break and text[i - 1] not whitespace (0: none)."""
    i = max(text.rfind("\n"), text.rfind("\r"))
    while i > 0:
        if not text[i - 1].isspace():
            return i
        i = max(text.rfind("\n", 0, i), text.rfind("\r", 0, i))
    return 0


def read_chat_template(directory: str | Path) -> str | None:
    """The chat template stored in `directory`: HF's chat_template.jinja if present (newer
    `transformers` write it there), else tokenizer_config.json's "chat_template" (a string, or
    HF's list of named templates, of which "default" is taken), else None."""
    directory = Path(directory)
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    file = directory / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        template = json.loads(file.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{str(file)!r} is not a JSON object: write it again") from None
    if isinstance(
        template, list
    ):  # [{"name": "default", "template": ...}, {"name": "tool_use"...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{str(file)!r}: chat_template must be a string, got {template!r}")
    return template


@functools.lru_cache(maxsize=16)
def _compile_template(template: str):
    """A Jinja template in the environment `transformers` renders chat templates in, compiled
    once per template text, as transformers caches its own: compiling is most of what
    rendering a chat costs (the figure: benchmarks/README.md)."""
    import jinja2  # torch depends on it, so it is there wherever attnlab is
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson  # HF's tojson: no HTML escaping
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _specials(extra: Iterable[str], fixed: bool = True) -> list[str]:
    """SPECIAL_TOKENS (if `fixed`) followed by the user's `extra` ones, each once and non-empty."""
    extra = list(extra)
    seen = set(SPECIAL_TOKENS if fixed else ())
    for t in extra:
        if not isinstance(t, str) or not t:
            raise ValueError(f"a special token must be a non-empty string, got {t!r}")
        if t in seen:
            raise ValueError(
                f"special token {t!r} is given twice (the fixed ones are {SPECIAL_TOKENS}): "
                "list each once"
            )
        seen.add(t)
    return (SPECIAL_TOKENS if fixed else []) + extra


def train_char_tokenizer(
    texts: Iterable[str], special_tokens: Iterable[str] = (), chat_template: str | None = None
) -> Tokenizer:
    """One token per distinct character (sorted), after the special tokens (the 7 fixed ones,
    then `special_tokens`, each a single id); `chat_template` as in `train_bpe_tokenizer`."""
    specials = _specials(special_tokens)
    chars = Counter()
    for text in texts:
        chars.update(text)
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(chars):
        vocab.setdefault(ch, len(vocab))
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.decoder = decoders.Fuse()  # characters join with nothing between them
    return Tokenizer(backend, chat_template)


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Iterable[str] = (),
    chat_template: str | None = None,
    fixed_specials: bool = True,
) -> Tokenizer:
    """Byte-level BPE with `vocab_size` tokens (specials included), GPT-2 style.

    Args:
        texts: the training texts.
        vocab_size: tokens in all: the specials, the 256 bytes, then merges.
        special_tokens: the user's own special tokens (e.g. "<|endoftext|>", CHAT_TOKENS),
            given ids right after the 7 fixed ones; each encodes as one id.
        chat_template: stored with the tokenizer (None: DEFAULT_CHAT_TEMPLATE when the
            specials include CHAT_TOKENS).
        fixed_specials: False: only `special_tokens` (GPT-2 style: just "<|endoftext|>"),
            without the 7 fixed ones; byte-level BPE needs no <unk> (every byte is a token).
    """
    specials = _specials(special_tokens, fixed_specials)
    if vocab_size < 256 + len(specials):
        raise ValueError(
            f"byte-level BPE needs vocab_size >= {256 + len(specials)}, got {vocab_size}"
        )
    backend = HFTokenizer(models.BPE(unk_token="<unk>" if fixed_specials else None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(backend, chat_template)
