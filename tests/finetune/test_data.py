"""Fine-tuning data from the standard library, and a user's JSONL: checked against `tokenize`,
`ast` and the files themselves, with tags and spans written out by hand."""

import ast
import json
import random
from pathlib import Path

import pytest

from attnlab.finetune.data import (
    CLASSIFY_PACKAGES,
    LabelVocab,
    TaskData,
    build_classification,
    build_instructions,
    build_preferences,
    build_tagging,
    file_keys,
    load_jsonl,
    module_name,
    stdlib_files,
    stdlib_root,
    user_task,
)
from attnlab.finetune.signatures import corrupt_signature, functions
from attnlab.finetune.tagging import (
    char_tags,
    spans_from_words,
    tag_spans,
    token_tags,
    words_from_spans,
)
from attnlab.tokenizer import train_char_tokenizer

SNIPPET = 'def f(x, y=10):  # add\n    return x + y * 2.5\ns = "hi"\n'
# (start, end, type) of every lexical token of SNIPPET, counted by hand.
SNIPPET_SPANS = [
    (0, 3, "KEYWORD"),  # def
    (4, 5, "NAME"),  # f
    (5, 6, "OP"),  # (
    (6, 7, "NAME"),  # x
    (7, 8, "OP"),  # ,
    (9, 10, "NAME"),  # y
    (10, 11, "OP"),  # =
    (11, 13, "NUMBER"),  # 10
    (13, 14, "OP"),  # )
    (14, 15, "OP"),  # :
    (17, 22, "COMMENT"),  # # add
    (27, 33, "KEYWORD"),  # return
    (34, 35, "NAME"),  # x
    (36, 37, "OP"),  # +
    (38, 39, "NAME"),  # y
    (40, 41, "OP"),  # *
    (42, 45, "NUMBER"),  # 2.5
    (46, 47, "NAME"),  # s
    (48, 49, "OP"),  # =
    (50, 54, "STRING"),  # "hi"
]


@pytest.fixture(scope="module")
def tagging() -> TaskData:
    return build_tagging(max_examples=300)


@pytest.fixture(scope="module")
def classification() -> TaskData:
    return build_classification(max_per_class=60)


@pytest.fixture(scope="module")
def instructions() -> TaskData:
    return build_instructions(max_examples=300)


def _disjoint(task: TaskData, key: str) -> None:
    owners = {}
    for split, examples in task.splits.items():
        for ex in examples:
            assert owners.setdefault(ex[key], split) == split, (ex[key], split)


# --- tagging --------------------------------------------------------------------------------------
def test_spans_agree_with_tokenize_on_a_snippet_written_out_by_hand():
    assert tag_spans(SNIPPET) == SNIPPET_SPANS
    for s, e, _ in SNIPPET_SPANS:
        assert SNIPPET[s:e].strip() == SNIPPET[s:e]  # no whitespace inside a span here


def test_fstrings_and_soft_keywords_and_multiline_strings():
    src = 'x = f"a{b!r}c"\nmatch = """two\nlines"""\n'
    assert tag_spans(src) == [
        (0, 1, "NAME"),
        (2, 3, "OP"),
        (4, 14, "STRING"),  # one span, on every Python version
        (15, 20, "NAME"),  # `match` is a soft keyword: keyword.iskeyword says no
        (21, 22, "OP"),
        (23, 38, "STRING"),
    ]


def test_char_bio_tags_by_hand():
    assert char_tags("def f(x)", tag_spans("def f(x)")) == [
        "B-KEYWORD", "I-KEYWORD", "I-KEYWORD", "O", "B-NAME", "B-OP", "B-NAME", "B-OP",
    ]  # fmt: skip


def test_token_tags_first_and_all_subword_rules_by_hand():
    text = "x1 = foo(y):  # a b"
    spans = tag_spans(text)
    # tokens: "x" "1" " =" " foo" "(" "y" "):" (it joins two operators) "  #" " a" " " "b"
    offsets = [(0, 1), (1, 2), (2, 4), (4, 8), (8, 9), (9, 10), (10, 12), (12, 15)]
    offsets += [(15, 17), (17, 18), (18, 19)]
    first = ["B-NAME", None, "B-OP", "B-NAME", "B-OP", "B-NAME", "B-OP", "B-COMMENT"]
    first += ["I-COMMENT", None, "I-COMMENT"]  # " a", "b" are new words; " " continues "a"
    assert token_tags(text, spans, offsets, "first") == first
    every = ["B-NAME", "I-NAME", *first[2:9], "I-COMMENT", "I-COMMENT"]
    assert token_tags(text, spans, offsets, "all") == every
    # A multi-word entity: the second word is I- under both rules (a new word, not a subword).
    text, spans = spans_from_words(["Barack", "Obama", "spoke"], ["B-PER", "I-PER", "O"])
    assert (text, spans) == ("Barack Obama spoke", [(0, 12, "PER")])
    offsets = [(0, 3), (3, 6), (6, 12), (12, 18)]  # "Bar" "ack" " Obama" " spoke"
    assert token_tags(text, spans, offsets, "first") == ["B-PER", None, "I-PER", "O"]
    assert token_tags(text, spans, offsets, "all") == ["B-PER", "I-PER", "I-PER", "O"]


def test_all_subwords_over_a_char_tokenizer_are_the_char_tags(tagging):
    ex = tagging.splits["train"][0]
    tok = train_char_tokenizer([ex["text"]])
    offsets = tok.backend.encode(ex["text"], add_special_tokens=False).offsets
    assert token_tags(ex["text"], ex["spans"], offsets, "all") == char_tags(ex["text"], ex["spans"])


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_tagging_windows_are_the_files_own_text_and_splits_are_disjoint_by_file(tagging):
    assert tagging.counts() == {"train": 300, "val": 50, "test": 50}
    _disjoint(tagging, "file")
    kinds = set()
    for examples in tagging.splits.values():
        for ex in examples[:40]:
            source = Path(ex["file"]).read_text(encoding="utf-8")
            assert source[ex["start"] : ex["start"] + len(ex["text"])] == ex["text"]
            for s, e, kind in ex["spans"]:
                piece = ex["text"][s:e]
                kinds.add(kind)
                if kind == "KEYWORD":
                    assert piece.isidentifier() and __import__("keyword").iskeyword(piece)
                elif kind == "NAME":
                    assert piece.isidentifier()
                elif kind == "COMMENT":
                    assert piece.startswith("#") and "\n" not in piece
                elif kind == "STRING":
                    assert piece[-1] in "'\""
    assert kinds == {"NAME", "KEYWORD", "STRING", "NUMBER", "COMMENT", "OP"}
    assert tagging.labels.labels[0] == "O" and "B-KEYWORD" in tagging.labels.labels
    again = build_tagging(max_examples=300)
    assert again.splits == tagging.splits  # deterministic


def test_files_that_fail_to_tokenize_are_skipped(tmp_path):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("x = 1\n" * 30)
    bad.write_text('s = """never closed\n' * 3)
    task = build_tagging(files=[good, bad], window_lines=10)
    files = {ex["file"] for examples in task.splits.values() for ex in examples}
    assert files == {str(good)}


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_stdlib_files_are_the_default_corpus():
    from attnlab.training.data import corpus_files

    assert stdlib_files() == corpus_files("stdlib")


# --- classification -------------------------------------------------------------------------------
@pytest.mark.slow
def test_classification_labels_are_the_real_package(classification):
    root = stdlib_root()
    _disjoint(classification, "file")
    for split, examples in classification.splits.items():
        assert {ex["label"] for ex in examples} == set(CLASSIFY_PACKAGES), split
        for ex in examples[::7]:
            assert Path(ex["file"]).relative_to(root).parts[0] == ex["label"]
            source = Path(ex["file"]).read_text(encoding="utf-8")
            first = ex["text"].splitlines()[0]
            assert first.lstrip().startswith(("def ", "async def ")) and first in source
            if len(ex["text"]) < 1500:
                ast.parse(ex["text"])  # a whole function
    counts = classification.counts()
    assert counts["classes"]["train"] == dict.fromkeys(sorted(CLASSIFY_PACKAGES), 60)
    assert classification.labels.labels == tuple(sorted(CLASSIFY_PACKAGES))


FORM_FEED_SOURCE = (
    "import os\r\n\x0c\r\nclass A:\r\n    def m(self, x):  # \x0c in a comment\r\n"
    "        return [x,\r\n                1]\r\n\x0c\n\nasync def g(\n    a='\u00e9'): pass\n"
)


@pytest.mark.slow
def test_function_text_is_what_get_source_segment_gives(classification):
    import textwrap

    sources = [FORM_FEED_SOURCE]
    sources += [
        Path(ex["file"]).read_text(encoding="utf-8") for ex in classification.splits["test"][:3]
    ]
    n = 0
    for source in sources:
        for node, text in functions(source):
            want = textwrap.dedent(ast.get_source_segment(source, node, padded=True))
            assert text == want
            n += 1
    assert n > 10


def test_spans_are_right_across_form_feeds_and_crlf():
    for s, e, kind in tag_spans(FORM_FEED_SOURCE):
        piece = FORM_FEED_SOURCE[s:e]
        assert piece.strip() == piece and piece, (s, e, kind)
    texts = [FORM_FEED_SOURCE[s:e] for s, e, _ in tag_spans(FORM_FEED_SOURCE)]
    assert texts[:6] == ["import", "os", "class", "A", ":", "def"]
    assert "# \x0c in a comment" in texts and "'\u00e9'" in texts


# --- instructions and DPO pairs -------------------------------------------------------------------
@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_instructions_are_valid_signatures_of_the_documented_function(instructions):
    _disjoint(instructions, "module")
    modules = {module_name(p): p for p in stdlib_files()}
    trees = {}
    for examples in instructions.splits.values():
        for ex in examples[::5]:
            node = ast.parse(ex["response"] + " ...").body[0]
            assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            assert node.name == ex["name"]
            doc = ex["prompt"].split("documented as: ", 1)[1]
            if ex["module"] not in trees:
                trees[ex["module"]] = ast.parse(modules[ex["module"]].read_text(encoding="utf-8"))
            tree = trees[ex["module"]]
            found = [
                n
                for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.name == ex["name"]
                and (ast.get_docstring(n) or "").strip().startswith(doc)
            ]
            assert any(f"{n.name}({ast.unparse(n.args)})" in ex["response"] for n in found)
    assert instructions.counts() == {"train": 300, "val": 50, "test": 50}


def test_dpo_pairs_reject_a_corrupted_signature(instructions):
    pairs = build_preferences(instructions)
    kinds = set()
    for split, examples in pairs.splits.items():
        assert [p["chosen"] for p in examples] == [
            ex["response"] for ex in instructions.splits[split]
        ]
        for p in examples:
            assert p["rejected"] != p["chosen"]
            ast.parse(p["rejected"] + " ...")
            kinds.add(p["corruption"])
    assert kinds == {"name", "drop", "rename"}
    assert build_preferences(instructions).splits == pairs.splits  # seeded: the same again
    assert build_preferences(instructions, seed=1).splits != pairs.splits
    own = TaskData("sft", {"train": [{"prompt": "p", "response": "def f(x):"}]})
    with pytest.raises(ValueError, match="needs build_instructions"):
        build_preferences(own)


def test_more_pairs_per_prompt_add_distinct_training_pairs_only(instructions):
    one = build_preferences(instructions)
    four = build_preferences(instructions, pairs_per_prompt=4)
    for split in ("val", "test"):  # held-out pairs do not change
        assert four.splits[split] == one.splits[split]
    by_prompt = {}
    for p in four.splits["train"]:
        by_prompt.setdefault(p["prompt"], []).append(p)
    firsts = [group[0] for group in by_prompt.values()]
    assert firsts == one.splits["train"]  # the first pair of each prompt is the one pair
    for group in by_prompt.values():
        rejected = [p["rejected"] for p in group]
        assert len(set(rejected)) == len(rejected) <= 4
        assert all(r != group[0]["chosen"] for r in rejected)
    sizes = [len(group) for group in by_prompt.values()]
    assert sizes.count(4) > 0.9 * len(sizes)
    with pytest.raises(ValueError, match="pairs_per_prompt"):
        build_preferences(instructions, pairs_per_prompt=0)


def test_wrong_names_come_from_the_same_split(instructions):
    pairs = build_preferences(instructions)
    for split in ("val", "test"):
        names = {ex["name"] for ex in instructions.splits[split]}
        for p in pairs.splits[split]:
            if p["corruption"] == "name":
                assert ast.parse(p["rejected"] + " ...").body[0].name in names


@pytest.mark.parametrize(
    "sig",
    [
        "def f(a, /, b=1, *args, c, d=2, **kw):",
        "async def g(self, x: int = 3) -> None:",
        "def h(*, key):",
        "def k(a, b, /):",
    ],
)
def test_every_corruption_of_hard_signatures_parses_and_differs(sig):
    for seed in range(40):
        kind, bad = corrupt_signature(sig, ["f", "other"], ["a", "zz"], random.Random(seed))
        assert bad != sig, (kind, bad)
        ast.parse(bad + " ...")


# --- a user's JSONL -------------------------------------------------------------------------------
def _write(tmp_path, rows, name="data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_of_each_kind_loads(tmp_path):
    rows = [{"text": "good", "label": 1}, "", {"text": "bad", "label": "neg"}]
    assert load_jsonl(_write(tmp_path, rows), "classify") == [
        {"text": "good", "label": "1"},
        {"text": "bad", "label": "neg"},
    ]
    rows = [{"tokens": ["New", "York", "is", "big"], "tags": ["B-LOC", "I-LOC", "O", "O"]}]
    assert load_jsonl(_write(tmp_path, rows), "tag") == [
        {"text": "New York is big", "spans": [(0, 8, "LOC")]}
    ]
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    assert load_jsonl(_write(tmp_path, rows), "dpo") == rows


@pytest.mark.parametrize(
    "kind, rows, message",
    [
        (
            "sft",
            [{"prompt": "p", "response": "r"}, {"prompt": "p"}],
            "line 2: field 'response' is missing",
        ),
        (
            "sft",
            [{"prompt": 3, "response": "r"}],
            "line 1: field 'prompt' must be a string, got int 3",
        ),
        ("sft", ["", {"prompt": " ", "response": "r"}], "line 2: field 'prompt' is empty"),
        ("classify", [{"text": "t", "label": None}], "line 1: field 'label' must be a string"),
        ("dpo", [{"prompt": "p", "chosen": "a"}], "line 1: field 'rejected' is missing"),
        (
            "tag",
            [{"tokens": ["a", "b"], "tags": ["O"]}],
            "line 1: field 'tags' has 1 tags for 2 tokens",
        ),
        (
            "tag",
            [{"tokens": "a b", "tags": ["O"]}],
            "line 1: field 'tokens' must be a list of strings",
        ),
        ("tag", [{"tokens": [], "tags": []}], "line 1: field 'tokens' must be a non-empty list"),
        ("tag", [{"tokens": ["a"], "tags": ["PER"]}], "line 1: field 'tags' holds 'PER'"),
        ("sft", ["{not json"], "line 1: not valid JSON"),
        ("sft", ["[1, 2]"], "line 1: expected a JSON object"),
        ("sft", [""], "holds no examples"),
    ],
)
def test_jsonl_errors_name_the_file_line_and_field(tmp_path, kind, rows, message):
    path = _write(tmp_path, rows)
    with pytest.raises(ValueError) as info:
        load_jsonl(path, kind)
    assert message in str(info.value) and str(path) in str(info.value)


def test_label_ids_come_from_training_and_are_saved(tmp_path):
    train = _write(tmp_path, [{"text": "a", "label": "pos"}, {"text": "b", "label": "neg"}], "t")
    val = _write(tmp_path, [{"text": "c", "label": "pos"}], "v")
    task = user_task("classify", train, val)
    assert task.labels.labels == ("neg", "pos") and task.labels.id("pos") == 1
    assert task.labels.label2id == {"neg": 0, "pos": 1}
    task.labels.save(tmp_path / "labels.json")
    assert LabelVocab.load(tmp_path / "labels.json") == task.labels
    unseen = _write(tmp_path, [{"text": "c", "label": "meh"}], "u")
    with pytest.raises(ValueError, match="u, example 1: label 'meh' was never seen in the train"):
        user_task("classify", train, unseen)
    tags = _write(tmp_path, [{"tokens": ["Ann", "ran"], "tags": ["B-PER", "O"]}], "tt")
    other = _write(tmp_path, [{"tokens": ["Rome"], "tags": ["B-LOC"]}], "tv")
    assert user_task("tag", tags, tags).labels.labels == ("O", "B-PER", "I-PER")
    with pytest.raises(ValueError, match="label 'B-LOC' was never seen"):
        user_task("tag", tags, other)


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_splits_do_not_depend_on_where_the_files_live(tmp_path):
    splits = []
    for where in ("a", "deeper/b"):
        files = []
        for i in range(12):
            path = tmp_path / where / "pkg" / f"m{i}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"x{i} = {i}\n" * 12)
            files.append(path)
        task = build_tagging(files=files, window_lines=4)
        splits.append({s: [ex["text"] for ex in v] for s, v in task.splits.items()})
    assert splits[0] == splits[1] and all(splits[0].values())
    assert "email/utils.py" in file_keys(stdlib_files())


def test_words_from_spans_by_hand_and_back():
    """TagTask's words: each span one B- word, the rest O words cut at whitespace, whitespace
    kept at the end of the word before it; joined they are the text; spans_from_words of a
    user's words comes back to the same entities."""
    text = "def f(x):\n    return x  # done\n"
    tokens, tags = words_from_spans(text, tag_spans(text))
    assert "".join(tokens) == text
    assert list(zip(tokens, tags)) == [
        ("def ", "B-KEYWORD"), ("f", "B-NAME"), ("(", "B-OP"), ("x", "B-NAME"), (")", "B-OP"),
        (":\n    ", "B-OP"), ("return ", "B-KEYWORD"), ("x  ", "B-NAME"), ("# done\n", "B-COMMENT"),
    ]  # fmt: skip
    words, word_tags = ["New", "York", "is", "big"], ["B-LOC", "I-LOC", "O", "O"]
    tokens, tags = words_from_spans(*spans_from_words(words, word_tags))
    assert tokens == ["New York ", "is ", "big"] and tags == ["B-LOC", "O", "O"]
    assert words_from_spans("  a", []) == (["  ", "a"], ["O", "O"])
