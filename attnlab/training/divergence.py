"""When a run has diverged although its loss is still finite: the rule the training loop stops by.

A NaN or an infinite loss stops a run at once (loop.py). A finite loss is held against a limit,
`divergence_limit`: MARGIN nats above the lower of

- ln V, the loss of guessing uniformly over the model's V tokens, which is where an untrained
  model starts (a run above it has learnt less than nothing), and
- BLOW_UP times the best validation loss so far (a run that was learning and fell back).

One loss above the limit is a spike: an evaluation's prints a warning. The run has diverged when
TRAIN_PATIENCE train losses, or VAL_PATIENCE validation losses, in a row are above it; the loop
then stops with one line naming the last good checkpoint. A checkpoint saved while the latest
train or validation loss was above the limit is marked as diverging in its trainer_state.json,
and never named as the last good one; such a validation loss is never kept as the best.

The rule holds for tasks whose loss is a cross-entropy over the vocabulary (CE_TASKS): uniform
guessing scores exactly ln V there, with or without label smoothing. Other losses (DPO, a reward
model's, GRPO's, a task head's) stop only on NaN or inf.
"""

import math

MARGIN = 1.0  # nats: an untrained model of every preset starts within 0.1 of ln V
BLOW_UP = 4.0  # times the best validation loss
TRAIN_PATIENCE = 10  # train steps in a row above the limit: diverged
VAL_PATIENCE = 3  # evaluations in a row above the limit: diverged
CE_TASKS = frozenset({"clm", "mlm", "seq2seq", "vqa", "vla", "prefix_lm", "permutation_lm", "sft"})


def divergence_limit(best: float, vocab_size: int) -> float:
    """The highest loss of a healthy run: MARGIN nats above the lower of ln(vocab_size) (the
    loss of guessing uniformly) and BLOW_UP times `best` (the best validation loss so far; inf
    before the first evaluation).

    Args:
        best: the run's best validation loss.  vocab_size: V, the model's vocabulary size.

    Returns:
        The limit in nats: a loss above it counts towards divergence.
    """
    return min(math.log(vocab_size), BLOW_UP * best) + MARGIN


class DivergenceWatch:
    """Counts, for one run, the train and validation losses in a row above the limit.

    Args:
        vocab_size: the model's V; None for a task the rule does not hold for (never diverged).
    """

    PATIENCE = {"train": TRAIN_PATIENCE, "val": VAL_PATIENCE}
    UNITS = {"train": "steps", "val": "evaluations"}

    def __init__(self, vocab_size: int | None):
        self.vocab_size = vocab_size
        self.in_a_row = {"train": 0, "val": 0}

    @property
    def healthy(self) -> bool:
        """Whether the latest train and validation losses were both within the limit."""
        return not any(self.in_a_row.values())

    def check(self, kind: str, loss: float, best: float) -> str | None:
        """Count `loss` (`kind` "train" or "val"); why the run has diverged, or None while
        it has not."""
        if self.vocab_size is None:
            return None
        above = loss > divergence_limit(best, self.vocab_size)
        self.in_a_row[kind] = self.in_a_row[kind] + 1 if above else 0
        if self.in_a_row[kind] < self.PATIENCE[kind]:
            return None
        return (
            f"{kind} loss {loss:.4g} has been above {self.describe_limit(best)} for "
            f"{self.in_a_row[kind]} {self.UNITS[kind]} in a row"
        )

    def describe_limit(self, best: float) -> str:
        """The limit, and what it is made of (see `divergence_limit`)."""
        limit, ln_v = divergence_limit(best, self.vocab_size), math.log(self.vocab_size)
        parts = f"ln V = {ln_v:.3g}, uniform guessing,"
        if math.isfinite(best):
            parts = f"the lower of {parts} and {BLOW_UP:g}x its best, {best:.4g},"
        return f"{limit:.4g} ({parts} plus {MARGIN:g})"
