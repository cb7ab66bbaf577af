"""The reward model against trl and transformers: the Bradley-Terry loss and its gradient equal
RewardTrainer.compute_loss on the same scores (with a margin, with centring); a padded batch
scores each sequence at its last real token as the sequence alone; the head exports to
LlamaForSequenceClassification with equal scores; and the built-in "spec -> signature" pairs."""

import ast
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from attnlab.finetune import data
from attnlab.finetune.reward import RewardTask, reward_loss, reward_model
from attnlab.finetune.rewards import signature_reward
from attnlab.finetune.signatures import all_args
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.tokenizer import train_char_tokenizer

PAIRS = [
    {"prompt": "up ab:", "chosen": "AB", "rejected": "ba"},
    {"prompt": "up cde:", "chosen": "CDE", "rejected": "edcx"},
    {"prompt": "up f:", "chosen": "F", "rejected": "ff", "margin": 0.5},
]


def trl_reward_loss(chosen, rejected, margin=None, center=None):
    """trl's RewardTrainer.compute_loss (trl/trainer/reward_trainer.py) on given scores: the
    trainer built without __init__, its "model" returning them as the (2b, 1) logits."""
    trl = pytest.importorskip("trl")
    t = trl.RewardTrainer.__new__(trl.RewardTrainer)
    t.model = SimpleNamespace(training=True)
    t.args = SimpleNamespace(center_rewards_coefficient=center)
    t.accelerator = SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x)
    t._metrics, t._total_train_tokens, t._tp_size = defaultdict(lambda: defaultdict(list)), 0, 1
    logits = torch.cat([chosen, rejected])[:, None]  # (2b, 1): chosen first, as trl batches
    inputs = {"input_ids": torch.zeros(len(logits), 2, dtype=torch.long)}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if margin is not None:
        inputs["margin"] = margin

    def model(**kw):
        return SimpleNamespace(logits=logits)

    return t.compute_loss(model, inputs), t._metrics["train"]


@pytest.mark.hf  # trl builds on transformers
@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_reward_loss_and_gradient_equal_trl(with_margin, center):
    torch.manual_seed(0)
    scores = (torch.randn(2, 7, dtype=torch.float64) * 3).requires_grad_()
    margin = torch.rand(7, dtype=torch.float64) if with_margin else None
    ours = reward_loss(scores[0], scores[1], margin, center or 0.0).mean()
    (g_ours,) = torch.autograd.grad(ours, scores)
    theirs, logged = trl_reward_loss(scores[0], scores[1], margin, center)
    (g_theirs,) = torch.autograd.grad(theirs, scores)
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert (g_ours - g_theirs).abs().max().item() < 1e-6
    assert (scores[0] > scores[1]).double().mean().item() == pytest.approx(logged["accuracy"][0])


@pytest.fixture(scope="module")
def tok():
    return train_char_tokenizer(["up abcdef: ABCDEF x"])


def base(tok):
    torch.manual_seed(0)
    cfg = replace(get_preset("llama-tiny"), vocab_size=tok.vocab_size, n_layers=1, max_seq_len=32)
    return SimpleNamespace(model=build_model(cfg), config=cfg, tokenizer=tok)


def test_a_padded_batch_scores_each_sequence_alone_and_the_body_is_the_base(tok):
    loaded = base(tok)
    model, cfg = reward_model(loaded)
    assert cfg.head.num_labels == 1 and model.head.out_features == 1
    torch.testing.assert_close(model.embed.weight, loaded.model.embed.weight)
    task = RewardTask(PAIRS, PAIRS, tok, batch_size=3, context=24, chat_template=False)
    batch = task._batch(task.train)
    with torch.no_grad():
        chosen, rejected = task.scores(model.eval(), batch)
        alone = [model(torch.tensor([ids]))[0, 0] for c, r, _ in task.train for ids in (c, r)]
        want = reward_loss(chosen, rejected, torch.tensor([0.0, 0.0, 0.5])).sum()
        assert task.loss_sum(model, batch).item() == pytest.approx(want.item(), abs=1e-6)
    torch.testing.assert_close(torch.stack([chosen, rejected], 1).flatten(), torch.stack(alone))
    assert task.n_targets(batch) == 3
    metrics = task.evaluate(model, 1, "cpu")
    assert metrics["val_accuracy"] == float((chosen > rejected).double().mean())


@pytest.mark.slow
@pytest.mark.hf
def test_the_reward_head_exports_to_llama_for_sequence_classification(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    from attnlab.interop.hf import save_hf

    model, cfg = reward_model(base(tok))
    save_hf(model.eval(), cfg, tmp_path / "hf")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    task = RewardTask(PAIRS, PAIRS, tok, batch_size=3, context=24, chat_template=False)
    batch = task._batch(task.train)
    with torch.no_grad():
        ours = model(batch["ids"], batch["mask"])
        theirs = hf(input_ids=batch["ids"], attention_mask=batch["mask"].long()).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def spec():
    return data.build_spec_instructions(data.build_instructions(max_examples=300))


def parts(sig: str) -> tuple[str, list[str]]:
    node = ast.parse(sig + " ...").body[0]
    return node.name, [a.arg for a in all_args(node.args)]


@pytest.mark.slow  # builds the instructions from the standard library (seconds)
def test_spec_prompts_state_the_answer_and_pairs_break_one_part(spec):
    for ex in spec.splits["train"][:50]:
        name, args = parts(ex["response"])
        assert name in ex["prompt"] and all(a in ex["prompt"] for a in args)
        assert "=" not in ex["response"] and args == ex["args"]
    pairs = data.build_spec_preferences(spec)
    modules = {s: {ex["module"] for ex in pairs.splits[s]} for s in ("train", "val", "test")}
    assert not modules["train"] & (modules["val"] | modules["test"])  # held out by module
    for split, examples in pairs.splits.items():
        kinds = [ex["corruption"] for ex in examples]
        assert abs(kinds.count("add") - kinds.count("drop")) <= 1, split  # length tells nothing
        for ex in examples:
            (n1, a1), (n2, a2) = parts(ex["chosen"]), parts(ex["rejected"])
            kind = ex["corruption"]
            assert (n1 != n2) == (kind == "name")
            if kind == "swap":
                assert sorted(a1) == sorted(a2) and a1 != a2
            elif kind == "add":
                assert len(a2) == len(a1) + 1 and set(a1) < set(a2)
            elif kind == "drop":
                assert len(a2) == len(a1) - 1 and set(a2) < set(a1)
            elif kind == "rename":
                assert len(a2) == len(a1) and sum(x != y for x, y in zip(a1, a2)) == 1
    assert set(kinds) == {"name", "drop", "add", "rename", "swap"}
    val = spec.splits["val"]  # GRPO's built-in reward: 1 for the answer, less for a broken one
    fields = {"name": [ex["name"] for ex in val], "args": [ex["args"] for ex in val]}
    assert signature_reward([], [ex["response"] for ex in val], **fields) == [1.0] * len(val)
    broken = {ex["prompt"]: ex["rejected"] for ex in pairs.splits["val"]}
    worse = signature_reward([], [broken[ex["prompt"]] for ex in val], **fields)
    assert max(worse) < 1.0
