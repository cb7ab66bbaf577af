"""What is trained: a task owns its data, draws batches, computes the loss and evaluates.

    LMTask       causal LM on a token stream (decoder models)
    PackedLMTask causal LM on packed rows of whole documents, with a document mask (data.pack)
    PrefixLMTask prefix LM (UniLM): bidirectional over a random prefix, causal after it
    PermutationLMTask  permutation LM (XLNet's content stream): a random factorisation order
    MLMTask      masked LM on the same kind of stream (encoder models)
    Seq2SeqTask  a synthetic copy / reverse / sort task (encoder-decoder models)
    SceneTask    VQA / VLA on generated scenes (vision-language models; training/embodied.py)

The loop only calls `train_batch`, `n_targets`, `loss_sum`, `evaluate` and `sample`, so it never
branches on the objective. `loss_sum` is the loss summed over a batch's target tokens and
`n_targets` their number: the loop divides the sum over all micro-batches by the global batch's
count, so gradient accumulation gives the global batch's mean (objectives.py). Evaluation
draws from its own seeded generator, so it never disturbs the training RNG.
"""

import math

import torch
from torch import Tensor, nn

from attnlab.components.masks import document_mask_mod, permutation_mask, prefix_lm_mask
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.tokenizer import Tokenizer
from attnlab.training.config import RunConfig
from attnlab.training.data import (
    TokenData,
    lm_batch,
    mask_tokens,
    pack_rows,
    packed_batch,
    pad_batch,
    prepare_text_data,
)
from attnlab.training.embodied import SceneTask
from attnlab.training.objectives import IGNORE_INDEX, clm_loss, mlm_loss, n_targets, seq2seq_loss
from attnlab.training.synthetic import synthetic_pairs, synthetic_tokenizer, task_name

EVAL_SEED = 1234
SAMPLE_SETTINGS = SamplingConfig(temperature=0.8, top_k=50)
GREEDY = SamplingConfig(temperature=0.0)


class LMTask:
    """Next-token prediction on random windows of a token stream."""

    def __init__(self, data: TokenData, run: RunConfig):
        self.data, self.tokenizer, self.run = data, data.tokenizer, run
        self.context, self.batch_size = run.train.context, run.train.batch_size

    def train_batch(self, gen: torch.Generator, rank: int = 0, world: int = 1) -> dict:
        x, y = lm_batch(self.data.train, self.context, self.batch_size, gen, rank, world)
        return {"x": x, "y": y}

    def n_targets(self, batch: dict) -> int:
        """Every position predicts the next token: B * T targets."""
        return batch["y"].numel()

    def loss_sum(self, model: nn.Module, batch: dict) -> Tensor:
        """The cross-entropy summed over the batch's n_targets tokens (a scalar)."""
        return clm_loss(model(batch["x"]), batch["y"], reduction="sum")

    @torch.no_grad()
    def evaluate(self, model: nn.Module, n_batches: int, device) -> dict:
        gen = torch.Generator().manual_seed(EVAL_SEED)
        loss = count = 0
        for _ in range(n_batches):
            batch = _to(self._val_batch(gen), device)
            loss += self.loss_sum(model, batch).item()
            count += self.n_targets(batch)
        loss /= count
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    def _val_batch(self, gen) -> dict:
        x, y = lm_batch(self.data.val, self.context, self.batch_size, gen)
        return {"x": x, "y": y}

    @torch.no_grad()
    def sample(self, model: nn.Module, n_tokens: int, device, prompt: str = "\n") -> str:
        """n_tokens sampled after `prompt`, never attending beyond the trained context.

        A model trained on windows of `context` tokens has never seen a longer one (nor, with
        learned or RoPE positions, the positions past it), so, like nanoGPT's sampler, we crop:
        when the text fills the context, its last half becomes the context the generation
        continues from (`generate`'s max_context and crop_to).
        """
        half = max(self.context // 2, 1)
        ids = self.tokenizer.encode(prompt)[-half:] or [0]
        new = generate(
            model,
            [ids],
            GenerationConfig(
                n_tokens, SAMPLE_SETTINGS, seed=EVAL_SEED, max_context=self.context, crop_to=half
            ),
        )[0]
        return self.tokenizer.decode(ids + new)


class PackedLMTask(LMTask):
    """Next-token prediction on packed rows of whole documents (data.pack; see DataConfig).

    Each row's tokens attend only to earlier tokens of their own document (`document_mask_mod`,
    a BlockMask on the flex backend, a dense mask on the others), their positions restart at 0
    at each document, and labels that cross into another document or padding are ignored.
    """

    def __init__(self, data: TokenData, run: RunConfig):
        super().__init__(data, run)
        if data.train_docs is None or data.val_docs is None:
            raise ValueError(
                "data.pack needs the documents' offsets, which this token cache lacks; delete "
                f"{run.data.cache_dir!r} to rebuild it"
            )
        row = self.context + 1
        self.train_layout = pack_rows(data.train_docs, row)
        self.val_layout = pack_rows(data.val_docs, row)

    def train_batch(self, gen: torch.Generator, rank: int = 0, world: int = 1) -> dict:
        return packed_batch(
            self.data.train, self.train_layout, self.context, self.batch_size, gen, rank, world
        )

    def _val_batch(self, gen) -> dict:
        return packed_batch(self.data.val, self.val_layout, self.context, self.batch_size, gen)

    def n_targets(self, batch: dict) -> int:
        """The labels inside their input's document (labels != -100)."""
        return n_targets(batch["labels"], IGNORE_INDEX)

    def loss_sum(self, model: nn.Module, batch: dict) -> Tensor:
        """The cross-entropy summed over the batch's in-document labels (a scalar)."""
        mask_mod = document_mask_mod(batch["doc"])  # causal within each document
        logits = model(batch["x"], attn_mask=mask_mod, pos=batch["pos"])  # (B, T, V)
        return mlm_loss(logits, batch["labels"], reduction="sum")


class MLMTask(LMTask):
    """BERT-style masked LM on random windows of a token stream."""

    def __init__(self, data: TokenData, run: RunConfig):
        super().__init__(data, run)
        tok = self.tokenizer
        self.mask_id = tok.token_id("<mask>")
        if self.mask_id is None:
            raise ValueError("masked LM needs a <mask> token in the tokenizer")
        self.special_ids = sorted(tok.special_ids.values())

    def _mask(self, x: Tensor, gen) -> dict:
        inputs, labels = mask_tokens(
            x,
            self.mask_id,
            self.tokenizer.vocab_size,
            self.special_ids,
            gen,
            self.run.data.mlm_probability,
        )
        return {"x": inputs, "labels": labels}

    def train_batch(self, gen, rank: int = 0, world: int = 1) -> dict:
        # Mask the whole global batch, then slice: the masks (and the generator's state) are
        # then the same for any number of ranks.
        b = self.batch_size
        x, _ = lm_batch(self.data.train, self.context, b * world, gen)  # (b * world, T)
        batch = self._mask(x, gen)
        return {k: v[rank * b : (rank + 1) * b] for k, v in batch.items()}  # (b, T)

    def _val_batch(self, gen) -> dict:
        x, _ = lm_batch(self.data.val, self.context, self.batch_size, gen)
        return self._mask(x, gen)

    def n_targets(self, batch: dict) -> int:
        """Only the masked positions count (labels != -100)."""
        return n_targets(batch["labels"], IGNORE_INDEX)

    def loss_sum(self, model, batch) -> Tensor:
        """The cross-entropy summed over the batch's masked tokens (a scalar)."""
        return mlm_loss(model(batch["x"]), batch["labels"], reduction="sum")

    @torch.no_grad()
    def evaluate(self, model, n_batches: int, device) -> dict:
        """The mean loss and accuracy over all masked tokens of n_batches batches."""
        gen = torch.Generator().manual_seed(EVAL_SEED)
        loss = correct = total = 0.0
        for _ in range(n_batches):
            batch = _to(self._val_batch(gen), device)
            logits = model(batch["x"])  # (B, T, V)
            loss += mlm_loss(logits, batch["labels"], reduction="sum").item()
            picked = batch["labels"] != IGNORE_INDEX
            correct += (logits.argmax(-1)[picked] == batch["labels"][picked]).sum().item()
            total += picked.sum().item()
        total = max(total, 1)
        return {"val_loss": loss / total, "val_mlm_accuracy": correct / total}

    def sample(self, model, n_tokens: int, device, prompt: str = "") -> None:
        return None


class _MaskedOrderTask(LMTask):
    """An LM whose batches carry their own attention mask (B, T, T) and labels (-100 = none).

    A subclass says how a window of ids x (B, T) with next tokens y (B, T) becomes
    {"x", "attn_mask", "labels"} (`_objective`); drawing, loss and counting are shared.
    """

    def _objective(self, x: Tensor, y: Tensor, gen: torch.Generator) -> dict:
        raise NotImplementedError

    def train_batch(self, gen, rank: int = 0, world: int = 1) -> dict:
        # Draw the whole global batch, then slice: the masks (and the generator's state) are
        # then the same for any number of ranks.
        b = self.batch_size
        x, y = lm_batch(self.data.train, self.context, b * world, gen)  # (b * world, T)
        batch = self._objective(x, y, gen)
        return {k: v[rank * b : (rank + 1) * b] for k, v in batch.items()}

    def _val_batch(self, gen) -> dict:
        x, y = lm_batch(self.data.val, self.context, self.batch_size, gen)
        return self._objective(x, y, gen)

    def n_targets(self, batch: dict) -> int:
        """Only the positions with a label count (labels != -100)."""
        return n_targets(batch["labels"], IGNORE_INDEX)

    def loss_sum(self, model: nn.Module, batch: dict) -> Tensor:
        """The cross-entropy summed over the batch's labelled tokens (a scalar)."""
        logits = model(batch["x"], attn_mask=batch["attn_mask"])  # (B, T, V)
        return mlm_loss(logits, batch["labels"], reduction="sum")


class PrefixLMTask(_MaskedOrderTask):
    """Prefix LM (UniLM, Dong et al. 2019): each window is split at a random prefix length P
    (1 <= P < T); the prefix attends to itself both ways, the rest causally, and the loss is on
    the tokens after the prefix only: x[P:] and the window's next token y[T-1].

    The output at position i predicts y[i] = x[i+1], so positions P-1 .. T-1 carry labels; each
    of them sees only keys <= i (the prefix lies before P), so no label leaks into its input.
    Sampling (`LMTask.sample`) is left to right, as a causal LM.
    """

    def _objective(self, x: Tensor, y: Tensor, gen: torch.Generator) -> dict:
        B, T = x.shape
        prefix = torch.randint(1, T, (B,), generator=gen)  # (B,)
        before = torch.arange(T)[None, :] < (prefix - 1)[:, None]  # (B, T) outputs in the prefix
        mask = prefix_lm_mask(T, prefix)[:, 0]  # (B, T, T)
        return {"x": x, "attn_mask": mask, "labels": y.masked_fill(before, IGNORE_INDEX)}


class PermutationLMTask(_MaskedOrderTask):
    """Permutation LM (XLNet, Yang et al. 2019), content stream only: a random factorisation
    order per window; the token at order[r] attends to itself and the tokens earlier in the
    order (`permutation_mask(order) | I`), and its output predicts the next token in the order,
    x[order[r+1]]. Positions stay the tokens' own.

    XLNet's second, query stream (which is told the position it predicts, but not its token) is
    left out: here the model is not told which position comes next, so its loss is an upper
    bound of what the two-stream model learns. With the identity order the mask is causal and
    the target the next token, so the trained model samples left to right as a causal LM.
    """

    def _objective(self, x: Tensor, y: Tensor, gen: torch.Generator) -> dict:
        B, T = x.shape
        order = torch.stack([torch.randperm(T, generator=gen) for _ in range(B)])  # (B, T)
        eye = torch.eye(T, dtype=torch.bool)
        mask = torch.stack([permutation_mask(o) | eye for o in order])  # (B, T, T)
        labels = torch.full_like(x, IGNORE_INDEX)  # the last in the order predicts nothing
        labels.scatter_(1, order[:, :-1], x.gather(1, order[:, 1:]))  # (B, T)
        return {"x": x, "attn_mask": mask, "labels": labels}


class Seq2SeqTask:
    """A synthetic seq2seq task; the source ends with <eos>, the target starts with <bos>."""

    def __init__(self, run: RunConfig):
        d = run.data
        self.run, self.task = run, task_name(d.source)
        self.tokenizer: Tokenizer = synthetic_tokenizer(d.synthetic_n_symbols)
        tok = self.tokenizer
        self.pad, self.bos, self.eos = (tok.token_id(t) for t in ("<pad>", "<bos>", "<eos>"))
        val_gen = torch.Generator().manual_seed(EVAL_SEED + 1)
        self.val_pairs = self._pairs(d.synthetic_n_val, val_gen)

    def _pairs(self, n: int, gen) -> list[tuple[str, str]]:
        d = self.run.data
        return synthetic_pairs(
            self.task, n, d.synthetic_n_symbols, d.synthetic_min_len, d.synthetic_max_len, gen
        )

    def _batch(self, pairs: list[tuple[str, str]]) -> dict:
        tok = self.tokenizer
        src, src_mask = pad_batch([tok.encode(s) + [self.eos] for s, _ in pairs], self.pad)
        tgt_in, tgt_mask = pad_batch([[self.bos] + tok.encode(t) for _, t in pairs], self.pad)
        labels, _ = pad_batch([tok.encode(t) + [self.eos] for _, t in pairs], self.pad)
        return {
            "src": src,
            "src_mask": src_mask,
            "tgt": tgt_in,
            "tgt_mask": tgt_mask,
            "labels": labels,
        }

    def train_batch(self, gen, rank: int = 0, world: int = 1) -> dict:
        b = self.run.train.batch_size
        pairs = self._pairs(b * world, gen)[rank * b : (rank + 1) * b]
        return self._batch(pairs)

    def n_targets(self, batch: dict) -> int:
        """The target tokens that are not padding."""
        return n_targets(batch["labels"], self.pad)

    def loss_sum(self, model, batch) -> Tensor:
        """The (label-smoothed) cross-entropy summed over the non-padding targets (a scalar)."""
        logits = model(
            batch["src"],
            batch["tgt"],
            attention_mask=batch["src_mask"],
            decoder_attention_mask=batch["tgt_mask"],
        )
        eps = self.run.train.label_smoothing
        return seq2seq_loss(logits, batch["labels"], self.pad, eps, reduction="sum")

    @torch.no_grad()
    def evaluate(self, model, n_batches: int, device) -> dict:
        """The mean loss over every target token of the held-out pairs, and exact matches."""
        b = self.run.train.batch_size * 8
        loss, count, hits = 0.0, 0, 0
        chunks = [self.val_pairs[i : i + b] for i in range(0, len(self.val_pairs), b)]
        for chunk in chunks:
            batch = _to(self._batch(chunk), device)
            loss += self.loss_sum(model, batch).item()
            count += self.n_targets(batch)
            hits += sum(a == t for a, (_, t) in zip(self.translate(model, batch), chunk))
        return {"val_loss": loss / count, "val_exact_match": hits / len(self.val_pairs)}

    def translate(self, model, batch: dict) -> list[str]:
        max_new = self.run.data.synthetic_max_len + 1
        starts = [[self.bos]] * batch["src"].shape[0]
        rows = generate(
            model,
            starts,
            GenerationConfig(max_new, GREEDY, stop_tokens=[self.eos]),
            source=batch["src"],
            source_mask=batch["src_mask"],
        )
        return [self.tokenizer.decode([t for t in row if t != self.eos]) for row in rows]

    @torch.no_grad()
    def sample(self, model, n_tokens: int, device, prompt: str = "") -> str:
        src, tgt = self.val_pairs[0]
        got = self.translate(model, _to(self._batch([(src, tgt)]), device))[0]
        return f"{src} -> {got} (expected {tgt})"


def _to(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def build_task(run: RunConfig):
    """The task a run config describes; text data is prepared (and cached) here."""
    if run.data.task in ("vqa", "vla"):
        return SceneTask(run)
    if run.data.task == "seq2seq":
        if not run.data.source.startswith("synthetic:"):
            raise ValueError(f"seq2seq trains on synthetic tasks; got source {run.data.source!r}")
        return Seq2SeqTask(run)
    data = prepare_text_data(run.data)
    tasks = {"mlm": MLMTask, "prefix_lm": PrefixLMTask, "permutation_lm": PermutationLMTask}
    if run.data.pack:
        return PackedLMTask(data, run)
    return tasks.get(run.data.task, LMTask)(data, run)
