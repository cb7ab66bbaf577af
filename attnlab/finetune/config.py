"""The fine-tuning run's own config sections: its data, LoRA and DPO (`attnlab finetune`).

The rest of a fine-tuning run is a pre-training run's: the base checkpoint's ModelConfig and a
TrainConfig (attnlab/training/config.py); the CLI joins them (attnlab/cli/finetune.py).
"""

from dataclasses import dataclass
from typing import Literal

from attnlab.configs import check_literals

FinetuneTaskName = Literal["sft", "dpo", "classify", "tag"]


@dataclass(frozen=True)
class FinetuneDataConfig:
    """What a fine-tuning run learns from.

    task: "sft" (prompt -> response, loss on the response), "dpo" (preference pairs),
        "classify" (a label per text: a sequence head) or "tag" (BIO tags: a token head).
    source: "builtin" (examples built from the running Python's standard library, see
        finetune/data.py) or a JSONL file of {"prompt", "response"} (sft), {"prompt",
        "chosen", "rejected"} (dpo), {"text", "label"} (classify) or {"tokens", "tags"} (tag)
        lines.
    val_source: a JSONL file of held-out examples; "" takes the last val_fraction of `source`.
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


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (Hu et al. 2021) on the named Linear layers; rank 0 trains every weight.

    targets: comma-separated module-name suffixes, e.g. "q_proj,v_proj".
    bias: "none", "all" (every bias trains beside the adapters, the norms' too) or "lora_only"
        (the adapted Linears' biases), as peft's LoraConfig.bias.
    modules_to_save: comma-separated module-name endings whose modules train in full beside
        the adapters, as peft's modules_to_save (e.g. "norm": every LayerNorm). A task head
        always trains in full.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "q_proj,v_proj"
    bias: Literal["none", "all", "lora_only"] = "none"
    modules_to_save: str = ""

    def __post_init__(self):
        check_literals(self)
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0 (0: no LoRA), got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.rank and not self.target_names:
            raise ValueError("lora.targets names no module; e.g. --lora.targets q_proj,v_proj")

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())

    @property
    def save_names(self) -> tuple[str, ...]:
        """modules_to_save as a tuple of names."""
        return tuple(t.strip() for t in self.modules_to_save.split(",") if t.strip())

    @property
    def trains_base(self) -> bool:
        """Whether weights of the base train beside the adapters (bias or modules_to_save)."""
        return bool(self.rank) and (self.bias != "none" or bool(self.save_names))


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
    """

    beta: float = 0.1
    precompute_reference: bool = False
    rpo_alpha: float = 0.0

    def __post_init__(self):
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        if self.rpo_alpha < 0:
            raise ValueError(f"dpo.rpo_alpha must be >= 0 (0: plain DPO), got {self.rpo_alpha}")
