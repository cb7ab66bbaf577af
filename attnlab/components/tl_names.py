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


def _attention(a: str, t: str, H: int, K: int, out: bool = True) -> list[Alias]:
    """One attention layer's own names: attnlab's points start with `a` ("blocks.i.self_attn."),
    TransformerLens' with `t` ("blocks.i.attn."); `out`: its output is `t + "hook_out"` too."""
    ro = dict(writable=False)
    names = [
        Alias(f"{t}hook_in", f"{a}hook_in"),
        Alias(f"{t}hook_q", f"{a}hook_q_proj"),
        Alias(f"{t}q.hook_out", f"{a}hook_q_proj"),
        Alias(f"{t}hook_k", f"{a}hook_k_proj"),
        Alias(f"{t}k.hook_out", f"{a}hook_k_proj"),
        Alias(f"{t}hook_v", f"{a}hook_v", "heads"),
        Alias(f"{t}v.hook_out", f"{a}hook_v", "heads"),
        Alias(f"{t}hook_attn_scores", f"{a}hook_scores"),
        Alias(f"{t}hook_pattern", f"{a}hook_pattern"),
        Alias(f"{t}hook_z", f"{a}hook_z", "heads"),
        Alias(f"{t}o.hook_in", f"{a}hook_z", "heads"),
        Alias(f"{t}hook_result", f"{a}hook_result"),
        Alias(f"{t}o.hook_out", f"{a}hook_out"),
        Alias(f"{t}hook_hidden_states", f"{a}hook_out"),
    ]
    if out:
        names.append(Alias(f"{t}hook_out", f"{a}hook_out"))
    for x in ("q", "k", "v"):  # one input, shared by the three projections
        names.append(Alias(f"{t}{x}.hook_in", f"{a}hook_in", **ro, instead=f"{t}hook_in"))
    for name, n in (("attn_in", H), ("q_input", H), ("k_input", K), ("v_input", K)):
        names.append(  # per-head copies of the stream (TL's split inputs): below, by block
            Alias(f"{t}hook_{name}", "", "per_head", False, n, f"{t}hook_in")
        )
    return names


def _split_inputs(names: list[Alias], ln: str, resid: str) -> list[Alias]:
    """The per-head input copies of `_attention` read from the stream `resid`, under both the
    attention's name and the block's (`ln` + "hook_q_input")."""
    out = []
    for x in names:
        if x.view == "per_head":
            out.append(Alias(x.name, resid, "per_head", False, x.heads, x.instead))
            out.append(
                Alias(ln + x.name.rsplit(".", 1)[1], resid, "per_head", False, x.heads, x.instead)
            )
    return [x for x in names if x.view != "per_head"] + out


def _mlp(p: str, ln: str, gated: bool) -> list[Alias]:
    """An FFN's names (`p` "blocks.i.ffn.", `ln` "blocks.i.mlp."); in a gated one `mlp.gate` is
    TransformerLens' gate_proj and `mlp.in` its up_proj."""
    out = [
        Alias(f"{ln}hook_in", f"{p}hook_in"),
        Alias(f"{ln}hook_pre", f"{p}hook_pre"),
        Alias(f"{ln}hook_post", f"{p}hook_hidden"),
        Alias(f"{ln}out.hook_in", f"{p}hook_hidden"),
        Alias(f"{ln}hook_out", f"{p}hook_out"),
        Alias(f"{ln}out.hook_out", f"{p}hook_out"),
    ]
    if not gated:
        return out + [
            Alias(f"{ln}in.hook_in", f"{p}hook_in"),
            Alias(f"{ln}in.hook_out", f"{p}hook_pre"),
        ]
    ro = dict(writable=False, instead=f"{ln}hook_in")
    return out + [
        Alias(f"{ln}gate.hook_in", f"{p}hook_in", **ro),
        Alias(f"{ln}gate.hook_out", f"{p}hook_pre"),
        Alias(f"{ln}in.hook_in", f"{p}hook_in", **ro),
        Alias(f"{ln}in.hook_out", f"{p}hook_pre_linear"),
        Alias(f"{ln}hook_pre_linear", f"{p}hook_pre_linear"),
    ]


def _norm(p: str, ln: str) -> list[Alias]:
    """A norm's two points (`p` "blocks.i.residuals.0.norm.", `ln` "blocks.i.ln1.")."""
    return [
        Alias(f"{ln}hook_scale", f"{p}hook_scale"),
        Alias(f"{ln}hook_normalized", f"{p}hook_normalized"),
    ]


def _block(
    p: str, ln: str, H: int, K: int, gated: bool, rope: bool, attn: str = "attn", cross=False
) -> list[Alias]:
    """The aliases of one pre-norm block whose points start with `p` ("blocks.i."); `ln` is
    TransformerLens' prefix for it, `attn` its name for the self-attention; `cross`: the block
    cross-attends (T5's decoder: ln2 before the cross attention, ln3 before the MLP)."""
    t = f"{ln}{attn}."
    out = [
        Alias(f"{ln}hook_resid_pre", f"{p}hook_resid_pre"),
        Alias(f"{ln}hook_in", f"{p}hook_resid_pre"),
        Alias(f"{ln}ln1.hook_in", f"{p}hook_resid_pre"),
        *_norm(f"{p}residuals.0.norm.", f"{ln}ln1."),
        Alias(f"{ln}ln1.hook_out", f"{p}self_attn.hook_in"),
        *_split_inputs(_attention(f"{p}self_attn.", t, H, K), ln, f"{p}hook_resid_pre"),
        Alias(f"{ln}hook_attn_out", f"{p}self_attn.hook_out"),
        Alias(f"{ln}hook_resid_mid", f"{p}hook_resid_mid"),
        Alias(f"{ln}ln2.hook_in", f"{p}hook_resid_mid"),
        *_mlp(f"{p}ffn.", f"{ln}mlp.", gated),
        Alias(f"{ln}hook_mlp_out", f"{p}ffn.hook_out"),
        Alias(f"{ln}hook_out", f"{p}hook_resid_post"),
        Alias(f"{ln}hook_resid_post", f"{p}hook_resid_post"),
    ]
    ffn_norm, ffn_ln, mid = "residuals.1.norm.", "ln2.", f"{p}hook_resid_mid"
    if cross:
        c = f"{ln}cross_attn."
        memory = "encoder.hook_final_norm"  # what the keys and values are projected from
        cross = [x for x in _attention(f"{p}cross_attn.", c, H, K) if x.view != "per_head"]
        cross = [x for x in cross if x.name not in (f"{c}k.hook_in", f"{c}v.hook_in")]
        out += cross + [
            *_norm(f"{p}residuals.1.norm.", f"{ln}ln2."),
            Alias(f"{ln}ln2.hook_out", f"{p}cross_attn.hook_in"),
            Alias(f"{c}q.hook_in", f"{p}cross_attn.hook_in"),
            Alias(f"{c}k.hook_in", memory, writable=False, instead="encoder_ln_final.hook_out"),
            Alias(f"{c}v.hook_in", memory, writable=False, instead="encoder_ln_final.hook_out"),
            Alias(f"{ln}hook_cross_attn_out", f"{p}cross_attn.hook_out"),
            Alias(f"{ln}hook_resid_mid2", f"{p}hook_resid_cross"),
            Alias(f"{ln}ln3.hook_in", f"{p}hook_resid_cross"),
        ]
        ffn_norm, ffn_ln, mid = "residuals.2.norm.", "ln3.", f"{p}hook_resid_cross"
    out += [
        *_norm(f"{p}{ffn_norm}", f"{ln}{ffn_ln}"),
        Alias(f"{ln}{ffn_ln}hook_out", f"{p}ffn.hook_in"),
        Alias(f"{ln}hook_mlp_in", mid, writable=False, instead=f"{ln}{ffn_ln}hook_in"),
    ]
    if rope:
        out += [
            Alias(f"{t}hook_rot_q", f"{p}self_attn.hook_q", "heads"),
            Alias(f"{t}hook_rot_k", f"{p}self_attn.hook_k", "heads"),
        ]
        for x in ("cos", "sin"):
            instead = f"rotary_emb.hook_{x}"
            out.append(Alias(f"{t}hook_{x}", f"positions.hook_{x}", "batch", False, 0, instead))
    return out


def _post_norm_block(p: str, ln: str, H: int) -> list[Alias]:
    """The aliases of one post-norm encoder block (BERT) as TransformerBridge names them: its
    attention's output (`attn.hook_out`, `hook_attn_out`) is the first norm's output, and its
    `hook_resid_mid` the second norm's input (the stream plus the MLP's output)."""
    attn = _attention(f"{p}self_attn.", f"{ln}attn.", H, H, out=False)
    return [
        Alias(f"{ln}hook_resid_pre", f"{p}hook_resid_pre"),
        Alias(f"{ln}hook_in", f"{p}hook_resid_pre"),
        *_split_inputs(attn, ln, f"{p}hook_resid_pre"),
        Alias(f"{ln}ln1.hook_in", f"{p}residuals.0.norm.hook_in"),
        *_norm(f"{p}residuals.0.norm.", f"{ln}ln1."),
        Alias(f"{ln}ln1.hook_out", f"{p}hook_resid_mid"),
        Alias(f"{ln}attn.hook_out", f"{p}hook_resid_mid"),
        Alias(f"{ln}hook_attn_out", f"{p}hook_resid_mid"),
        *_mlp(f"{p}ffn.", f"{ln}mlp.", False),
        Alias(f"{ln}hook_mlp_in", f"{p}ffn.hook_in"),
        Alias(f"{ln}hook_mlp_out", f"{p}ffn.hook_out"),
        Alias(f"{ln}ln2.hook_in", f"{p}residuals.1.norm.hook_in"),
        Alias(f"{ln}hook_resid_mid", f"{p}residuals.1.norm.hook_in"),
        *_norm(f"{p}residuals.1.norm.", f"{ln}ln2."),
        Alias(f"{ln}ln2.hook_out", f"{p}hook_resid_post"),
        Alias(f"{ln}hook_out", f"{p}hook_resid_post"),
        Alias(f"{ln}hook_resid_post", f"{p}hook_resid_post"),
    ]


def _encoder(points: set[str], heads: list[tuple[int, int]]) -> list[Alias]:
    """An encoder-only model's aliases (BERT: `encoder.` points, a masked-LM `head.`)."""
    e = "encoder."
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
    for i, (H, _) in enumerate(heads):
        if f"{e}blocks.{i}.residuals.1.norm.hook_in" in points:
            out += _post_norm_block(f"{e}blocks.{i}.", f"blocks.{i}.", H)
    return out


def _t5(points: set[str], heads: dict[str, list[tuple[int, int]]]) -> list[Alias]:
    """An encoder-decoder's aliases (T5) as TransformerBridge names them: `encoder_blocks.i`,
    `decoder_blocks.i` with `self_attn` and `cross_attn`, ln1-ln3, the relative position bias
    as `pos_embed` / `decoder_pos_embed` ((T, S) buckets and their (T, S, H) bias)."""
    out = [
        Alias("embed.hook_in", "encoder.hook_tokens"),
        Alias("embed.hook_out", "encoder.hook_embed"),
        Alias("hook_embed", "encoder.hook_embed"),
        Alias("pos_embed.hook_in", "encoder.positions.hook_buckets"),
        Alias("pos_embed.hook_out", "encoder.positions.hook_pos_embed"),
        Alias("hook_pos_embed", "encoder.positions.hook_pos_embed"),
        Alias("decoder_pos_embed.hook_in", "decoder.positions.hook_buckets"),
        Alias("decoder_pos_embed.hook_out", "decoder.positions.hook_pos_embed"),
        Alias("unembed.hook_in", "decoder.hook_head_in"),  # times d_model^-0.5 (a tied head)
        Alias("unembed.hook_out", "decoder.hook_logits"),
        Alias("hook_unembed", "decoder.hook_logits"),
    ]
    for stack in ("encoder", "decoder"):
        out += [
            Alias(f"{stack}_ln_final.hook_in", f"{stack}.norm.hook_in"),
            *_norm(f"{stack}.norm.", f"{stack}_ln_final."),
            Alias(f"{stack}_ln_final.hook_out", f"{stack}.hook_final_norm"),
        ]
        attn = "attn" if stack == "encoder" else "self_attn"
        for i, (H, K) in enumerate(heads[f"{stack}."]):
            p = f"{stack}.blocks.{i}."
            if f"{p}self_attn.hook_q_proj" in points and f"{p}ffn.hook_pre" in points:
                gated = f"{p}ffn.hook_pre_linear" in points
                cross = f"{p}hook_resid_cross" in points
                out += _block(p, f"{stack}_blocks.{i}.", H, K, gated, False, attn, cross)
    return out


def tl_table(points: list[str], heads: dict[str, list[tuple[int, int]]]) -> dict[str, Alias]:
    """Every TransformerLens name this model's points can answer, by name.

    Args:
        points: the model's point names (`hook_points(model)`): a pre-norm decoder-only model,
            a post-norm encoder-only one (BERT) or a pre-norm encoder-decoder (T5) with
            attnlab's standard blocks (an MLA or MoE block gets no aliases).
        heads: for each stack ("" for a decoder-only model, "encoder." and / or "decoder."),
            (query heads, key/value heads) of each of its blocks.

    Returns:
        {TransformerLens name: Alias}, only those whose attnlab point exists.
    """
    have = set(points)
    if "encoder." in heads and "decoder." in heads:
        aliases = _t5(have, heads)
    elif "encoder." in heads:
        aliases = _encoder(have, heads["encoder."])
    else:
        aliases = _decoder(have, heads[""])
    return {a.name: a for a in aliases if a.point in have}


def _decoder(have: set[str], heads: list[tuple[int, int]]) -> list[Alias]:
    """A decoder-only model's aliases (GPT-2, Llama)."""
    rope = "positions.hook_cos" in have
    out = [
        Alias("embed.hook_in", "hook_tokens"),
        Alias("hook_embed", "hook_embed"),
        Alias("embed.hook_out", "hook_embed"),
        Alias("pos_embed.hook_in", "positions.hook_pos", "batch"),
        Alias("hook_pos_embed", "positions.hook_pos_embed"),
        Alias("pos_embed.hook_out", "positions.hook_pos_embed"),
        Alias("ln_final.hook_in", f"blocks.{len(heads) - 1}.hook_resid_post"),
        *_norm("norm.", "ln_final."),
        Alias("ln_final.hook_out", "hook_final_norm"),
        Alias("unembed.hook_in", "hook_head_in"),
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
            out += _block(p, p, H, K, f"{p}ffn.hook_pre_linear" in have, rope)
    return out


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
