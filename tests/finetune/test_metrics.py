"""The fine-tuning metrics against hand counts (and seqeval's entity rule written out)."""

import builtins

import pytest
import torch

from attnlab.finetune.metrics import accuracy, entity_scores, exact_match, preference_metrics


def test_accuracy_counts_equal_labels():
    assert accuracy(["a", "b", "c", "a"], ["a", "b", "a", "b"]) == 0.5
    with pytest.raises(ValueError, match="3 predictions for 2 references"):
        accuracy([1, 2, 3], [1, 2])


def test_entity_scores_count_whole_entities():
    """Gold entities: NAME 0-1, OP 3, NAME 5. Predicted: NAME 0-1 (right), NUMBER 3 (wrong
    type), NAME 4-5 (wrong start). One of 3 predicted is right (precision 1/3), one of 3 gold
    ones is found (recall 1/3)."""
    pytest.importorskip("seqeval")
    gold = [["B-NAME", "I-NAME", "O", "B-OP", "O", "B-NAME"]]
    pred = [["B-NAME", "I-NAME", "O", "B-NUMBER", "B-NAME", "I-NAME"]]
    scores = entity_scores(gold, pred)
    assert scores["precision"] == pytest.approx(1 / 3)
    assert scores["recall"] == pytest.approx(1 / 3)
    assert scores["f1"] == pytest.approx(1 / 3)
    assert entity_scores(gold, gold)["f1"] == 1.0


def test_entity_scores_are_per_entity_not_per_tag():
    """Token accuracy would be 3/4 here; entity F1 is 0: the one entity's end is wrong."""
    pytest.importorskip("seqeval")
    scores = entity_scores([["B-STRING", "I-STRING", "I-STRING", "O"]], [["B-STRING"] + ["O"] * 3])
    assert scores == {"precision": 0.0, "recall": 0.0, "f1": 0.0}


def test_entity_scores_name_the_extra_when_seqeval_is_missing(monkeypatch):
    real_import = builtins.__import__

    def no_seqeval(name, *args, **kwargs):
        if name.startswith("seqeval"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_seqeval)
    with pytest.raises(ImportError, match=r"attnlab\[finetune\]"):
        entity_scores([["O"]], [["O"]])


def test_entity_scores_refuse_sequences_of_different_lengths():
    pytest.importorskip("seqeval")
    with pytest.raises(ValueError, match="sequence 0: 1 predicted tags for 2"):
        entity_scores([["O", "O"]], [["O"]])


def test_exact_match_compares_after_strip():
    assert exact_match(
        ["def f(x):\n", " def g():", "def h(a)"], ["def f(x):", "def g():", "h"]
    ) == (pytest.approx(2 / 3))


def test_preference_metrics():
    chosen = torch.tensor([1.0, 0.5, -0.2, 0.3])
    rejected = torch.tensor([0.0, 0.7, -0.4, 0.3])
    got = preference_metrics(chosen, rejected)
    assert got["reward_margin"] == pytest.approx((1.0 - 0.2 + 0.2 + 0.0) / 4)
    assert got["preference_accuracy"] == 0.5  # a tie is not a preference
    with pytest.raises(ValueError, match="expected two equal"):
        preference_metrics(chosen, rejected[:2])
