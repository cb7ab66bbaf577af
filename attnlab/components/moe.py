"""Sparse Mixture-of-Experts feed-forward layer (Shazeer et al. 2017, arXiv:1701.06538; Switch
Transformer, Fedus et al. 2021, arXiv:2101.03961; Mixtral, arXiv:2401.04088; DeepSeekMoE,
arXiv:2401.06066; DeepSeek-V3, arXiv:2412.19437).

Each token picks k of E expert FFNs; its output is their gate-weighted sum, plus shared experts
that every token uses:

    x ──router──> logits (E) ──score──> s ──top-k──> experts e_1..e_k, gates g_1..g_k
    y = sum_i g_i * FFN_{e_i}(x)  [+ sigmoid(w . x) * FFN_shared(x)]      (Qwen2-MoE)
                                  [+ FFN_shared(x)]                       (DeepSeek)

Routers (`score`):
- "softmax": s = softmax(logits) over all E, then the top k. With `normalize` the k gates are
  divided by their sum (Mixtral, Qwen3-MoE): the same numbers as Mixtral's paper, which takes the
  top k logits first and softmaxes over those k ("softmax after top-k"). Without it the gates
  are the plain probabilities and sum to less than 1 (Switch, Qwen1.5/2-MoE's norm_topk_prob=False).
- "sigmoid": s = sigmoid(logits), each expert's affinity on its own (DeepSeek-V3 §2.1.2). The
  top k are chosen on s + b, where b is a per-expert bias that only steers the choice (the gates
  are still s): the auxiliary-loss-free balancing. After each training step b_e moves by the
  update rate gamma towards balance: down if expert e took more than the mean load, up if less
  (`update_router_bias`). With groups, each token first keeps the `topk_groups` groups of experts
  whose two best scores sum highest, then picks its k within them (V3's node-limited routing).
`routed_scale` multiplies the routed gates (DeepSeek's routed_scaling_factor).

The load-balancing loss (Switch eq. 4-6, as Mixtral and transformers compute it over all layers
at once): with f_e the fraction of (token, choice) pairs sent to expert e and P_e the mean router
probability of e, aux = E * sum_e f_e P_e, which is k at a perfectly uniform routing and grows as
the load concentrates. `load_balancing_loss` is transformers' `load_balancing_loss_func`.

Grouped computation: the N * k (token, expert) pairs are sorted by expert, so each expert runs
once on one contiguous slice of its tokens (the permute / un-permute of GShard and MegaBlocks,
arXiv:2211.15841, without their fused grouped GEMM); the outputs are scaled by their gates and
summed back into their tokens with one index_add. The Python loop is over experts, never tokens.

What a layer records of its last forward (fairseq's MOELayer keeps its `l_aux` the same way):
`router_logits` (N, E) for the auxiliary loss, and in training mode the running `expert_load`
(tokens per expert) that `take_expert_load` reads and clears once per step. Both are plain
attributes, not buffers: statistics of a forward, not weights, so no state dict holds them.

Shapes: B batch, T length, N = B * T tokens, C d_model, E experts, k experts per token.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.components.ffn import GatedMLP
from attnlab.components.hooks import HookPoint

SCORES = ("softmax", "sigmoid")
GROUP_TOP = 2  # DeepSeek-V3 scores a group of experts by the sum of its two best affinities
EPS = 1e-20  # DeepSeek-V3's guard on the gates' sum when normalising


def check_routing(n_experts: int, k: int, score: str, n_groups: int, topk_groups: int) -> None:
    """ValueError naming the routing field that cannot work."""
    if score not in SCORES:
        raise ValueError(f"moe.score={score!r} is not a router attnlab implements; use {SCORES}")
    if not 1 <= k <= n_experts:
        raise ValueError(
            f"moe.n_experts_per_token={k} must be between 1 and moe.n_experts={n_experts}"
        )
    if n_groups < 1 or n_experts % n_groups:
        raise ValueError(f"moe.n_groups={n_groups} must divide moe.n_experts={n_experts}")
    if not 1 <= topk_groups <= n_groups or k > topk_groups * (n_experts // n_groups):
        raise ValueError(
            f"moe.topk_groups={topk_groups} must be in 1..n_groups={n_groups} and keep at "
            f"least n_experts_per_token={k} experts"
        )


def _group_mask(choice: Tensor, n_groups: int, topk_groups: int) -> Tensor:
    """(N, E) bool: True for the experts in each token's `topk_groups` best groups."""
    N, E = choice.shape
    groups = choice.view(N, n_groups, E // n_groups)  # (N, G, E/G)
    group_scores = groups.topk(min(GROUP_TOP, E // n_groups), dim=-1).values.sum(-1)  # (N, G)
    best = group_scores.topk(topk_groups, dim=-1).indices  # (N, topk_groups)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (N, G)
    return keep.unsqueeze(-1).expand_as(groups).reshape(N, E)


def route(
    logits: Tensor,
    k: int,
    score: str = "softmax",
    normalize: bool = True,
    bias: Tensor | None = None,
    n_groups: int = 1,
    topk_groups: int = 1,
    routed_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Choose k experts per token and their gates (see the module docstring).

    Args:
        logits: (N, E) router outputs.  k: experts per token.  score: "softmax" or "sigmoid".
        normalize: divide the k gates by their sum.
        bias: (E,) added to the scores for the choice only (DeepSeek-V3); None = no bias.
        n_groups, topk_groups: group-limited routing (1, 1 = off).
        routed_scale: multiplies the gates.

    Returns:
        (gates (N, k) float32, experts (N, k) int64).
    """
    scores = logits.float().softmax(-1) if score == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias  # (N, E)
    if n_groups > 1:
        choice = choice.masked_fill(~_group_mask(choice, n_groups, topk_groups), float("-inf"))
    experts = choice.topk(k, dim=-1).indices  # (N, k)
    gates = scores.gather(1, experts)  # (N, k): the unbiased scores
    if normalize:
        gates = gates / (gates.sum(-1, keepdim=True) + (EPS if score == "sigmoid" else 0.0))
    return gates * routed_scale, experts


def grouped_experts(x: Tensor, gates: Tensor, experts: Tensor, ffns: nn.ModuleList) -> Tensor:
    """sum_i gates[:, i] * ffns[experts[:, i]](x), each expert run once on its own tokens.

    Args:
        x: (N, C) tokens.  gates: (N, k).  experts: (N, k) expert ids.  ffns: the E experts.

    Returns:
        (N, C).
    """
    N, k = experts.shape
    flat = experts.reshape(-1)  # (N k,)
    order = flat.argsort(stable=True)  # the pairs grouped by expert
    token = order // k  # (N k,) which token each sorted pair belongs to
    counts = torch.bincount(flat, minlength=len(ffns)).tolist()  # one host sync per layer
    chunks = x[token].split(counts)  # one (n_e, C) slice per expert
    y = torch.cat([ffn(chunk) for ffn, chunk in zip(ffns, chunks)])  # (N k, C)
    y = y * gates.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)  # (N, C)


class MoE(nn.Module):
    """A routed SwiGLU-expert FFN with optional shared experts; a drop-in for `GatedMLP`.

    Args:
        d_model: C.  d_expert: each routed expert's hidden width.
        n_experts: E.  k: experts per token.  score, normalize, n_groups, topk_groups,
            routed_scale: as `route`.
        d_shared: the shared expert's hidden width (DeepSeek's n_shared experts are one FFN of
            n_shared * d_expert); 0 = none.
        shared_gate: scale the shared expert by sigmoid(w . x) (Qwen2-MoE).
        bias_update_rate: gamma of the auxiliary-loss-free balancing ("sigmoid" routers keep
            the bias as a buffer, saved with the weights, whatever the rate).
        activation: of the experts' gates ("silu": SwiGLU).  dropout: inside each expert.
    """

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        n_experts: int,
        k: int,
        score: str = "softmax",
        normalize: bool = True,
        n_groups: int = 1,
        topk_groups: int = 1,
        routed_scale: float = 1.0,
        d_shared: int = 0,
        shared_gate: bool = False,
        bias_update_rate: float = 0.0,
        activation: str = "silu",
        dropout: float = 0.0,
    ):
        super().__init__()
        check_routing(n_experts, k, score, n_groups, topk_groups)
        self.k, self.score, self.normalize = k, score, normalize
        self.n_groups, self.topk_groups, self.routed_scale = n_groups, topk_groups, routed_scale
        self.bias_update_rate = bias_update_rate
        self.router = nn.Linear(d_model, n_experts, bias=False)
        if score == "sigmoid":
            self.register_buffer("router_bias", torch.zeros(n_experts))
        else:
            self.router_bias = None
        self.experts = nn.ModuleList(
            GatedMLP(d_model, d_expert, activation, False, dropout) for _ in range(n_experts)
        )
        self.shared = GatedMLP(d_model, d_shared, activation, False, dropout) if d_shared else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if d_shared and shared_gate else None
        # What the last forwards saw (plain attributes, not buffers: statistics, not weights).
        self.router_logits: Tensor | None = None  # (N, E) of the last forward
        self.expert_load: Tensor | None = None  # (E,) tokens per expert, training forwards
        # (N, k) gates, and the layer's output as an FFN's hook_out (components/hooks.py)
        self.hook_gates, self.hook_out = HookPoint(), HookPoint()

    @property
    def n_experts(self) -> int:
        return len(self.experts)

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, T, C) -> (B, T, C)."""
        B, T, C = x.shape
        flat = x.reshape(B * T, C)  # (N, C)
        logits = self.router(flat)  # (N, E)
        gates, experts = route(
            logits,
            self.k,
            self.score,
            self.normalize,
            self.router_bias,
            self.n_groups,
            self.topk_groups,
            self.routed_scale,
        )
        y = grouped_experts(flat, self.hook_gates(gates), experts, self.experts)  # (N, C)
        if self.shared is not None:
            shared = self.shared(flat)  # (N, C)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            y = y + shared
        self.router_logits = logits
        if self.training:
            load = torch.bincount(experts.detach().reshape(-1), minlength=self.n_experts)
            self.expert_load = load if self.expert_load is None else self.expert_load + load
        return self.hook_out(y.view(B, T, C))


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers, in order (none for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def load_balancing_loss(
    router_logits: Sequence[Tensor], k: int, attention_mask: Tensor | None = None
) -> Tensor:
    """The Switch / Mixtral auxiliary loss over every layer's routing, E * sum_e f_e P_e.

    f_e: the share of all (token, choice) pairs of every layer that went to expert e (summing to
    k); P_e: e's softmax probability averaged over every token of every layer. The same numbers
    as transformers' `load_balancing_loss_func` (the layers pooled, not averaged one by one).

    Args:
        router_logits: per layer (N, E), N = B * T.  k: experts per token.
        attention_mask: (B, T), True / 1 = a real token; padding counts in neither f nor P.

    Returns:
        () the loss; 0.0 without layers.
    """
    if not router_logits:
        return torch.zeros(())
    E = router_logits[0].shape[-1]
    logits = torch.cat(list(router_logits))  # (L N, E)
    probs = logits.float().softmax(-1)  # (L N, E)
    chosen = F.one_hot(probs.topk(k, dim=-1).indices, E).sum(1).float()  # (L N, E)
    if attention_mask is None:
        weight = torch.ones(len(probs), device=probs.device)
    else:
        weight = attention_mask.reshape(-1).float().to(probs.device).repeat(len(router_logits))
    total = weight.sum()
    f = (chosen * weight[:, None]).sum(0) / total  # (E,)
    P = (probs * weight[:, None]).sum(0) / total  # (E,)
    return E * (f * P).sum()


def router_aux_loss(model: nn.Module, attention_mask: Tensor | None = None) -> Tensor:
    """`load_balancing_loss` of the model's last forward (0.0 for a dense model)."""
    layers = moe_layers(model)
    if not layers:
        return torch.zeros(())
    return load_balancing_loss([m.router_logits for m in layers], layers[0].k, attention_mask)


def take_expert_load(model: nn.Module) -> Tensor:
    """Tokens routed to each expert since the last call, (L, E) (L MoE layers), and clear them."""
    layers = moe_layers(model)
    if not layers:
        return torch.zeros(0, 0)
    device = layers[0].router.weight.device
    zeros = torch.zeros(layers[0].n_experts, dtype=torch.long, device=device)
    load = torch.stack([zeros if m.expert_load is None else m.expert_load for m in layers])
    for m in layers:
        m.expert_load = None
    return load


@torch.no_grad()
def update_router_bias(model: nn.Module, load: Tensor) -> None:
    """DeepSeek-V3's auxiliary-loss-free step: b_e += gamma * sign(mean load - load_e).

    Args:
        model: its MoE layers with a router bias and a rate > 0 are updated.
        load: (L, E) tokens per expert of the step (`take_expert_load`, summed over ranks).
    """
    for m, layer_load in zip(moe_layers(model), load):
        if m.router_bias is not None and m.bias_update_rate > 0:
            layer_load = layer_load.to(m.router_bias.device, torch.float32)
            m.router_bias += m.bias_update_rate * torch.sign(layer_load.mean() - layer_load)
