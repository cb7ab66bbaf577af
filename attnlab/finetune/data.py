"""Fine-tuning data that needs no download, built at run time from the running Python's own
standard library (like the default pre-training corpus), and a user's own JSONL files.

    task        example                                   built from                 split by
    tag         {"text", "spans": [[start, end, label]]}  `tokenize` of source       file
    classify    {"text", "label"}                         a function's source (ast)  file
    sft         {"prompt", "response"}                    docstring -> signature     module
    dpo         {"prompt", "chosen", "rejected"}          sft, one part corrupted    module
    spec        {"prompt", "response"} and pairs          name + arguments -> bare   module
                                                          signature, one part broken

Tagging labels every lexical token of a window of source lines as NAME, KEYWORD
(`keyword.iskeyword`), STRING, NUMBER, COMMENT or OP; `char_tags` writes the spans as BIO
tags over characters and `token_tags` moves them onto a tokenizer's tokens (offsets ->
tags, the first-subword or all-subwords rule). Classification asks which of eight top-level
packages a function comes from. Instructions ask for the signature (`def name(args):`, the
arguments by `ast.unparse`) of the function whose docstring's first line is given; the DPO
pairs reject a signature with the wrong name, a dropped argument or a renamed one. The
"spec -> signature" examples state the function's name and arguments in the prompt, so that the
prompt decides the answer (a docstring line does not: no small model knows every module's API);
their pairs reject a signature with exactly one part broken (the name, or an argument dropped,
added, renamed or swapped), as many added as dropped so that length tells nothing. The reward
and GRPO tasks read the same examples (pairs; prompts with their "name" and "args").

Every split is deterministic and disjoint by file (tag, classify) or by module (sft, dpo): a
key's split comes from a hash of the key and the seed, never from the order files are found.
Label ids (`LabelVocab`) come from the training split and are saved with the model, so that
evaluation uses the same ids. Every builder takes a cap on the examples and runs in seconds.
"""

import ast
import bisect
import hashlib
import json
import os
import random
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from attnlab.finetune.signatures import (
    SPEC_KINDS,
    all_args,
    applicable_kinds,
    bare_signature,
    corrupt_signature,
    functions,
    signature,
)
from attnlab.finetune.tagging import spans_from_words, tag_spans, windows
from attnlab.training.data import stdlib_files, stdlib_root  # the "stdlib" corpus's files

TaskKind = Literal["tag", "classify", "sft", "dpo", "reward", "grpo"]
SPLITS = ("train", "val", "test")
FRACTIONS = (0.8, 0.1, 0.1)  # train, val, test: of the files (or modules)
FIELDS = {  # a user's JSONL: the fields of each line, by task
    "tag": ("tokens", "tags"),
    "classify": ("text", "label"),
    "sft": ("prompt", "response"),
    "dpo": ("prompt", "chosen", "rejected"),
    "reward": ("prompt", "chosen", "rejected"),  # and an optional number "margin"
    "grpo": ("prompt",),  # other fields go to the reward function
}
# Eight packages present in every CPython since 3.10 (not tkinter: distributions ship it apart),
# each with 5+ files and about 100+ functions of 3+ lines, so every split holds each of them.
CLASSIFY_PACKAGES = (
    "asyncio",
    "email",
    "http",
    "importlib",
    "multiprocessing",
    "unittest",
    "urllib",
    "xml",
)
SFT_PROMPT = "Write the signature of the function documented as: {doc}"
SPEC_PROMPT = "Write the signature of the function {name} whose arguments are: {args}"


# --- files and splits ---------------------------------------------------------------------------
def module_name(path: Path) -> str:
    """ "email.utils" for .../email/utils.py, "email" for .../email/__init__.py."""
    parts = list(path.relative_to(stdlib_root()).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def file_keys(files: list[Path]) -> dict[str, Path]:
    """{key: file}, the key a file's path below the files' common folder ("email/utils.py"
    for the standard library), so that a split does not depend on where Python is installed."""
    if not files:
        return {}
    common = Path(os.path.commonpath([str(f.resolve().parent) for f in files]))
    return {f.resolve().relative_to(common).as_posix(): f for f in files}


def _hash(key: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()


def assign_splits(keys, seed: int = 0, fractions=FRACTIONS) -> dict[str, str]:
    """{key: "train" | "val" | "test"}: keys ordered by a seeded hash, the first
    round(n * test) to test (at least one when there are 3+ keys), the next to val, the
    rest to train. Deterministic; no key is in two splits."""
    keys = sorted(set(keys), key=lambda k: _hash(k, seed))
    n = len(keys)
    n_test = max(1, round(n * fractions[2])) if n >= 3 else 0
    n_val = max(1, round(n * fractions[1])) if n >= 3 else 0
    return {
        k: "test" if i < n_test else "val" if i < n_test + n_val else "train"
        for i, k in enumerate(keys)
    }


def split_by_weight(weights: dict[str, int], seed: int = 0, fractions=FRACTIONS) -> dict[str, str]:
    """{key: split} with each split's share of the total weight (e.g. functions per file)
    near `fractions`. Keys go from the heaviest down (the seeded hash breaks ties): to a split
    still empty when the key weighs at most twice that split's share (so a package of a few
    big files still has a file in val and in test), else to the split furthest below its
    share. Deterministic; no key is in two splits."""
    total = sum(weights.values())
    target = {s: f * total for s, f in zip(SPLITS, fractions)}
    assigned = dict.fromkeys(SPLITS, 0)
    out = {}
    for key in sorted(weights, key=lambda k: (-weights[k], _hash(k, seed))):
        w = weights[key]
        empty = [s for s in SPLITS[1:] if assigned[s] == 0 and 0 < w <= 2 * target[s]]
        split = empty[0] if empty else max(SPLITS, key=lambda s: target[s] - assigned[s])
        out[key] = split
        assigned[split] += w
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


# --- labels -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LabelVocab:
    """Label <-> id, fixed by the training split and saved with the model (labels.json).

    Args:
        labels: the labels in id order.
    """

    labels: tuple[str, ...]

    @classmethod
    def from_examples(cls, examples: list[dict], kind: TaskKind) -> "LabelVocab":
        """Sorted labels of `examples` (for "tag": "O", then B-X and I-X for each type X)."""
        if kind == "classify":
            return cls(tuple(sorted({ex["label"] for ex in examples})))
        if kind == "tag":
            types = sorted({s[2] for ex in examples for s in ex["spans"]})
            return cls(("O", *(f"{p}-{t}" for t in types for p in "BI")))
        raise ValueError(f"task {kind!r} has no labels (only 'tag' and 'classify' do)")

    def id(self, label: str) -> int:
        try:
            return self.labels.index(label)
        except ValueError:
            raise ValueError(
                f"label {label!r} was never seen in the training data (known: "
                f"{list(self.labels)}): add examples of it to the training split"
            ) from None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def label2id(self) -> dict[str, int]:
        """{label: id}, as HF configs store it (id2label is its inverse)."""
        return {label: i for i, label in enumerate(self.labels)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"labels": list(self.labels)}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "LabelVocab":
        labels = json.loads(Path(path).read_text()).get("labels")
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            raise ValueError(f"{str(path)!r} must hold {{'labels': [str, ...]}}")
        return cls(tuple(labels))


@dataclass
class TaskData:
    """A task's examples by split, and its label ids (None for sft and dpo).

    Attributes:
        kind: "tag", "classify", "sft" or "dpo".
        splits: {"train": [...], "val": [...], "test": [...]}.
        labels: LabelVocab of the training split.
    """

    kind: TaskKind
    splits: dict[str, list[dict]]
    labels: LabelVocab | None = None

    def counts(self) -> dict:
        """{split: number of examples} and, for classify, {"classes": {split: {label: n}}}."""
        out: dict = {s: len(v) for s, v in self.splits.items()}
        if self.kind == "classify":
            out["classes"] = {
                s: dict(sorted(Counter(ex["label"] for ex in v).items()))
                for s, v in self.splits.items()
            }
        return out


# --- (a) tagging --------------------------------------------------------------------------------
def build_tagging(
    max_examples: int = 2000,
    window_lines: int = 8,
    max_chars: int = 1000,
    seed: int = 0,
    files: list[Path] | None = None,
) -> TaskData:
    """Windows of standard-library source with their `tokenize` spans, split by file.

    Args:
        max_examples: at most this many training windows (val and test: a tenth each, at
            least 50).
        window_lines: lines per window (more where a multi-line string would be cut).
        max_chars: windows longer than this are left out.
        seed: the split's seed.
        files: source files (default: the standard library's); those that fail to read or
            tokenize are skipped.

    Returns:
        TaskData("tag") of {"text", "spans", "file", "start"} examples: the text is
        file[start : start + len(text)], the spans are relative to the text.
    """
    files = stdlib_files() if files is None else [Path(f) for f in files]
    names = file_keys(files)
    split_of = assign_splits(names, seed)
    caps = {"train": max_examples, "val": max(50, max_examples // 10)}
    caps["test"] = caps["val"]
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for key in sorted(names, key=lambda k: _hash(k, seed)):
        split = split_of[key]
        if len(out[split]) >= caps[split]:
            continue
        source = _read(names[key])
        try:
            spans = tag_spans(source) if source else None
        except (tokenize.TokenError, SyntaxError):
            spans = None
        if not spans:
            continue
        first = [s for s, _, _ in spans]  # sorted: tokenize reads left to right
        for a, b in windows(source, spans, window_lines):
            mine = spans[bisect.bisect_left(first, a) : bisect.bisect_left(first, b)]
            inside = [(s - a, e - a, t) for s, e, t in mine]
            if inside and b - a <= max_chars and len(out[split]) < caps[split]:
                example = {"text": source[a:b], "spans": inside, "file": str(names[key])}
                out[split].append({**example, "start": a})
    return TaskData("tag", out, LabelVocab.from_examples(out["train"], "tag"))


# --- (b) classification -------------------------------------------------------------------------
def build_classification(
    max_per_class: int = 150,
    packages: tuple[str, ...] = CLASSIFY_PACKAGES,
    min_lines: int = 3,
    max_chars: int = 1500,
    seed: int = 0,
) -> TaskData:
    """Function sources labelled by their top-level standard-library package, split by file
    within each package, each split holding about its fraction of the package's functions
    (`split_by_weight`), so every package is in every split.

    Args:
        max_per_class: at most this many functions per package in each split (chosen by a
            seeded hash), which balances the classes where they have enough.
        packages: the labels.
        min_lines: shorter functions are left out (one-line stubs say nothing of a package).
        max_chars: longer sources are cut to their first `max_chars` characters.
        seed: the split's seed.

    Returns:
        TaskData("classify") of {"text", "label", "file"}; `counts()` gives the classes.
    """
    root = stdlib_root()
    missing = [p for p in packages if not (root / p).is_dir()]
    if missing:
        raise ValueError(f"packages {missing} are not in this Python's standard library ({root})")
    files = stdlib_files()
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    seen: set[str] = set()  # a text found in two places is kept once
    for package in packages:
        by_file: dict[str, list[dict]] = {}  # by the path below the standard library
        for path in (p for p in files if p.relative_to(root).parts[0] == package):
            source = _read(path)
            try:
                found = list(functions(source)) if source else []
            except SyntaxError:
                continue
            kept = by_file.setdefault(path.relative_to(root).as_posix(), [])
            for _, text in found:
                if text.count("\n") + 1 >= min_lines and text not in seen:
                    seen.add(text)
                    kept.append({"text": text[:max_chars], "label": package, "file": str(path)})
        weights = {f: len(v) for f, v in by_file.items()}
        split_of = split_by_weight(weights, seed)
        for split in SPLITS:
            examples = [ex for f, v in by_file.items() if split_of[f] == split for ex in v]
            examples.sort(key=lambda ex: _hash(ex["text"], seed))
            out[split] += examples[:max_per_class]
    return TaskData("classify", out, LabelVocab.from_examples(out["train"], "classify"))


# --- (c) instructions and preference pairs ------------------------------------------------------
def build_instructions(
    max_examples: int = 2000,
    max_signature_chars: int = 100,
    seed: int = 0,
) -> TaskData:
    """ "Write the signature of the function documented as: <first docstring line>" ->
    `def name(args):`, split by module.

    Public functions only (no leading "_"), with a one-line summary of 10 to 200 characters;
    a summary found twice in a split (overloads, copies) is kept once, so every prompt has
    one answer.

    Args:
        max_examples: at most this many training examples (val and test: a tenth, >= 50).
        max_signature_chars: longer signatures are left out.
        seed: the split's seed.

    Returns:
        TaskData("sft") of {"prompt", "response", "module", "name", "args"} examples
        ("args": the argument names, used by `build_preferences`).
    """
    files = stdlib_files()
    modules = {module_name(p): p for p in files}
    split_of = assign_splits(modules, seed)
    caps = {"train": max_examples, "val": max(50, max_examples // 10)}
    caps["test"] = caps["val"]
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    prompts: set[tuple[str, str]] = set()
    for module in sorted(modules, key=lambda m: _hash(m, seed)):
        split = split_of[module]
        if len(out[split]) >= caps[split]:
            continue
        source = _read(modules[module])
        try:
            found = list(functions(source, with_text=False)) if source else []
        except SyntaxError:
            continue
        for node, _ in found:
            doc = (ast.get_docstring(node) or "").strip().split("\n")[0].strip()
            sig = signature(node)
            if node.name.startswith("_") or not 10 <= len(doc) <= 200:
                continue
            if len(sig) > max_signature_chars or (split, doc) in prompts:
                continue
            if len(out[split]) >= caps[split]:
                break
            prompts.add((split, doc))
            out[split].append(
                {
                    "prompt": SFT_PROMPT.format(doc=doc),
                    "response": sig,
                    "module": module,
                    "name": node.name,
                    "args": [a.arg for a in all_args(node.args)],
                }
            )
    return TaskData("sft", out)


def build_preferences(
    instructions: TaskData | None = None, seed: int = 0, pairs_per_prompt: int = 1
) -> TaskData:
    """DPO pairs from the instructions (default: `build_instructions()`): chosen = the right
    signature, rejected = `corrupt_signature` of it, drawn with a generator seeded by `seed`
    and the pair's own text. Wrong names and argument names come from the same split, so no
    split leaks into another.

    Args:
        pairs_per_prompt: training pairs per prompt, each with another corruption (fewer when
            the signature has fewer distinct ones); the first is the one pair drawn with 1.
            Held-out splits keep one pair per prompt, so they do not change with it.

    Returns:
        TaskData("dpo") of {"prompt", "chosen", "rejected", "module", "corruption"}.
    """
    if pairs_per_prompt < 1:
        raise ValueError(f"pairs_per_prompt must be >= 1, got {pairs_per_prompt}")
    instructions = build_instructions(seed=seed) if instructions is None else instructions
    out: dict[str, list[dict]] = {}
    for split, examples in instructions.splits.items():
        if any("name" not in ex or "args" not in ex for ex in examples):
            raise ValueError(
                "build_preferences needs build_instructions() examples (with 'name' and 'args'); "
                "a user's own pairs come as {'prompt', 'chosen', 'rejected'} JSONL (load_jsonl)"
            )
        names = sorted({ex["name"] for ex in examples})
        arg_names = sorted({a for ex in examples for a in ex["args"]})
        per_prompt = pairs_per_prompt if split == "train" else 1
        pairs = []
        for ex in examples:
            rng = random.Random(_hash(ex["prompt"] + ex["response"], seed))
            drawn: dict[str, str] = {}  # rejected -> its kind, in the order drawn
            for _ in range(4 * per_prompt):  # a few tries: draws may repeat
                kind, rejected = corrupt_signature(ex["response"], names, arg_names, rng)
                drawn.setdefault(rejected, kind)
                if len(drawn) == per_prompt:
                    break
            pairs += [preference_pair(ex, rejected, kind) for rejected, kind in drawn.items()]
        out[split] = pairs
    return TaskData("dpo", out)


def preference_pair(example: dict, rejected: str, kind: str) -> dict:
    """A DPO pair of an instruction example: its response chosen, `rejected` (broken by
    `kind`) not."""
    return {
        "prompt": example["prompt"],
        "chosen": example["response"],
        "rejected": rejected,
        "module": example["module"],
        "corruption": kind,
    }


def build_spec_instructions(instructions: TaskData | None = None) -> TaskData:
    """ "Write the signature of the function NAME whose arguments are: a, b, *, c" -> `def
    NAME(a, b, *, c):`: the prompt states the name and the arguments (as `bare_signature` writes
    them, no defaults nor annotations), so it decides the answer. Made from the instructions
    (default: `build_instructions()`), so split by the same modules; coroutines are left out
    (the spec does not say `async`), and a prompt found twice in a split is kept once.

    Returns:
        TaskData("sft") of {"prompt", "response", "module", "name", "args"} examples.
    """
    instructions = build_instructions() if instructions is None else instructions
    out: dict[str, list[dict]] = {}
    for split, examples in instructions.splits.items():
        seen, kept = set(), []
        for ex in examples:
            node = ast.parse(ex["response"] + " ...").body[0]
            if isinstance(node, ast.AsyncFunctionDef):
                continue
            sig = bare_signature(node)
            args = sig[len(f"def {node.name}(") : -len("):")]
            prompt = SPEC_PROMPT.format(name=node.name, args=args or "none")
            if prompt not in seen:
                seen.add(prompt)
                kept.append({**ex, "prompt": prompt, "response": sig})
        out[split] = kept
    return TaskData("sft", out)


def build_spec_preferences(spec: TaskData | None = None, seed: int = 0) -> TaskData:
    """Preference pairs of the spec examples (default: `build_spec_instructions()`): chosen =
    the right bare signature, rejected = the same with exactly one part broken (signatures.
    SPEC_KINDS: name, drop, add, rename, swap), the kind drawn per pair from those that apply
    with a generator seeded by `seed` and the pair's text. A signature without arguments can
    only take another name (adding one would unbalance added against dropped); each draw of
    "add" or "drop" takes whichever of the two the split has had fewer of, so they are as many
    (to one) and a longer or shorter answer says nothing. Wrong names and argument names come
    from the same split. One pair per prompt.

    Returns:
        TaskData("dpo") of {"prompt", "chosen", "rejected", "module", "corruption"}.
    """
    spec = build_spec_instructions() if spec is None else spec
    out: dict[str, list[dict]] = {}
    for split, examples in spec.splits.items():
        names = sorted({ex["name"] for ex in examples})
        arg_names = sorted({a for ex in examples for a in ex["args"]})
        counts = {"add": 0, "drop": 0}
        pairs = []
        for ex in examples:
            rng = random.Random(_hash(ex["prompt"] + ex["response"], seed))
            kinds = applicable_kinds(ex["response"], names, SPEC_KINDS)
            if "drop" not in kinds:
                kinds = [k for k in kinds if k != "add"]
            if not kinds:
                continue
            kind = rng.choice(kinds)
            if kind in counts:
                kind = min(("add", "drop"), key=lambda k: (counts[k], k != kind))
                counts[kind] += 1
            _, rejected = corrupt_signature(ex["response"], names, arg_names, rng, (kind,))
            pairs.append(preference_pair(ex, rejected, kind))
        out[split] = pairs
    return TaskData("dpo", out)


# --- a user's own JSONL -------------------------------------------------------------------------
def _check_field(path, n: int, kind: str, row: dict, field: str) -> None:
    """ValueError naming the file, line and field unless row[field] is right for `kind`."""
    where = f"{path}, line {n}: field {field!r}"
    if field not in row:
        raise ValueError(f"{where} is missing (a {kind} line needs {list(FIELDS[kind])})")
    value = row[field]
    if field in ("tokens", "tags"):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where} must be a list of strings, got {value!r}")
        if not value or not all(value):
            raise ValueError(f"{where} must be a non-empty list of non-empty strings")
        if field == "tags":
            if len(value) != len(row["tokens"]):
                raise ValueError(
                    f"{where} has {len(value)} tags for {len(row['tokens'])} tokens: "
                    "give one tag per token"
                )
            bad = [t for t in value if t != "O" and not (t[:2] in ("B-", "I-") and t[2:])]
            if bad:
                raise ValueError(f"{where} holds {bad[0]!r}: tags are O, B-TYPE or I-TYPE")
        return
    if field == "label" and isinstance(value, int) and not isinstance(value, bool):
        return
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {type(value).__name__} {value!r}")
    if not value.strip():
        raise ValueError(f"{where} is empty")


def load_jsonl(path: str | Path, kind: TaskKind) -> list[dict]:
    """A user's examples, one JSON object per line (blank lines skipped), each checked.

    Args:
        path: the file.
        kind: "classify" {"text", "label"} (label a string or an int, kept as a string),
            "tag" {"tokens", "tags"} (word-level BIO), "sft" {"prompt", "response"}, "dpo"
            {"prompt", "chosen", "rejected"}, "reward" the same and an optional number
            "margin" (trl's), "grpo" {"prompt"} and any other fields (the reward function's).

    Returns:
        the examples; "tag" ones as {"text", "spans"} like the built-in ones
        (`spans_from_words`), "classify" labels as strings.

    Raises:
        ValueError: naming the file, the line number and the field that is missing, of the
            wrong type or empty (or the line that is not a JSON object, or an empty file).
    """
    if kind not in FIELDS:
        raise ValueError(f"kind must be one of {list(FIELDS)}, got {kind!r}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no JSONL file at {str(path)!r}")
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{str(path)!r} is not a UTF-8 text file (byte {e.start}: {e.reason}); give "
            "--data.source a JSONL file, one JSON object per line"
        ) from None
    examples = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}, line {n}: expected a JSON object with {FIELDS[kind]}")
        for field in FIELDS[kind]:
            _check_field(path, n, kind, row, field)
        margin = row.get("margin", 0.0) if kind == "reward" else 0.0
        if isinstance(margin, bool) or not isinstance(margin, (int, float)):
            raise ValueError(f"{path}, line {n}: field 'margin' must be a number, got {margin!r}")
        if kind == "tag":
            text, spans = spans_from_words(row["tokens"], row["tags"])
            row = {"text": text, "spans": spans}
        elif kind == "classify":
            row = {**row, "label": str(row["label"])}
        examples.append(row)
    if not examples:
        raise ValueError(f"{path} holds no examples (one JSON object per line)")
    return examples


def user_task(kind: TaskKind, train: str | Path, val: str | Path, test: str | Path | None = None):
    """TaskData of a user's JSONL files (`load_jsonl`), labels from the training file; a label
    in val or test that training never saw is a ValueError naming it."""
    splits = {"train": load_jsonl(train, kind), "val": load_jsonl(val, kind)}
    splits["test"] = load_jsonl(test, kind) if test is not None else []
    labels = (
        LabelVocab.from_examples(splits["train"], kind) if kind in ("tag", "classify") else None
    )
    for split, path in (("val", val), ("test", test)):
        for n, ex in enumerate(splits[split] if labels is not None else [], 1):
            found = [ex["label"]] if kind == "classify" else [f"B-{s[2]}" for s in ex["spans"]]
            for label in found:
                try:
                    labels.id(label)
                except ValueError as e:
                    raise ValueError(f"{path}, example {n}: {e}") from None
    return TaskData(kind, splits, labels)
