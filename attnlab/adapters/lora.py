"""LoRA: low-rank adaptation of frozen Linear layers (Hu et al. 2021, arXiv:2106.09685).

A pre-trained weight W0 (N, K) stays frozen; what trains is a rank-r update beside it:

    h = W0 x + (alpha / r) B A dropout(x)        A (r, K), B (N, r), r << min(N, K)

    x ──┬── W0 (frozen: float, int8 or int4) ─────────────┬─(+)──> h
        └── dropout ── A (r, K) ── B (N, r) ── * alpha/r ──┘

A starts Kaiming-uniform (a = sqrt(5), as nn.Linear and `peft` initialise it) and B at zero, so
the wrapped model starts out exactly equal to the base, and the gradient reaches B first.
`alpha / r` keeps the update's size steady when r changes (the paper's section 4.1).
rsLoRA (Kalajdzievski 2023, arXiv:2312.03732) scales by alpha / sqrt(r) instead: with 1/r the
update's gradients shrink as r grows, so large ranks learn no better than small ones; 1/sqrt(r)
keeps them stable (peft's `use_rslora=True`).

QLoRA-style (Dettmers et al. 2023): the frozen W0 may be one of attnlab's quantized Linears
(`Int8Linear`, `Int4Linear`); A and B stay fp32 whatever the base holds. When its input needs a
gradient, a quantized Linear runs its reference path (dequantize, then F.linear), because the fused
int8/int4 kernels have no backward; under `torch.no_grad` it runs its kernel as usual.

Beside the adapters, `add_lora` can train what peft's `LoraConfig` can: `bias="all"` every bias
of the model (LayerNorms' too: peft's rule is a parameter named "bias" or ending in ".bias"),
`bias="lora_only"` the biases of the adapted Linears, and `modules_to_save` whole modules in full
(peft's rule: every module whose name ends with one of the given strings, e.g. "norm").
These change the base in place, so `disable_adapters` no longer gives the base model back.

`merge` folds the update into the weight (W0 += (alpha/r) B A: no extra cost at inference),
`unmerge` takes it out again. A quantized W0 refuses to merge: the update is far smaller than one
quantization step, so re-quantizing W0 + BA would lose most of it and unmerge could not give back
the same bytes; merge into the float base instead (load it unquantized, `load_lora_state_dict`).

Shapes: N out_features, K in_features, r rank; activations (..., K) in, (..., N) out.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

# Short names for the usual targets: attention's four projections and the MLP's Linears
# (the names of components/attention.py and components/ffn.py).
ALIASES: dict[str, tuple[str, ...]] = {
    "q": ("q_proj",),
    "k": ("k_proj",),
    "v": ("v_proj",),
    "o": ("o_proj",),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def is_linear_like(module: nn.Module) -> bool:
    """An nn.Linear or one of attnlab's quantized Linears (in/out_features, a reference path)."""
    if isinstance(module, nn.Linear):
        return True
    return (
        hasattr(module, "in_features")
        and hasattr(module, "out_features")
        and hasattr(module, "reference_forward")  # attnlab's Int8Linear and Int4Linear
    )


def is_quantized(module: nn.Module) -> bool:
    return is_linear_like(module) and not isinstance(module, nn.Linear)


class LoRALinear(nn.Module):
    """A frozen Linear-like `base` plus a trainable low-rank update (alpha / r) B A.

    Args:
        base: an nn.Linear, Int8Linear or Int4Linear (frozen here).
        rank: r, the rank of the update (>= 1).
        alpha: the update is scaled by alpha / r (alpha / sqrt(r) with `rslora`).
        dropout: dropout probability on the input of A (training only).
        rslora: rank-stabilised scaling, alpha / sqrt(r) (Kalajdzievski 2023).
    """

    def __init__(
        self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0, rslora: bool = False
    ):
        super().__init__()
        if not is_linear_like(base):
            raise ValueError(f"LoRA wraps Linear layers, not {type(base).__name__}")
        if int(rank) != rank or rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got rank={rank}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got dropout={dropout}")
        self.base = base.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.rslora = int(rank), float(alpha), bool(rslora)
        self.scale = alpha / (math.sqrt(rank) if rslora else rank)
        device = base.weight.device  # a Parameter (nn.Linear) or a buffer (quantized)
        # fp32 whatever the base holds: the update is small, and bf16 would round most of it away
        self.lora_A = nn.Parameter(torch.empty(self.rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, self.rank, device=device))
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.enabled = True  # False inside `disable_adapters`: the base alone
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A Kaiming-uniform (a = sqrt(5), as peft and nn.Linear), B zeros: the update is 0."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def delta_weight(self) -> Tensor:
        """(alpha / r) B A: (N, K) fp32, the update merge adds to W0."""
        return self.scale * (self.lora_B @ self.lora_A)

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., K) -> (..., N)."""
        y = self.base(x)  # (..., N)
        if self.merged or not self.enabled:
            return y
        a = self.drop(x).to(self.lora_A.dtype) @ self.lora_A.T  # (..., r)
        return y + ((a @ self.lora_B.T) * self.scale).to(y.dtype)  # (..., N)

    def _check_mergeable(self, what: str) -> None:
        if is_quantized(self.base):
            raise ValueError(
                f"cannot {what} LoRA into a quantized {type(self.base).__name__}: re-quantizing "
                "W0 + BA would lose the update; merge into the float base instead"
            )

    @torch.no_grad()
    def merge(self) -> None:
        """W0 += (alpha / r) B A; the forward then skips the adapter (same outputs)."""
        self._check_mergeable("merge")
        if not self.merged:
            w = self.base.weight
            w.copy_((w.float() + self.delta_weight()).to(w.dtype))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """W0 -= (alpha / r) B A: the base weight back (up to float rounding)."""
        self._check_mergeable("unmerge")
        if self.merged:
            w = self.base.weight
            w.copy_((w.float() - self.delta_weight()).to(w.dtype))
            self.merged = False

    def extra_repr(self) -> str:
        rs = ", rslora=True" if self.rslora else ""
        return f"rank={self.rank}, alpha={self.alpha:g}{rs}, merged={self.merged}"


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """{module name: LoRALinear} of every adapter in `model`."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def match_targets(model: nn.Module, targets: str | tuple[str, ...] | list[str]) -> list[str]:
    """Names of the Linear-like modules whose name is a target or ends in "." + a target
    (an alias matches any of its names: mlp is gate/up/down_proj, whichever the model has).

    Raises:
        ValueError naming a target that matches no Linear-like module, with the names there are.
    """
    adapters = lora_modules(model)
    linears = [  # a wrapped base counts under its LoRALinear's name
        n
        for n, m in model.named_modules()
        if n in adapters or (is_linear_like(m) and n.removesuffix(".base") not in adapters)
    ]
    found: list[str] = []
    for target in [targets] if isinstance(targets, str) else list(targets):
        suffixes = ALIASES.get(target, (target,))
        hits = [n for s in suffixes for n in linears if n == s or n.endswith("." + s)]
        if not hits:
            leaves = sorted({n.rpartition(".")[2] for n in linears})
            raise ValueError(
                f"LoRA target {target!r} matches no Linear layer of {type(model).__name__}; "
                f"its Linear names end in {leaves} (aliases: {sorted(ALIASES)})"
            )
        found += [n for n in hits if n not in found]
    return found


BIAS_MODES = ("none", "all", "lora_only")  # peft's LoraConfig.bias


def add_lora(
    model: nn.Module,
    targets: str | tuple[str, ...] | list[str] = ("q_proj", "v_proj"),
    rank: int | dict[str, int] = 8,
    alpha: float | dict[str, float] = 16.0,
    dropout: float = 0.0,
    bias: str = "none",
    modules_to_save: str | tuple[str, ...] | list[str] = (),
    rslora: bool = False,
) -> list[str]:
    """Wrap the targeted Linears in LoRALinear (in place) and freeze everything else (but the
    biases and modules that `bias` and `modules_to_save` train, see `train_beside_adapters`).

    Args:
        model: any attnlab model (float or quantized with attnlab.quantize).
        targets: module names or name suffixes ("q_proj", "blocks.0.ffn.up_proj"), or the
            aliases q, k, v, o (the attention projections) and mlp (gate/up/down_proj).
        rank, alpha: r and alpha for every target, or {module name: value} per wrapped module.
        dropout: on the input of A.
        bias: "none", "all" or "lora_only" (peft's LoraConfig.bias).
        modules_to_save: module-name endings whose modules train in full (peft's).
        rslora: scale by alpha / sqrt(r) (rsLoRA, peft's use_rslora) instead of alpha / r.

    Returns:
        the wrapped module names, in model order.
    """
    if bias not in BIAS_MODES:
        raise ValueError(f"LoRA bias must be one of {list(BIAS_MODES)}, got bias={bias!r}")
    names = match_targets(model, targets)
    wrapped = [n for n in names if isinstance(model.get_submodule(n), LoRALinear)]
    if wrapped:
        raise ValueError(f"these modules already have LoRA: {wrapped}; remove_lora first")
    model.requires_grad_(False)
    for name in names:
        r = rank[name] if isinstance(rank, dict) else rank
        a = alpha[name] if isinstance(alpha, dict) else alpha
        owner, _, attr = name.rpartition(".")
        parent = model.get_submodule(owner) if owner else model
        setattr(parent, attr, LoRALinear(model.get_submodule(name), r, a, dropout, rslora))
    train_beside_adapters(model, bias, modules_to_save)
    return names


def train_beside_adapters(
    model: nn.Module, bias: str = "none", modules_to_save: str | tuple[str, ...] | list[str] = ()
) -> list[str]:
    """Make trainable, beside the adapters, the parameters peft's LoraConfig(bias=...,
    modules_to_save=...) trains; the rest stays as it is.

    Args:
        model: a model with adapters (add_lora).
        bias: "none"; "all": every parameter named "bias" or ending in ".bias" (norms' too);
            "lora_only": the bias of each adapted Linear.
        modules_to_save: names; every module whose name ends with one of them (peft's rule,
            a plain string ending: "norm" matches "embed_norm" too) trains in full.

    Returns:
        the names of the parameters made trainable, in model order.

    Raises:
        ValueError for an unknown bias mode, a name that matches no module with parameters,
        or one that matches an adapted Linear (train it with LoRA or in full, not both).
    """
    if bias not in BIAS_MODES:
        raise ValueError(f"LoRA bias must be one of {list(BIAS_MODES)}, got bias={bias!r}")
    adapters = lora_modules(model)
    names = [modules_to_save] if isinstance(modules_to_save, str) else list(modules_to_save)
    chosen: set[str] = set()
    for target in names:
        hits = [
            n
            for n, m in model.named_modules()
            if n.endswith(target) and n and any(True for _ in m.parameters())
        ]
        adapted = [n for n in hits if n in adapters or n.removesuffix(".base") in adapters]
        if adapted:
            raise ValueError(
                f"modules_to_save {target!r} matches {adapted[:3]}, which carry LoRA adapters; "
                "train a module with LoRA or in full, not both"
            )
        if not hits:
            raise ValueError(
                f"modules_to_save {target!r} matches no module with parameters in "
                f"{type(model).__name__} (a name ending, e.g. 'norm' or 'embed')"
            )
        chosen.update(
            f"{n}.{p}" for n in hits for p, _ in model.get_submodule(n).named_parameters()
        )
    if bias == "all":
        chosen.update(n for n, _ in model.named_parameters() if n == "bias" or n.endswith(".bias"))
    elif bias == "lora_only":
        chosen.update(f"{n}.base.bias" for n, m in adapters.items() if m.base.bias is not None)
    trained = [n for n, _ in model.named_parameters() if n in chosen]
    for n, p in model.named_parameters():
        if n in chosen:
            p.requires_grad_(True)
    return trained


def remove_lora(model: nn.Module, merge: bool = False) -> nn.Module:
    """Put every base Linear back in place of its LoRALinear (after merging it, if `merge`).

    Parameters stay frozen: `model.requires_grad_()` makes them all trainable again.
    """
    for name, module in lora_modules(model).items():
        if merge:
            module.merge()
        elif module.merged:
            module.unmerge()
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, module.base)
    return model


def merge_lora(model: nn.Module) -> None:
    """Merge every adapter of `model` into its base weight."""
    for module in lora_modules(model).values():
        module.merge()


def unmerge_lora(model: nn.Module) -> None:
    """Take every merged adapter out of its base weight again."""
    for module in lora_modules(model).values():
        module.unmerge()


@contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """The base model alone, for the length of a `with` block: every adapter of `model` is
    switched off (its Linear computes W0 x), then back on after the block, as peft's
    `disable_adapter()`. DPO uses it as the reference model: the policy before its update.

    Raises:
        ValueError when `model` has no adapters, or a merged one (the base weight holds it:
        unmerge first).
    """
    adapters = lora_modules(model)
    if not adapters:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to disable (add_lora)")
    merged = [n for n, m in adapters.items() if m.merged]
    if merged:
        raise ValueError(f"cannot disable merged adapters {merged[:3]}; unmerge_lora first")
    before = {n: m.enabled for n, m in adapters.items()}
    for m in adapters.values():
        m.enabled = False
    try:
        yield model
    finally:
        for n, m in adapters.items():
            m.enabled = before[n]


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """{"<module>.lora_A": (r, K), "<module>.lora_B": (N, r)} for every adapter, detached."""
    return {
        f"{name}.{p}": getattr(m, p).detach().clone()
        for name, m in lora_modules(model).items()
        for p in ("lora_A", "lora_B")
    }


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy adapter weights (lora_state_dict's names) into `model`'s existing adapters.

    Raises:
        ValueError listing missing and unexpected names, or a shape that differs.
    """
    params = {
        f"{n}.{p}": getattr(m, p)
        for n, m in lora_modules(model).items()
        for p in ("lora_A", "lora_B")
    }
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"adapter weights do not fit: missing {missing}, unexpected {unexpected}")
    for name, p in params.items():
        if p.shape != state[name].shape:
            raise ValueError(
                f"adapter {name}: stored shape {tuple(state[name].shape)}, model {tuple(p.shape)}"
            )
        p.copy_(state[name])


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied parameters are counted once.

    As peft's `print_trainable_parameters`, the total includes the adapters; a quantized base's
    int8/int4 weights are buffers and are not counted (count the float model for its size).
    """
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
