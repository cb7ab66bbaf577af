"""Activation patching and direct logit attribution on a causal LM's hook points.

    logit_diff(logits, answer, wrong)      the last position's logit of `answer` minus `wrong`
    normalised(value, clean, corrupt)      0 at the corrupted run's value, 1 at the clean run's
    patch(model, corrupt, cache, metric, kind)   (L, T) or (L, H): the metric with one clean
                                           activation patched into the corrupted run
    residual_stack(model, cache)           (N, B, T, C): embeddings, every head, every MLP, biases
    apply_final_norm(model, stack, cache)  each component through the final norm's frozen scale
    logit_attribution(model, cache, answer, wrong)   per head (L, H) and per layer (L, 2)
    logit_lens(model, cache, answer, wrong)          the metric read off each residual stream
    patching_experiment(model, clean, corrupt, answer, wrong)   all of it for one pair of prompts
    patch_lab(ckpt, clean, corrupt, answer, wrong, out)  `attnlab lab patch`: JSON and PNGs

Activation patching ("causal tracing", Meng et al. 2022; TransformerLens' `patching` module):
run the corrupted prompt, replace one activation by its value in the clean run, and see how much
of the clean answer comes back. Here the corrupted run is patched with clean activations
(denoising), as TransformerLens' `get_act_patch_*` helpers do, one forward per cell:

    kind        hook point                      cell
    resid_pre   blocks.i.hook_resid_pre         (layer, position)
    resid_mid   blocks.i.hook_resid_mid         (layer, position)
    attn_out    blocks.i.self_attn.hook_out     (layer, position)
    mlp_out     blocks.i.ffn.hook_out           (layer, position)
    head        blocks.i.self_attn.hook_z       (layer, head), every position at once

Direct logit attribution (Elhage et al. 2021): in a pre-norm model the final residual stream is
a sum of what the embeddings, each head (z_h @ W_O[h]) and each MLP wrote, plus the biases. With
the final norm's scale frozen at its value on the whole stream (TransformerLens'
`apply_ln_to_stack`), the norm is linear in that sum, so the logit splits into one term per
component; the terms plus the norm's bias and the head's bias sum to the logit exactly.

Shapes: B batch, T positions, C d_model, H heads, D head_dim, L layers, V vocab, N components.
"""

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.checkpoint import open_checkpoint, plain_model
from attnlab.components.hooks import HookPoint, hooks, run_with_cache
from attnlab.components.norms import LayerNorm, RMSNorm
from attnlab.models.decoder import DecoderLM
from attnlab.viz.patching import plot_attribution, plot_patching

Metric = Callable[[Tensor], Tensor]  # logits (B, T, V) -> a scalar tensor
KINDS = {
    "resid_pre": "blocks.{}.hook_resid_pre",
    "resid_mid": "blocks.{}.hook_resid_mid",
    "attn_out": "blocks.{}.self_attn.hook_out",
    "mlp_out": "blocks.{}.ffn.hook_out",
    "head": "blocks.{}.self_attn.hook_z",
}


def check_lm(model: nn.Module) -> DecoderLM:
    """`model` itself, once it is known to be a pre-norm decoder LM (what both methods take)."""
    if not isinstance(model, DecoderLM):
        raise ValueError(
            f"patching and attribution take a causal LM (DecoderLM), got {type(model).__name__}"
        )
    if not model.blocks[0].residuals[0].pre:
        raise ValueError(
            "direct logit attribution needs a pre-norm model (the residual stream is a sum only "
            "there); this one is post-norm"
        )
    return model


def token_id(tokenizer, word: str | int) -> int:
    """The one token id of `word` (an int is taken as an id); a ValueError when it is several."""
    if isinstance(word, int):
        return word
    ids = tokenizer.encode(word)
    if len(ids) != 1:
        raise ValueError(
            f"{word!r} is {len(ids)} tokens {ids} for this tokenizer; give a single-token "
            "answer (often with its leading space, e.g. ' Paris') or its id"
        )
    return ids[0]


# --- the metric ----------------------------------------------------------------------------------
def logit_diff(logits: Tensor, answer: int, wrong: int | None = None) -> Tensor:
    """Mean over the batch of the last position's logit of `answer` minus that of `wrong`
    (or, without `wrong`, the answer's log-probability).

    Args:
        logits: (B, T, V).
    """
    last = logits[:, -1].float()  # (B, V)
    if wrong is None:
        return last.log_softmax(-1)[:, answer].mean()
    return (last[:, answer] - last[:, wrong]).mean()


def normalised(value: Tensor, clean: float, corrupt: float) -> Tensor:
    """(value - corrupt) / (clean - corrupt): 0 = as corrupted, 1 = the clean answer restored
    (the normalisation of TransformerLens' "Exploratory Analysis Demo")."""
    if clean == corrupt:
        raise ValueError(
            f"the clean and corrupted prompts give the same metric ({clean:.4g}); choose "
            "prompts whose answers differ"
        )
    return (value - corrupt) / (clean - corrupt)


# --- activation patching -------------------------------------------------------------------------
def _patch_at(clean: Tensor, pos: int | None, head: int | list[int] | None):
    """A hook writing clean[..., pos, :] (a residual point) or clean[:, head] (hook_z; `head`
    may be a list of heads)."""

    def fn(x: Tensor, hook: HookPoint) -> Tensor:
        x = x.clone()
        if head is not None:
            x[:, head] = clean[:, head]  # (B, T, D) of head h
        else:
            x[:, pos] = clean[:, pos]  # (B, C) at one position
        return x

    return fn


@torch.no_grad()
def patch(
    model: nn.Module, corrupt: Tensor, clean_cache: dict[str, Tensor], metric: Metric, kind: str
) -> Tensor:
    """The metric of the corrupted run with one clean activation patched in, for every cell.

    Args:
        model: a DecoderLM.
        corrupt: (B, T) the corrupted prompt's ids (as long as the clean one).
        clean_cache: the clean run's activations at the points of `kind`
            (`run_with_cache(model, clean, names=patch_names(model, kind))`).
        metric: logits (B, T, V) -> a scalar tensor, e.g. a normalised `logit_diff`.
        kind: "resid_pre", "resid_mid", "attn_out", "mlp_out" (per layer and position) or
            "head" (per layer and head, all positions).

    Returns:
        (L, T), or (L, H) for "head".
    """
    names = patch_names(model, kind)
    missing = [n for n in names if n not in clean_cache]
    if missing:
        raise ValueError(f"the clean cache lacks {missing[0]!r}; cache patch_names(model, kind)")
    first = clean_cache[names[0]]
    T = corrupt.shape[1]
    if first.shape[-2] != T:
        raise ValueError(
            f"the clean prompt has {first.shape[-2]} tokens and the corrupted one {T}; patching "
            "compares position by position, so give prompts of the same length in tokens"
        )
    cells = first.shape[1] if kind == "head" else T
    out = torch.zeros(len(names), cells)
    for layer, name in enumerate(names):
        for c in range(cells):
            pos, head = (None, c) if kind == "head" else (c, None)
            with hooks(model, [(name, _patch_at(clean_cache[name], pos, head))]):
                out[layer, c] = metric(model(corrupt)).float()
    return out


@torch.no_grad()
def patch_heads(
    model: nn.Module,
    corrupt: Tensor,
    clean_cache: dict[str, Tensor],
    heads: Sequence[tuple[int, int]],
) -> Tensor:
    """The corrupted run's logits with every head of `heads` patched from the clean run at once
    (hook_z, all positions): a circuit of several heads, where `patch` moves one.

    Args:
        corrupt: (B, T) ids.  clean_cache: the clean run's `patch_names(model, "head")`.
        heads: (layer, head) pairs.

    Returns:
        (B, T, V) logits.
    """
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    names = patch_names(model, "head")
    fwd = [(names[i], _patch_at(clean_cache[names[i]], None, hs)) for i, hs in by_layer.items()]
    with hooks(model, fwd):
        return model(corrupt)


def patch_names(model: nn.Module, kind: str) -> list[str]:
    """The hook point of `kind` in every layer, in order."""
    if kind not in KINDS:
        raise ValueError(f"unknown patching kind {kind!r}; choose one of {sorted(KINDS)}")
    return [KINDS[kind].format(i) for i in range(len(check_lm(model).blocks))]


# --- direct logit attribution --------------------------------------------------------------------
def attribution_names(model: nn.Module) -> list[str]:
    """What `residual_stack` reads: the first stream, each hook_z and MLP output, the last."""
    L = len(check_lm(model).blocks)
    names = ["blocks.0.hook_resid_pre", f"blocks.{L - 1}.hook_resid_post"]
    for i in range(L):
        names += [KINDS["head"].format(i), KINDS["mlp_out"].format(i)]
    return names


def residual_stack(model: nn.Module, cache: dict[str, Tensor]) -> tuple[Tensor, list[str]]:
    """The final residual stream split into what each component wrote.

    Returns:
        (stack, labels): stack (N, B, T, C), N = 1 + L*(H + 2); labels "embed", then for each
        layer "L{i}H{h}" per head, "L{i}.attn_bias" (its o_proj's bias: o_proj(z) =
        sum_h z_h W_O[h] + b; zeros without one) and "L{i}.mlp". The rows sum to the final
        residual stream (`blocks.{L-1}.hook_resid_post`).
    """
    model = check_lm(model)
    rows, labels = [cache["blocks.0.hook_resid_pre"]], ["embed"]
    for i, block in enumerate(model.blocks):
        attn = block.self_attn
        z = cache[KINDS["head"].format(i)]  # (B, H, T, D)
        H, D = z.shape[1], z.shape[3]
        w_o = attn.o_proj.weight.view(-1, H, D)  # (C, H, D)
        rows += list(torch.einsum("bhtd,chd->hbtc", z, w_o.to(z.dtype)))  # H x (B, T, C)
        bias = attn.o_proj.bias
        rows.append(torch.zeros_like(rows[0]) if bias is None else bias.expand_as(rows[0]))
        labels += [f"L{i}H{h}" for h in range(H)] + [f"L{i}.attn_bias"]
        rows.append(cache[KINDS["mlp_out"].format(i)])
        labels.append(f"L{i}.mlp")
    return torch.stack(rows), labels  # (N, B, T, C)


def apply_final_norm(model: nn.Module, stack: Tensor, cache: dict[str, Tensor]) -> Tensor:
    """Each component through the final norm with its scale frozen at the whole stream's
    (TransformerLens' `apply_ln_to_stack`, then the norm's weight; its bias is left out).

    Args:
        stack: (N, B, T, C) components summing to the final residual stream.

    Returns:
        (N, B, T, C); their sum plus the norm's bias is the final norm's output.
    """
    norm = check_lm(model).norm
    final = cache[f"blocks.{len(model.blocks) - 1}.hook_resid_post"].float()  # (B, T, C)
    stack = stack.float()
    if isinstance(norm, LayerNorm):
        scale = (final.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()  # (B, T, 1)
        stack = stack - stack.mean(-1, keepdim=True)
    elif isinstance(norm, RMSNorm):
        scale = (final.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()  # (B, T, 1)
    else:
        raise ValueError(f"no frozen-scale rule for a final norm of type {type(norm).__name__}")
    return stack / scale * norm.weight.float()  # (N, B, T, C)


def _direction(model: DecoderLM, answer: int, wrong: int | None) -> tuple[Tensor, Tensor]:
    """(C,) the unembedding direction of answer (minus wrong), and the head bias' share."""
    w = model.head.weight.float() * model.head_scale  # (V, C)
    d = w[answer] - (0 if wrong is None else w[wrong])
    b = model.head.bias
    b = torch.zeros(()) if b is None else b[answer].float() - (0 if wrong is None else b[wrong])
    return d, b


@torch.no_grad()
def logit_attribution(
    model: nn.Module, cache: dict[str, Tensor], answer: int, wrong: int | None = None
) -> dict:
    """Direct logit attribution at the last position, averaged over the batch.

    Args:
        cache: the points of `attribution_names(model)`.
        answer, wrong: token ids; the attributed quantity is logit[answer] - logit[wrong]
            (the logit itself without `wrong`).

    Returns:
        {"components": (N,) one value per `residual_stack` label, "labels", "heads": (L, H),
        "layers": (L, 2) attention (its heads and its o_proj bias, as TransformerLens'
        `decompose_resid` counts `attn_out`) and MLP per layer, "embed", "bias": the final
        norm's bias and the head's bias, "total": their sum (equals the model's logit
        difference)}.
    """
    model = check_lm(model)
    stack, labels = residual_stack(model, cache)
    normed = apply_final_norm(model, stack, cache)[:, :, -1]  # (N, B, C)
    d, head_bias = _direction(model, answer, wrong)
    comps = (normed @ d).mean(1)  # (N,)
    norm_bias = getattr(model.norm, "bias", None)
    bias = head_bias + (0 if norm_bias is None else norm_bias.float() @ d)
    L = len(model.blocks)
    H = (len(labels) - 1) // L - 2
    per_layer = comps[1:].view(L, H + 2)  # (L, H + 2): the heads, the o_proj bias, the MLP
    return {
        "components": comps,
        "labels": labels,
        "heads": per_layer[:, :H],
        "layers": torch.stack([per_layer[:, : H + 1].sum(1), per_layer[:, H + 1]], 1),
        "embed": comps[0],
        "bias": bias,
        "total": comps.sum() + bias,
    }


@torch.no_grad()
def logit_lens(
    model: nn.Module, cache: dict[str, Tensor], answer: int, wrong: int | None = None
) -> Tensor:
    """The final norm and head on each residual stream of the cache (nostalgebraist 2020):
    the metric `logit_diff` read after the embeddings and after each block.

    Args:
        cache: `blocks.0.hook_resid_pre` and every `blocks.i.hook_resid_post`.

    Returns:
        (L + 1,) the embeddings' stream first.
    """
    model = check_lm(model)
    names = ["blocks.0.hook_resid_pre"] + [
        f"blocks.{i}.hook_resid_post" for i in range(len(model.blocks))
    ]
    return torch.stack([logit_diff(model.logits(cache[n]), answer, wrong) for n in names])


def lens_names(model: nn.Module) -> list[str]:
    """The points `logit_lens` reads."""
    L = len(check_lm(model).blocks)
    return ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(L)]


@torch.no_grad()
def patching_experiment(
    model: nn.Module,
    clean: Tensor,
    corrupt: Tensor,
    answer: int,
    wrong: int | None = None,
    kinds: Sequence[str] = ("resid_pre", "attn_out", "mlp_out", "head"),
) -> dict:
    """Everything for one clean/corrupted pair: every patching map (normalised: 1 = the clean
    answer restored), the DLA of the clean run and the logit lens of both runs.

    Args:
        clean, corrupt: (B, T) ids of the same length.  answer, wrong: token ids.

    Returns:
        {"clean", "corrupt": the two runs' logit_diff, "patching": {kind: (L, T) or (L, H)},
        "dla": logit_attribution's dict, "lens": {"clean", "corrupt": (L + 1,)}}.
    """
    model = check_lm(model)
    names = sorted(
        {n for k in kinds for n in patch_names(model, k)}
        | set(attribution_names(model))
        | set(lens_names(model))
    )
    clean_logits, cache = run_with_cache(model, clean, names=names)
    corrupt_logits, corrupt_cache = run_with_cache(model, corrupt, names=lens_names(model))
    c, k = (
        logit_diff(clean_logits, answer, wrong).item(),
        logit_diff(corrupt_logits, answer, wrong).item(),
    )

    def metric(logits: Tensor) -> Tensor:
        return normalised(logit_diff(logits, answer, wrong), c, k)

    return {
        "clean": c,
        "corrupt": k,
        "patching": {kind: patch(model, corrupt, cache, metric, kind) for kind in kinds},
        "dla": logit_attribution(model, cache, answer, wrong),
        "lens": {
            "clean": logit_lens(model, cache, answer, wrong),
            "corrupt": logit_lens(model, corrupt_cache, answer, wrong),
        },
    }


# --- one checkpoint, written out -----------------------------------------------------------------
def to_json(result: dict, tokens: Sequence[str], answer: str, wrong: str | None) -> dict:
    """`patching_experiment`'s result as plain lists (what patching.json holds)."""
    dla = result["dla"]
    return {
        "tokens": list(tokens),
        "answer": answer,
        "wrong": wrong,
        "metric": "logit_diff" if wrong is not None else "log_prob",
        "clean": result["clean"],
        "corrupt": result["corrupt"],
        "patching": {k: v.tolist() for k, v in result["patching"].items()},
        "dla": {
            "heads": dla["heads"].tolist(),
            "layers": dla["layers"].tolist(),
            "embed": dla["embed"].item(),
            "bias": dla["bias"].item(),
            "total": dla["total"].item(),
        },
        "logit_lens": {k: v.tolist() for k, v in result["lens"].items()},
    }


def patch_lab(
    ckpt: str | Path, clean: str, corrupt: str, answer: str, wrong: str | None, out: str | Path
) -> dict:
    """Open a checkpoint, run `patching_experiment` on two prompts (text, through the
    checkpoint's tokenizer), write patching.json, patching.png and attribution.png under `out`.

    Args:
        answer, wrong: single-token words (e.g. " Paris"); wrong may be None (then the metric
            is the answer's log-probability).

    Returns:
        The JSON dict, with "files": the paths written.
    """
    loaded = plain_model(open_checkpoint(ckpt), "patching takes a plain causal LM")
    tok = loaded.tokenizer
    if tok is None:
        raise ValueError(f"{str(loaded.path)!r} has no tokenizer.json to read the prompts with")
    ids = [torch.tensor([tok.encode(text)]) for text in (clean, corrupt)]  # (1, T) each
    if ids[0].shape[1] == 0:
        raise ValueError("--clean is empty; give the prompt whose answer is patched back")
    a = token_id(tok, answer)
    w = None if wrong is None else token_id(tok, wrong)
    result = patching_experiment(loaded.model, ids[0], ids[1], a, w)
    tokens = [tok.decode([i], skip_special=False) for i in ids[0][0].tolist()]
    data = to_json(result, tokens, answer, wrong)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "patching.json", out / "patching.png", out / "attribution.png"]
    files[0].write_text(json.dumps(data, indent=1))
    title = f"{clean!r} vs {corrupt!r}: {answer!r}" + ("" if wrong is None else f" - {wrong!r}")
    plot_patching(result["patching"], tokens, files[1], title)
    dla = result["dla"]
    plot_attribution(dla["heads"], dla["layers"], result["lens"], files[2], title)
    return data | {"files": [str(f) for f in files]}
