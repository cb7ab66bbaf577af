"""The fine-tuning run's own config sections: its data, task head, DPO, the reward model and GRPO
(`attnlab finetune`).

The rest of a fine-tuning run is a pre-training run's: the base checkpoint's ModelConfig and a
TrainConfig (attnlab/training/config.py), and its LoRA section (attnlab/adapters/config.py);
`finetune.run.FinetuneRun` joins them.
"""

from dataclasses import dataclass
from typing import Literal

from attnlab.configs import check_literals

FinetuneTaskName = Literal["sft", "dpo", "reward", "grpo", "classify", "tag"]


@dataclass(frozen=True)
class FinetuneDataConfig:
    """What a fine-tuning run learns from.

    task: "sft" (prompt -> response, loss on the response), "dpo" (preference pairs),
        "reward" (a reward model on preference pairs: a one-output sequence head), "grpo" (RL
        on prompts, rewarded by the grpo section's reward), "classify" (a label per text: a
        sequence head) or "tag" (BIO tags: a token head).
    source: "builtin" (examples built from the running Python's standard library, see
        finetune/data.py) or a JSONL file of {"prompt", "response"} (sft), {"prompt",
        "chosen", "rejected"} (dpo; reward, with an optional number "margin"), {"prompt", ...}
        (grpo: the other fields go to the reward function), {"text", "label"} (classify) or
        {"tokens", "tags"} (tag) lines.
    builtin (sft, dpo, reward, grpo on the built-in data): "docstring" (a docstring's first
        line -> the signature) or "spec" (the function's name and arguments -> its bare
        signature: the prompt decides the answer; the pairs break one part of it).
    val_source: a JSONL file of held-out examples; "" holds out val_fraction of `source`,
        drawn at random with the run's train.seed (finetune.run.hold_out).
    max_examples: use at most this many training examples (0: all of them).
    pairs_per_prompt (dpo, built-in data): training pairs per prompt, each rejecting another
        corruption of its signature (the held-out pairs stay one per prompt).
    packing (sft): several examples in one row of `train.context` tokens, each attending only
        to itself and with its own positions from 0, so no padding is trained on or computed.
    chat_template: format prompts with the tokenizer's chat template when it has one.
    eval_examples: held-out examples scored at each evaluation (loss and metrics; classify
        and tag score at most train.eval_batches batches of them).
    max_new_tokens (sft): the longest response generated for exact match.
    eval_before: evaluate the base before the first step of a new run (the "before" figures).
    """

    task: FinetuneTaskName = "sft"
    source: str = "builtin"
    builtin: Literal["docstring", "spec"] = "docstring"
    val_source: str = ""
    val_fraction: float = 0.1
    max_examples: int = 0
    pairs_per_prompt: int = 1
    packing: bool = False
    chat_template: bool = True
    eval_examples: int = 64
    max_new_tokens: int = 48
    eval_before: bool = True

    def __post_init__(self):
        check_literals(self)
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        for name in ("eval_examples", "max_new_tokens", "pairs_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_examples < 0:
            raise ValueError(f"data.max_examples must be >= 0 (0: all), got {self.max_examples}")
        signature_task = self.task in ("sft", "dpo", "reward", "grpo")
        if self.builtin != "docstring" and (self.source != "builtin" or not signature_task):
            raise ValueError(
                f"data.builtin={self.builtin!r} chooses the built-in signature examples: it "
                "applies to --task sft, dpo, reward or grpo on --data.source builtin only"
            )


@dataclass(frozen=True)
class HeadOptions:
    """The task head a classify run puts on its base (models/heads.py).

    pooling: "cls", the first token through BERT's pooler (what HF's
        BertForSequenceClassification does), or "mean", the mean of the real tokens' hidden
        states through the same pooler (an encoder's sequence head only; no HF export).
    """

    pooling: Literal["cls", "mean"] = "cls"

    def __post_init__(self):
        check_literals(self)


@dataclass(frozen=True)
class DPOConfig:
    """DPO (Rafailov et al. 2023).

    beta: the weight of the implicit KL penalty towards the reference: a small beta lets the
        policy move far from it.
    precompute_reference: compute the frozen reference's log-probs of every pair once before
        training (then each step runs the policy alone, and no copy of the model is kept).
    rpo_alpha: RPO (Pang et al. 2024): add this times the chosen responses' SFT loss (0: DPO).
    loss: "sigmoid" (DPO), "ipo" (Azar et al. 2023: beta is its tau) or "robust" (Chowdhury et
        al. 2024), as trl's loss_type (finetune/objectives.py `dpo_loss`).
    label_smoothing: the probability eps that a pair's preference is flipped: with "sigmoid",
        conservative DPO (cDPO); with "robust", the flip rate its loss corrects for.
    """

    beta: float = 0.1
    precompute_reference: bool = False
    rpo_alpha: float = 0.0
    loss: Literal["sigmoid", "ipo", "robust"] = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self):
        check_literals(self)
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.loss == "ipo" and self.label_smoothing:
            raise ValueError("dpo.label_smoothing applies to --dpo.loss sigmoid or robust, not ipo")
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        if self.rpo_alpha < 0:
            raise ValueError(f"dpo.rpo_alpha must be >= 0 (0: plain DPO), got {self.rpo_alpha}")


@dataclass(frozen=True)
class RewardConfig:
    """The reward model's Bradley-Terry loss (finetune/reward.py), as trl's RewardTrainer.

    center_coefficient: add this times the mean of (r_chosen + r_rejected)^2, which keeps the
        scores centred on 0 (Eisenstein et al. 2023; trl's center_rewards_coefficient; 0: off).
    A pair's margin comes from the data (a "margin" field of a JSONL line, trl's column).
    """

    center_coefficient: float = 0.0

    def __post_init__(self):
        if self.center_coefficient < 0:
            raise ValueError(
                f"reward.center_coefficient must be >= 0 (0: off), got {self.center_coefficient}"
            )


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO (Shao et al. 2024, DeepSeekMath §4.1), as trl's GRPOTrainer computes it
    (finetune/grpo.py). train.batch_size counts prompts: a step samples num_generations
    completions of each.

    reward: "signature" (built in: the completion parses as a `def` with the prompt's name and
        argument names, finetune/grpo.py), "module:function" (a Python function f(prompts,
        completions, **fields) -> one number per completion, trl's convention), or the
        directory of a reward model from `--task reward`.
    num_generations: G, the completions sampled per prompt (>= 2: a group's advantages are
        its rewards' deviations from the group's mean).
    max_completion_length: the most tokens sampled per completion.
    temperature: of the sampling, and of the log-probs the loss reads (trl's).
    beta: the weight of the KL term to the frozen reference (k3 estimator; 0: no reference).
    epsilon, epsilon_high: the clip range [1 - epsilon, 1 + epsilon_high] of the ratio
        (epsilon_high 0: epsilon).
    loss_type: "grpo" (each completion's token mean, then the mean over completions), "bnpo"
        (the mean over all completion tokens of the batch) or "dr_grpo" (their sum over
        completions x max_completion_length; Liu et al. 2025).
    scale_rewards: divide the advantages by the "group"'s reward std, the "batch"'s, or
        "none" (Dr. GRPO).
    """

    reward: str = "signature"
    num_generations: int = 4
    max_completion_length: int = 32
    temperature: float = 1.0
    beta: float = 0.04
    epsilon: float = 0.2
    epsilon_high: float = 0.0
    loss_type: Literal["grpo", "bnpo", "dr_grpo"] = "grpo"
    scale_rewards: Literal["group", "batch", "none"] = "group"

    def __post_init__(self):
        check_literals(self)
        if self.num_generations < 2:
            raise ValueError(f"grpo.num_generations must be >= 2, got {self.num_generations}")
        if self.max_completion_length < 1:
            raise ValueError(
                f"grpo.max_completion_length must be >= 1, got {self.max_completion_length}"
            )
        if self.temperature <= 0:
            raise ValueError(f"grpo.temperature must be > 0 (GRPO samples), got {self.temperature}")
        for name in ("beta", "epsilon", "epsilon_high"):
            if getattr(self, name) < 0:
                raise ValueError(f"grpo.{name} must be >= 0, got {getattr(self, name)}")
        if not self.reward:
            raise ValueError("grpo.reward is empty: 'signature', module:function or a directory")
