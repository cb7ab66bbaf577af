"""TransformerLens' activation patching helpers, by their names, on attnlab's models.

Each `get_act_patch_*` takes what `transformer_lens.patching`'s does (the model, the corrupted
tokens, the clean run's cache, a metric of the logits) and returns the same tensor: for every
cell, the metric of the corrupted run with that one piece of the clean run patched in. The
cache is read by TransformerLens' names and layouts (`run_with_cache(model, clean,
naming="transformer_lens")`, or `names=` those of `tl_patch_names`), and the patches go through
the same names, so a head is (B, T, H, D)'s axis 2 and `q` / `k` are taken before RoPE, as in
TransformerLens.

    function                                    point      cell                      shape
    resid_pre, resid_mid, attn_out, mlp_out     the stream  (layer, pos)              (L, T)
    attn_head_{out,q,k,v}_by_pos                z, q, k, v  (layer, pos, head)        (L, T, H)
    attn_head_{out,q,k,v}_all_pos               z, q, k, v  (layer, head)             (L, H)
    attn_head_pattern_all_pos                   pattern     (layer, head)             (L, H)
    attn_head_pattern_by_pos                    pattern     (layer, head, dest)       (L, H, T)
    attn_head_pattern_dest_src_pos              pattern     (layer, head, dest, src)  (L, H, T, T)
    block_every                                 resid_pre, attn_out, mlp_out         (3, L, T)
    attn_head_all_pos_every / by_pos_every      out, q, k, v, pattern     (5, L, H) / (5, L, T, H)

k and v of a GQA model have K heads, and their maps K columns (as TransformerLens' do); the
`_every` stacks pad them with zeros to H columns, as TransformerLens does.

Shapes: B batch, T positions, L layers, H heads, K kv heads.
"""

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.components.hooks import hooks
from attnlab.components.tl_names import get_act_name
from attnlab.lab.patching import Metric, check_lm
from attnlab.lab.tl_model import HookedModel

Setter = Callable[[Tensor, tuple[int, ...], Tensor], None]  # (corrupt, cell, clean), in place


def _at_pos(x: Tensor, cell: tuple[int, ...], clean: Tensor) -> None:
    x[:, cell[0]] = clean[:, cell[0]]  # (B, ...) at one position


def _at_pos_head(x: Tensor, cell: tuple[int, ...], clean: Tensor) -> None:
    x[:, cell[0], cell[1]] = clean[:, cell[0], cell[1]]  # (B, D) of one head at one position


def _at_head(x: Tensor, cell: tuple[int, ...], clean: Tensor) -> None:
    x[:, :, cell[0]] = clean[:, :, cell[0]]  # (B, T, D): one head, every position


def _pattern_at(x: Tensor, cell: tuple[int, ...], clean: Tensor) -> None:
    x[(slice(None),) + cell] = clean[(slice(None),) + cell]  # head[, dest[, src]] of (B,H,T,S)


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The blocks patched: a causal LM's (a HookedModel's), or an encoder-only model's (BERT,
    whose metric reads its masked-LM logits)."""
    model = model.model if isinstance(model, HookedModel) else model
    if hasattr(model, "encoder") and not hasattr(model, "decoder"):
        return model.encoder.blocks
    return check_lm(model).blocks


def _sizes(blocks: nn.ModuleList, act: str, axes: tuple[str, ...], T: int) -> list[int]:
    attn = blocks[0].self_attn
    heads = attn.n_kv_heads if act in ("k", "v") else attn.n_heads
    size = {"layer": len(blocks), "pos": T, "head": heads, "dest": T, "src": T}
    return [size[a] for a in axes]


@torch.no_grad()
def activation_patch(
    model: nn.Module,
    corrupted_tokens: Tensor,
    clean_cache: dict[str, Tensor],
    patching_metric: Metric,
    act: str,
    axes: tuple[str, ...],
    setter: Setter,
) -> Tensor:
    """TransformerLens' `generic_activation_patch`: one corrupted forward per cell.

    Args:
        model: a DecoderLM, a HookedModel (lab/tl_model.py) or an encoder-only model (BERT).
        corrupted_tokens: (B, T) ids.
        clean_cache: the clean run's activations under TransformerLens' names.
        patching_metric: logits (B, T, V) -> a scalar tensor.
        act: a `get_act_name` short name ("resid_pre", "z", "q", "pattern", ...).
        axes: "layer" first, then any of "pos", "head", "dest", "src".
        setter: writes the clean cell into the (cloned) corrupted activation.

    Returns:
        The metric for every cell, shaped by `axes`.
    """
    sizes = _sizes(_blocks(model), act, axes, corrupted_tokens.shape[-1])
    model = model.model if isinstance(model, HookedModel) else model
    out = torch.zeros(sizes)
    for cell in itertools.product(*(range(n) for n in sizes)):
        name = get_act_name(act, cell[0])
        if name not in clean_cache:
            raise ValueError(
                f"the clean cache lacks {name!r}; cache TransformerLens' names "
                "(run_with_cache(model, clean, naming='transformer_lens'))"
            )
        clean = clean_cache[name]

        def patch(x: Tensor, hook, clean=clean, rest=cell[1:]) -> Tensor:
            x = x.clone()
            setter(x, rest, clean)
            return x

        with hooks(model, [(name, patch)]):
            out[cell] = patching_metric(model(corrupted_tokens)).float()
    return out


def _patcher(act: str, axes: tuple[str, ...], setter: Setter, what: str):
    def fn(model, corrupted_tokens, clean_cache, patching_metric) -> Tensor:
        return activation_patch(
            model, corrupted_tokens, clean_cache, patching_metric, act, axes, setter
        )

    fn.__doc__ = f"TransformerLens' patching of {what}: shape ({', '.join(axes)})."
    return fn


get_act_patch_resid_pre = _patcher("resid_pre", ("layer", "pos"), _at_pos, "resid_pre")
get_act_patch_resid_mid = _patcher("resid_mid", ("layer", "pos"), _at_pos, "resid_mid")
get_act_patch_attn_out = _patcher("attn_out", ("layer", "pos"), _at_pos, "attention's output")
get_act_patch_mlp_out = _patcher("mlp_out", ("layer", "pos"), _at_pos, "the MLP's output")
_BY_POS, _ALL_POS = ("layer", "pos", "head"), ("layer", "head")
get_act_patch_attn_head_out_by_pos = _patcher("z", _BY_POS, _at_pos_head, "each head's z")
get_act_patch_attn_head_q_by_pos = _patcher("q", _BY_POS, _at_pos_head, "each head's q")
get_act_patch_attn_head_k_by_pos = _patcher("k", _BY_POS, _at_pos_head, "each kv head's k")
get_act_patch_attn_head_v_by_pos = _patcher("v", _BY_POS, _at_pos_head, "each kv head's v")
get_act_patch_attn_head_out_all_pos = _patcher("z", _ALL_POS, _at_head, "each head's z")
get_act_patch_attn_head_q_all_pos = _patcher("q", _ALL_POS, _at_head, "each head's q")
get_act_patch_attn_head_k_all_pos = _patcher("k", _ALL_POS, _at_head, "each kv head's k")
get_act_patch_attn_head_v_all_pos = _patcher("v", _ALL_POS, _at_head, "each kv head's v")
get_act_patch_attn_head_pattern_all_pos = _patcher(
    "pattern", ("layer", "head"), _pattern_at, "each head's pattern"
)
get_act_patch_attn_head_pattern_by_pos = _patcher(
    "pattern", ("layer", "head", "dest"), _pattern_at, "each head's pattern row"
)
get_act_patch_attn_head_pattern_dest_src_pos = _patcher(
    "pattern", ("layer", "head", "dest", "src"), _pattern_at, "each pattern entry"
)


def _stack_heads(maps: list[Tensor]) -> Tensor:
    """The maps stacked, GQA's K-column k and v maps zero-padded to the H of the others."""
    H = maps[0].shape[-1]
    return torch.stack([F.pad(m, (0, H - m.shape[-1])) for m in maps])


def get_act_patch_block_every(model, corrupted_tokens, clean_cache, patching_metric) -> Tensor:
    """resid_pre, attn_out and mlp_out by (layer, pos), stacked: (3, L, T)."""
    fns = (get_act_patch_resid_pre, get_act_patch_attn_out, get_act_patch_mlp_out)
    return torch.stack([f(model, corrupted_tokens, clean_cache, patching_metric) for f in fns])


def get_act_patch_attn_head_all_pos_every(
    model, corrupted_tokens, clean_cache, patching_metric
) -> Tensor:
    """Each head's out, q, k, v and pattern over all positions, stacked: (5, L, H)."""
    fns = (
        get_act_patch_attn_head_out_all_pos,
        get_act_patch_attn_head_q_all_pos,
        get_act_patch_attn_head_k_all_pos,
        get_act_patch_attn_head_v_all_pos,
        get_act_patch_attn_head_pattern_all_pos,
    )
    return _stack_heads([f(model, corrupted_tokens, clean_cache, patching_metric) for f in fns])


def get_act_patch_attn_head_by_pos_every(
    model, corrupted_tokens, clean_cache, patching_metric
) -> Tensor:
    """Each head's out, q, k, v by position, and its pattern by destination, stacked:
    (5, L, T, H) (the pattern's (L, H, T) turned to (L, T, H))."""
    fns = (
        get_act_patch_attn_head_out_by_pos,
        get_act_patch_attn_head_q_by_pos,
        get_act_patch_attn_head_k_by_pos,
        get_act_patch_attn_head_v_by_pos,
    )
    maps = [f(model, corrupted_tokens, clean_cache, patching_metric) for f in fns]
    pattern = get_act_patch_attn_head_pattern_by_pos(
        model, corrupted_tokens, clean_cache, patching_metric
    )
    return _stack_heads(maps + [pattern.transpose(1, 2)])  # (5, L, T, H)


def tl_patch_names(model: nn.Module) -> list[str]:
    """Every TransformerLens name these functions read, for `run_with_cache(names=...)`."""
    acts = ("resid_pre", "resid_mid", "attn_out", "mlp_out", "z", "q", "k", "v", "pattern")
    return [get_act_name(a, i) for i in range(len(_blocks(model))) for a in acts]
