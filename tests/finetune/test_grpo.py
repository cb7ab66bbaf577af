"""GRPO against trl: the per-batch loss and its gradient equal GRPOTrainer._compute_loss on the
same tokens, log-probs, advantages and settings; the group-normalised advantages equal trl's
formula (its nanstd); KL is 0 at step 0; the built-in signature reward; reward functions that
fail stop the run in one line; and a short run whose reward rises."""

import copy
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from attnlab.adapters.lora import add_lora
from attnlab.finetune.config import GRPOConfig
from attnlab.finetune.grpo import GRPOTask, aggregate, group_advantages, grpo_token_losses
from attnlab.finetune.objectives import IGNORE_INDEX
from attnlab.finetune.rewards import load_reward, score, signature_reward
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.tokenizer import train_char_tokenizer

PROMPTS = [{"prompt": "say a:"}, {"prompt": "say b:"}, {"prompt": "say c:"}]


def trl_grpo_trainer(loss_type, beta, epsilon, epsilon_high, max_completion_length):
    """A trl.GRPOTrainer built without __init__, holding only what `_compute_loss` reads
    (trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss and
    _get_per_token_logps_and_entropies): one process, no gradient accumulation, no vLLM."""
    trl = pytest.importorskip("trl")
    t = trl.GRPOTrainer.__new__(trl.GRPOTrainer)
    t.model = SimpleNamespace(training=True)
    t.accelerator = SimpleNamespace(
        device=torch.device("cpu"),
        is_main_process=True,
        autocast=nullcontext,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction="sum": x,
    )
    t.args = SimpleNamespace(use_bias_correction_kl=False, delta=None)
    t.top_entropy_quantile, t.off_policy_mask_threshold = 1.0, None
    t.importance_sampling_level, t.loss_type, t.beta = "token", loss_type, beta
    t.epsilon_low, t.epsilon_high = epsilon, epsilon_high
    t.use_vllm, t.vllm_importance_sampling_correction = False, False
    t.current_gradient_accumulation_steps, t.max_completion_length = 1, max_completion_length
    t._entropy_bonus_enabled, t.aux_loss_enabled = False, False
    t._metrics = defaultdict(lambda: defaultdict(list))
    return t


def trl_grpo_loss(trainer, logps, old, ref, advantages, completion_mask):
    """trainer._compute_loss on a batch whose "model" returns `logps` (B, T) as the log-probs
    of the completion's T tokens (a prompt of one token before them)."""
    B, T = logps.shape

    def model(**kwargs):
        zeros = torch.zeros(B, T + 1)
        return SimpleNamespace(log_probs=torch.cat([zeros[:, :1], logps], 1), entropy=zeros)

    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": completion_mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
    }
    return trainer._compute_loss(model, inputs), trainer._metrics["train"]


@pytest.mark.hf  # trl builds on transformers
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_and_gradient_equal_trl(loss_type, beta):
    """Completions of different lengths (masked ends), a policy that moved off the one that
    sampled (ratios outside the clip range on both sides) and off the reference."""
    torch.manual_seed(0)
    B, T, L = 6, 5, 8
    lengths = torch.tensor([5, 3, 1, 4, 5, 2])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    old = -torch.rand(B, T, dtype=torch.float64) * 3
    logps = (old + torch.randn(B, T, dtype=torch.float64) * 0.3).requires_grad_()
    ref = old + torch.randn(B, T, dtype=torch.float64) * 0.2
    adv = torch.randn(B, dtype=torch.float64)
    losses, kl = grpo_token_losses(logps, old, adv, ref, beta, 0.2, 0.28)
    ours = aggregate(losses, mask, loss_type, L)
    (g_ours,) = torch.autograd.grad(ours, logps)
    trainer = trl_grpo_trainer(loss_type, beta, 0.2, 0.28, L)
    theirs, logged = trl_grpo_loss(trainer, logps, old, ref, adv, mask)
    (g_theirs,) = torch.autograd.grad(theirs, logps)
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert (g_ours - g_theirs).abs().max().item() < 1e-6
    ratio = (logps - old).exp()
    assert ((ratio > 1.28) & mask).any() and ((ratio < 0.8) & mask).any()  # clipping happens
    if beta:
        assert (kl * mask).sum().item() / mask.sum().item() == pytest.approx(logged["kl"][0])


def test_group_advantages_are_trls_formula():
    """trl (GRPOTrainer._generate_and_score_completions, scale_rewards "group" / "batch" /
    "none"): (r - group mean) / (nanstd + 1e-4), nanstd with Bessel's correction."""
    utils = pytest.importorskip("trl.trainer.utils")
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, 0.0, 1.0, 3.0, 0.25])
    G = 4
    mean = r.view(-1, G).mean(1).repeat_interleave(G)
    std = utils.nanstd(r.view(-1, G), dim=1).repeat_interleave(G)
    torch.testing.assert_close(group_advantages(r, G), (r - mean) / (std + 1e-4))
    batch = (r - mean) / (utils.nanstd(r) + 1e-4)
    torch.testing.assert_close(group_advantages(r, G, "batch"), batch)
    torch.testing.assert_close(group_advantages(r, G, "none"), r - mean)
    assert group_advantages(r, G)[4:8].abs().max() == 0  # equal rewards: no signal


@pytest.fixture(scope="module")
def tok():
    return train_char_tokenizer(["say abc: abc xyz"])


def tiny_policy(vocab: int):
    torch.manual_seed(0)
    cfg = replace(get_preset("llama-tiny"), vocab_size=vocab, n_layers=1, max_seq_len=32)
    return build_model(cfg)


def count_a(prompts, completions, **fields):
    return [c.count("a") / max(len(c), 1) for c in completions]


def task(tok, policy, reward=count_a, reference=None, **cfg):
    grpo = GRPOConfig(**{"num_generations": 4, "max_completion_length": 6, **cfg})
    return GRPOTask(PROMPTS, PROMPTS, tok, policy, reward, batch_size=2, context=24,
                    grpo=grpo, reference=reference, chat_template=False)  # fmt: skip


def test_kl_is_zero_at_step_0_and_batches_hold_groups(tok):
    policy = tiny_policy(tok.vocab_size)
    t = task(tok, policy, reference=copy.deepcopy(policy), beta=0.1)
    batch = t.train_batch(torch.Generator().manual_seed(0))
    assert batch["x"].shape[0] == 8 and batch["advantages"].shape == (8,)
    for group in batch["advantages"].view(2, 4):
        assert abs(float(group.sum())) < 1e-4  # centred within each group
    loss = t.loss_sum(policy, batch)
    assert t.last_kl == 0.0  # the policy is its reference
    loss.backward()
    assert t.n_targets(batch) == 8
    done = (batch["labels"] != IGNORE_INDEX).sum(1)
    assert done.min() >= 1 and done.max() <= 6


def test_lora_reference_is_the_policy_with_adapters_off(tok):
    policy = tiny_policy(tok.vocab_size)
    base = copy.deepcopy(policy)
    add_lora(policy, targets=("q_proj", "v_proj"), rank=2)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(std=0.5)
    kw = dict(beta=0.1)
    batch = task(tok, policy, **kw).train_batch(torch.Generator().manual_seed(1))
    with_adapters_off = task(tok, policy, **kw)
    with_copy = task(tok, policy, reference=base, **kw)
    with torch.no_grad():
        with_adapters_off.loss_sum(policy, batch)
        with_copy.loss_sum(policy, batch)
    assert with_adapters_off.last_kl > 0
    assert with_adapters_off.last_kl == pytest.approx(with_copy.last_kl, abs=1e-6)


def test_signature_reward():
    name, args = ["f"] * 5, [["a", "b"]] * 5
    got = signature_reward(
        [""] * 5,
        ["def f(a, b):", "def g(a, b):", "def f(a):", "f(a, b)", "def f(b, a):\n  return 1"],
        name,
        args,
    )
    assert got == [1.0, 0.75, 0.5, 0.0, 0.0]


def returns_none(prompts, completions, **fields):
    return [None] * len(completions)


def raises(prompts, completions, **fields):
    raise KeyError("score")


@pytest.mark.parametrize(
    "fn, message",
    [
        (raises, r"reward function tests.finetune.test_grpo:raises raised KeyError"),
        (returns_none, r"returns_none returned None for completion 0 .*expected a finite"),
        (lambda prompts, completions: [1.0], r"returned 1 values for 2 completions"),
    ],
)
def test_a_failing_reward_function_stops_with_one_line_naming_it(fn, message):
    with pytest.raises(ValueError, match=message):
        score(fn, ["p", "q"], ["x", "y"], {})


def test_reward_names_resolve_or_fail_in_one_line():
    assert load_reward("signature") is signature_reward
    assert load_reward("tests.finetune.test_grpo:count_a") is count_a
    with pytest.raises(ValueError, match="cannot import it"):
        load_reward("tests.finetune.test_grpo:nothing_here")
    with pytest.raises(ValueError, match="neither 'signature'"):
        load_reward("no-colon")


@pytest.mark.slow
def test_a_grpo_run_raises_its_reward(tok):
    """A reward the policy can reach in a few steps (the share of "a" in the completion):
    20 steps of 2 prompts x 4 samples at lr 1e-2 lift the mean reward of the batches."""
    torch.set_num_threads(1)
    policy = tiny_policy(tok.vocab_size).train()
    t = task(tok, policy, beta=0.0)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        batch = t.train_batch(gen)
        loss = t.loss_sum(policy, batch) / t.n_targets(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    first, last = t.rewards_seen[:5], t.rewards_seen[-5:]
    assert sum(last) / 5 > sum(first) / 5 + 0.2, t.rewards_seen


GATHER_DRIVER = """
import json, sys
import torch, torch.distributed as dist
torch.set_num_threads(1)
from tests.finetune.test_grpo import task, tiny_policy
from attnlab.tokenizer import train_char_tokenizer
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
tok = train_char_tokenizer(["say abc: abc xyz"])
t = task(tok, tiny_policy(tok.vocab_size), scale_rewards="batch", temperature=1.5)
batch = t.train_batch(torch.Generator().manual_seed(0), rank, world)
out = {"rewards": batch["rewards"].tolist(), "advantages": batch["advantages"].tolist()}
with open(sys.argv[1] + f".{rank}", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_batch_scaled_rewards_use_every_ranks_rewards(tmp_path):
    """scale_rewards "batch" under torchrun, 2 processes: each rank's advantages are trl's
    formula over both ranks' rewards (trl gathers every process's rewards first): its own
    group means over the std of all 2 x 8 rewards, not of its own 8."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    utils = pytest.importorskip("trl.trainer.utils")
    (tmp_path / "driver.py").write_text(GATHER_DRIVER)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(tmp_path / "driver.py"), str(tmp_path / "out")]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    everyone = torch.tensor([x for r in ranks for x in r["rewards"]])
    std = utils.nanstd(everyone)
    G = 4
    for r in ranks:
        rewards = torch.tensor(r["rewards"])
        mean = rewards.view(-1, G).mean(1).repeat_interleave(G)
        torch.testing.assert_close(torch.tensor(r["advantages"]), (rewards - mean) / (std + 1e-4))
        own = (rewards - mean) / (utils.nanstd(rewards) + 1e-4)  # what each rank took before
        assert not torch.allclose(own, torch.tensor(r["advantages"]))
