"""ClassifyTask and TagTask: a tiny model fine-tuned through the training loop learns a trivially
learnable task; tags follow the first-subword rule; bad examples and bases are named."""

import random
import string
from dataclasses import replace

import pytest
import torch

from attnlab.checkpoint import open_checkpoint, save_pretrained
from attnlab.finetune.heads_tasks import IGNORE_INDEX, TagTask, build_head_task
from attnlab.models.build import build_model
from attnlab.models.config import HeadConfig
from attnlab.models.presets import get_preset
from attnlab.tokenizer import train_bpe_tokenizer, train_char_tokenizer
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from attnlab.training.loop import train

NAME_INITIALS = "ABCEFGHIJKLNOPQRSTUVWXYZ"  # not D or M: a word's first character tells its tag
ALPHABET = string.ascii_lowercase + string.digits + string.ascii_uppercase + " ."


def base_checkpoint(tmp_path, preset="bert-tiny"):
    """A randomly initialised tiny base with a character tokenizer, opened as a checkpoint."""
    tokenizer = train_char_tokenizer([ALPHABET])
    torch.manual_seed(0)
    cfg = get_preset(preset)
    save_pretrained(tmp_path / "base", build_model(cfg), cfg, tokenizer)
    return open_checkpoint(tmp_path / "base")


def digit_examples(n, seed):
    """Texts of 6..14 letters; half hold one digit somewhere: label "digit", else "none"."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        chars = rng.choices(string.ascii_lowercase, k=rng.randint(6, 14))
        if i % 2:
            chars[rng.randrange(len(chars))] = rng.choice(string.digits)
        out.append({"text": "".join(chars), "label": "digit" if i % 2 else "none"})
    return out


def tag_examples(n, seed):
    """Words: lowercase (O), numbers (B-NUM), names "Dr. Xyz" or "Mr. Xyz Abc" (B-PER I-PER...)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens, tags = [], []
        while len(tokens) < 6:
            kind = rng.choice(["lower", "num", "name"])
            if kind == "lower":
                tokens.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 4))))
                tags.append("O")
            elif kind == "num":
                tokens.append("".join(rng.choices(string.digits, k=rng.randint(1, 3))))
                tags.append("B-NUM")
            else:
                tokens.append(rng.choice(["Dr.", "Mr."]))
                tags.append("B-PER")
                for _ in range(rng.randint(1, 2)):
                    word = rng.choice(NAME_INITIALS)
                    tokens.append(word + "".join(rng.choices(string.ascii_lowercase, k=2)))
                    tags.append("I-PER")
        out.append({"tokens": tokens, "tags": tags})
    return out


def run_config(tmp_path, model_cfg, task, steps):
    train_cfg = TrainConfig(
        steps=steps,
        batch_size=16,
        context=48,
        lr=3e-3,
        min_lr=3e-4,
        warmup=5,
        weight_decay=0.0,
        eval_every=steps,
        eval_batches=8,
        ckpt_every=steps,
        sample_tokens=1,  # the task's sample: a prediction on one validation example
        device="cpu",
        out_dir=str(tmp_path / "run"),
        progress=False,
    )
    # The loop's run check pairs data.task with an arch ("mlm": encoder, "clm": decoder).
    return RunConfig(model_cfg, train_cfg, DataConfig(task=task))


@pytest.mark.slow
def test_an_encoder_learns_to_classify_whether_a_text_holds_a_digit(tmp_path):
    base = base_checkpoint(tmp_path)
    run = run_config(tmp_path, base.config, "mlm", steps=60)
    model, task, run = build_head_task(
        "classify", base, digit_examples(400, 0), digit_examples(128, 1), run
    )
    assert run.model.head == HeadConfig("sequence", 2, ("digit", "none"))
    before = task.evaluate(model.eval(), 8, "cpu")
    state = train(model, task, run)
    after = state.last_eval
    assert after["val_majority"] == 0.5 and before["val_accuracy"] < 0.75
    assert after["val_accuracy"] >= 0.95, (before, after)
    assert "->" in after["sample"]
    saved = open_checkpoint(tmp_path / "run")  # the run's latest checkpoint: the classifier
    assert saved.config.head.labels == ("digit", "none")
    assert task.evaluate(saved.model, 8, "cpu")["val_accuracy"] == after["val_accuracy"]


@pytest.mark.slow
def test_an_encoder_learns_to_tag_numbers_and_capitalised_names(tmp_path):
    pytest.importorskip("seqeval")
    base = base_checkpoint(tmp_path)
    run = run_config(tmp_path, base.config, "mlm", steps=80)
    model, task, run = build_head_task("tag", base, tag_examples(400, 0), tag_examples(128, 1), run)
    assert run.model.head.labels == ("O", "B-NUM", "B-PER", "I-PER")
    before = task.evaluate(model.eval(), 8, "cpu")
    after = train(model, task, run).last_eval
    assert before["val_f1"] < 0.5 and after["val_f1"] >= 0.95, (before, after)


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.parametrize("kind", ["classify", "tag"])
def test_held_out_metrics_are_named_val_like_every_other_task(tmp_path, kind):
    """ClassifyTask and TagTask name their held-out metrics val_* as SFT, DPO and `attnlab
    train` do (metrics.jsonl, the run's printout and `attnlab eval` read alike)."""
    if kind == "tag":
        pytest.importorskip("seqeval")
    base = base_checkpoint(tmp_path)
    run = run_config(tmp_path, base.config, "mlm", steps=1)
    make = digit_examples if kind == "classify" else tag_examples
    model, task, run = build_head_task(kind, base, make(16, 0), make(16, 1), run)
    metrics = task.evaluate(model.eval(), 1, "cpu")
    expected = {
        "classify": {"val_loss", "val_accuracy", "val_majority"},
        "tag": {"val_loss", "val_f1", "val_precision", "val_recall", "val_word_accuracy"},
    }[kind]
    assert set(metrics) == expected


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_a_decoder_classifies_from_its_last_token(tmp_path):
    base = base_checkpoint(tmp_path, "gpt2-tiny")
    run = run_config(tmp_path, base.config, "clm", steps=100)
    model, task, run = build_head_task(
        "classify", base, digit_examples(400, 0), digit_examples(128, 1), run
    )
    assert run.model.head.pad_token_id == base.tokenizer.token_id("<pad>")
    assert train(model, task, run).last_eval["val_accuracy"] >= 0.9


def test_tags_go_to_each_words_first_subword():
    words = ["the", "transformers", "library", "x", "12345"]
    tokenizer = train_bpe_tokenizer(["the transformers library"] * 20, vocab_size=280)
    cfg = replace(
        get_preset("bert-tiny"), vocab_size=300, head=HeadConfig("token", 2, ("O", "B-X"))
    )
    examples = [{"tokens": words, "tags": ["O", "B-X", "O", "B-X", "O"]}]
    task = TagTask(tokenizer, cfg, examples, examples, batch_size=1, max_len=64)
    ids, labels = task.train_rows[0]
    cls = tokenizer.token_id("<cls>")
    assert ids[0] == cls and labels[0] == IGNORE_INDEX
    # the reference: each word's tokens, encoded after a space (but the first), as running text is
    expected_ids, expected_labels = [cls], [IGNORE_INDEX]
    for w, (word, tag) in enumerate(zip(words, [0, 1, 0, 1, 0])):
        text = word if w == 0 else " " + word
        pieces = tokenizer.encode(text)
        assert tokenizer.decode(pieces) == text
        expected_ids += pieces
        # the first token that holds one of the word's own characters (not just "Ġ", the
        # space) carries the tag
        first = next(i for i, p in enumerate(pieces) if tokenizer.decode([p]).strip())
        expected_labels += [tag if i == first else IGNORE_INDEX for i in range(len(pieces))]
    assert ids == expected_ids and labels == expected_labels
    assert len(ids) > len(words) + 1  # some word did split into several tokens
    assert task.val_positions[0] == [i for i, l in enumerate(labels) if l != IGNORE_INDEX]


def test_a_separator_token_of_its_own_is_ignored():
    """With characters as tokens, the space before a word is a token: it carries no tag."""
    tokenizer = train_char_tokenizer([ALPHABET])
    cfg = replace(get_preset("bert-tiny"), head=HeadConfig("token", 2, ("O", "B-X")))
    examples = [{"tokens": ["ab", "c"], "tags": ["B-X", "O"]}]
    task = TagTask(tokenizer, cfg, examples, examples, batch_size=1, max_len=64)
    ids, labels = task.train_rows[0]
    assert tokenizer.decode(ids[1:]) == "ab c"
    assert labels == [IGNORE_INDEX, 1, IGNORE_INDEX, IGNORE_INDEX, 0]


def test_bad_examples_and_bases_are_named(tmp_path):
    base = base_checkpoint(tmp_path)
    run = run_config(tmp_path, base.config, "mlm", steps=1)
    good = digit_examples(4, 0)
    with pytest.raises(ValueError, match="train example 1 has no field 'label'"):
        build_head_task("classify", base, [good[0], {"text": "abc"}], good, run)
    with pytest.raises(ValueError, match=r"labels \['maybe'\] never seen in training"):
        build_head_task("classify", base, good, good + [{"text": "ab", "label": "maybe"}], run)
    tags = tag_examples(2, 0)
    with pytest.raises(ValueError, match="val example 0 has 1 tokens but 2 tags"):
        build_head_task("tag", base, tags, [{"tokens": ["a"], "tags": ["O", "O"]}], run)
    with pytest.raises(ValueError, match="is not one of"):
        build_head_task("ner", base, tags, tags, run)
    decoder = base_checkpoint(tmp_path / "d", "gpt2-tiny")
    with pytest.raises(ValueError, match="task 'tag' needs a base model with arch in"):
        build_head_task("tag", decoder, tags, tags, run)
