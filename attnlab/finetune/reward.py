"""The reward model of RLHF (Stiennon et al. 2020; Ouyang et al. 2022 §3.5): a decoder with a
one-output sequence head, trained on preference pairs to score the chosen response above the
rejected one.

The head reads the hidden state of the last real token of prompt + response (a causal model
has read the whole text only there), as transformers' `*ForSequenceClassification` with
num_labels=1 does: `models.heads.DecoderForSequenceClassification`, so a reward model exports
to HF as the other sequence heads do. Its score r(x, y) is the logit.

Bradley-Terry (1952): P(y_c preferred to y_r | x) = sigmoid(r(x, y_c) - r(x, y_r)), so the
negative log-likelihood of a pair is

    L = -log sigmoid(r_c - r_r - m)  [+ c * (r_c + r_r)^2]

with m a margin the pair may carry (Touvron et al. 2023, Llama 2 §3.2.2: how much better the
chosen one is) and c the centring coefficient (Eisenstein et al. 2023), as trl's
`RewardTrainer.compute_loss`. Held-out metric: pairwise accuracy, how often r_c > r_r.

Shapes: b pairs, B = 2b sequences (the chosen ones first), T length.
"""

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.finetune.heads_tasks import pad
from attnlab.finetune.metrics import preference_metrics
from attnlab.finetune.sequences import DPO_FIELDS, ChatFormat, check_examples
from attnlab.models.build import build_model
from attnlab.models.config import HeadConfig, ModelConfig
from attnlab.models.heads import copy_body
from attnlab.quantize.handler import quantized_like


def _to(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def reward_loss(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, center: float = 0.0
) -> Tensor:
    """The Bradley-Terry loss of each pair (its mean is trl's RewardTrainer loss).

    Args:
        chosen, rejected: (b,) the scores r(x, y_c) and r(x, y_r).
        margin: (b,) how far above r_r the chosen score should be (None: 0).
        center: the weight of (r_c + r_r)^2, which pulls the scores towards 0.

    Returns:
        (b,) -log sigmoid(r_c - r_r - margin) + center * (r_c + r_r)^2.
    """
    diff = chosen - rejected if margin is None else chosen - rejected - margin
    losses = -F.logsigmoid(diff)
    if center:
        losses = losses + center * (chosen + rejected) ** 2
    return losses


def reward_model(base) -> tuple[nn.Module, ModelConfig]:
    """(model, its config): the base decoder (an `open_checkpoint` result) with a fresh
    one-output sequence head (HeadConfig num_labels=1, label "reward") in place of its LM head;
    a quantized base keeps its int8 / int4 Linears (QLoRA)."""
    pad_id = base.tokenizer.token_id("<pad>")
    cfg = replace(base.config, head=HeadConfig("sequence", 1, ("reward",), pad_id))
    return copy_body(quantized_like(build_model(cfg), base.model), base.model), cfg


class RewardTask:
    """A reward model on {"prompt", "chosen", "rejected"} pairs (and an optional "margin").

    Each response is scored as prompt + response through the chat format (the tokenizer's
    template when it has one), ending with its end-of-turn marker (or <eos>). Pairs longer than
    `context` tokens are left out (counted in `skipped`).

    Args:
        train, val: the pairs.  tokenizer: the base's.  batch_size: pairs per micro-batch.
        context: the longest sequence.  chat_template, eval_examples: as SFTTask's.
        center: reward.center_coefficient.
    """

    def __init__(
        self,
        train: list[dict],
        val: list[dict],
        tokenizer,
        batch_size: int,
        context: int,
        chat_template: bool = True,
        eval_examples: int = 64,
        center: float = 0.0,
    ):
        check_examples(train, DPO_FIELDS, "the training data")
        check_examples(val, DPO_FIELDS, "the validation data")
        self.tokenizer, self.batch_size, self.context = tokenizer, batch_size, context
        self.format, self.center = ChatFormat(tokenizer, chat_template), center
        self.pad = tokenizer.token_id("<pad>") or 0
        self.skipped = 0
        self.train = self._encode_all(train)
        self.val_examples = [ex for ex in val[:eval_examples] if self._encode(ex) is not None]
        self.val = self._encode_all(val[:eval_examples])
        for split, rows in (("training", self.train), ("validation", self.val)):
            if not rows:
                raise ValueError(
                    f"every {split} pair is longer than train.context={context} tokens; "
                    "raise --train.context"
                )

    def _encode(self, ex: dict) -> tuple[list[int], list[int], float] | None:
        """(chosen ids, rejected ids, margin), or None when one is longer than the context."""
        chosen = self.format.encode(ex["prompt"], ex["chosen"])[0]
        rejected = self.format.encode(ex["prompt"], ex["rejected"])[0]
        if max(len(chosen), len(rejected)) > self.context:
            return None
        return chosen, rejected, float(ex.get("margin", 0.0))

    def _encode_all(self, examples: list[dict]) -> list:
        encoded = [self._encode(ex) for ex in examples]
        self.skipped += sum(e is None for e in encoded)
        return [e for e in encoded if e is not None]

    def _batch(self, pairs: list) -> dict:
        """ids (2b, T): the chosen sequences, then the rejected ones, right-padded; mask (2b,
        T) True = real token; margin (b,)."""
        rows = [c for c, _, _ in pairs] + [r for _, r, _ in pairs]
        return {
            "ids": pad(rows, self.pad),
            "mask": pad([[1] * len(r) for r in rows], 0).bool(),
            "margin": torch.tensor([m for _, _, m in pairs]),
        }

    def train_batch(self, gen: torch.Generator, rank: int = 0, world: int = 1) -> dict:
        b = self.batch_size
        picked = torch.randint(len(self.train), (b * world,), generator=gen).tolist()
        return self._batch([self.train[i] for i in picked[rank * b : (rank + 1) * b]])

    def scores(self, model: nn.Module, batch: dict) -> tuple[Tensor, Tensor]:
        """(r_c, r_r), each (b,) fp32: the model's score of each pair's two sequences."""
        r = model(batch["ids"], batch["mask"])[:, 0].float()  # (2b,)
        return r.chunk(2)

    def n_targets(self, batch: dict) -> int:
        """The pairs: the loss is a mean over pairs."""
        return batch["ids"].shape[0] // 2

    def loss_sum(self, model: nn.Module, batch: dict) -> Tensor:
        """The Bradley-Terry loss summed over the batch's pairs (a scalar)."""
        chosen, rejected = self.scores(model, batch)
        return reward_loss(chosen, rejected, batch["margin"], self.center).sum()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, n_batches: int, device) -> dict:
        """Mean loss, pairwise accuracy (r_c > r_r), mean margin r_c - r_r and mean scores
        over the first `eval_examples` held-out pairs (all of them, whatever n_batches)."""
        loss, chosen, rejected = 0.0, [], []
        for i in range(0, len(self.val), self.batch_size):
            batch = _to(self._batch(self.val[i : i + self.batch_size]), device)
            loss += float(self.loss_sum(model, batch))
            c, r = self.scores(model, batch)
            chosen.append(c.cpu())
            rejected.append(r.cpu())
        chosen, rejected = torch.cat(chosen), torch.cat(rejected)
        prefs = preference_metrics(chosen, rejected)
        return {
            "val_loss": loss / len(self.val),
            "val_accuracy": prefs["preference_accuracy"],
            "val_margin": prefs["reward_margin"],
            "val_chosen_score": float(chosen.mean()),
            "val_rejected_score": float(rejected.mean()),
        }

    @torch.no_grad()
    def sample(self, model: nn.Module, n_tokens: int, device, prompt: str = "") -> str:
        """The first held-out pair and its two scores (n_tokens unused)."""
        ex = self.val_examples[0]
        batch = _to(self._batch(self.val[:1]), device)
        c, r = self.scores(model, batch)
        return (
            f"{ex['prompt']} -> chosen {ex['chosen'].strip()!r} {float(c[0]):.3f}, "
            f"rejected {ex['rejected'].strip()!r} {float(r[0]):.3f}"
        )
