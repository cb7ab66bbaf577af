"""LoRA adapters in `peft`'s format: `adapter_config.json` + `adapter_model.safetensors`.

A directory written by `save_peft` loads with `peft.PeftModel.from_pretrained(hf_model, dir)` onto
the HF export of the base (`attnlab.interop.hf.save_hf`); `load_peft` reads one that peft wrote
(`save_pretrained`) onto an attnlab model. peft's layout, for each adapted HF module M:

    base_model.model.<M>.lora_A.weight   (r, K)      adapter_config.json: r, lora_alpha,
    base_model.model.<M>.lora_B.weight   (N_M, r)    target_modules, rank_pattern, alpha_pattern,
                                                     fan_in_fan_out, peft_type "LORA", task_type

Where each of our Linears sits in the HF model comes from the family converter itself, not from a
second name table: `hf_placements` writes numbered marks down column 0 and along row 0 of our
weight, runs the converter's save path (`to_hf_state`) on that probe, and reads back which HF
weight and which rows and columns the marks landed in. That covers every transform the
converter knows:

- renames (q_proj -> model.layers.{i}.self_attn.q_proj, attention.self.query, ...);
- GPT-2's Conv1D, stored (in, out): the adapter is still A (r, K), B (N, r), and peft's
  `fan_in_fan_out` transposes the update;
- GPT-2's fused c_attn (C -> 3C): our q, k, v are rows 0..C, C..2C, 2C..3C of it. Ours to peft:
  the adapters of q and v become one of rank r_q + r_v, exactly:

      [B_q A_q]   [B_q  0 ]
      [   0   ] = [ 0   0 ] [A_q]        A = [A_q; A_v] (2r, C),  B block-diagonal (3C, 2r)
      [B_v A_v]   [ 0  B_v] [A_v]

  peft to ours: one adapter (A, B) on c_attn becomes three, with A shared and B split by rows:
  B_q = B[:C], B_k = B[C:2C], B_v = B[2C:] (the same update; peft's gradient of A is the sum of
  the three copies' gradients);
- a RoPE layout permutation of q/k rows (Llama loaded as "interleaved"): B's rows follow.

Biases and norms trained beside the adapters (`add_lora(bias=..., modules_to_save=...)`) are
written as peft writes them, and read back:

    base_model.model.<M>.base_layer.bias   the bias of an adapted HF module M (bias "lora_only"
                                           or "all")
    base_model.model.<M>.bias              any other bias (bias "all")
    base_model.model.<M>.weight, .bias     a module in modules_to_save (a LayerNorm, the
                                           token embedding)

Where each of our 1-D weights sits in the HF export is found as for the Linears: `hf_vectors`
marks every one with its own numbers, runs the converter, and reads where they land (GPT-2's
fused c_attn bias holds our q, k and v biases); a whole matrix in modules_to_save (an
embedding) as a Linear's weight is (`hf_placements`). rsLoRA's alpha / sqrt(r) scaling is
`use_rslora` (the alpha written is then scale * sqrt(r)); DoRA raises a ValueError.

Prefix tuning and prompt tuning (adapters/prompt_learning.py) are peft's PREFIX_TUNING and
PROMPT_TUNING: one tensor, "prompt_embeddings", the prefix's keys and values (P, L * 2 * K*D)
in the HF model's head order, or the soft prompt (P, C) (`save_prompt_learning`,
`load_prompt_learning`).

A task head is written whole, as peft writes it: for task_type SEQ_CLS and TOKEN_CLS peft adds
"classifier" and "score" to modules_to_save, and reads their weights back from the adapter
(`PeftModel.from_pretrained` raises a KeyError without them). So a classifier's adapter holds
its head (BERT's `classifier` and `bert.pooler.dense`, a decoder's `score`) in
modules_to_save, trained or not (`attnlab finetune --task classify|tag --lora.rank 8` trains it
in full beside the adapters). Nothing here imports peft.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from attnlab.adapters.lora import LoRALinear, add_lora, is_linear_like, lora_modules
from attnlab.adapters.prompt_learning import PromptLearningLM
from attnlab.checkpoint import check_output_dir, open_checkpoint, resolve_checkpoint
from attnlab.components.attention import Attention
from attnlab.interop.convert import detect_format
from attnlab.interop.hf import converter_for
from attnlab.models.build import build_model
from attnlab.models.config import ModelConfig
from attnlab.models.heads import config_with_head, head_modules
from attnlab.models.weights import load_weights, without_tied_names

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
BASE_LAYER = ".base_layer"  # peft's wrapped Linear: the bias of an adapted M is M.base_layer.bias
# adapter_config.json fields that change what LoRA computes, and the only value read here
PLAIN_LORA = {
    "use_dora": False,
    "lora_bias": False,
}
BIAS_MODES = ("none", "all", "lora_only")  # adapter_config.json "bias": all are read


@dataclass(frozen=True)
class Placement:
    """Where one of our Linears (N outputs) sits in the HF model.

    Attributes:
        module: the HF module path, e.g. "transformer.h.0.attn.c_attn".
        rows: (N,) long, the HF module's output index of each of our outputs.
        out_features: the HF module's number of outputs (3C for c_attn).
        transposed: the HF weight is stored (in, out) (GPT-2's Conv1D).
    """

    module: str
    rows: Tensor
    out_features: int
    transposed: bool


# Marks are float32 numbers 1, 2, 3, ...: exact below 2**24, as many marks as any model needs
MAX_MARKS = 2**24


def _marked(shape: torch.Size, first: int) -> Tensor:
    """A (N, K) float32 weight marked first, first+1, ... down column 0 (one per output row o)
    and then along row 0 from column 1 (one per input column i); zeros elsewhere."""
    N, K = shape
    w = torch.zeros(N, K)
    w[:, 0] = torch.arange(first, first + N)
    w[0, 1:] = torch.arange(first + N, first + N + K - 1)
    return w


def _probe(cfg: ModelConfig, names: list[str], strict: bool) -> tuple[dict, dict[str, tuple]]:
    """The converter's HF state of a `cfg` model whose `names` weights are marked (`_marked`)
    and all else zero (broadcast views: no memory); and {name: (first mark, N, K)}.
    A name that is no Linear with a weight of its own there (a head tied to the embedding) is
    an error if `strict`, skipped otherwise."""
    with torch.device("meta"):
        probe = build_model(cfg)
    state = without_tied_names(probe.state_dict(), probe)
    state = {k: torch.zeros(()).expand(v.shape) for k, v in state.items()}
    marks, first = {}, 1
    for name in names:
        key = f"{name}.weight"
        if key not in state or state[key].dim() != 2:
            if not strict:
                continue
            raise ValueError(
                f"{name!r} is not a Linear with a weight of its own in a freshly built "
                f"{cfg.arch} model, so it has no place in an HF adapter"
            )
        N, K = state[key].shape
        state[key], marks[name], first = (
            _marked(state[key].shape, first),
            (first, N, K),
            first + N + K - 1,
        )
    if first > MAX_MARKS:
        raise ValueError(f"too many Linears to place at once ({first - 1} marks > {MAX_MARKS})")
    return converter_for(cfg).to_hf_state(load_weights(probe, state), cfg), marks


def hf_placements(cfg: ModelConfig, names: list[str], strict: bool = True) -> dict[str, Placement]:
    """{our Linear's name: its Placement in the HF export of a `cfg` model}.

    Our weight (N, K) goes through the converter's save path marked down column 0 and along
    row 0; where the marks land gives the HF weight, each output row's HF row, and whether the
    HF weight is transposed (row 0's marks then run down an HF column).

    Args:
        cfg: the model config (picks the converter).  names: our Linears' module names.
        strict: raise for a name with no place; otherwise leave it out.

    Raises:
        ValueError for a Linear the HF checkpoint does not hold as a plain row map.
    """
    hf_state, marks = _probe(cfg, list(dict.fromkeys(names)), strict)
    found: dict[str, Placement] = {}
    for key, t in hf_state.items():
        if t.dim() != 2 or 0 in t.stride() or not t.any():
            continue  # a broadcast zero: none of ours is in it
        pos = t.nonzero()  # (M, 2) HF (row, col) of every mark here
        values = t[pos[:, 0], pos[:, 1]].long()
        for name, (first, N, K) in marks.items():
            sel = (values >= first) & (values < first + N + K - 1)
            if not sel.any():
                continue
            local, (row, col) = values[sel] - first, pos[sel].T
            o = torch.where(local < N, local, 0)  # our (o, i) of each mark
            i = torch.where(local < N, 0, local - N + 1)
            transposed = not torch.equal(col, i)
            hf_rows, hf_cols = (col, row) if transposed else (row, col)
            if (
                len(local) != N + K - 1
                or not key.endswith(".weight")
                or not torch.equal(hf_cols, i)
            ):
                raise ValueError(f"{name!r} is not a row block of the HF weight {key!r}")
            rows = torch.empty(N, dtype=torch.long)
            rows[o[local < N]] = hf_rows[local < N]
            out = t.shape[1] if transposed else t.shape[0]
            found[name] = Placement(key.removesuffix(".weight"), rows, out, transposed)
    missing = [n for n in names if n not in found]
    if missing and strict:
        raise ValueError(f"the HF export of this model has no place for {missing}")
    return found


def hf_weight_modules(cfg: ModelConfig) -> list[str]:
    """The HF module paths that hold a 2-D weight in the export of a `cfg` model."""
    hf_state, _ = _probe(cfg, [], strict=True)
    return sorted(k.removesuffix(".weight") for k, t in hf_state.items() if t.dim() == 2)


def _vector_probe(cfg: ModelConfig) -> tuple[dict, dict[str, torch.Size]]:
    """(hf_vectors' result, {HF key: shape}) of a `cfg` model."""
    with torch.device("meta"):
        probe = build_model(cfg)
    state = without_tied_names(probe.state_dict(), probe)
    state = {k: torch.zeros((), dtype=v.dtype).expand(v.shape) for k, v in state.items()}
    marks, first = {}, 1
    for key, t in state.items():
        if t.dim() == 1 and t.is_floating_point():
            n = t.shape[0]
            state[key] = torch.arange(first, first + n, dtype=torch.float32)
            marks[key], first = (first, n), first + n
    if first > MAX_MARKS:
        raise ValueError(f"too many vector weights to place at once ({first - 1} > {MAX_MARKS})")
    hf_state = converter_for(cfg).to_hf_state(load_weights(probe, state), cfg)
    found: dict[str, list[tuple[str, Tensor, Tensor]]] = {}
    landed = torch.zeros(first, dtype=torch.long)
    for key, t in hf_state.items():
        if t.dim() == 0 or 0 in t.stride() or not t.is_floating_point() or not t.any():
            continue
        flat = t.reshape(-1)
        pos = flat.nonzero().squeeze(1)  # (M,) flat positions of every mark here
        values = flat[pos].long()
        landed.index_add_(0, values.clamp(0, first - 1), torch.ones_like(values))
        for name, (start, n) in marks.items():
            sel = (values >= start) & (values < start + n)
            if sel.any():
                found.setdefault(key, []).append((name, values[sel] - start, pos[sel]))
    if (landed[1:] > 1).any():
        raise ValueError(
            f"the HF export of this {cfg.arch} model changes its vector weights' values, not "
            "only their place: its biases and norms cannot be placed in an HF adapter"
        )
    return found, {k: t.shape for k, t in hf_state.items()}


def hf_vectors(cfg: ModelConfig) -> dict[str, list[tuple[str, Tensor, Tensor]]]:
    """Where our 1-D weights (biases, norm weights) sit in the HF export of a `cfg` model.

    Every 1-D float weight of a freshly built model is marked with its own numbers 1, 2, 3...
    and the rest zero; the converter's save path moves them, and where they land is read back.

    Returns:
        {HF key: [(our weight's name, its indices (n,), their flat positions in the HF tensor
        (n,)), ...]} for every HF tensor that holds some of them, e.g. GPT-2's
        "transformer.h.0.attn.c_attn.bias": q's, k's and v's biases.

    Raises:
        ValueError when a mark lands twice (a converter that changes the values of vectors,
        not only their place).
    """
    return _vector_probe(cfg)[0]


def _own_vectors(model: nn.Module) -> dict[str, Tensor]:
    """{name in the model without adapters: tensor} of every 1-D float parameter and buffer
    (a quantized Linear's bias is a buffer)."""
    tensors = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    return {
        k.replace(".base.", "."): t
        for k, t in tensors.items()
        if "lora_" not in k and t.dim() == 1 and t.is_floating_point()
    }


def _matrices_to_hf(
    model: nn.Module, cfg: ModelConfig, trained: list[str], vectors: set[str]
) -> dict[str, Tensor]:
    """{HF key: tensor} of the trained matrices among `trained` (not in `vectors`): whole HF
    weights (an embedding in modules_to_save), placed as `hf_placements` places a Linear's."""
    names = [k for k in trained if k not in vectors]
    odd = [k for k in names if not k.endswith(".weight")]
    if odd:
        raise ValueError(f"{odd[:3]} train beside the adapters and have no place in an HF adapter")
    params = {k.replace(".base.", "."): p for k, p in model.named_parameters()}
    for name in names:
        tied = [k for k, p in model.named_parameters(remove_duplicate=False) if p is params[name]]
        if len(tied) > 1:
            raise ValueError(
                f"{name!r} trains beside the adapters and is tied to {tied[1:]}: peft's "
                "modules_to_save would train a copy of one and untie them; keep the run's "
                "attnlab checkpoint"
            )
    modules = [k.removesuffix(".weight") for k in names]
    out = {}
    for name, place in hf_placements(cfg, modules).items():
        w = params[f"{name}.weight"].detach().float().cpu()  # (N, K)
        if len(place.rows) != place.out_features:
            raise ValueError(
                f"{name!r} is a part of the HF weight {place.module}.weight (which holds "
                f"{place.out_features} rows, {name} {len(place.rows)}): it cannot train alone"
            )
        t = torch.empty_like(w)
        t[place.rows] = w
        out[f"{place.module}.weight"] = t.T.contiguous() if place.transposed else t
    return out


def _extras_to_hf(
    model: nn.Module, cfg: ModelConfig, adapted: set[str]
) -> tuple[dict[str, Tensor], str, list[str]]:
    """The weights that train beside the adapters and the task head's (trained or not), as
    peft stores them.

    Args:
        model: the model with adapters.  cfg: its config.  adapted: the adapted HF modules.

    Returns:
        ({peft key: tensor}, adapter_config's "bias", its "modules_to_save" HF module paths).
    """
    head = tuple(f"{name}." for name in _head_names(model))
    trained = sorted(
        k.replace(".base.", ".")
        for k, p in model.named_parameters()
        if (p.requires_grad or k.startswith(head)) and "lora_" not in k
    )
    if not trained:
        return {}, "none", []
    own = _own_vectors(model)
    tensors = {PREFIX + k: t for k, t in _matrices_to_hf(model, cfg, trained, set(own)).items()}
    vectors, shapes = _vector_probe(cfg)
    trained = [k for k in trained if k in own]
    touched = {k for k, parts in vectors.items() if any(name in trained for name, _, _ in parts)}
    placed = {name for k in touched for name, _, _ in vectors[k]}
    if not set(trained) <= placed:
        raise ValueError(f"the HF export has no place for {sorted(set(trained) - placed)[:3]}")
    # a module whose weight (not only its bias) trained is saved whole (peft's modules_to_save)
    matrices = {k.removeprefix(PREFIX).rpartition(".")[0] for k in tensors}
    saved = {k.rpartition(".")[0] for k in touched if not k.endswith(".bias")} - adapted
    saved = sorted(saved | matrices)
    biases: set[str] = set()
    for key in sorted(touched | {k for k in vectors if k.rpartition(".")[0] in saved}):
        flat = torch.full((shapes[key].numel(),), float("nan"))
        for name, index, pos in vectors[key]:
            flat[pos] = own[name].detach().float().cpu()[index]
        if flat.isnan().any():
            raise ValueError(f"the HF weight {key!r} holds more than our vectors; cannot save it")
        module, _, leaf = key.rpartition(".")
        if module not in saved:
            biases.add(module)
        name = f"{module}{BASE_LAYER}.{leaf}" if module in adapted else key
        tensors[PREFIX + name] = flat.reshape(shapes[key])
    bias = "none" if not biases else "lora_only" if biases <= adapted else "all"
    return tensors, bias, saved


@torch.no_grad()
def _load_extras(model: nn.Module, cfg: ModelConfig, state: dict[str, Tensor], where: str):
    """Copy peft's saved biases and modules_to_save vectors ({HF key: tensor}) into `model`."""
    vectors = hf_vectors(cfg)
    own = _own_vectors(model)
    matrices = {k: t for k, t in state.items() if k not in vectors and t.dim() == 2}
    if matrices:  # whole weights in modules_to_save (an embedding): ours that sit there
        params = {k.replace(".base.", "."): p for k, p in model.named_parameters()}
        weights = [k.removesuffix(".weight") for k, p in params.items() if p.dim() == 2]
        for name, place in hf_placements(cfg, weights, strict=False).items():
            t = matrices.get(f"{place.module}.weight")
            if t is not None and len(place.rows) == place.out_features:
                params[f"{name}.weight"].copy_((t.T if place.transposed else t)[place.rows])
                state = {k: v for k, v in state.items() if k != f"{place.module}.weight"}
    for key, t in state.items():
        if key not in vectors and any(
            k in vectors and torch.equal(t, v) for k, v in state.items()
        ):  # a tied alias peft writes twice (BERT's cls.predictions.decoder.bias)
            continue
        if key not in vectors:
            raise ValueError(
                f"{where}: {PREFIX}{key} is no weight of this {cfg.arch} model's HF export "
                "that loads beside LoRA (a bias, a norm or a whole weight of modules_to_save)"
            )
        flat = t.reshape(-1)
        if flat.numel() != sum(len(pos) for _, _, pos in vectors[key]):
            raise ValueError(f"{where}: {key} has {flat.numel()} values, the model another count")
        for name, index, pos in vectors[key]:
            own[name][index] = flat[pos].to(own[name].dtype)


def _head_names(model: nn.Module) -> tuple[str, ...]:
    """The task head's Linear modules (models.heads.head_modules), none for an LM."""
    try:
        names = head_modules(model)
    except ValueError:
        return ()
    return tuple(
        n for n in names if isinstance(getattr(model.get_submodule(n), "weight", None), Tensor)
    )


def _task_type(cfg: ModelConfig) -> str | None:
    """peft's task type: the head's (SEQ_CLS, TOKEN_CLS), else the LM's (None: masked LM)."""
    if cfg.head is not None:
        return {"sequence": "SEQ_CLS", "token": "TOKEN_CLS"}[cfg.head.task]
    return {"decoder": "CAUSAL_LM", "encoder_decoder": "SEQ_2_SEQ_LM"}.get(cfg.arch)


def _target_modules(modules: list[str], all_modules: list[str]) -> list[str]:
    """peft's target_modules: the leaf names (c_attn, q_proj) when they pick exactly `modules`
    out of the HF model's weights, the full paths otherwise (GPT-2's c_proj is in attn and mlp)."""
    leaves = {m.rpartition(".")[2] for m in modules}
    picked = {m for m in all_modules if m.rpartition(".")[2] in leaves}
    return sorted(leaves) if picked == set(modules) else sorted(modules)


def save_peft(
    model: nn.Module,
    cfg: ModelConfig,
    path: str | Path,
    base_model_name_or_path: str | None = None,
    task_type: str | None = "auto",
) -> Path:
    """Write `model`'s LoRA adapters as a peft adapter directory for the HF export of its base.

    Args:
        model: an attnlab model with adapters (add_lora); a quantized base is fine.
        cfg: its ModelConfig (picks the HF family converter).
        path: the directory to write.
        base_model_name_or_path: recorded in the config (peft reads it when given no model).
        task_type: peft's task type ("CAUSAL_LM", "SEQ_CLS", ...; None: a plain PeftModel);
            "auto" picks it from the model (CAUSAL_LM for a decoder LM, None for masked LM,
            SEQ_CLS / TOKEN_CLS for a sequence / token classifier).

    Returns:
        the directory.
    """
    adapters = lora_modules(model)
    if not adapters:
        raise ValueError("the model has no LoRA adapters to save (add_lora first)")
    cfg = config_with_head(cfg, model)  # a model built with n_labels: its head in the config
    if any(m.merged for m in adapters.values()):
        raise ValueError("unmerge the adapters before saving them (merged: the base holds them)")
    rslora = {m.rslora for m in adapters.values()}
    if len(rslora) > 1:
        raise ValueError("some adapters scale by rsLoRA and some not: peft has one use_rslora")
    rslora = rslora.pop()
    places = hf_placements(cfg, list(adapters))
    groups: dict[str, list[str]] = {}
    for name in adapters:
        groups.setdefault(places[name].module, []).append(name)
    extras, bias, saved = _extras_to_hf(model, cfg, set(groups))
    tensors, ranks, alphas = dict(extras), {}, {}
    for module, names in groups.items():
        members = [adapters[n] for n in names]
        rank, scale = sum(m.rank for m in members), members[0].scale
        B = torch.zeros(places[names[0]].out_features, rank)  # (N_M, r_M)
        col = 0
        for name, m in zip(names, members):
            B[places[name].rows, col : col + m.rank] = m.lora_B.detach().cpu() * (m.scale / scale)
            col += m.rank
        A = torch.cat([m.lora_A.detach().cpu() for m in members])  # (r_M, K)
        tensors[f"{PREFIX}{module}.lora_A.weight"] = A.contiguous()
        tensors[f"{PREFIX}{module}.lora_B.weight"] = B
        ranks[module], alphas[module] = rank, scale * (rank**0.5 if rslora else rank)
    r = max(set(ranks.values()), key=list(ranks.values()).count)  # the most common rank
    alpha = next(alphas[m] for m in ranks if ranks[m] == r)
    first = next(iter(adapters.values()))
    config = {
        "peft_type": "LORA",
        "task_type": _task_type(cfg) if task_type == "auto" else task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": first.drop.p if isinstance(first.drop, nn.Dropout) else 0.0,
        "target_modules": _target_modules(list(groups), hf_weight_modules(cfg)),
        "rank_pattern": {m: k for m, k in ranks.items() if k != r},
        "alpha_pattern": {m: a for m, a in alphas.items() if a != alpha},
        "fan_in_fan_out": any(p.transposed for p in places.values()),
        "init_lora_weights": True,
        "inference_mode": True,
        **PLAIN_LORA,
        "use_rslora": rslora,
        "bias": bias,
        "modules_to_save": saved or None,
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    return path


def _hf_base(run: dict) -> str | None:
    """The base checkpoint a fine-tuning run started from, when it is an HF directory (peft
    reads `base_model_name_or_path` to load it); None for an attnlab one."""
    base = run.get("base")
    try:
        return base if base and detect_format(base) == "hf" else None
    except ValueError:
        return None


def save_run_peft(src: str | Path, dst: str | Path, overwrite: bool = False) -> Path:
    """The LoRA adapters of a fine-tuning run (`attnlab finetune --lora.rank R`), or its prefix
    (`--peft.method prefix|prompt`), as a peft adapter directory: `attnlab convert --from
    attnlab RUN --to peft DIR`.

    peft loads it onto the HF export of the run's base (`attnlab convert --from attnlab BASE
    --to hf DIR`; a QLoRA run's: the float checkpoint its base was quantized from). A task
    head, and the biases and modules that trained beside the adapters, are in it as peft
    writes them.

    Args:
        src: the run directory (its latest checkpoint) or one of its checkpoints.
        dst: the adapter directory to write: new or empty, unless `overwrite` (then only
            adapter_config.json and adapter_model.safetensors are replaced there).

    Returns:
        dst.
    """
    src = resolve_checkpoint(src)
    if Path(dst).resolve() == src.resolve():
        raise ValueError(f"the output directory is the input directory ({str(src)!r})")
    check_output_dir(dst, overwrite)
    loaded = open_checkpoint(src, keep_adapters=True)
    if isinstance(loaded.model, PromptLearningLM):  # --peft.method prefix|prompt
        return save_prompt_learning(loaded.model, loaded.config, dst, _hf_base(loaded.run))
    if not lora_modules(loaded.model):
        raise ValueError(
            f"{str(src)!r} holds no LoRA adapters (only a run of attnlab finetune --lora.rank R "
            "has them); convert --to hf exports a whole model"
        )
    return save_peft(loaded.model, loaded.config, dst, _hf_base(loaded.run))


def read_peft_config(path: str | Path) -> dict:
    """adapter_config.json, checked to describe plain LoRA (ValueError naming the field)."""
    file = Path(path) / CONFIG
    if not file.is_file():
        raise ValueError(f"{str(path)!r} has no {CONFIG} (not a peft adapter directory)")
    config = json.loads(file.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{str(file)!r}: peft_type={config.get('peft_type')!r}, only LORA loads")
    if config.get("bias", "none") not in BIAS_MODES:
        raise ValueError(f"{str(file)!r}: bias={config['bias']!r} is not one of {BIAS_MODES}")
    for field, plain in PLAIN_LORA.items():
        if config.get(field, plain) not in (plain, [], {}):
            raise ValueError(
                f"{str(file)!r}: {field}={config[field]!r} is not supported (plain LoRA needs "
                f"{field}={plain!r})"
            )
    return config


def _pattern(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern rule: a key matching the end of the module path."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_peft(path: str | Path) -> tuple[dict, dict[str, tuple[Tensor, Tensor]], dict]:
    """(adapter_config.json, {HF module: (A (r, K), B (N, r))}, {HF key: tensor} of the biases
    and modules_to_save weights trained beside the adapters) of a peft adapter directory."""
    config = read_peft_config(path)
    file = Path(path) / WEIGHTS
    if not file.is_file():
        raise ValueError(f"{str(path)!r} has no {WEIGHTS}")
    state = load_file(str(file))
    parts: dict[str, dict[str, Tensor]] = {}
    others: dict[str, Tensor] = {}
    saved = config.get("modules_to_save") or []
    for key, t in state.items():
        match = KEY.match(key)
        if ".original_module." in key:  # peft's frozen copy of a modules_to_save module
            continue
        hf_key = key.removeprefix(PREFIX).replace(f"{BASE_LAYER}.", ".")
        hf_key = hf_key.replace(".modules_to_save.", ".")  # peft's trained copy (bias "all")
        if match is not None:
            parts.setdefault(match["module"], {})[match["ab"]] = t
        elif key.startswith(PREFIX) and (
            hf_key.endswith(".bias") or any(hf_key.rpartition(".")[0].endswith(m) for m in saved)
        ):
            others[hf_key] = t
        else:
            raise ValueError(
                f"{str(file)!r}: {key!r} is no LoRA weight ({PREFIX}<module>.lora_A.weight), "
                "bias or modules_to_save weight"
            )
    half = sorted(m for m, ab in parts.items() if len(ab) != 2)
    if half:
        raise ValueError(f"{str(file)!r}: modules with lora_A or lora_B only: {half}")
    return config, {m: (ab["A"], ab["B"]) for m, ab in parts.items()}, others


@dataclass(frozen=True)
class Adapter:
    """One of our Linears' adapter, read from a peft directory: A (r, K), B (N, r), alpha, and
    rsLoRA's scaling or not (`LoRALinear`'s arguments)."""

    A: Tensor
    B: Tensor
    alpha: float
    rslora: bool

    @property
    def scale(self) -> float:
        r = self.A.shape[0]
        return self.alpha / (r**0.5 if self.rslora else r)


def read_adapters(
    model: nn.Module, cfg: ModelConfig, path: str | Path
) -> tuple[dict, dict[str, Adapter], dict[str, Tensor]]:
    """(adapter_config.json, {our Linear's name: Adapter}, {HF key: tensor} of the biases and
    modules_to_save weights) of a peft directory made for the HF export of `model`.

    Raises:
        ValueError for a directory that is no LoRA adapter, or one for another base model
        (a module its HF export does not have, or shapes that differ).
    """
    config, weights, others = read_peft(path)
    linears = [n for n, m in model.named_modules() if is_linear_like(m)]
    places = hf_placements(cfg, linears, strict=False)
    by_module: dict[str, list[str]] = {}
    for name, place in places.items():
        by_module.setdefault(place.module, []).append(name)
    unknown = sorted(set(weights) - set(by_module))
    if unknown:
        raise ValueError(
            f"the adapter in {str(path)!r} adapts {unknown}, which this {cfg.arch} model's HF "
            f"export does not have (is it for another base model?)"
        )
    rslora, adapters = bool(config.get("use_rslora", False)), {}
    for module, (A, B) in weights.items():
        r = _pattern(config.get("rank_pattern"), module, config["r"])
        alpha = _pattern(config.get("alpha_pattern"), module, config["lora_alpha"])
        for name in by_module[module]:
            p, lin = places[name], model.get_submodule(name)
            if A.shape != (r, lin.in_features) or B.shape != (p.out_features, r):
                raise ValueError(
                    f"adapter for {module}: lora_A {tuple(A.shape)}, lora_B {tuple(B.shape)}; "
                    f"the model needs ({r}, {lin.in_features}) and ({p.out_features}, {r}) "
                    "(is it for another base model?)"
                )
            adapters[name] = Adapter(A, B[p.rows], float(alpha), rslora)
    return config, adapters, others


@torch.no_grad()
def load_peft(model: nn.Module, cfg: ModelConfig, path: str | Path) -> list[str]:
    """Add the adapters of a peft directory (made for the HF export of `model`) to `model`.

    Args:
        model: an attnlab model without adapters (float or quantized).
        cfg: its ModelConfig.
        path: a directory peft's `save_pretrained` (or `save_peft`) wrote.

    Returns:
        the names of our modules that now carry LoRA.
    """
    if lora_modules(model):
        raise ValueError(f"the model already has LoRA on {list(lora_modules(model))}")
    config, adapters, others = read_adapters(model, cfg, path)
    ranks = {n: a.A.shape[0] for n, a in adapters.items()}
    alphas = {n: a.alpha for n, a in adapters.items()}
    dropout, rslora = config.get("lora_dropout", 0.0), bool(config.get("use_rslora", False))
    names = add_lora(model, list(adapters), ranks, alphas, dropout, rslora=rslora)
    for name in names:
        lora: LoRALinear = model.get_submodule(name)
        lora.lora_A.copy_(adapters[name].A)
        lora.lora_B.copy_(adapters[name].B)
    if others:  # trained biases and norms (bias "all" / "lora_only", modules_to_save)
        _load_extras(model, cfg, others, repr(str(path)))
    return names


# --- prefix tuning and prompt tuning (adapters/prompt_learning.py) -------------------------------

PROMPT_TYPES = {"prefix": "PREFIX_TUNING", "prompt": "PROMPT_TUNING"}  # peft's peft_type
PROMPT_KEY = "prompt_embeddings"  # the one tensor peft saves for a prompt-learning method


def _kv_rows(model: nn.Module, cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    """For our key and value outputs (K*D each), the index of each in the HF model's: the HF
    prefix holds layer i's keys as its k projection's outputs, which a RoPE layout may order
    otherwise (`hf_placements`; GPT-2's c_attn holds them at an offset, taken off here)."""
    attn = next(n for n, m in model.named_modules() if isinstance(m, Attention))
    places = hf_placements(cfg, [f"{attn}.k_proj", f"{attn}.v_proj"])
    rows = [places[f"{attn}.{p}"].rows for p in ("k_proj", "v_proj")]
    return tuple(r - r.min() for r in rows)


def save_prompt_learning(
    model: PromptLearningLM,
    cfg: ModelConfig,
    path: str | Path,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write a prefix- or prompt-tuned model's prefix as a peft adapter directory for the HF
    export of its base: `PeftModel.from_pretrained(hf_model, path)` gives the same logits.

    As peft, the file holds the prefix alone ("prompt_embeddings": (P, L * 2 * K*D) keys and
    values, or (P, C) embeddings): a prefix_projection MLP is saved as its output, and the
    config says prefix_projection so that peft knows where it came from.
    """
    if not isinstance(model, PromptLearningLM):
        raise ValueError(f"{type(model).__name__} has no prefix or soft prompt to save")
    prefix = model.prefix().detach().float().cpu()
    attn = model.decoder.blocks[0].self_attn
    if model.method == "prefix":
        L, P = len(model.decoder.blocks), model.num_virtual_tokens
        rows_k, rows_v = _kv_rows(model.decoder, cfg)
        ours = prefix.view(P, L, 2, -1)
        theirs = torch.empty_like(ours)
        theirs[..., 0, rows_k], theirs[..., 1, rows_v] = ours[..., 0, :], ours[..., 1, :]
        prefix = theirs.reshape(P, -1)
    heads = attn.n_kv_heads if model.method == "prefix" else attn.n_heads
    token_dim = attn.n_kv_heads * attn.head_dim if model.method == "prefix" else cfg.d_model
    config = {
        "peft_type": PROMPT_TYPES[model.method],
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "num_virtual_tokens": model.num_virtual_tokens,
        "token_dim": token_dim,
        "num_layers": len(model.decoder.blocks),
        "num_attention_heads": heads,
        "num_transformer_submodules": 1,
        "inference_mode": True,
    }
    if model.method == "prefix":
        hidden = model.transform[0].out_features if model.transform is not None else token_dim
        config |= {"prefix_projection": model.transform is not None, "encoder_hidden_size": hidden}
    else:
        config |= {"prompt_tuning_init": "RANDOM", "prompt_tuning_init_text": None}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({PROMPT_KEY: prefix.contiguous()}, str(path / WEIGHTS), metadata={"format": "pt"})
    return path


def load_prompt_learning(model: nn.Module, cfg: ModelConfig, path: str | Path) -> PromptLearningLM:
    """A peft prefix- or prompt-tuning adapter (peft's `save_pretrained` or
    `save_prompt_learning`) on an attnlab decoder LM: the PromptLearningLM that holds it (its
    saved prefix, trainable; a prefix_projection MLP is not in the file, so none is rebuilt).

    Raises:
        ValueError naming the field or shape that does not fit `model`.
    """
    file = Path(path) / CONFIG
    if not file.is_file():
        raise ValueError(f"{str(path)!r} has no {CONFIG} (not a peft adapter directory)")
    config = json.loads(file.read_text())
    methods = {v: k for k, v in PROMPT_TYPES.items()}
    method = methods.get(config.get("peft_type"))
    if method is None:
        raise ValueError(
            f"{str(file)!r}: peft_type={config.get('peft_type')!r}, not one of {sorted(methods)}"
        )
    if config.get("num_transformer_submodules", 1) != 1 or cfg.arch != "decoder":
        raise ValueError(f"{str(file)!r}: prefix and prompt tuning load onto a decoder LM only")
    if config.get("num_layers") != len(model.blocks):
        raise ValueError(
            f"{str(file)!r} is for {config.get('num_layers')} layers, the model has "
            f"{len(model.blocks)} (is it for another base model?)"
        )
    P = int(config["num_virtual_tokens"])
    wrapped = PromptLearningLM(model, method, P)
    state = load_file(str(Path(path) / WEIGHTS)) if (Path(path) / WEIGHTS).is_file() else {}
    prefix = state.get(PROMPT_KEY)
    if prefix is None or prefix.shape != wrapped.embedding.weight.shape:
        got = None if prefix is None else tuple(prefix.shape)
        raise ValueError(
            f"{str(path)!r}: {PROMPT_KEY} is {got}, the model needs "
            f"{tuple(wrapped.embedding.weight.shape)} (is it for another base model?)"
        )
    if method == "prefix":
        rows_k, rows_v = _kv_rows(model, cfg)
        theirs = prefix.view(P, len(model.blocks), 2, -1)
        prefix = torch.stack([theirs[..., 0, rows_k], theirs[..., 1, rows_v]], dim=2).reshape(P, -1)
    with torch.no_grad():
        wrapped.embedding.weight.copy_(prefix)
    return wrapped
