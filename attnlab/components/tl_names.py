"""TransformerLens' hook names on attnlab's hook points, with TransformerLens' axis order.

TransformerLens (HookedTransformer, and TransformerBridge in 4.x) names its points after its own
modules (`blocks.0.attn.hook_q`, `blocks.0.mlp.hook_post`, `ln_final.hook_scale`) and lays
per-head tensors out as (B, T, H, D). attnlab's points keep their module paths (the weights'
names, Llama-style: `self_attn`, `ffn`, `residuals.0.norm`) and attention's own order
(B, H, T, D). This file is the dictionary between the two: each TransformerLens name is an
`Alias` of one attnlab point, with the view that turns one layout into the other.

    TransformerLens                     attnlab point                         view
    blocks.i.attn.hook_q / hook_k       blocks.i.self_attn.hook_q_proj / _k   (before RoPE)
    blocks.i.attn.hook_rot_q / _rot_k   blocks.i.self_attn.hook_q / hook_k    heads (after RoPE)
    blocks.i.attn.hook_v / hook_z       blocks.i.self_attn.hook_v / hook_z    heads
    blocks.i.attn.hook_attn_scores      blocks.i.self_attn.hook_scores
    blocks.i.ln1.hook_scale             blocks.i.residuals.0.norm.hook_scale
    blocks.i.mlp.hook_pre / hook_post   blocks.i.ffn.hook_pre / hook_hidden
    ln_final.hook_normalized            norm.hook_normalized
    hook_unembed                        hook_logits

`tl_table` builds the whole list from a model's point names. A few TransformerLens names are
read-only here: TransformerLens' per-head copies of the residual stream (`hook_q_input`,
`hook_attn_in`; attnlab's attention reads one copy for every head), the q, k and v inputs that
attnlab's attention shares (`attn.q.hook_in`), `hook_mlp_in` (the residual stream the FFN's norm
reads, which an edit would change for every later layer too) and each layer's `attn.hook_cos`
(one table for every layer: edit `rotary_emb.hook_cos`). An edit through one of them is an
error that names the point to edit instead.

Shapes: B batch, T positions, H heads, K kv heads, D head_dim, C d_model, R rotary dims.
"""

import re
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

View = Literal["", "heads", "batch", "per_head"]


@dataclass(frozen=True)
class Alias:
    """One TransformerLens name of an attnlab point.

    Attributes:
        name: TransformerLens' name.  point: attnlab's point.
        view: "" the same tensor; "heads" (B, H, T, D) <-> (B, T, H, D); "batch" a batch axis
            of one in front of (T, ...) (positions, cos/sin; (B, 1, T, R) -> (B, T, R));
            "per_head" (B, T, C) repeated over `heads` as (B, T, H, C).
        writable: an edit through this name is one of the point (False: an error).
        instead: for a read-only alias, the name to edit instead.
    """

    name: str
    point: str
    view: View = ""
    writable: bool = True
    heads: int = 0
    instead: str = ""

    def read(self, x: Tensor) -> Tensor:
        """The point's activation as TransformerLens lays it out."""
        if self.view == "heads":
            return x.transpose(1, 2)
        if self.view == "batch":
            return x.unsqueeze(0) if x.dim() in (1, 2) else x.squeeze(1) if x.dim() == 4 else x
        if self.view == "per_head":
            return x.unsqueeze(2).expand(-1, -1, self.heads, -1)
        return x

    def write(self, y: Tensor, x: Tensor) -> Tensor:
        """A hook's tensor `y` (TransformerLens' layout) back in the point's layout (`x`'s)."""
        if not self.writable:
            raise ValueError(
                f"{self.name} is read-only in attnlab ({self.point} seen as TransformerLens "
                f"lays it out); edit {self.instead} instead"
            )
        if self.view == "heads":
            return y.transpose(1, 2)
        if self.view == "batch":
            return y.reshape(x.shape) if y.numel() == x.numel() else y.unsqueeze(1)
        return y


def _block(p: str, ln: str, H: int, K: int, gated: bool, rope: bool) -> list[Alias]:
    """The aliases of one decoder or encoder block whose points start with `p` ("blocks.i.");
    `ln` is TransformerLens' prefix for the same block."""
    ro = dict(writable=False)
    out = [
        Alias(f"{ln}hook_resid_pre", f"{p}hook_resid_pre"),
        Alias(f"{ln}hook_in", f"{p}hook_resid_pre"),
        Alias(f"{ln}ln1.hook_in", f"{p}hook_resid_pre"),
        Alias(f"{ln}ln1.hook_scale", f"{p}residuals.0.norm.hook_scale"),
        Alias(f"{ln}ln1.hook_normalized", f"{p}residuals.0.norm.hook_normalized"),
        Alias(f"{ln}ln1.hook_out", f"{p}self_attn.hook_in"),
        Alias(f"{ln}attn.hook_in", f"{p}self_attn.hook_in"),
        Alias(f"{ln}attn.hook_q", f"{p}self_attn.hook_q_proj"),
        Alias(f"{ln}attn.q.hook_out", f"{p}self_attn.hook_q_proj"),
        Alias(f"{ln}attn.hook_k", f"{p}self_attn.hook_k_proj"),
        Alias(f"{ln}attn.k.hook_out", f"{p}self_attn.hook_k_proj"),
        Alias(f"{ln}attn.hook_v", f"{p}self_attn.hook_v", "heads"),
        Alias(f"{ln}attn.v.hook_out", f"{p}self_attn.hook_v", "heads"),
        Alias(f"{ln}attn.hook_attn_scores", f"{p}self_attn.hook_scores"),
        Alias(f"{ln}attn.hook_pattern", f"{p}self_attn.hook_pattern"),
        Alias(f"{ln}attn.hook_z", f"{p}self_attn.hook_z", "heads"),
        Alias(f"{ln}attn.o.hook_in", f"{p}self_attn.hook_z", "heads"),
        Alias(f"{ln}attn.hook_result", f"{p}self_attn.hook_result"),
        Alias(f"{ln}attn.hook_out", f"{p}self_attn.hook_out"),
        Alias(f"{ln}attn.o.hook_out", f"{p}self_attn.hook_out"),
        Alias(f"{ln}attn.hook_hidden_states", f"{p}self_attn.hook_out"),
        Alias(f"{ln}hook_attn_out", f"{p}self_attn.hook_out"),
        Alias(f"{ln}hook_resid_mid", f"{p}hook_resid_mid"),
        Alias(f"{ln}ln2.hook_in", f"{p}hook_resid_mid"),
        Alias(f"{ln}hook_mlp_in", f"{p}hook_resid_mid", **ro, instead=f"{ln}ln2.hook_in"),
        Alias(f"{ln}ln2.hook_scale", f"{p}residuals.1.norm.hook_scale"),
        Alias(f"{ln}ln2.hook_normalized", f"{p}residuals.1.norm.hook_normalized"),
        Alias(f"{ln}ln2.hook_out", f"{p}ffn.hook_in"),
        Alias(f"{ln}mlp.hook_in", f"{p}ffn.hook_in"),
        Alias(f"{ln}mlp.hook_pre", f"{p}ffn.hook_pre"),
        Alias(f"{ln}mlp.hook_post", f"{p}ffn.hook_hidden"),
        Alias(f"{ln}mlp.out.hook_in", f"{p}ffn.hook_hidden"),
        Alias(f"{ln}mlp.hook_out", f"{p}ffn.hook_out"),
        Alias(f"{ln}mlp.out.hook_out", f"{p}ffn.hook_out"),
        Alias(f"{ln}hook_mlp_out", f"{p}ffn.hook_out"),
        Alias(f"{ln}hook_out", f"{p}hook_resid_post"),
        Alias(f"{ln}hook_resid_post", f"{p}hook_resid_post"),
    ]
    for x in ("q", "k", "v"):  # one input, shared by the three projections
        instead = f"{ln}attn.hook_in"
        out.append(Alias(f"{ln}attn.{x}.hook_in", f"{p}self_attn.hook_in", **ro, instead=instead))
    for name, n in (("attn_in", H), ("q_input", H), ("k_input", K), ("v_input", K)):
        for where in (ln, f"{ln}attn."):  # per-head copies of the stream (TL's split inputs)
            instead = f"{ln}attn.hook_in"
            out.append(
                Alias(f"{where}hook_{name}", f"{p}hook_resid_pre", "per_head", False, n, instead)
            )
    if gated:  # mlp.gate is TransformerLens' gate_proj, mlp.in its up_proj
        instead = f"{ln}mlp.hook_in"
        out += [
            Alias(f"{ln}mlp.gate.hook_in", f"{p}ffn.hook_in", **ro, instead=instead),
            Alias(f"{ln}mlp.gate.hook_out", f"{p}ffn.hook_pre"),
            Alias(f"{ln}mlp.in.hook_in", f"{p}ffn.hook_in", **ro, instead=instead),
            Alias(f"{ln}mlp.in.hook_out", f"{p}ffn.hook_pre_linear"),
            Alias(f"{ln}mlp.hook_pre_linear", f"{p}ffn.hook_pre_linear"),
        ]
    else:
        out += [
            Alias(f"{ln}mlp.in.hook_in", f"{p}ffn.hook_in"),
            Alias(f"{ln}mlp.in.hook_out", f"{p}ffn.hook_pre"),
        ]
    if rope:
        out += [
            Alias(f"{ln}attn.hook_rot_q", f"{p}self_attn.hook_q", "heads"),
            Alias(f"{ln}attn.hook_rot_k", f"{p}self_attn.hook_k", "heads"),
        ]
        for x in ("cos", "sin"):
            instead = f"rotary_emb.hook_{x}"
            out.append(
                Alias(f"{ln}attn.hook_{x}", f"positions.hook_{x}", "batch", False, 0, instead)
            )
    return out


def _post_norm_block(p: str, ln: str, H: int) -> list[Alias]:
    """The aliases of one post-norm encoder block (BERT) as TransformerBridge names them: its
    attention's output (`attn.hook_out`, `hook_attn_out`) is the first norm's output, and its
    `hook_resid_mid` the second norm's input (the stream plus the MLP's output)."""
    ro = dict(writable=False)
    out = [
        Alias(f"{ln}hook_resid_pre", f"{p}hook_resid_pre"),
        Alias(f"{ln}hook_in", f"{p}hook_resid_pre"),
        Alias(f"{ln}attn.hook_in", f"{p}self_attn.hook_in"),
        Alias(f"{ln}attn.hook_q", f"{p}self_attn.hook_q_proj"),
        Alias(f"{ln}attn.q.hook_out", f"{p}self_attn.hook_q_proj"),
        Alias(f"{ln}attn.hook_k", f"{p}self_attn.hook_k_proj"),
        Alias(f"{ln}attn.k.hook_out", f"{p}self_attn.hook_k_proj"),
        Alias(f"{ln}attn.hook_v", f"{p}self_attn.hook_v", "heads"),
        Alias(f"{ln}attn.v.hook_out", f"{p}self_attn.hook_v", "heads"),
        Alias(f"{ln}attn.hook_attn_scores", f"{p}self_attn.hook_scores"),
        Alias(f"{ln}attn.hook_pattern", f"{p}self_attn.hook_pattern"),
        Alias(f"{ln}attn.hook_z", f"{p}self_attn.hook_z", "heads"),
        Alias(f"{ln}attn.o.hook_in", f"{p}self_attn.hook_z", "heads"),
        Alias(f"{ln}attn.hook_result", f"{p}self_attn.hook_result"),
        Alias(f"{ln}attn.o.hook_out", f"{p}self_attn.hook_out"),
        Alias(f"{ln}attn.hook_hidden_states", f"{p}self_attn.hook_out"),
        Alias(f"{ln}ln1.hook_in", f"{p}residuals.0.norm.hook_in"),
        Alias(f"{ln}ln1.hook_scale", f"{p}residuals.0.norm.hook_scale"),
        Alias(f"{ln}ln1.hook_normalized", f"{p}residuals.0.norm.hook_normalized"),
        Alias(f"{ln}ln1.hook_out", f"{p}hook_resid_mid"),
        Alias(f"{ln}attn.hook_out", f"{p}hook_resid_mid"),
        Alias(f"{ln}hook_attn_out", f"{p}hook_resid_mid"),
        Alias(f"{ln}mlp.hook_in", f"{p}ffn.hook_in"),
        Alias(f"{ln}hook_mlp_in", f"{p}ffn.hook_in"),
        Alias(f"{ln}mlp.in.hook_in", f"{p}ffn.hook_in"),
        Alias(f"{ln}mlp.in.hook_out", f"{p}ffn.hook_pre"),
        Alias(f"{ln}mlp.hook_pre", f"{p}ffn.hook_pre"),
        Alias(f"{ln}mlp.hook_post", f"{p}ffn.hook_hidden"),
        Alias(f"{ln}mlp.out.hook_in", f"{p}ffn.hook_hidden"),
        Alias(f"{ln}mlp.hook_out", f"{p}ffn.hook_out"),
        Alias(f"{ln}mlp.out.hook_out", f"{p}ffn.hook_out"),
        Alias(f"{ln}hook_mlp_out", f"{p}ffn.hook_out"),
        Alias(f"{ln}ln2.hook_in", f"{p}residuals.1.norm.hook_in"),
        Alias(f"{ln}hook_resid_mid", f"{p}residuals.1.norm.hook_in"),
        Alias(f"{ln}ln2.hook_scale", f"{p}residuals.1.norm.hook_scale"),
        Alias(f"{ln}ln2.hook_normalized", f"{p}residuals.1.norm.hook_normalized"),
        Alias(f"{ln}ln2.hook_out", f"{p}hook_resid_post"),
        Alias(f"{ln}hook_out", f"{p}hook_resid_post"),
        Alias(f"{ln}hook_resid_post", f"{p}hook_resid_post"),
    ]
    for x in ("q", "k", "v"):
        instead = f"{ln}attn.hook_in"
        out.append(Alias(f"{ln}attn.{x}.hook_in", f"{p}self_attn.hook_in", **ro, instead=instead))
    for name in ("attn_in", "q_input", "k_input", "v_input"):
        for where in (ln, f"{ln}attn."):
            instead = f"{ln}attn.hook_in"
            out.append(
                Alias(f"{where}hook_{name}", f"{p}hook_resid_pre", "per_head", False, H, instead)
            )
    return out


def _encoder(points: set[str], heads: list[tuple[int, int]]) -> list[Alias]:
    """An encoder-only model's aliases (BERT: `encoder.` points, a masked-LM `head.`)."""
    e, L = "encoder.", len(heads)
    out = [
        Alias("embed.hook_in", f"{e}hook_tokens"),
        Alias("embed.hook_out", f"{e}hook_embed"),
        Alias("token_type_embed.hook_in", f"{e}hook_types"),
        Alias("token_type_embed.hook_out", f"{e}hook_type_embed"),
        Alias("pos_embed.hook_in", f"{e}positions.hook_pos", "batch"),
        Alias("pos_embed.hook_out", f"{e}positions.hook_pos_embed"),
        Alias("hook_pos_embed", f"{e}positions.hook_pos_embed"),
        Alias("embed_ln.hook_in", f"{e}embed_norm.hook_in"),
        Alias("embed_ln.hook_scale", f"{e}embed_norm.hook_scale"),
        Alias("embed_ln.hook_normalized", f"{e}embed_norm.hook_normalized"),
        Alias("embed_ln.hook_out", f"{e}blocks.0.hook_resid_pre"),
        Alias("hook_embed", f"{e}blocks.0.hook_resid_pre"),
        Alias("mlm_head.hook_in", f"{e}hook_final_norm"),
        Alias("ln_final.hook_in", "head.norm.hook_in"),
        Alias("ln_final.hook_scale", "head.norm.hook_scale"),
        Alias("ln_final.hook_normalized", "head.norm.hook_normalized"),
        Alias("ln_final.hook_out", "head.hook_transformed"),
        Alias("mlm_head.hook_out", "head.hook_dense"),  # the bridge's mlm_head: the dense
        Alias("unembed.hook_in", "head.hook_transformed"),
        Alias("unembed.hook_out", "head.hook_logits"),
        Alias("hook_unembed", "head.hook_logits"),
    ]
    for i, (H, _) in enumerate(heads[:L]):
        if f"{e}blocks.{i}.residuals.1.norm.hook_in" in points:
            out += _post_norm_block(f"{e}blocks.{i}.", f"blocks.{i}.", H)
    return out


def tl_table(points: list[str], heads: list[tuple[int, int]]) -> dict[str, Alias]:
    """Every TransformerLens name this model's points can answer, by name.

    Args:
        points: the model's point names (`hook_points(model)`): a pre-norm decoder-only model
            or a post-norm encoder-only one (BERT) with attnlab's standard blocks (an
            encoder-decoder, MLA or MoE block gets no aliases).
        heads: (query heads, key/value heads) of each block.

    Returns:
        {TransformerLens name: Alias}, only those whose attnlab point exists.
    """
    have = set(points)
    if "encoder.hook_tokens" in have and "decoder.hook_tokens" not in have:
        return {a.name: a for a in _encoder(have, heads) if a.point in have}
    rope = "positions.hook_cos" in have
    out = [
        Alias("embed.hook_in", "hook_tokens"),
        Alias("hook_embed", "hook_embed"),
        Alias("embed.hook_out", "hook_embed"),
        Alias("pos_embed.hook_in", "positions.hook_pos", "batch"),
        Alias("hook_pos_embed", "positions.hook_pos_embed"),
        Alias("pos_embed.hook_out", "positions.hook_pos_embed"),
        Alias("ln_final.hook_in", f"blocks.{len(heads) - 1}.hook_resid_post"),
        Alias("ln_final.hook_scale", "norm.hook_scale"),
        Alias("ln_final.hook_normalized", "norm.hook_normalized"),
        Alias("ln_final.hook_out", "hook_final_norm"),
        Alias("unembed.hook_in", "hook_final_norm"),
        Alias("unembed.hook_out", "hook_logits"),
        Alias("hook_unembed", "hook_logits"),
    ]
    if rope:
        out.append(Alias("rotary_emb.hook_in", "hook_embed", writable=False, instead="hook_embed"))
        out += [
            Alias(f"rotary_emb.hook_{x}", f"positions.hook_{x}", "batch") for x in ("cos", "sin")
        ]
    for i, (H, K) in enumerate(heads):
        p = f"blocks.{i}."
        if f"{p}self_attn.hook_q_proj" in have and f"{p}ffn.hook_pre" in have:
            gated = f"{p}ffn.hook_pre_linear" in have
            out += _block(p, p, H, K, gated, rope)
    return {a.name: a for a in out if a.point in have}


# TransformerLens' `utils.get_act_name` shorthands, and where each kind of point lives.
_SHORT = {
    "attn": "pattern",
    "attn_logits": "attn_scores",
    "key": "k",
    "query": "q",
    "value": "v",
    "mlp_pre": "pre",
    "mlp_mid": "mid",
    "mlp_post": "post",
}
_IN_ATTN = {"k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores"}
_IN_MLP = {"pre", "post", "mid", "pre_linear"}
_NORMS = {"scale", "normalized"}
_LAYER_TYPES = {"a": "attn", "m": "mlp", "b": "", "block": "", "blocks": "", "attention": "attn"}


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """A TransformerLens hook name from a short one, as `transformer_lens.utilities.get_act_name`:
    ("pattern", 3) -> "blocks.3.attn.hook_pattern"; ("scale", 2, "ln1") ->
    "blocks.2.ln1.hook_scale"; "k6" -> "blocks.6.attn.hook_k"; "resid_pre0" ->
    "blocks.0.hook_resid_pre"."""
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name  # already a full name
    packed = re.match(r"([a-z]+)(\d+)([a-z]?.*)", name)  # "scale4ln1": name, layer, type
    if packed is not None:
        name, layer, layer_type = packed.groups(0)
    name = _SHORT.get(name, name)
    full = "" if layer is None else f"blocks.{layer}."
    if name in _IN_ATTN:
        layer_type = "attn"
    elif name in _IN_MLP:
        layer_type = "mlp"
    elif layer_type in _LAYER_TYPES:
        layer_type = _LAYER_TYPES[layer_type]
    if layer_type:
        full += f"{layer_type}."
    full += f"hook_{name}"
    if name in _NORMS and layer is None:
        full = f"ln_final.{full}"
    return full
