"""Hook points: a named identity at every activation, for reading and editing a forward pass.

Every layer calls a `HookPoint` where an activation a researcher would look at is computed
(the idea and the names follow TransformerLens' `hook_*` points; the mechanism is smaller):

    DecoderLM    hook_tokens ─> hook_embed ─> blocks.i.hook_resid_pre ─> self_attn
                 ─> blocks.i.hook_resid_mid (─> cross_attn ─> blocks.i.hook_resid_cross) ─> ffn
                 ─> blocks.i.hook_resid_post ─> hook_final_norm ─> hook_logits
    Attention    hook_in  hook_q_proj  hook_k_proj (unrotated)  hook_q  hook_k  hook_v
                 hook_scores  hook_pattern  hook_z  hook_result  hook_out
    MLP          hook_in  hook_pre  (gated: hook_pre_linear)  hook_hidden  hook_out
    norms        hook_in  hook_scale  hook_normalized
    positions    hook_pos  hook_pos_embed (learned)  hook_cos  hook_sin (RoPE)
    MoE          hook_gates  hook_out  (and each expert's MLP points, experts.j.hook_*)

TransformerLens' names for the same points, in its axis order, are accepted wherever a name
is (components/tl_names.py; `tl_points(model)` lists them).

A point's name is its module path (`blocks.0.self_attn.hook_pattern`; in an encoder-decoder
`encoder.blocks.0...` and `decoder.blocks.0.cross_attn...`); `hook_points(model)` lists them all.
A hook is `fn(activation, hook) -> Tensor | None`: None only looks, a tensor replaces the
activation from there on. `run_with_cache` keeps the activations asked for, `run_with_hooks`
edits, and `hooks(model, [...])` installs hooks for the length of a `with` block.

A point is a plain attribute, not a submodule: reading it is an ordinary attribute lookup (not
nn.Module's `__getattr__`), it adds nothing to `state_dict`, `modules()` or `.to()`, and unhooked
it costs one test of an empty list, so the plain path computes exactly what it computed without. The
attention scores and pattern are not materialised by the fused backends (sdpa, flash, flex):
`attend_heads` recomputes them on the written-out path only while a hook watches them, and keeps
the fast path's output unless a hook edited them.

Shapes: B batch, H query heads, K kv heads, T queries, S keys, D head_dim.
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import torch
from torch import Tensor, nn

from attnlab.components.backends import attention_probs, attention_scores, repeat_kv
from attnlab.components.flex import dense_terms
from attnlab.components.masks import check_mask
from attnlab.components.tl_names import Alias, tl_table

HookFn = Callable[[Tensor, "HookPoint"], Tensor | None]
NameFilter = str | Callable[[str], bool]
WEIGHTS_BACKENDS = ("flash",)  # backends that give the probabilities from what they saved


class HookPoint:
    """An identity on one activation that runs the hooks installed on it, in order.

    Attributes:
        fns: the installed hooks; empty on the plain path.
        name: the point's path in the model the last `hook_points` call was made on.
        attached: {full name: point} of a module a hook has put in this point's place while
            it is active (lab/sae.py's `splice`: `blocks.3.hook_resid_post.hook_sae_acts_post`);
            `hook_points` lists them after this point.
    """

    def __init__(self):
        self.fns: list[HookFn] = []
        self.name = ""
        self.attached: dict[str, HookPoint] = {}  # points of a module spliced in here (an SAE)

    def __call__(self, x: Tensor) -> Tensor:
        return self.run(x) if self.fns else x  # a point without hooks: one list test

    def run(self, x: Tensor) -> Tensor:
        """Every hook on x in turn; a hook's tensor replaces x for the next one and after."""
        for fn in self.fns:
            out = fn(x, self)
            x = x if out is None else out
        return x

    def add(self, fn: HookFn) -> HookFn:
        """Install `fn` after the hooks already there; returns it (for `remove`)."""
        self.fns.append(fn)
        return fn

    def remove(self, fn: HookFn) -> None:
        """Take `fn` off (nothing happens when it is not installed)."""
        self.fns = [f for f in self.fns if f is not fn]


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of `model` by name: `module path.attribute`, in module order."""
    points = {
        f"{path}.{attr}" if path else attr: value
        for path, module in model.named_modules()
        for attr, value in vars(module).items()
        if isinstance(value, HookPoint)
    }
    points |= {n: p for point in list(points.values()) for n, p in point.attached.items()}
    for name, point in points.items():
        point.name = name
    return points


Naming = Literal["attnlab", "transformer_lens"]


def tl_points(model: nn.Module) -> dict[str, Alias]:
    """TransformerLens' name of each point this model has one for (components/tl_names.py)."""
    if hasattr(model, "blocks"):
        stacks = {"": model}
    else:  # BERT's encoder, T5's encoder and decoder
        stacks = {f"{n}.": getattr(model, n) for n in ("encoder", "decoder") if hasattr(model, n)}
    heads = {
        prefix: [
            (b.self_attn.n_heads, getattr(b.self_attn, "n_kv_heads", b.self_attn.n_heads))
            for b in stack.blocks
            if hasattr(b, "self_attn")
        ]
        for prefix, stack in stacks.items()
    }
    return tl_table(list(hook_points(model)), heads)


class AliasHook:
    """What a hook installed under a TransformerLens name sees as `hook`: that name."""

    def __init__(self, alias: Alias, point: HookPoint):
        self.name, self.point, self.alias = alias.name, point, alias

    def layer(self) -> int:
        """The block's index, as TransformerLens' `HookPoint.layer()`."""
        return int(self.name.split(".")[1])


def _through(alias: Alias, fn: HookFn, point: HookPoint) -> HookFn:
    """`fn` shown the point's activation in TransformerLens' layout; an edit mapped back."""
    seen = AliasHook(alias, point)

    def hook(x: Tensor, _: HookPoint) -> Tensor | None:
        out = fn(alias.read(x), seen)
        return None if out is None else alias.write(out, x)

    return hook


def _select(
    model, points, which: NameFilter, naming: Naming, aliases: dict
) -> list[tuple[HookPoint, Alias | None]]:
    """The points `which` names (an alias None: attnlab's own name); a string is looked up in
    attnlab's names, then TransformerLens'; a filter runs over the names of `naming`.
    `aliases` is filled with `tl_points(model)` the first time it is needed."""
    if not callable(which) and which in points:
        return [(points[which], None)]
    if callable(which) and naming == "attnlab":
        return [(p, None) for n, p in points.items() if which(n)]
    if not aliases:
        aliases.update(tl_points(model))  # built once per `hooks` call
    if callable(which):
        return [(points[a.point], a) for n, a in aliases.items() if which(n)]
    if which in aliases:
        return [(points[aliases[which].point], aliases[which])]
    near = [n for n in points if n.endswith(which.rsplit(".", 1)[-1])][:3]
    raise ValueError(
        f"no hook point {which!r} in this model (e.g. {near or list(points)[:3]}); "
        "hook_points(model) lists attnlab's names, tl_points(model) TransformerLens'"
    )


def point_named(model: nn.Module, name: str) -> tuple[HookPoint, Alias | None]:
    """The point `name` (attnlab's or TransformerLens') names, and its alias (None: attnlab's
    own name); a ValueError with near names when the model has no such point."""
    return _select(model, hook_points(model), name, "attnlab", {})[0]


@contextmanager
def hooks(
    model: nn.Module,
    fwd_hooks: Sequence[tuple[NameFilter, HookFn]],
    naming: Naming = "attnlab",
) -> Iterator[None]:
    """Install hooks for the length of a `with` block, and take them off after (errors too).

    Args:
        model: any module holding hook points.
        fwd_hooks: (name or name filter, fn) pairs; a filter is `name -> bool`. A name may be
            attnlab's or TransformerLens' (then `fn` sees TransformerLens' layout).
        naming: the names a filter is asked about.
    """
    points, aliases = hook_points(model), {}
    installed = []
    for which, fn in fwd_hooks:
        for point, alias in _select(model, points, which, naming, aliases):
            installed.append(
                (point, point.add(fn if alias is None else _through(alias, fn, point)))
            )
    try:
        yield
    finally:
        for point, fn in installed:
            point.remove(fn)


def run_with_hooks(
    model: nn.Module,
    *args,
    fwd_hooks: Sequence[tuple[NameFilter, HookFn]],
    naming: Naming = "attnlab",
    **kw,
):
    """`model(*args, **kw)` with `fwd_hooks` installed (a hook returning a tensor edits)."""
    with hooks(model, fwd_hooks, naming):
        return model(*args, **kw)


def run_with_cache(
    model: nn.Module,
    *args,
    names: Sequence[NameFilter] | None = None,
    detach: bool = True,
    naming: Naming = "attnlab",
    **kw,
) -> tuple[object, dict[str, Tensor]]:
    """`model(*args, **kw)`, keeping the activations of the points asked for (all by default).

    Only the chosen points are hooked, so nothing else is kept (or, for the attention pattern,
    recomputed). A point called twice (a layer run twice) keeps its last activation. A point
    asked for by a TransformerLens name is kept under that name, in that layout; with
    naming="transformer_lens", the default (every point) and filters mean TransformerLens'
    names.

    Returns:
        (the model's output, {name: activation}).
    """
    cache: dict[str, Tensor] = {}

    def keep(x: Tensor, hook: HookPoint) -> None:
        cache[hook.name] = x.detach() if detach else x

    chosen = [lambda n: True] if names is None else list(names)
    out = run_with_hooks(model, *args, fwd_hooks=[(w, keep) for w in chosen], naming=naming, **kw)
    return out, cache


def attend_heads(
    layer: nn.Module,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    is_causal: bool = False,
) -> Tensor:
    """A layer's backend on its heads, with its `hook_scores` and `hook_pattern` points.

    Args:
        layer: an attention module with `attend`, `backend`, `scale`, `dropout`, the two points.
        q: (B, H, T, D).  k, v: (B, K, S, D).  mask, bias, is_causal: as the backends take them.

    Returns:
        (B, H, T, D) each head's output.
    """
    B, H, T, _ = q.shape
    if mask is not None:
        check_mask(mask, B, H, T, k.shape[2])
    args = dict(mask=mask, bias=bias, is_causal=is_causal, scale=layer.scale)
    dropout = layer.dropout if layer.training else 0.0
    watched = bool(layer.hook_scores.fns or layer.hook_pattern.fns)
    own = watched and layer.backend in WEIGHTS_BACKENDS and not layer.hook_scores.fns
    out, weights = layer.attend(q, k, v, dropout=dropout, return_weights=own, **args)
    if watched:
        out = _watched(layer, q, k, v, args, out, weights)
    return out


def _watched(layer, q, k, v, args, out, weights) -> Tensor:
    """The scores and pattern recomputed on the eager path (a flex layer's functions evaluated
    into the dense tensors it takes) and shown to the hooks; `out` recomputed from the pattern
    only when a hook edited the scores or the pattern."""
    if weights is None:
        B, H, T, _ = q.shape
        mask, bias = dense_terms(args["mask"], args["bias"], B, H, T, k.shape[2])
        softcap = getattr(layer, "softcap", None)  # Gemma 2's cap, applied before the mask
        scores, mask = attention_scores(q, k, mask, bias, args["is_causal"], args["scale"], softcap)
        hooked = layer.hook_scores(scores)  # (B, H, T, S) fp32, -inf where masked
        weights = attention_probs(hooked, mask)
        edited = hooked is not scores
    else:
        edited = False
    pattern = layer.hook_pattern(weights)  # (B, H, T, S) fp32 probabilities
    if not edited and pattern is weights:
        return out
    v = repeat_kv(v, q.shape[1] // v.shape[1])  # (B, H, S, D)
    return (pattern.float() @ v.float()).to(q.dtype)  # (B, H, T, D)


def project_heads(layer: nn.Module, z: Tensor) -> Tensor:
    """A layer's `o_proj` on its heads' outputs, through its `hook_result` point.

    The heads are concatenated and projected in one matmul. While a hook watches `hook_result`,
    each head's own write z_h W_O[h]^T (TransformerLens' `attn.hook_result`) is built and shown
    too: o_proj on that head alone (the others zeroed) less o_proj of zeros (its bias), so it
    holds for any affine o_proj (quantized, LoRA). When a hook edited it, the output is the
    edited writes' sum plus the bias.

    Args:
        layer: an attention module with `o_proj` and `hook_result`.  z: (B, H, T, D).

    Returns:
        (B, T, C).
    """
    B, H, T, D = z.shape
    heads = z.transpose(1, 2)  # (B, T, H, D)
    out = layer.o_proj(heads.reshape(B, T, H * D))  # (B, T, C)
    if not layer.hook_result.fns:
        return out
    alone = torch.eye(H, dtype=z.dtype, device=z.device).view(H, 1, 1, H, 1)  # head h kept
    bias = layer.o_proj(torch.zeros_like(heads[:1, :1]).reshape(1, H * D))  # (1, C)
    result = layer.o_proj((heads * alone).reshape(H, B, T, H * D)) - bias  # (H, B, T, C)
    result = result.permute(1, 2, 0, 3)  # (B, T, H, C)
    hooked = layer.hook_result(result)
    return out if hooked is result else hooked.sum(2) + bias  # (B, T, C)
