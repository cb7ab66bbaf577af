"""Fine-tuning tasks for the training loop (attnlab/training/loop.py): SFT and DPO.

    SFTTask   {"prompt", "response"} examples: next-token loss on the response tokens only;
              evaluation adds exact match of greedily generated responses
    DPOTask   {"prompt", "chosen", "rejected"} pairs: the DPO loss against a frozen reference;
              evaluation adds the reward margin and preference accuracy

Like the pre-training tasks (training/tasks.py), a task provides what the loop calls:
`train_batch(gen, rank, world)`, `n_targets(batch)`, `loss_sum(model, batch)` (the loss summed
over the batch's n_targets units: response tokens for SFT, pairs for DPO, so the loop's division
by the global count gives the token-weighted, resp. pair-averaged, mean), `evaluate(model,
n_batches, device)` and `sample(model, n_tokens, device)`, plus `tokenizer`. Examples are drawn
with replacement from the seeded generator, so a resumed run draws what the first one would have.

Examples become token rows as sequences.py says (the chat template when the tokenizer has one,
padded or packed rows). Examples longer than `context` tokens are left out (and counted in
`skipped`).

Shapes: B batch, T length (<= context), V vocab_size.
"""

import torch
from torch import Tensor, nn

from attnlab.finetune.metrics import exact_match, preference_metrics
from attnlab.finetune.objectives import (
    IGNORE_INDEX,
    pair_losses,
    reference_model,
    response_labels,
    sequence_logps,
    sft_loss,
    token_logps,
)
from attnlab.finetune.sequences import (
    DPO_FIELDS,
    SFT_FIELDS,
    ChatFormat,
    check_examples,
    pack_rows,
    pad_rows,
)
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.quantize import without_kernels

GREEDY = SamplingConfig(temperature=0.0)


def _forward(model: nn.Module, batch: dict) -> Tensor:
    """Logits (B, T, V) of a padded or packed batch."""
    if "attn_mask" in batch:
        return model(batch["x"], pos=batch["pos"], attn_mask=batch["attn_mask"])
    return model(batch["x"], attention_mask=batch["mask"])


def _to(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


class _PromptTask:
    """What SFT and DPO share: encoded examples, drawing, greedy responses."""

    fields: tuple[str, ...] = ()

    def __init__(self, train, val, tokenizer, batch_size, context, chat_template, eval_examples):
        check_examples(train, self.fields, "the training data")
        check_examples(val, self.fields, "the validation data")
        self.tokenizer, self.batch_size, self.context = tokenizer, batch_size, context
        self.format = ChatFormat(tokenizer, chat_template)
        self.pad = tokenizer.token_id("<pad>") or 0
        self.skipped = 0
        self.train = self._encode_all(train)
        self.val = self._encode_all(val[:eval_examples])
        self.val_examples = list(val[:eval_examples])
        for split, rows in (("training", self.train), ("validation", self.val)):
            if not rows:
                raise ValueError(
                    f"every {split} example is longer than train.context={context} tokens; "
                    "raise --train.context"
                )

    def _encode_all(self, examples: list[dict]) -> list:
        out = []
        for ex in examples:
            encoded = self._encode(ex)
            if encoded is None:
                self.skipped += 1
            else:
                out.append(encoded)
        return out

    def _row(self, prompt: str, response: str) -> tuple[list[int], list[int]] | None:
        """(x, labels) of one sequence, or None when it is longer than the context."""
        ids, n_prompt = self.format.encode(prompt, response)
        if len(ids) - 1 > self.context:
            return None
        return response_labels(ids, n_prompt)

    def _draw(self, gen: torch.Generator, n: int) -> list[int]:
        return torch.randint(len(self.train), (n,), generator=gen).tolist()

    @torch.no_grad()
    def responses(self, model: nn.Module, prompts: list[str], max_new_tokens: int) -> list[str]:
        """Greedy responses to `prompts` (left-padded batches, never past the context)."""
        out = []
        fmt = self.format
        for i in range(0, len(prompts), 16):
            ids = [self.tokenizer.encode(fmt.prompt_text(p)) for p in prompts[i : i + 16]]
            room = self.context - max(len(p) for p in ids)
            if room < 1:
                out += [""] * len(ids)
                continue
            rows = generate(
                model,
                ids,
                GenerationConfig(
                    min(max_new_tokens, room),
                    GREEDY,
                    stop_tokens=fmt.stop_tokens,
                    stop_strings=[fmt.end],
                ),
                decode=lambda t: self.tokenizer.decode(t, skip_special=False),
            )
            out += [fmt.response_of(row) for row in rows]
        return out


class SFTTask(_PromptTask):
    """Supervised fine-tuning on {"prompt", "response"} examples.

    Args:
        train, val: the examples (dicts).  tokenizer: the base model's Tokenizer.
        batch_size: sequences per micro-batch (rows of `context` tokens when packing).
        context: the longest sequence (train.context, at most the model's max_seq_len).
        packing: several examples per row (`pack_rows`) instead of one per padded row.
        chat_template: use the tokenizer's chat template when it has one.
        eval_examples: held-out examples scored per evaluation.
        max_new_tokens: the longest response generated for exact match.
    """

    fields = SFT_FIELDS

    def __init__(
        self,
        train: list[dict],
        val: list[dict],
        tokenizer,
        batch_size: int,
        context: int,
        packing: bool = False,
        chat_template: bool = True,
        eval_examples: int = 64,
        max_new_tokens: int = 48,
    ):
        super().__init__(train, val, tokenizer, batch_size, context, chat_template, eval_examples)
        self.packing, self.max_new_tokens = packing, max_new_tokens

    def _encode(self, ex: dict):
        return self._row(ex["prompt"], ex["response"])

    def train_batch(self, gen: torch.Generator, rank: int = 0, world: int = 1) -> dict:
        b = self.batch_size
        if not self.packing:
            rows = [self.train[i] for i in self._draw(gen, b * world)]
            return pad_rows(rows[rank * b : (rank + 1) * b], self.pad)
        packed = []
        for _ in range(b * world):  # fill each row until the next example does not fit
            row, used = [], 0
            while True:
                x, labels = self.train[self._draw(gen, 1)[0]]
                if used + len(x) > self.context:
                    break  # that draw is dropped: the state stays in `gen` alone
                row.append((x, labels))
                used += len(x)
            packed.append(row)
        return pack_rows(packed[rank * b : (rank + 1) * b], self.context, self.pad)

    def n_targets(self, batch: dict) -> int:
        """The response tokens (labels != IGNORE_INDEX)."""
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def loss_sum(self, model: nn.Module, batch: dict) -> Tensor:
        """The cross-entropy summed over the batch's response tokens (a scalar)."""
        return sft_loss(_forward(model, batch), batch["labels"], reduction="sum")

    @torch.no_grad()
    def evaluate(self, model: nn.Module, n_batches: int, device) -> dict:
        """Loss per response token and exact match over the first `eval_examples` held-out
        examples (all of them, whatever n_batches)."""
        loss = count = 0.0
        for i in range(0, len(self.val), self.batch_size):
            batch = _to(pad_rows(self.val[i : i + self.batch_size], self.pad), device)
            loss += self.loss_sum(model, batch).item()
            count += self.n_targets(batch)
        examples = self._fitting(self.val_examples)
        got = self.responses(model, [ex["prompt"] for ex in examples], self.max_new_tokens)
        match = exact_match(got, [ex["response"] for ex in examples])
        return {"val_loss": loss / max(count, 1), "val_exact_match": match}

    def _fitting(self, examples: list[dict]) -> list[dict]:
        return [ex for ex in examples if self._encode(ex) is not None]

    @torch.no_grad()
    def sample(self, model: nn.Module, n_tokens: int, device, prompt: str = "") -> str:
        ex = self._fitting(self.val_examples)[0]
        got = self.responses(model, [ex["prompt"]], self.max_new_tokens)[0]
        return f"{ex['prompt']} -> {got.strip()!r} (expected {ex['response'].strip()!r})"


class DPOTask(_PromptTask):
    """DPO on {"prompt", "chosen", "rejected"} pairs (Rafailov et al. 2023).

    A batch holds the chosen sequences of b pairs, then their rejected ones: x (2b, T). The
    reference log-probs are computed in `loss_sum` without gradient, by `reference` (a frozen
    copy of the base model) or, when it is None, by the policy with its LoRA adapters off
    (`objectives.reference_model`) -- or, after `precompute_reference`, read from a table
    that the batches carry ("ref_logps").

    Args:
        train, val, tokenizer, batch_size (pairs per micro-batch), context, chat_template,
        eval_examples: as SFTTask's.
        beta: DPO's beta.  reference: the frozen reference model, or None (adapters off).
        rpo_alpha: the weight of RPO's NLL term on the chosen responses (0: plain DPO;
            `objectives.pair_losses`).
        loss, label_smoothing: the preference loss (sigmoid, ipo, robust) and its eps
            (`objectives.dpo_loss`).
    """

    fields = DPO_FIELDS

    def __init__(
        self,
        train: list[dict],
        val: list[dict],
        tokenizer,
        batch_size: int,
        context: int,
        beta: float = 0.1,
        reference: nn.Module | None = None,
        chat_template: bool = True,
        eval_examples: int = 64,
        rpo_alpha: float = 0.0,
        loss: str = "sigmoid",
        label_smoothing: float = 0.0,
    ):
        super().__init__(train, val, tokenizer, batch_size, context, chat_template, eval_examples)
        self.beta, self.rpo_alpha = beta, rpo_alpha
        self.loss, self.label_smoothing = loss, label_smoothing
        self.reference = None if reference is None else reference.eval().requires_grad_(False)
        self.ref_train = self.ref_val = None  # (N, 2) reference log-probs, once precomputed

    def _encode(self, ex: dict):
        chosen = self._row(ex["prompt"], ex["chosen"])
        rejected = self._row(ex["prompt"], ex["rejected"])
        return None if chosen is None or rejected is None else (chosen, rejected)

    def _batch(self, pairs: list, refs: Tensor | None = None) -> dict:
        """Chosen rows, then rejected rows, padded: x (2b, T); with refs (b, 2), the reference
        log-probs of (chosen, rejected) as "ref_logps" (2b,) in the same order."""
        batch = pad_rows([c for c, _ in pairs] + [r for _, r in pairs], self.pad)  # (2b, T)
        if refs is not None:
            batch["ref_logps"] = torch.cat([refs[:, 0], refs[:, 1]])  # (2b,)
        return batch

    def train_batch(self, gen: torch.Generator, rank: int = 0, world: int = 1) -> dict:
        b = self.batch_size
        picked = self._draw(gen, b * world)[rank * b : (rank + 1) * b]
        refs = None if self.ref_train is None else self.ref_train[picked]  # (b, 2)
        return self._batch([self.train[i] for i in picked], refs)

    @torch.no_grad()
    def precompute_reference(self, model: nn.Module, device) -> None:
        """Compute the reference log-probs of every training and held-out pair once, so that
        each step runs the policy alone (trl's `precompute_ref_log_probs`). A speed-up, off
        unless asked for: the reference is frozen, so these are the values each step would
        compute (up to float rounding in differently padded batches). The frozen copy is then
        let go.

        Args:
            model: the policy as it starts (its adapters are switched off when there is no
                frozen copy).
        """
        mode = model.training
        model.eval()
        self.ref_train = self._reference_table(self.train, model, device)
        self.ref_val = self._reference_table(self.val, model, device)
        model.train(mode)
        self.reference = None

    def _reference_table(self, pairs: list, model: nn.Module, device) -> Tensor:
        rows = []
        for i in range(0, len(pairs), self.batch_size):
            batch = _to(self._batch(pairs[i : i + self.batch_size]), device)
            rows.append(self._reference_logps(model, batch).view(2, -1).T.cpu())  # (b, 2)
        return torch.cat(rows)  # (N, 2)

    def _reference_logps(self, model: nn.Module, batch: dict) -> Tensor:
        """log ref(y|x) of the batch's sequences, (2b,), without gradient (a quantized base
        through the policy's exact path: `pair_losses`)."""
        if self.reference is not None:
            self.reference.to(batch["x"].device)  # a no-op once it is there
        with (
            torch.no_grad(),
            without_kernels(model, self.reference),
            reference_model(model, self.reference) as ref,
        ):
            return sequence_logps(_forward(ref, batch), batch["labels"])

    def n_targets(self, batch: dict) -> int:
        """The pairs: the loss is a mean over pairs."""
        return batch["x"].shape[0] // 2

    def pair_losses(self, model: nn.Module, batch: dict) -> tuple[Tensor, Tensor, Tensor]:
        """Each pair's DPO (or RPO) loss and its chosen and rejected rewards, all (b,).

        A quantized base (QLoRA) takes the same exact path in the policy's forward as in the
        reference's (`quantize.without_kernels`): the bf16 kernel, which a layer takes only
        when no gradient flows through it, made the policy differ from its own reference at
        step 0 (log-ratios off zero, the loss off log 2)."""
        with without_kernels(model):
            tokens = token_logps(_forward(model, batch), batch["labels"])  # (2b, T)
        ref_logps = batch.get("ref_logps")  # (2b,) when precomputed
        if ref_logps is None:
            ref_logps = self._reference_logps(model, batch)
        extra = (self.rpo_alpha, self.loss, self.label_smoothing)
        return pair_losses(tokens, batch["labels"], ref_logps, self.beta, *extra)

    def loss_sum(self, model: nn.Module, batch: dict) -> Tensor:
        """The DPO loss summed over the batch's pairs (a scalar)."""
        return self.pair_losses(model, batch)[0].sum()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, n_batches: int, device) -> dict:
        """Mean loss, rewards, reward margin and preference accuracy over the first
        `eval_examples` held-out pairs (all of them, whatever n_batches)."""
        losses, chosen, rejected = [], [], []
        for i in range(0, len(self.val), self.batch_size):
            refs = None if self.ref_val is None else self.ref_val[i : i + self.batch_size]
            batch = _to(self._batch(self.val[i : i + self.batch_size], refs), device)
            loss, rc, rr = self.pair_losses(model, batch)
            losses.append(loss.cpu())
            chosen.append(rc.cpu())
            rejected.append(rr.cpu())
        chosen, rejected = torch.cat(chosen), torch.cat(rejected)
        prefs = preference_metrics(chosen, rejected)
        return {
            "val_loss": float(torch.cat(losses).mean()),
            "val_reward_margin": prefs["reward_margin"],
            "val_preference_accuracy": prefs["preference_accuracy"],
            "val_chosen_reward": float(chosen.mean()),
            "val_rejected_reward": float(rejected.mean()),
        }

    @torch.no_grad()
    def sample(self, model: nn.Module, n_tokens: int, device, prompt: str = "") -> str:
        ex = next(e for e in self.val_examples if self._encode(e) is not None)
        got = self.responses(model, [ex["prompt"]], max(n_tokens, 1))[0]
        return f"{ex['prompt']} -> {got.strip()!r} (chosen {ex['chosen'].strip()!r})"
