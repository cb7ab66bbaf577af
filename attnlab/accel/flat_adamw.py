"""AdamW over flat buffers: each group's parameters and gradients are views into one tensor.

Why: for a small model, most of the time of the optimizer step and of the gradient-norm clip
is spent per tensor (Python, dispatch, one kernel launch each), not per element. Over one flat
tensor per group those costs are paid once per group (benchmarks/README.md).

How (per group g of `param_groups`, with parameters p_i of n_i elements at offsets o_i):

    P_g = [p_0 | p_1 | ...]        (N_g,)    p_i.data = P_g[o_i : o_i + n_i].view(shape_i)
    G_g = [grad_0 | grad_1 | ...]  (N_g,)    p_i.grad = G_g[o_i : o_i + n_i].view(shape_i)

Backward accumulates each parameter's gradient in place into its view of G_g (autograd adds
into an existing .grad), so after it G_g holds every gradient of the group; `torch.optim.AdamW`
then steps the P_g (one fused kernel per group), the clip takes the norm of the G_g, and
`zero_grad` zeroes them. AdamW is elementwise, so this is the same arithmetic, element by
element, as AdamW over the separate tensors (tested equal). `state_dict` and `load_state_dict`
speak the separate tensors' format, so checkpoints do not change. One difference: a parameter
that gets no gradient is stepped with a zero one (momentum and weight decay still act on it),
as AdamW does after `zero_grad(set_to_none=False)`; with None gradients AdamW would skip it.

The model's parameters stay the same Parameter objects (hooks, tied weights and state_dict
keys untouched); only their storage moves. Build the optimizer after the model reaches its
device (`.to()` would move the parameters out of the buffers again), and load weights in place
(`load_state_dict` does). One process only: DDP and FSDP manage gradients their own way.
Off unless asked for: `TrainConfig.flat_adamw`, or `build_optimizer(flat=True)`.
"""

import torch
from torch import Tensor, nn


class FlatAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` over one flat buffer per parameter group.

    Args:
        groups: parameter groups as for torch.optim.AdamW ({"params": [...], options});
            each group's parameters must share a dtype and a device.
        **defaults: AdamW's options (lr, betas, fused, ...).
    """

    def __init__(self, groups: list[dict], **defaults):
        self.members: list[list[nn.Parameter]] = []  # per group, the model's parameters
        self.grad_views: list[list[Tensor]] = []  # per group, each parameter's view of G_g
        flat_groups = []
        for group in groups:
            params = list(group["params"])
            self.members.append(params)
            options = {k: v for k, v in group.items() if k != "params"}
            flat_groups.append({**options, "params": [self._flatten(params)] if params else []})
        super().__init__(flat_groups, **defaults)

    def _flatten(self, params: list[nn.Parameter]) -> nn.Parameter:
        """Move `params` into one buffer P (their values copied), their gradients into views
        of one buffer G; return P as a Parameter whose .grad is G."""
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            kinds = sorted(map(str, kinds))
            raise ValueError(f"FlatAdamW: a group mixes dtypes or devices: {kinds}")
        dtype, device = kinds.pop()
        total = sum(p.numel() for p in params)
        flat = torch.empty(total, dtype=dtype, device=device)  # (N_g,)
        grad = torch.zeros(total, dtype=dtype, device=device)  # (N_g,)
        views, offset = [], 0
        for p in params:
            n = p.numel()
            flat[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = flat[offset : offset + n].view_as(p)
            p.grad = grad[offset : offset + n].view_as(p)
            views.append(p.grad)
            offset += n
        self.grad_views.append(views)
        joined = nn.Parameter(flat)
        joined.grad = grad
        return joined

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW's step over the flat buffers, after gathering any gradient that landed
        outside them (someone set p.grad to None or to another tensor: see `_reattach`)."""
        self._reattach()
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradients. The views stay attached (set_to_none is ignored): the next
        backward accumulates into them."""
        for group in self.param_groups:
            for flat in group["params"]:
                flat.grad.zero_()
        self._reattach()

    def _reattach(self) -> None:
        """Point each p.grad at its view of G_g again, copying in a gradient that backward
        put elsewhere (a zero one where p.grad was None)."""
        for params, views in zip(self.members, self.grad_views):
            for p, view in zip(params, views):
                if p.grad is None:
                    view.zero_()
                elif p.grad is not view:
                    view.copy_(p.grad)
                p.grad = view

    def state_dict(self) -> dict:
        """The state dict that AdamW over the separate parameters would have."""
        flat = super().state_dict()
        state, groups, index = {}, [], 0
        for group, params in zip(flat["param_groups"], self.members):
            ids = list(range(index, index + len(params)))
            groups.append({**group, "params": ids})
            if group["params"] and group["params"][0] in flat["state"]:
                slices = _split(flat["state"][group["params"][0]], params)
                state.update(zip(ids, slices))
            index += len(params)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the state dict of AdamW over the separate parameters (what `state_dict` gives)."""
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in groups]
        expected = [len(params) for params in self.members]
        if sizes != expected:
            raise ValueError(
                f"optimizer state has groups of {sizes} parameters; this optimizer has {expected}"
            )
        flat_state, flat_groups, index = {}, [], 0
        for group, params in zip(groups, self.members):
            per_param = [state_dict["state"].get(i) for i in group["params"]]
            flat_groups.append({**group, "params": [index] if params else []})
            if params and all(s is not None for s in per_param):
                flat_state[index] = {  # copies: the caller's tensors stay its own
                    k: torch.cat([s[k].reshape(-1) for s in per_param])
                    if per_param[0][k].dim()
                    else per_param[0][k].clone()
                    for k in per_param[0]
                }
            index += bool(params)
        super().load_state_dict({"state": flat_state, "param_groups": flat_groups})


def _split(flat_state: dict, params: list[nn.Parameter]):
    """Yield each parameter's state: its slice of the group's flat buffers (exp_avg,
    exp_avg_sq), and a copy of the shared scalars (step)."""
    offset = 0
    for p in params:
        n = p.numel()
        yield {
            k: v[offset : offset + n].view_as(p).clone() if v.dim() else v.clone()
            for k, v in flat_state.items()
        }
        offset += n


__all__ = ["FlatAdamW"]
