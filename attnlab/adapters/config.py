"""The LoRA section of a fine-tuning run's config (`--lora.*`), recorded in every checkpoint it
writes, so that the loader (attnlab/checkpoint.py) puts the same adapters back on opening it."""

from dataclasses import dataclass
from typing import Literal

from attnlab.configs import check_literals


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (Hu et al. 2021) on the named Linear layers; rank 0 trains every weight.

    targets: comma-separated module-name suffixes, e.g. "q_proj,v_proj".
    bias: "none", "all" (every bias trains beside the adapters, the norms' too) or "lora_only"
        (the adapted Linears' biases), as peft's LoraConfig.bias.
    modules_to_save: comma-separated module-name endings whose modules train in full beside
        the adapters, as peft's modules_to_save (e.g. "norm": every LayerNorm). A task head
        always trains in full.
    rslora: scale the update by alpha / sqrt(rank) (rsLoRA, Kalajdzievski 2023; peft's
        use_rslora) instead of alpha / rank.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "q_proj,v_proj"
    bias: Literal["none", "all", "lora_only"] = "none"
    modules_to_save: str = ""
    rslora: bool = False

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
class PromptLearningConfig:
    """Prefix tuning or prompt tuning (`--peft.*`, adapters/prompt_learning.py): a frozen decoder
    LM steered by learned virtual tokens, as peft's PrefixTuningConfig / PromptTuningConfig.

    method: "none", "prefix" (learned keys and values in every layer; Li & Liang 2021) or
        "prompt" (learned input embeddings; Lester et al. 2021).
    num_virtual_tokens: P, the prefix's length.
    prefix_projection: (prefix) train the prefix through an MLP of this hidden width (peft's
        prefix_projection with encoder_hidden_size); 0 trains the prefix itself.
    """

    method: Literal["none", "prefix", "prompt"] = "none"
    num_virtual_tokens: int = 20
    prefix_projection: int = 0

    def __post_init__(self):
        check_literals(self)
        if self.num_virtual_tokens < 1:
            raise ValueError(f"peft.num_virtual_tokens must be >= 1, got {self.num_virtual_tokens}")
        if self.prefix_projection < 0:
            raise ValueError(f"peft.prefix_projection must be >= 0, got {self.prefix_projection}")
        if self.prefix_projection and self.method != "prefix":
            raise ValueError(
                "peft.prefix_projection is prefix tuning's MLP: give --peft.method prefix"
            )
