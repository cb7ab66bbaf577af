"""A fine-tuning run's examples from a user's JSONL (finetune/run.py `load_examples`): the
held-out set is a seeded random sample of the file, not its last lines, and a held-out set
too small or of one class draws a one-line warning."""

import json

from attnlab.finetune.config import FinetuneDataConfig
from attnlab.finetune.run import load_examples


def grouped_by_label(tmp_path, n=40):
    """n classification examples, the first half labelled "a", the rest "b"."""
    path = tmp_path / "grouped.jsonl"
    rows = [{"text": f"text {i}", "label": "ab"[i >= n // 2]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def test_a_file_grouped_by_label_holds_out_both_labels_the_same_way_each_time(tmp_path):
    path, rows = grouped_by_label(tmp_path)
    d = FinetuneDataConfig(task="classify", source=str(path), val_fraction=0.25)
    train, val = load_examples(d, seed=0)
    assert len(val) == 10 and len(train) == 30
    assert {ex["label"] for ex in val} == {"a", "b"}  # the last 10 lines are all "b"
    assert sorted(map(str, train + val)) == sorted(map(str, rows))  # a split: nothing lost
    assert [rows.index(ex) for ex in train] == sorted(rows.index(ex) for ex in train)
    assert load_examples(d, seed=0) == (train, val)  # the seed decides: deterministic
    assert load_examples(d, seed=1)[1] != val


def test_a_tiny_or_one_class_held_out_set_draws_one_warning_line(tmp_path, capsys):
    path, _ = grouped_by_label(tmp_path)
    load_examples(FinetuneDataConfig(task="classify", source=str(path), val_fraction=0.25))
    assert capsys.readouterr().err == ""  # 10 examples of both labels: nothing to say
    load_examples(FinetuneDataConfig(task="classify", source=str(path)))  # 4 held out
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "warning:" in err and "4 examples" in err
    assert str(path) in err
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"text": f"v{i}", "label": "a"}) + "\n" for i in range(12)))
    d = FinetuneDataConfig(task="classify", source=str(path), val_source=str(val))
    load_examples(d)
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "one label only ('a')" in err and str(val) in err
