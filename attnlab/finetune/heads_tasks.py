"""Fine-tuning with a task head: ClassifyTask (one label per text) and TagTask (a BIO tag per word).

    ClassifyTask  {"text": str, "label": str | int}    val_accuracy (and val_majority, the
                                                       majority class's share)
    TagTask       {"tokens": [str], "tags": [str]}      val_f1: entity-level F1 through seqeval

Like every task's, their held-out metrics are named val_* (metrics.jsonl, `attnlab eval`).

Both follow the training loop's task protocol (training/loop.py, training/tasks.py): the loop
calls `train_batch`, `n_targets`, `loss_sum`, `evaluate` and `sample`, and saves `tokenizer`.
`build_head_task` puts the head on a pre-trained base (an `open_checkpoint` result) and returns
the model, the task and the run config to give `training.loop.train`.

A quantized base (`attnlab quantize`) keeps its int8 / int4 Linears in the head model (QLoRA
with a float head; `quantize.handler.quantized_like`).

An encoder reads `<cls>` first (the token its sequence head pools), when the tokenizer has one.
Tagging aligns word tags to subword tokens with the first-subword rule (Devlin et al. 2019,
section 5.3): a word's first token carries its tag, every other token the loss's ignore index.

Shapes: B batch, T tokens, N labels.
"""

from collections import Counter
from dataclasses import replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.models.build import build_model
from attnlab.models.config import HeadConfig, ModelConfig
from attnlab.models.heads import copy_body
from attnlab.quantize.handler import quantized_like
from attnlab.tokenizer import Tokenizer
from attnlab.training.checks import TASK_ARCH
from attnlab.training.objectives import IGNORE_INDEX

TASK_ARCHES = {kind: TASK_ARCH[kind] for kind in ("classify", "tag")}  # the families of each


def check_examples(examples: list, fields: dict[str, type | tuple], split: str) -> None:
    """ValueError naming the first example (by index) that lacks a field or has the wrong type."""
    if not examples:
        raise ValueError(f"the {split} examples are empty; give at least one")
    for i, ex in enumerate(examples):
        if not isinstance(ex, dict):
            raise ValueError(
                f"{split} example {i} must be a dict with {sorted(fields)}, got {ex!r}"
            )
        for name, kind in fields.items():
            if name not in ex:
                raise ValueError(f"{split} example {i} has no field {name!r} (it has {sorted(ex)})")
            if not isinstance(ex[name], kind) or isinstance(ex[name], bool):
                raise ValueError(
                    f"{split} example {i}: field {name!r} must be {kind}, got {ex[name]!r}"
                )


def label_ids(values: list, names: tuple[str, ...], split: str, what: str) -> list[int]:
    """The ids of `values` (compared as strings) among `names`; an unseen one is a ValueError."""
    index = {name: i for i, name in enumerate(names)}
    unseen = sorted({str(v) for v in values} - set(index))
    if unseen:
        raise ValueError(
            f"the {split} examples have {what} {unseen} never seen in training (known: "
            f"{list(names)}); add training examples for them or drop them"
        )
    return [index[str(v)] for v in values]


def summed_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy summed over the labels that are not IGNORE_INDEX.

    Args:
        logits: (B, N) or (B, T, N).  labels: (B,) or (B, T), IGNORE_INDEX where none counts.
    """
    return F.cross_entropy(
        logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def pad(rows: list[list[int]], value: int) -> Tensor:
    """Right-pad lists of ints to one (B, T) long tensor."""
    T = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (T - len(r)) for r in rows], dtype=torch.long)


class HeadTask:
    """What ClassifyTask and TagTask share: encoded examples, random batches, ordered evaluation.

    Subclasses fill self.train_rows / self.val_rows (lists of (ids, labels)) and implement
    `_metrics` (the task's metric) and `_describe` (one prediction as text).

    Args:
        tokenizer: the base model's.  cfg: the model config with its head.
        batch_size: examples per batch.  max_len: the most tokens an example keeps.
    """

    def __init__(self, tokenizer: Tokenizer, cfg: ModelConfig, batch_size: int, max_len: int):
        self.tokenizer, self.cfg, self.batch_size = tokenizer, cfg, batch_size
        self.max_len = min(max_len, cfg.max_seq_len)
        cls = tokenizer.token_id("<cls>") if cfg.arch == "encoder" else None
        self.prefix = [] if cls is None else [cls]
        pad_id = tokenizer.token_id("<pad>")
        self.pad_id = 0 if pad_id is None else pad_id  # any id will do: the mask hides it
        self.train_rows: list[tuple[list[int], list[int]]] = []
        self.val_rows: list[tuple[list[int], list[int]]] = []

    def _batch(self, rows: list[tuple[list[int], list[int]]]) -> dict:
        ids = pad([r[0] for r in rows], self.pad_id)  # (B, T)
        mask = pad([[1] * len(r[0]) for r in rows], 0).bool()  # (B, T) True = real token
        labels = pad([r[1] for r in rows], IGNORE_INDEX)  # (B,) or (B, T)
        return {"ids": ids, "mask": mask, "labels": labels}

    def train_batch(self, gen: torch.Generator, rank: int = 0, world: int = 1) -> dict:
        """Examples drawn at random for the whole global batch, then this rank's slice."""
        b = self.batch_size
        pick = torch.randint(len(self.train_rows), (b * world,), generator=gen)
        return self._batch([self.train_rows[i] for i in pick[rank * b : (rank + 1) * b]])

    def n_targets(self, batch: dict) -> int:
        """The labels that count: every example's (classify), every word's first token (tag)."""
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def loss_sum(self, model: nn.Module, batch: dict) -> Tensor:
        """Cross-entropy summed over the batch's n_targets labels (a scalar)."""
        return summed_loss(model(batch["ids"], batch["mask"]), batch["labels"])

    @torch.no_grad()
    def evaluate(self, model: nn.Module, n_batches: int, device) -> dict:
        """val_loss and the task's metric on the first n_batches batches of the validation
        examples, in order (the same examples at every evaluation)."""
        rows = self.val_rows[: n_batches * self.batch_size]
        loss = count = 0.0
        predictions = []
        for start in range(0, len(rows), self.batch_size):
            batch = {
                k: v.to(device)
                for k, v in self._batch(rows[start : start + self.batch_size]).items()
            }
            logits = model(batch["ids"], batch["mask"])  # (B, N) or (B, T, N)
            loss += float(summed_loss(logits, batch["labels"]))
            count += self.n_targets(batch)
            predictions += list(logits.argmax(-1).cpu())  # one (,) or (T,) tensor per example
        return {"val_loss": loss / max(count, 1), **self._metrics(rows, predictions)}

    def _metrics(self, rows: list, predictions: list[Tensor]) -> dict:
        raise NotImplementedError

    @torch.no_grad()
    def sample(self, model: nn.Module, n_tokens: int, device, prompt: str = "") -> str:
        """The model's answer on the first validation example, as text (n_tokens unused)."""
        ids, labels = self.val_rows[0]
        batch = self._batch([(ids, labels)])
        logits = model(batch["ids"].to(device), batch["mask"].to(device))
        return self._describe(0, logits.argmax(-1)[0].cpu())

    def _describe(self, i: int, prediction: Tensor) -> str:
        raise NotImplementedError


class ClassifyTask(HeadTask):
    """Sequence classification: {"text", "label"} examples; reports accuracy.

    Args:
        tokenizer, cfg, batch_size, max_len: as HeadTask (cfg.head.labels names the classes).
        train, val: lists of {"text": str, "label": str | int}.
    """

    def __init__(self, tokenizer, cfg: ModelConfig, train: list, val: list, batch_size, max_len):
        super().__init__(tokenizer, cfg, batch_size, max_len)
        names = cfg.head.id2label
        self.names = tuple(names[i] for i in range(len(names)))
        self.val = val
        for split, examples, out in (
            ("train", train, self.train_rows),
            ("val", val, self.val_rows),
        ):
            check_examples(examples, {"text": str, "label": (str, int)}, split)
            labels = label_ids([ex["label"] for ex in examples], self.names, split, "labels")
            encoded = tokenizer.encode_batch([ex["text"] for ex in examples])
            for i, (ids, label) in enumerate(zip(encoded, labels)):
                ids = (self.prefix + ids)[: self.max_len]
                if not ids:
                    raise ValueError(
                        f"{split} example {i} has no tokens (text {examples[i]['text']!r})"
                    )
                out.append((ids, [label]))
        counts = Counter(r[1][0] for r in self.train_rows)
        self.majority = counts.most_common(1)[0][0]

    def _metrics(self, rows: list, predictions: list[Tensor]) -> dict:
        gold = [r[1][0] for r in rows]
        right = sum(int(p) == g for p, g in zip(predictions, gold))
        return {
            "val_accuracy": right / max(len(gold), 1),
            "val_majority": sum(g == self.majority for g in gold) / max(len(gold), 1),
        }

    def _describe(self, i: int, prediction: Tensor) -> str:
        ex = self.val[i]
        return f"{ex['text'][:80]!r} -> {self.names[int(prediction)]} (label {ex['label']})"


class TagTask(HeadTask):
    """Token classification: {"tokens", "tags"} examples (BIO tags, one per word); reports
    entity-level precision, recall and F1 (seqeval), and word accuracy.

    Each word is encoded after `word_sep` (a space: running text, so byte-level BPE sees "Ġword"
    as it does in prose); tokens that cover only the separator are ignored. Give word_sep=""
    when the words are pieces of a text that carry their own whitespace (characters, source
    tokens). A word cut off by max_len, or with no token of its own, is predicted "O".

    Args:
        tokenizer, cfg, batch_size, max_len: as HeadTask (cfg.head.labels names the tags).
        train, val: lists of {"tokens": [str], "tags": [str]}.  word_sep: see above.
    """

    def __init__(
        self, tokenizer, cfg: ModelConfig, train: list, val: list, batch_size, max_len, word_sep=" "
    ):
        super().__init__(tokenizer, cfg, batch_size, max_len)
        names = cfg.head.id2label
        self.names = tuple(names[i] for i in range(len(names)))
        self.word_sep = word_sep
        self.val, self.val_positions = val, []
        for split, examples, out in (
            ("train", train, self.train_rows),
            ("val", val, self.val_rows),
        ):
            check_examples(examples, {"tokens": list, "tags": list}, split)
            for i, ex in enumerate(examples):
                if not all(isinstance(w, str) for w in ex["tokens"]):
                    raise ValueError(f"{split} example {i}: every token must be a string")
                if len(ex["tokens"]) != len(ex["tags"]):
                    raise ValueError(
                        f"{split} example {i} has {len(ex['tokens'])} tokens but "
                        f"{len(ex['tags'])} tags; give one tag per token"
                    )
                tags = label_ids(ex["tags"], self.names, f"{split} example {i}", "tags")
                ids, labels, positions = self._align(ex["tokens"], tags)
                out.append((ids, labels))
                if split == "val":
                    self.val_positions.append(positions)

    def _align(self, words: list[str], tags: list[int]) -> tuple[list, list, list]:
        """(ids, labels, positions): labels IGNORE_INDEX but at each word's first token;
        positions[w] = the index of word w's first token, or -1."""
        ids, labels = list(self.prefix), [IGNORE_INDEX] * len(self.prefix)
        positions = [-1] * len(words)
        pieces = [(self.word_sep if w else "") + word for w, word in enumerate(words)]
        for w, enc in enumerate(
            self.tokenizer.backend.encode_batch(pieces, add_special_tokens=False)
        ):
            skip = len(pieces[w]) - len(words[w])  # the separator's characters
            for token, (_, end) in zip(enc.ids, enc.offsets):
                if len(ids) == self.max_len:
                    return ids, labels, positions
                first = end > skip and positions[w] < 0  # the word's first token of its own
                if first:
                    positions[w] = len(ids)
                ids.append(token)
                labels.append(tags[w] if first else IGNORE_INDEX)
        return ids, labels, positions

    def _tags(self, i: int, prediction: Tensor) -> list[str]:
        return [self.names[int(prediction[p])] if p >= 0 else "O" for p in self.val_positions[i]]

    def _metrics(self, rows: list, predictions: list[Tensor]) -> dict:
        try:
            from seqeval.metrics import f1_score, precision_score, recall_score
        except ImportError:
            raise ValueError(
                "tagging reports entity F1 through seqeval: pip install seqeval"
            ) from None
        gold = [list(map(str, self.val[i]["tags"])) for i in range(len(rows))]
        pred = [self._tags(i, p) for i, p in enumerate(predictions)]
        words = sum(len(g) for g in gold)
        right = sum(a == b for g, p in zip(gold, pred) for a, b in zip(g, p))
        return {
            "val_f1": float(f1_score(gold, pred, zero_division=0)),
            "val_precision": float(precision_score(gold, pred, zero_division=0)),
            "val_recall": float(recall_score(gold, pred, zero_division=0)),
            "val_word_accuracy": right / max(words, 1),
        }

    def _describe(self, i: int, prediction: Tensor) -> str:
        words, tags = self.val[i]["tokens"], self._tags(i, prediction)
        return " ".join(f"{w}/{t}" for w, t in list(zip(words, tags))[:20])


def build_head_task(
    kind: Literal["classify", "tag"],
    base,
    examples_train: list[dict],
    examples_val: list[dict],
    run,
    word_sep: str = " ",
    pooling: str = "cls",
):
    """A pre-trained base with a fresh head for `kind`, its task, and the run config to train.

    Args:
        kind: "classify" ({"text", "label"} examples) or "tag" ({"tokens", "tags"}).
        base: what `checkpoint.open_checkpoint` returned for the base model (with a tokenizer).
        examples_train, examples_val: the examples; labels (tags) are named in sorted order
            from the training examples ("O" first for tags).
        run: the run config (a RunConfig): train.batch_size, and train.context as the most
            tokens an example keeps.
        word_sep: TagTask's.
        pooling: the sequence head's, "cls" or "mean" (HeadConfig.pooling; classify only).

    Returns:
        (model, task, run): the head model in train mode (body weights from base), the task,
        and `run` with its model config set to the base's with the head; then
        `training.loop.train(model, task, run)`.
    """
    if kind not in TASK_ARCHES:
        raise ValueError(f"task {kind!r} is not one of {sorted(TASK_ARCHES)}")
    cfg: ModelConfig = base.config
    if cfg.arch not in TASK_ARCHES[kind]:
        raise ValueError(
            f"task {kind!r} needs a base model with arch in {list(TASK_ARCHES[kind])}; the base "
            f"checkpoint {str(base.path)!r} has arch={cfg.arch!r}"
        )
    if base.tokenizer is None:
        raise ValueError(f"the base checkpoint {str(base.path)!r} has no tokenizer.json")
    fields = (
        {"text": str, "label": (str, int)} if kind == "classify" else {"tokens": list, "tags": list}
    )
    check_examples(examples_train, fields, "train")
    if kind == "classify":
        seen = {str(ex["label"]): ex["label"] for ex in examples_train}
        names = sorted(seen, key=lambda s: (isinstance(seen[s], str), seen[s]))
        task_name = "sequence"
    else:
        seen = {str(t) for ex in examples_train for t in ex["tags"]}
        names = sorted(seen, key=lambda t: (t != "O", t))
        task_name = "token"
    pad_id = base.tokenizer.token_id("<pad>") if cfg.arch == "decoder" else None
    if pooling != "cls" and kind != "classify":
        raise ValueError(f"head.pooling={pooling!r} is for --task classify, not {kind!r}")
    cfg = replace(cfg, head=HeadConfig(task_name, len(names), tuple(names), pad_id, pooling))
    model = copy_body(quantized_like(build_model(cfg), base.model), base.model)
    task_cls = ClassifyTask if kind == "classify" else TagTask
    extra = {} if kind == "classify" else {"word_sep": word_sep}
    task = task_cls(
        base.tokenizer,
        cfg,
        examples_train,
        examples_val,
        run.train.batch_size,
        run.train.context,
        **extra,
    )
    return model, task, replace(run, model=cfg)
