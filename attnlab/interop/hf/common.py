"""What every HF family converter shares: reading and writing checkpoint directories, key tables
with a `{i}` layer placeholder, the transforms between layouts, and building on the meta device.

A converter is data plus a few small functions:

    HF directory ── read_config, read_state_dict ──> (config.json dict, {HF name: tensor})
        config_from_hf(dict) ──> ModelConfig ──> model built on the meta device
        check_state: names and shapes against to_hf_state(meta model)  (errors list every key)
        rename(state, HF -> ours)   (the key table, "{i}" expanded for every layer)
        load transforms             (transpose Conv1D, split qkv, permute for a RoPE layout, ...)
        load_weights(model, state)  (assign=True; tied parameters re-linked)
    save_hf runs the same steps backwards and writes config.json + model.safetensors.

The expected HF names and shapes come from running the save path on the meta model, so loading
and saving cannot disagree about a key.

Only safetensors are read: a pickle (`pytorch_model.bin`) can run code when loaded, so a
directory that has nothing else is an error, never a fallback. Nothing here imports transformers.
"""

import errno
import json
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from attnlab.models.build import build_model
from attnlab.models.config import HeadConfig, ModelConfig
from attnlab.models.weights import load_weights, shared_groups

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")

# A key table: (our name, HF name) pairs; "{i}" stands for the layer index.
KeyTable = list[tuple[str, str]]
# A transform rewrites a state dict (our names) for one direction of the conversion.
Transform = Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]


# --- reading and writing directories ---------------------------------------------------------
def read_config(path: str | Path) -> dict:
    """The config.json of an HF checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is not a directory (expected an HF checkpoint directory)")
    if not (path / CONFIG).is_file():
        raise ValueError(f"{str(path)!r} has no {CONFIG}")
    data = json.loads((path / CONFIG).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{str(path / CONFIG)!r} must hold a JSON object")
    return data


def read_state_dict(path: str | Path, device: str = "cpu") -> dict[str, Tensor]:
    """All tensors of an HF checkpoint directory: model.safetensors, or the shards an index lists.

    Raises:
        ValueError if the directory has only pickled weights (pytorch_model.bin) or none at all.
    """
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return load_file(str(path / WEIGHTS), device=device)
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text()).get("weight_map", {})
        state: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise ValueError(f"{str(path / INDEX)!r} lists shard {shard!r}, which is missing")
            state.update(load_file(str(path / shard), device=device))
        listed, found = set(weight_map), set(state)
        if listed != found:
            raise ValueError(
                f"the shards of {str(path)!r} do not match their index: listed but "
                f"absent {sorted(listed - found)}, present but unlisted "
                f"{sorted(found - listed)}"
            )
        return state
    pickles = [p for p in PICKLES if (path / p).is_file()]
    if pickles:
        raise ValueError(
            f"{str(path)!r} holds only {pickles}: attnlab reads safetensors only, because "
            "unpickling a checkpoint can run arbitrary code. Convert it once in a trusted "
            "environment (transformers: model.save_pretrained(dir, safe_serialization=True))."
        )
    raise ValueError(f"{str(path)!r} has no {WEIGHTS} (nor a sharded {INDEX})")


def write_hf_dir(path: str | Path, hf_config: dict, state: dict[str, Tensor]) -> Path:
    """Write config.json and model.safetensors (tensors contiguous, each stored once)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    # safetensors refuses tensors that share memory; every name here is its own tensor.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    # transformers refuses a safetensors file without the "format": "pt" metadata
    try:
        save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    except SafetensorError as e:  # safetensors reports a full disk without an errno
        full = "No space left" in str(e)
        code, what = (errno.ENOSPC, "No space left on device") if full else (errno.EIO, str(e))
        raise OSError(code, what, str(path / WEIGHTS)) from e
    return path


# --- key tables ------------------------------------------------------------------------------
def expand(table: KeyTable, n_layers: int) -> dict[str, str]:
    """{our name: HF name} with "{i}" replaced by 0..n_layers-1 (rows without "{i}" once)."""
    out = {}
    for ours, theirs in table:
        if "{i}" in ours:
            out.update({ours.format(i=i): theirs.format(i=i) for i in range(n_layers)})
        else:
            out[ours] = theirs
    return out


def rename(
    state: dict[str, Tensor], mapping: dict[str, str], what: str = "state dict"
) -> dict[str, Tensor]:
    """Rename every key of `state` through `mapping` (old name -> new name): the two must have
    exactly the same keys. A ValueError lists every missing and every unexpected key."""
    missing = sorted(set(mapping) - set(state))
    unexpected = sorted(set(state) - set(mapping))
    if missing or unexpected:
        raise ValueError(
            f"the {what} does not match the expected weights: "
            f"missing {missing}, unexpected {unexpected}"
        )
    return {mapping[k]: v for k, v in state.items()}


def drop_tied_aliases(
    model: nn.Module, state: dict[str, Tensor], wanted: Iterable[str]
) -> dict[str, Tensor]:
    """Keep one name per group of tied parameters: the names in `wanted` (a key table's)."""
    wanted, state = set(wanted), dict(state)
    for names in shared_groups(model):
        keep = [n for n in names if n in wanted]
        for n in names:
            if n not in keep:
                state.pop(n, None)
    return state


def resolve_tie(
    cfg: ModelConfig, state: dict[str, Tensor], head: str, embed: str
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(cfg, state) for a checkpoint whose config says tied: a stored head *different* from the
    embedding unties the model (HF does the same); a stored copy of a tied head is dropped."""
    if not cfg.tie_embeddings or head not in state:
        return cfg, state
    if embed in state and torch.equal(state[head], state[embed]):
        return cfg, {k: v for k, v in state.items() if k != head}
    return replace(cfg, tie_embeddings=False), state


# --- transforms ------------------------------------------------------------------------------
def transpose(names: Iterable[str]) -> Transform:
    """Transpose the 2-D weights `names` ({i} expanded): HF GPT-2's Conv1D stores (in, out)
    where nn.Linear stores (out, in). Its own inverse, so it serves both directions."""
    names = list(names)

    def run(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        for name in expand([(n, n) for n in names], cfg.n_layers):
            state[name] = state[name].t().contiguous()  # a copy: parameters own their memory
        return state

    run.__name__ = f"transpose({', '.join(names)})"
    return run


def split_rows(
    fused: str, parts: list[str], sizes: Callable[[ModelConfig], list[int]]
) -> Transform:
    """Split the weight or bias `fused` along dim 0 into `parts` (a fused qkv into q, k, v)."""

    def run(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        for i in range(cfg.n_layers):
            chunks = state.pop(fused.format(i=i)).split(sizes(cfg), dim=0)
            state.update({p.format(i=i): c.clone() for p, c in zip(parts, chunks)})  # own memory
        return state

    run.__name__ = f"split({fused} -> {', '.join(parts)})"
    return run


def fuse_rows(parts: list[str], fused: str) -> Transform:
    """The inverse of `split_rows`: concatenate `parts` along dim 0 into `fused`."""

    def run(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        for i in range(cfg.n_layers):
            state[fused.format(i=i)] = torch.cat([state.pop(p.format(i=i)) for p in parts])
        return state

    run.__name__ = f"fuse({', '.join(parts)} -> {fused})"
    return run


def apply(
    transforms: Iterable[Transform], state: dict[str, Tensor], cfg: ModelConfig
) -> dict[str, Tensor]:
    state = dict(state)
    for t in transforms:
        state = t(state, cfg)
    return state


# --- configs ---------------------------------------------------------------------------------
def activation_from_hf(name: str, field: str) -> str:
    """An HF activation name -> ours ("gelu_new" is GPT-2's tanh approximation)."""
    names = {
        "gelu": "gelu",
        "gelu_python": "gelu",
        "gelu_new": "gelu_tanh",
        "gelu_pytorch_tanh": "gelu_tanh",
        "relu": "relu",
        "silu": "silu",
        "swish": "silu",
    }
    if name not in names:
        raise ValueError(f"{field}={name!r} is not supported; attnlab has {sorted(names)}")
    return names[name]


def activation_to_hf(name: str) -> str:
    return {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}[name]


# Fields of the newer families (interop/hf/families.py) at the value every older family has:
# each family refuses other values unless its own `expected` names the field.
NEWER_FIELDS = {
    "attention.qk_norm_scope": "head",
    "attention.global_every": None,
    "attention.logit_softcap": None,
    "rope.local_theta": None,
    "norm_unit_offset": False,
    "logit_softcap": None,
}


def require(cfg: ModelConfig, family: str, expected: dict[str, object]) -> None:
    """Raise a ValueError listing every field of `cfg` (dotted names) that `family` cannot hold
    (`expected`, and NEWER_FIELDS where `expected` does not name them)."""
    wrong = []
    for dotted, want in (NEWER_FIELDS | expected).items():
        value = cfg
        for part in dotted.split("."):
            value = getattr(value, part)
        ok = value in want if isinstance(want, tuple) else value == want
        if not ok:
            wrong.append(f"{dotted}={value!r} (needs {want!r})")
    if wrong:
        raise ValueError(f"an HF {family} checkpoint cannot hold this config: {', '.join(wrong)}")


def get(hf: dict, key: str, default=None, required: bool = False):
    """hf[key], or the default; a required key that is missing names itself and the file."""
    if key in hf and hf[key] is not None:
        return hf[key]
    if required:
        raise ValueError(f"config.json has no {key!r} (model_type {hf.get('model_type')!r})")
    return default


def head_from_hf(hf: dict, task: str, pad_token_id: int | None = None) -> HeadConfig:
    """A task head from an HF config.json: its id2label (or num_labels), names kept.

    Names HF made up (LABEL_0, LABEL_1, ...) are left out (HeadConfig.labels = ()), so they
    round-trip to the same config.json."""
    id2label = hf.get("id2label")
    if not id2label:
        return HeadConfig(task, int(hf.get("num_labels", 2)), pad_token_id=pad_token_id)
    by_id = {int(k): str(v) for k, v in id2label.items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError(f"config.json id2label must number its labels 0..N-1, got {id2label}")
    names = tuple(by_id[i] for i in range(len(by_id)))
    made_up = names == tuple(f"LABEL_{i}" for i in range(len(names)))
    return HeadConfig(task, len(names), () if made_up else names, pad_token_id)


def head_to_hf(head: HeadConfig) -> dict:
    """HF's id2label and label2id for a task head."""
    names = head.id2label
    return {
        "id2label": {str(i): name for i, name in names.items()},
        "label2id": {name: i for i, name in names.items()},
    }


# --- models ---------------------------------------------------------------------------------
ToHF = Callable[[nn.Module, ModelConfig], dict[str, Tensor]]
FromHF = Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]


def check_state(
    state: dict[str, Tensor],
    expected: dict[str, Tensor],
    ignore: Iterable[str] = (),
    what: str = "checkpoint",
) -> None:
    """Compare a checkpoint's names and shapes with what the model expects (both HF names).

    Raises:
        ValueError listing every missing key, every unexpected key, and every shape mismatch
        with both shapes.
    """
    ignore = set(ignore)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - ignore)
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)}, model {tuple(expected[k].shape)}"
        for k in sorted(set(state) & set(expected))
        if tuple(state[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"the {what} does not fit the model its config.json describes: "
            f"missing {missing}, unexpected {unexpected}, shape mismatches {shapes}"
        )


def load_checked(
    cfg: ModelConfig,
    state: dict[str, Tensor],
    to_hf: ToHF,
    from_hf: FromHF,
    ignore: Iterable[str] = (),
    what: str = "checkpoint",
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Build `cfg` on the meta device, check `state` (HF names) against it, and load it.

    The expected HF names and shapes are the save path (`to_hf`) run on the meta model, so
    loading and saving cannot disagree about a key; `from_hf` maps the checked state to ours.
    Returns the model in eval mode, ties re-linked.
    """
    with torch.device("meta"):
        model = build_model(cfg)  # with the task head cfg.head names, if any
    expected = to_hf(model, cfg)
    check_state(state, expected, ignore, what)
    ours = from_hf({k: v for k, v in state.items() if k in expected}, cfg)
    if dtype is not None:
        ours = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ours.items()}
    load_weights(model, ours)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"no weights were given for {left}")
    return model.eval()


def model_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's parameters and persistent buffers, by our names (tied ones under each name)."""
    return dict(model.state_dict())
