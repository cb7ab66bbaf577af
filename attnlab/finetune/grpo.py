"""GRPO, Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath §4.1), as trl's
GRPOTrainer computes it: RL from a reward without a value model.

For each prompt q the policy samples a group of G completions o_1 ... o_G (the one generation
loop: one left-padded batch of every prompt G times, KV cache), and a reward function scores
each: r_1 ... r_G (finetune/rewards.py). A completion's advantage is its reward against its
group's (eq. 3's outcome supervision):

    A_i = (r_i - mean(r)) / (std(r) + 1e-4)     std with Bessel's correction (trl's `nanstd`)

so no critic is trained: the group is the baseline. Every token t of o_i then has PPO's
clipped objective (Schulman et al. 2017) and a KL penalty towards the frozen reference:

    rho_t = pi(o_t | q, o_<t) / pi_old(o_t | q, o_<t)
    l_t   = -min(rho_t A_i, clip(rho_t, 1 - eps, 1 + eps_high) A_i) + beta * KL_t
    KL_t  = ref/pi - log(ref/pi) - 1        (Schulman's k3 estimator: unbiased, never < 0)

and the loss averages them (loss_type): "grpo" 1/G sum_i 1/|o_i| sum_t l_t (eq. 3), "bnpo"
the mean over every completion token of the batch, "dr_grpo" their sum over G x the longest
completion allowed (Liu et al. 2025, Dr. GRPO: no length bias).

One gradient step per sampled batch (trl's num_iterations=1): pi_old is the policy itself,
detached, so rho_t = 1 and the gradient is A_i grad log pi (the clip matters only when a
batch is reused, which `grpo_token_losses` computes too). At step 0 the policy is the
reference, so the KL is 0. Log-probs are of logits / temperature, the distribution sampled
from (trl's). The reference is a frozen copy of the base, or under LoRA the policy with its
adapters off (objectives.reference_model), as for DPO; beta 0 needs none.

Shapes: b prompts, B = b * G completions (each group consecutive), T length.
"""

from typing import Literal

import torch
from torch import Tensor, nn

from attnlab.finetune.config import GRPOConfig
from attnlab.finetune.metrics import exact_match
from attnlab.finetune.objectives import (
    IGNORE_INDEX,
    reference_model,
    response_labels,
    token_logps,
)
from attnlab.finetune.rewards import RewardFn, score
from attnlab.finetune.sequences import pad_rows
from attnlab.finetune.tasks import _PromptTask  # the prompt encoding and greedy responses
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.training.distributed import every_rank

LossType = Literal["grpo", "bnpo", "dr_grpo"]
STD_EPS = 1e-4  # added to the std, as trl


def group_advantages(rewards: Tensor, G: int, scale: str = "group") -> Tensor:
    """Each completion's reward minus its group's mean, over the group's std (trl's
    scale_rewards: "group"), the whole batch's ("batch") or nothing ("none", Dr. GRPO).

    Args:
        rewards: (B,) with the G completions of each prompt consecutive.

    Returns:
        (B,) advantages (0 for every member of a group whose rewards are all equal).
    """
    grouped = rewards.view(-1, G)  # (b, G)
    centred = (grouped - grouped.mean(1, keepdim=True)).flatten()  # (B,)
    if scale == "none":
        return centred
    if scale == "batch":
        return centred / (rewards.std() + STD_EPS)
    std = grouped.std(1, keepdim=True).expand(-1, G).flatten()  # (B,)
    return centred / (std + STD_EPS)


def grpo_token_losses(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    ref_logps: Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """l_t of every token: the clipped ratio objective plus beta times the k3 KL.

    Args:
        logps: (B, T) log pi of each sampled token (with gradient).
        old_logps: (B, T) log pi_old, the policy that sampled them (no gradient).
        advantages: (B,) A_i, one per completion.
        ref_logps: (B, T) log ref (needed when beta > 0).
        beta: the KL term's weight.  epsilon, epsilon_high: the clip range (None: epsilon).

    Returns:
        (per-token losses (B, T), per-token KL (B, T) or None when beta is 0). Positions
        off the completion are for the caller's mask.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logps - old_logps)  # (B, T) rho_t
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    A = advantages[:, None]  # (B, 1)
    losses = -torch.min(ratio * A, clipped * A)
    if not beta:
        return losses, None
    log_ref_over_pi = ref_logps - logps
    kl = torch.exp(log_ref_over_pi) - log_ref_over_pi - 1  # k3
    return losses + beta * kl, kl


def aggregate(
    losses: Tensor,
    mask: Tensor,
    loss_type: LossType = "grpo",
    max_completion_length: int = 1,
    reduction: Literal["mean", "sum"] = "mean",
) -> Tensor:
    """The batch's loss from its per-token losses, as loss_type averages them.

    Args:
        losses: (B, T).  mask: (B, T) True on completion tokens.
        reduction: "mean" (trl's per-batch loss) or "sum" over the units `n_units` counts
            (completions for grpo and dr_grpo, tokens for bnpo), for the training loop to
            divide by the global batch's count.
    """
    m = mask.to(losses.dtype)
    summed = (losses * m).sum(-1)  # (B,)
    if loss_type == "grpo":
        per_completion = summed / m.sum(-1).clamp(min=1.0)
        return per_completion.mean() if reduction == "mean" else per_completion.sum()
    if loss_type == "dr_grpo":
        total = summed.sum() / max_completion_length
        return total / losses.shape[0] if reduction == "mean" else total
    total = summed.sum()  # bnpo
    return total / m.sum().clamp(min=1.0) if reduction == "mean" else total


def n_units(mask: Tensor, loss_type: LossType) -> int:
    """What `aggregate(..., reduction="sum")` sums over: completions, or tokens for bnpo."""
    return int(mask.sum()) if loss_type == "bnpo" else mask.shape[0]


class GRPOTask(_PromptTask):
    """GRPO on {"prompt", ...} examples: each training batch samples G completions of b
    prompts from `policy` and scores them with `reward` (the examples' other fields go to it
    as lists, trl's convention); evaluation scores greedy completions of held-out prompts.

    Args:
        train, val: the examples.  tokenizer, batch_size (prompts per micro-batch), context,
            chat_template, eval_examples: as SFTTask's.
        policy: the model being trained (the training loop's; it samples the batches).
        reward: the reward function (rewards.load_reward).
        grpo: the GRPOConfig (None: its defaults).
        reference: a frozen copy of the base, or None (the adapters off; not needed when
            grpo.beta is 0).
    """

    fields = ("prompt",)

    def __init__(
        self,
        train: list[dict],
        val: list[dict],
        tokenizer,
        policy: nn.Module,
        reward: RewardFn,
        batch_size: int,
        context: int,
        grpo: GRPOConfig | None = None,
        reference: nn.Module | None = None,
        chat_template: bool = True,
        eval_examples: int = 64,
    ):
        super().__init__(train, val, tokenizer, batch_size, context, chat_template, eval_examples)
        self.policy, self.reward, self.cfg = policy, reward, grpo or GRPOConfig()
        self.reference = None if reference is None else reference.eval().requires_grad_(False)
        self.rewards_seen: list[float] = []  # each training batch's mean reward
        self.last_kl = 0.0  # the last batch's mean KL to the reference

    def _encode(self, ex: dict):
        """(example, prompt ids), or None when the prompt leaves no room in the context."""
        ids = self.tokenizer.encode(self.format.prompt_text(ex["prompt"]))
        return None if len(ids) >= self.context else (ex, ids)

    def _score(self, examples: list[dict], completions: list[str]) -> Tensor:
        keys = [k for k in examples[0] if k != "prompt"]
        fields = {k: [ex.get(k) for ex in examples] for k in keys}
        return score(self.reward, [ex["prompt"] for ex in examples], completions, fields)

    @torch.no_grad()
    def sample_completions(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """Completions of `prompts` sampled from the policy (in eval mode, so no dropout), each
        ending with the chat format's end marker or cut at max_completion_length."""
        mode = self.policy.training
        self.policy.eval()
        room = self.context - max(len(p) for p in prompts)
        config = GenerationConfig(
            min(self.cfg.max_completion_length, room),
            SamplingConfig(temperature=self.cfg.temperature),
            stop_tokens=self.format.stop_tokens,
            stop_strings=(self.format.end,),
            seed=seed,
        )
        decode = lambda t: self.tokenizer.decode(t, skip_special=False)  # noqa: E731
        rows = generate(self.policy, prompts, config, decode=decode)
        self.policy.train(mode)
        return rows

    def train_batch(self, gen: torch.Generator, rank: int = 0, world: int = 1) -> dict:
        """b prompts drawn for the global batch (this rank's slice), G completions of each,
        their rewards and advantages: {"x", "labels", "mask"} (B, T) over prompt + completion
        (labels on the completion), "advantages" and "rewards" (B,)."""
        b, G = self.batch_size, self.cfg.num_generations
        picked = self._draw(gen, b * world)[rank * b : (rank + 1) * b]
        seed = int(torch.randint(2**31 - 1, (1,), generator=gen)) + rank
        examples = [self.train[i][0] for i in picked for _ in range(G)]
        prompts = [self.train[i][1] for i in picked for _ in range(G)]
        completions = self.sample_completions(prompts, seed)
        texts = [self.format.response_of(c) for c in completions]
        rewards = self._score(examples, texts)  # (B,)
        self.rewards_seen.append(float(rewards.mean()))
        rows = [response_labels(p + c, len(p)) for p, c in zip(prompts, completions)]
        batch = pad_rows(rows, self.pad)
        # over every rank's rewards, as trl gathers every process's (a "batch" std is global)
        everyone = every_rank(rewards, world)
        mine = slice(rank * len(rewards), (rank + 1) * len(rewards))
        batch["advantages"] = group_advantages(everyone, G, self.cfg.scale_rewards)[mine]
        batch["rewards"] = rewards
        return batch

    def _logps(self, model: nn.Module, batch: dict) -> Tensor:
        """(B, T) log-probs of the completion tokens at the sampling temperature (0 elsewhere)."""
        logits = model(batch["x"], attention_mask=batch["mask"])
        return token_logps(logits.float() / self.cfg.temperature, batch["labels"])

    def n_targets(self, batch: dict) -> int:
        return n_units(batch["labels"] != IGNORE_INDEX, self.cfg.loss_type)

    def loss_sum(self, model: nn.Module, batch: dict) -> Tensor:
        """The GRPO loss summed over the batch's n_targets units (a scalar)."""
        c = self.cfg
        logps = self._logps(model, batch)
        mask = batch["labels"] != IGNORE_INDEX
        ref = None
        if c.beta:
            if self.reference is not None:
                self.reference.to(batch["x"].device)  # a no-op once it is there
            with torch.no_grad(), reference_model(model, self.reference) as frozen:
                ref = self._logps(frozen, batch)
        eps_high = c.epsilon_high or c.epsilon
        losses, kl = grpo_token_losses(
            logps, logps.detach(), batch["advantages"], ref, c.beta, c.epsilon, eps_high
        )
        if kl is not None:
            self.last_kl = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
        return aggregate(losses, mask, c.loss_type, c.max_completion_length, "sum")

    @torch.no_grad()
    def evaluate(self, model: nn.Module, n_batches: int, device) -> dict:
        """val_reward: the mean reward of greedy completions of the first `eval_examples`
        held-out prompts; val_loss is minus it (the loop keeps the best checkpoint by it);
        val_exact_match when the examples carry a "response"; train_reward: the mean reward of
        the training batches since the last evaluation."""
        examples = [ex for ex, _ in self.val]
        prompts = [ex["prompt"] for ex in examples]
        got = self.responses(model, prompts, self.cfg.max_completion_length)
        rewards = self._score(examples, got)
        out = {"val_loss": -float(rewards.mean()), "val_reward": float(rewards.mean())}
        if all("response" in ex for ex in examples):
            out["val_exact_match"] = exact_match(got, [ex["response"] for ex in examples])
        if self.rewards_seen:
            out["train_reward"] = sum(self.rewards_seen) / len(self.rewards_seen)
            out["train_kl"] = self.last_kl
            self.rewards_seen = []
        return out

    @torch.no_grad()
    def sample(self, model: nn.Module, n_tokens: int, device, prompt: str = "") -> str:
        ex = self.val[0][0]
        got = self.responses(model, [ex["prompt"]], self.cfg.max_completion_length)
        reward = float(self._score([ex], got)[0])
        return f"{ex['prompt']} -> {got[0].strip()!r} (reward {reward:.3f})"
