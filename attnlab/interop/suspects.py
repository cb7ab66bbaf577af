"""The usual suspects of a port, each a small reversible change to an attnlab model.

    RoPE layout      half <-> interleaved, q/k weights left as they are
    norm eps         every norm takes the reference's epsilon
    GELU             exact (erf) <-> tanh approximation
    mask polarity    the attention mask inverted
    embedding scale  the sqrt(d_model) multiplier on <-> off (Vaswani et al. 2017, §3.4)
    output head      the reference's head matrix swapped in (tied vs untied)
    head rescale     T5's d_model^-0.5 before a tied head on <-> off
    experts per tok  every MoE layer routes to the reference's k experts per token
    top-k renorm     the k chosen experts' gates renormalised to sum to 1 on <-> off

`check` re-runs the attnlab side under each change; one that makes the first divergent point
match names the likely cause.
"""

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from attnlab.components.embedding import TokenEmbedding
from attnlab.components.ffn import ACTIVATIONS
from attnlab.components.moe import moe_layers
from attnlab.components.norms import LayerNorm, RMSNorm
from attnlab.components.positions.rope import RoPE, rope_angles
from attnlab.interop.sides import Inputs, Side
from attnlab.models.decoder import DecoderLM


@dataclass(frozen=True)
class Suspect:
    """One usual suspect: what to change on the attnlab side, and what it means if that helps."""

    key: str
    change: str  # what the re-run changed, e.g. "RoPE layout interleaved -> half"
    cause: str  # the explanation when this change fixes the divergence
    apply: Callable[[Inputs], AbstractContextManager]  # a context in which the change holds


@contextmanager
def _setting(changes: list[tuple[object, str, object]]) -> Iterator[None]:
    """Temporarily set attributes: [(object, name, value)], restored afterwards."""
    old = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
    try:
        for obj, name, value in changes:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(old):
            setattr(obj, name, value)


def eps_of(model: nn.Module) -> list[float]:
    """Every norm's epsilon, in module order (attnlab: eps; HF: eps or variance_epsilon)."""
    out = []
    for m in model.modules():
        if "Norm" in type(m).__name__:
            eps = getattr(m, "eps", getattr(m, "variance_epsilon", None))
            if isinstance(eps, float):
                out.append(eps)
    return out


def fmt_eps(values) -> str:
    return "{" + ", ".join(f"{v:g}" for v in sorted(set(values))) + "}"


def _rope_layout(model: nn.Module, who: str, ref: str) -> Suspect | None:
    """The same q/k weights rotated in the other pairing of features."""
    ropes = [m for m in model.modules() if isinstance(m, RoPE)]
    if not ropes:
        return None
    cur = ropes[0].layout
    other = "half" if cur == "interleaved" else "interleaved"

    def apply(_x):
        changes = []
        for r in ropes:
            cos, sin = rope_angles(r.rotary_dim, r.cos.shape[0], r.theta, r.scaling, other)
            changes += [
                (r, "layout", other),
                (r, "cos", cos.to(r.cos.device)),
                (r, "sin", sin.to(r.sin.device)),
            ]
        return _setting(changes)

    cause = (
        f"RoPE layout: {who} rotates q/k in the {cur!r} layout but its q_proj/k_proj rows "
        f"are in the {other!r} layout. Convert with the layout you build (the HF converter "
        f"permutes q/k rows: permute_qk_weight), or build with rope.layout={other!r}."
    )
    return Suspect("rope_layout", f"RoPE layout {cur} -> {other}", cause, apply)


def _norm_eps(model: nn.Module, reference: nn.Module, who: str, ref: str) -> Suspect | None:
    """The reference's epsilons: one by one when the norms line up, else its usual one."""
    norms = [m for m in model.modules() if isinstance(m, LayerNorm | RMSNorm)]
    ref_eps = eps_of(reference)
    if not norms or not ref_eps:
        return None
    ours = [m.eps for m in norms]
    if len(ref_eps) == len(norms):
        target = ref_eps
    else:
        target = [max(set(ref_eps), key=ref_eps.count)] * len(norms)
    if target == ours:
        return None

    def apply(_x):
        return _setting([(m, "eps", e) for m, e in zip(norms, target)])

    cause = (
        f"norm eps: {who}'s norms use eps {fmt_eps(ours)}, {ref}'s {fmt_eps(ref_eps)} "
        "(check norm_eps / layer_norm_eps / rms_norm_eps)."
    )
    return Suspect("norm_eps", f"norm eps {fmt_eps(ours)} -> {fmt_eps(target)}", cause, apply)


def _gelu(model: nn.Module, who: str, ref: str) -> Suspect | None:
    """Exact (erf) GELU <-> its tanh approximation, wherever a module holds one."""
    exact, tanh = ACTIVATIONS["gelu"], ACTIVATIONS["gelu_tanh"]
    acts = [m for m in model.modules() if getattr(m, "act", None) in (exact, tanh)]
    if not acts:
        return None
    now, swapped = ("exact", "tanh") if acts[0].act is exact else ("tanh", "exact")

    def apply(_x):
        return _setting([(m, "act", tanh if m.act is exact else exact) for m in acts])

    cause = (
        f"GELU variant: {who} uses the {now} GELU where {ref} uses the {swapped} one "
        "(HF 'gelu' is exact erf, 'gelu_new' / 'gelu_pytorch_tanh' are tanh: attnlab's "
        "activation 'gelu' vs 'gelu_tanh')."
    )
    return Suspect("gelu", f"GELU {now} -> {swapped}", cause, apply)


def _mask_polarity(x: Inputs, who: str) -> Suspect | None:
    """Run with the attention masks inverted (True <-> False)."""
    if x.mask is None:
        return None

    @contextmanager
    def apply(x: Inputs):
        saved = (x.mask, x.decoder_mask)
        x.mask = ~x.mask
        x.decoder_mask = None if x.decoder_mask is None else ~x.decoder_mask
        try:
            yield
        finally:
            x.mask, x.decoder_mask = saved

    cause = (
        f"mask polarity: {who} reads the attention mask inverted (attnlab masks are "
        "True/1 = real token; an additive or 'True = masked' mask must be flipped)."
    )
    return Suspect("mask", "attention mask inverted", cause, apply)


def _embedding_scale(model: nn.Module, who: str, ref: str) -> Suspect | None:
    """The sqrt(d_model) multiplier of the token embedding on <-> off."""
    embeds = list({id(m): m for m in model.modules() if isinstance(m, TokenEmbedding)}.values())
    if not embeds:
        return None
    has = embeds[0].multiplier != 1.0

    def apply(_x):
        return _setting(
            [(e, "multiplier", 1.0 if has else math.sqrt(e.embedding_dim)) for e in embeds]
        )

    cause = (
        f"embedding scale: {who} {'multiplies' if has else 'does not multiply'} the token "
        f"embeddings by sqrt(d_model) and {ref} {'does not' if has else 'does'} "
        "(scale_embeddings)."
    )
    return Suspect(
        "embed_scale",
        f"sqrt(d) embedding scale {'on -> off' if has else 'off -> on'}",
        cause,
        apply,
    )


def _output_head(side: Side) -> tuple[nn.Module | None, bool]:
    """The output (LM head) Linear and whether its weight is the input embedding's."""
    m, head, embed = side.model, None, None
    if not side.ours:
        head, embed = m.get_output_embeddings(), m.get_input_embeddings()
    elif side.kind == "decoder":
        head, embed = m.head, m.embed
    elif side.kind == "encoder_decoder":
        head, embed = m.decoder.head, m.decoder.embed
    elif side.kind == "encoder":
        head, embed = m.head.decoder, m.encoder.embed
    if head is None or embed is None:
        return None, False
    return head, head.weight is embed.weight


def _head_weights(ours: Side, reference: Side, who: str, ref: str) -> Suspect | None:
    """The reference's output matrix swapped in; the cause says whether tying differs."""
    head, tied = _output_head(ours)
    ref_head, ref_tied = _output_head(reference)
    if head is None or ref_head is None or head.weight.shape != ref_head.weight.shape:
        return None
    if torch.equal(head.weight, ref_head.weight):
        return None

    def apply(_x):
        return _setting([(head, "weight", nn.Parameter(ref_head.weight.detach().clone()))])

    if tied != ref_tied:
        cause = (
            f"tied vs untied head: {who}'s output head {'is' if tied else 'is not'} the "
            f"token embedding, {ref}'s {'is' if ref_tied else 'is not'} "
            "(tie_embeddings / tie_word_embeddings)."
        )
    else:
        cause = f"the output head weights differ from {ref}'s (check the head's key map)."
    return Suspect("head", f"output head -> {ref}'s matrix", cause, apply)


def _head_rescale(ours: Side, who: str, ref: str) -> Suspect | None:
    """T5 v1.0's d_model^-0.5 before a tied head on <-> off."""
    decoder = ours.model.decoder if ours.kind == "encoder_decoder" else ours.model
    if not isinstance(decoder, DecoderLM) or decoder.head.weight is not decoder.embed.weight:
        return None  # the rescale belongs to a tied head
    on = decoder.head_scale != 1.0

    def apply(_x):
        return _setting([(decoder, "head_scale", 1.0 if on else decoder.embed.embedding_dim**-0.5)])

    cause = (
        f"head rescale: {who} {'scales' if on else 'does not scale'} the final hidden "
        f"state by d_model^-0.5 before the tied head and {ref} {'does not' if on else 'does'} "
        "(T5 v1.0: head_rescale)."
    )
    return Suspect(
        "head_rescale", f"head rescale d^-0.5 {'on -> off' if on else 'off -> on'}", cause, apply
    )


def _experts_per_token(
    model: nn.Module, reference: nn.Module, who: str, ref: str
) -> Suspect | None:
    """Every MoE layer routing to the reference's number of experts per token."""
    layers, ref_layers = moe_layers(model), moe_layers(reference)
    config = getattr(reference, "config", None)  # transformers: num_experts_per_tok
    ref_k = ref_layers[0].k if ref_layers else getattr(config, "num_experts_per_tok", None)
    if not layers or not isinstance(ref_k, int) or not 1 <= ref_k <= layers[0].n_experts:
        return None
    k = layers[0].k
    if k == ref_k:
        return None

    def apply(_x):
        return _setting([(m, "k", ref_k) for m in layers])

    cause = (
        f"experts per token: {who} routes each token to {k} experts, {ref} to {ref_k} "
        "(check num_experts_per_tok / n_experts_per_token)."
    )
    return Suspect("moe_k", f"experts per token {k} -> {ref_k}", cause, apply)


def _topk_renorm(model: nn.Module, who: str, ref: str) -> Suspect | None:
    """The chosen experts' gates renormalised to sum to 1 (Mixtral) <-> left as scored (Qwen2-MoE
    without norm_topk_prob)."""
    layers = moe_layers(model)
    if not layers:
        return None
    on = layers[0].normalize

    def apply(_x):
        return _setting([(m, "normalize", not on) for m in layers])

    cause = (
        f"top-k renormalisation: {who} {'rescales' if on else 'does not rescale'} the chosen "
        f"experts' gates to sum to 1 and {ref} {'does not' if on else 'does'} "
        "(check norm_topk_prob / MoEConfig.normalize)."
    )
    return Suspect(
        "moe_normalize", f"top-k renorm {'on -> off' if on else 'off -> on'}", cause, apply
    )


def suspects(ours: Side, reference: Side, x: Inputs, who: str, ref: str) -> list[Suspect]:
    """Every suspect that applies to the attnlab side `ours` (called `who` in messages)."""
    found = [
        _rope_layout(ours.model, who, ref),
        _norm_eps(ours.model, reference.model, who, ref),
        _gelu(ours.model, who, ref),
        _mask_polarity(x, who),
        _embedding_scale(ours.model, who, ref),
        _head_weights(ours, reference, who, ref),
        _head_rescale(ours, who, ref),
        _experts_per_token(ours.model, reference.model, who, ref),
        _topk_renorm(ours.model, who, ref),
    ]
    return [s for s in found if s is not None]
