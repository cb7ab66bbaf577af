"""The fine-tuning tasks' metrics, as plain functions of predictions and references.

    accuracy              classification: the fraction of predicted labels that are right
    entity_scores         tagging: entity-level precision / recall / F1 over BIO tags, by `seqeval`
                          (an entity counts only when its type and both ends are right)
    exact_match           SFT: generated responses equal to the reference after strip()
    preference_metrics    DPO: the mean reward margin r_w - r_l and the preference accuracy, the
                          fraction of pairs whose chosen response gets the higher implicit reward

`seqeval` is an optional dependency (the `finetune` extra), imported only when tags are scored.
"""

from collections.abc import Sequence

from torch import Tensor


def accuracy(predictions: Sequence, references: Sequence) -> float:
    """The fraction of `predictions` equal to `references` (the same length, not empty)."""
    _check_lengths(predictions, references)
    return sum(p == r for p, r in zip(predictions, references)) / len(references)


def entity_scores(
    references: Sequence[Sequence[str]], predictions: Sequence[Sequence[str]]
) -> dict[str, float]:
    """Entity-level precision, recall and F1 of BIO tag sequences (CoNLL-2000 evaluation).

    Args:
        references: the gold tags of each sequence, e.g. [["B-NAME", "I-NAME", "O"], ...].
        predictions: the predicted tags, each sequence as long as its reference.

    Returns:
        {"precision", "recall", "f1"}, micro-averaged over the entities of all types.
    """
    try:
        from seqeval.metrics import f1_score, precision_score, recall_score
    except ImportError:
        raise ImportError(
            "entity-level F1 needs the seqeval package: pip install 'attnlab[finetune]' "
            "(or pip install seqeval)"
        ) from None
    _check_lengths(predictions, references)
    for i, (p, r) in enumerate(zip(predictions, references)):
        if len(p) != len(r):
            raise ValueError(f"sequence {i}: {len(p)} predicted tags for {len(r)} reference tags")
    refs, preds = [list(r) for r in references], [list(p) for p in predictions]
    return {
        "precision": float(precision_score(refs, preds)),
        "recall": float(recall_score(refs, preds)),
        "f1": float(f1_score(refs, preds)),
    }


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """The fraction of generated responses that equal their reference, both stripped."""
    _check_lengths(predictions, references)
    return sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / len(references)


def preference_metrics(chosen_rewards: Tensor, rejected_rewards: Tensor) -> dict[str, float]:
    """DPO's reward margin and preference accuracy.

    Args:
        chosen_rewards, rejected_rewards: (B,) implicit rewards beta * (log pi - log ref) of the
            chosen and rejected responses (`objectives.dpo_loss`).

    Returns:
        {"reward_margin": mean of r_w - r_l, "preference_accuracy": fraction with r_w > r_l}.
    """
    if chosen_rewards.shape != rejected_rewards.shape or chosen_rewards.numel() == 0:
        raise ValueError(
            f"rewards of shapes {tuple(chosen_rewards.shape)} and "
            f"{tuple(rejected_rewards.shape)}: expected two equal, non-empty (B,) tensors"
        )
    margin = (chosen_rewards - rejected_rewards).double()
    return {
        "reward_margin": float(margin.mean()),
        "preference_accuracy": float((chosen_rewards > rejected_rewards).double().mean()),
    }


def _check_lengths(predictions: Sequence, references: Sequence) -> None:
    if len(predictions) != len(references) or not references:
        raise ValueError(
            f"{len(predictions)} predictions for {len(references)} references: expected the "
            "same number, at least one"
        )
