"""Checkpoints: one directory per save, written atomically, holding only tensors and plain data.

    step_000500/
      config.json          the run config: {"model": ..., "train": ..., "data": ...}
      model.safetensors    weights (tied matrices stored once)
      optimizer.pt         AdamW state: tensors, numbers and lists only
      rng.pt               torch RNG state and the data generator's state (the data position)
      trainer_state.json   step, best validation loss, ...
      tokenizer.json       the tokenizer (HF fast-tokenizer format)
      tokenizer_config.json   its chat template, when it has one (where HF keeps it)

A save goes to `step_000500.tmp/` first and is renamed into place only when complete; a
directory that already has the name (`best/`) is renamed aside to `best.old/` first and deleted
only after the new one is in, then the `latest` pointer is replaced (os.replace is atomic). So a
run killed at any moment leaves a complete checkpoint under every name it had, and
`CheckpointDir` finishes or undoes a save it finds cut short. Every file follows the umask.
Loading uses safetensors and `torch.load(weights_only=True)`: no pickled code from a checkpoint
ever runs.

`open_checkpoint` is the one way to get a model from disk: every command and library call that
opens a checkpoint uses it, for every kind (a training checkpoint, a model-only one written by
`save_pretrained`, a quantized one, a classifier, a vision model, a LoRA fine-tuning run, an HF
directory, or a run directory resolved to its latest checkpoint), and gets the same `Loaded` back.
"""

import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from pickle import UnpicklingError

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from attnlab.adapters.config import LoraConfig, PromptLearningConfig
from attnlab.adapters.lora import add_lora, remove_lora
from attnlab.adapters.prompt_learning import PromptLearningLM
from attnlab.configs import from_dict, to_dict
from attnlab.interop.gguf import load_gguf
from attnlab.interop.hf.auto import load_hf, load_tokenizer
from attnlab.interop.hub import is_hub_name, resolve_hub_name
from attnlab.models.build import build_model
from attnlab.models.config import HeadConfig, ModelConfig
from attnlab.models.heads import config_with_head, copy_body
from attnlab.models.weights import load_weights, with_tied_names, without_tied_names
from attnlab.quantize.handler import (
    QuantScheme,
    head_names,
    linear_names,
    make_scheme,
    quantized_like,
    read_heads,
    read_scheme,
    swap_modules,
)
from attnlab.tokenizer import Tokenizer

LATEST = "latest"
TOKENIZER_CONFIG = "tokenizer_config.json"  # the chat template, beside tokenizer.json (HF's place)
REQUIRED_FILES = ("config.json", "model.safetensors", "trainer_state.json")
# What a save writes: a checkpoint directory's other entries are a user's, never deleted.
CHECKPOINT_FILES = frozenset(
    {*REQUIRED_FILES, "optimizer.pt", "rng.pt", "tokenizer.json", TOKENIZER_CONFIG}
)


def check_output_dir(path: str | Path, overwrite: bool) -> None:
    """Refuse an output directory that already holds something, unless `overwrite`.

    Raises:
        ValueError: `path` is a file, or a non-empty directory and `overwrite` is False.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"the output {str(path)!r} is a file, not a directory")
    names = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if names and not overwrite:
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise ValueError(
            f"the output directory {str(path)!r} is not empty ({shown}): choose a new one, or"
            " pass --overwrite to replace the checkpoint files in it (nothing else is deleted)"
        )


# Every write and rename of a save goes through these three functions (the fault-injection
# tests in tests/reliability/ make each one fail in turn, as a kill at that instant would).
def _write_file(path: Path, write) -> None:
    """Create the file `path` with `write(path)`."""
    write(path)


def _rename(src: Path, dst: Path) -> None:
    """Atomically give `src` the name `dst` (replacing a file, or an empty directory)."""
    os.replace(src, dst)


def _remove(path: Path) -> None:
    """Delete a directory: renamed to `X.trash` first, so a half-deleted one is never mistaken
    for a checkpoint (CheckpointDir removes any `*.trash` it finds)."""
    trash = path.with_name(path.name + ".trash")
    _rename(path, trash)
    shutil.rmtree(trash)


def _json_writer(data):
    return lambda path: path.write_text(json.dumps(data, indent=2))


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def _sync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    path: Path,
    model: nn.Module | dict,
    optimizer: torch.optim.Optimizer | dict | None,
    run,
    trainer_state: dict,
    rng: dict | None = None,
    tokenizer=None,
) -> Path:
    """Write a complete checkpoint directory at `path` atomically (via `path.tmp`).

    `model` and `optimizer` may also be full state dicts (gathered from FSDP shards; a tied
    matrix under one name only). `tokenizer` (with a .save(path)) is stored as tokenizer.json,
    so a checkpoint generates text on its own. Written as `_write_dir` says: all or nothing."""
    weights = model
    if isinstance(model, nn.Module):
        weights = without_tied_names(model.state_dict(), model)  # a tied matrix stored once
    weights = {k: v.contiguous() for k, v in weights.items()}
    files = {"config.json": _json_writer(to_dict(run))}
    files["model.safetensors"] = lambda f: save_file(weights, str(f))
    if optimizer is not None:
        state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
        files["optimizer.pt"] = lambda f: torch.save(state, f)
    if rng is not None:
        files["rng.pt"] = lambda f: torch.save(rng, f)
    files["trainer_state.json"] = _json_writer(trainer_state)
    if tokenizer is not None:
        files["tokenizer.json"] = tokenizer.save
        if getattr(tokenizer, "chat_template", None) is not None:  # read back by from_file
            files[TOKENIZER_CONFIG] = tokenizer.save_config
    return _write_dir(Path(path), files)


def _write_dir(path: Path, files: dict, keep_others: bool = False) -> Path:
    """Write the directory `path` atomically: `files` ({name: write(file_path)}) into
    `path.tmp`, each synced to disk, then renamed in. An existing `path` is replaced in three
    steps, each leaving a complete directory findable: rename it aside to `path.old`, rename
    the new one in, delete `path.old`. With `keep_others`, every entry of the old `path` that
    is not a checkpoint file (CHECKPOINT_FILES) moves into the new one before step 3 (a save
    never deletes what it did not write; killed there, the rest is still in `path.old`). On an
    OSError (a full disk, a read-only directory; one line naming the file, see `_write_error`)
    the unfinished `path.tmp` is removed and the error raised; `path` is untouched."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        mode = 0o666 & ~_umask()  # as open() creates files (safetensors writes 0600)
        for name, write in files.items():
            try:
                _write_file(tmp / name, write)
            except (OSError, RuntimeError, SafetensorError) as e:
                raise _write_error(e, tmp, path / name) from e
            os.chmod(tmp / name, mode)
            with open(tmp / name, "rb") as fh:  # data on disk before the rename shows it
                os.fsync(fh.fileno())
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back; `path` is untouched
        raise
    if path.exists():
        if old.exists():  # left by an earlier save cut short, while `path` was complete
            shutil.rmtree(old)
        _rename(path, old)  # 1. the old one aside: recovery renames it back if we stop here
    _rename(tmp, path)  # 2. the new one in
    _sync_dir(path.parent)
    if keep_others and old.exists():
        for entry in sorted(old.iterdir()):
            if entry.name not in CHECKPOINT_FILES and not (path / entry.name).exists():
                _rename(entry, path / entry.name)  # the user's own files stay
    if old.exists():
        _remove(old)  # 3. only now the old one goes
    return path


FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a full quota


def _write_error(e: Exception, tmp: Path, file: Path) -> Exception:
    """The OSError to raise when a writer failed on `file` (written into `tmp`): torch.save and
    safetensors report a full disk as a RuntimeError or a SafetensorError without its errno
    ("[enforce fail at inline_container.cc]"), so a full file system is asked directly. Any
    other exception of a writer is a bug, returned as it is."""
    if isinstance(e, OSError) and e.errno is not None and e.errno not in FULL:
        return OSError(e.errno, e.strerror or str(e), str(file))
    full = getattr(e, "errno", None) in FULL or "No space left" in str(e)
    if not (full or _free_bytes(tmp) < 1 << 20):  # under 1 MiB left: full
        return e
    return OSError(errno.ENOSPC, f"No space left on device writing {file.name} in {file.parent}")


def _free_bytes(path: Path) -> int:
    """The space left on `path`'s file system (unknown: as if plenty)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 1 << 62


def read_checkpoint(path: Path) -> dict:
    """A checkpoint's files as plain data, read without a model.

    Returns:
        {"run": config dict, "trainer": trainer_state, "rng": dict or None,
         "weights": {name: tensor}, "optimizer": optimizer state dict or None}.
    """
    path = Path(path)
    if not (path / "model.safetensors").is_file():
        raise ValueError(f"{str(path)!r} is not a checkpoint (no model.safetensors)")
    optimizer, rng = path / "optimizer.pt", path / "rng.pt"
    return {
        "run": _read(path / "config.json", lambda f: json.loads(f.read_text())),
        "trainer": _read(path / "trainer_state.json", lambda f: json.loads(f.read_text())),
        "rng": _read(rng, _torch_load) if rng.is_file() else None,
        "weights": _read(path / "model.safetensors", load_file),
        "optimizer": _read(optimizer, _torch_load) if optimizer.is_file() else None,
    }


def _torch_load(path: Path):
    return torch.load(path, weights_only=True)


def _read(path: Path, load):
    """`load(path)`, or a ValueError naming the file when it is missing or damaged."""
    try:
        return load(path)
    except FileNotFoundError:
        raise ValueError(f"checkpoint file {str(path)!r} is missing") from None
    except (OSError, ValueError, SafetensorError, RuntimeError, EOFError, UnpicklingError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"checkpoint file {str(path)!r} cannot be read ({reason}); it is damaged: use "
            "another checkpoint"
        ) from None


def copy_weights(
    model: nn.Module, weights: dict, where: str = "the checkpoint", only: set[str] | None = None
) -> None:
    """Copy `weights` into the existing parameters of `model` (an optimizer keeps pointing at
    them; compare models.weights.load_weights, which adopts the tensors of a model built on
    the meta device). ValueError naming any missing or unexpected names. only: the names
    `weights` should hold (the trained ones of a run on a frozen base); None: all of them."""
    missing, unexpected = model.load_state_dict(with_tied_names(weights, model), strict=False)
    if only is not None:
        missing = [name for name in missing if name in only]
    if missing or unexpected:
        raise ValueError(
            f"{where} does not fit this model: "
            f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[dict, dict, dict | None]:
    """Load weights (and optimizer state) into existing objects.

    Returns:
        (run config as a dict, trainer_state, rng dict or None).
    """
    files = read_checkpoint(path)
    copy_weights(model, files["weights"], f"checkpoint {str(path)!r}")
    if optimizer is not None:
        optimizer.load_state_dict(files["optimizer"])
    return files["run"], files["trainer"], files["rng"]


class CheckpointDir:
    """The checkpoints of one run: `step_NNNNNN/` directories, a `latest` pointer, and `best/`.

    Opening one finishes or undoes whatever a save killed part-way left (see `recover`).

    Args:
        root: the run's checkpoint directory.  keep_last: how many step checkpoints to keep.
    """

    def __init__(self, root: Path, keep_last: int = 2):
        self.root, self.keep_last = Path(root), keep_last
        self.root.mkdir(parents=True, exist_ok=True)
        self.recover()

    def recover(self) -> None:
        """Bring every name back to a complete checkpoint after a save was cut short.

        What a killed save can leave, and what becomes of it (save_checkpoint's three steps):
            X.tmp             a save that never finished: removed (X, or X.old, is intact)
            X.old and no X    killed between renaming X aside and the new X in: X.old is X again
            X.old and X       killed before the replaced X.old was deleted: X.old removed
            X.trash           a deletion cut short: removed
        """
        for old in self.root.glob("*.old"):
            target = old.with_name(old.name.removesuffix(".old"))
            if target.exists():
                _remove(old)
            else:
                _rename(old, target)
        for leftover in [*self.root.glob("*.tmp"), *self.root.glob("*.trash")]:
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)  # latest.tmp

    def steps(self) -> list[Path]:
        """The complete step checkpoints, oldest first (by step number, not by name)."""
        return step_checkpoints(self.root)

    def latest(self) -> Path | None:
        """The newest step checkpoint of the run (see `latest_checkpoint`)."""
        return latest_checkpoint(self.root)

    def resumable(self) -> Path | None:
        """The checkpoint `--resume` continues from (see `resumable_checkpoint`)."""
        return resumable_checkpoint(self.root)

    def saved(self) -> list[Path]:
        """The complete step checkpoints and best/, oldest first by the step they hold (at the
        same step, best/ first)."""
        found = [(int(p.name.removeprefix("step_")), 1, p) for p in self.steps()]
        best = self.root / "best"
        if is_complete(best):
            found.append((_trainer_state(best).get("step", -1), 0, best))
        return [path for *_, path in sorted(found)]

    def last_good(self) -> Path | None:
        """The newest checkpoint (a step one or best/) whose weights load and are all finite
        and that the training loop did not mark as diverging ("diverging" in its
        trainer_state.json: saved while a loss was above the divergence limit); None if none."""
        for path in reversed(self.saved()):
            if _trainer_state(path).get("diverging", False):
                continue
            try:
                weights = load_file(path / "model.safetensors")
            except (OSError, SafetensorError):
                continue
            if all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point()):
                return path
        return None

    def save(self, step: int, *args, **kwargs) -> Path:
        """save_checkpoint as `step_NNNNNN/`, point `latest` at it, keep the newest keep_last."""
        path = save_checkpoint(self.root / f"step_{step:06d}", *args, **kwargs)
        tmp = self.root / f"{LATEST}.tmp"
        try:
            _write_file(tmp, lambda f: f.write_text(path.name))
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        _rename(tmp, self.root / LATEST)
        others = [p for p in self.steps() if p != path]
        for old in others[: max(len(others) - (self.keep_last - 1), 0)]:
            _remove(old)
        return path

    def save_best(self, *args, **kwargs) -> Path:
        return save_checkpoint(self.root / "best", *args, **kwargs)


def _trainer_state(path: Path) -> dict:
    """A checkpoint's trainer_state.json ({} where it cannot be read)."""
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def is_complete(path: Path, required: tuple[str, ...] = REQUIRED_FILES) -> bool:
    """Whether `path` is a checkpoint directory with the files every training checkpoint has (a
    save makes it appear whole, by a rename, so these tell a checkpoint from a stray directory).
    `required`: the files to look for instead (a model to open needs only config and weights)."""
    return all((Path(path) / name).is_file() for name in required)


def step_checkpoints(root: Path, required: tuple[str, ...] = REQUIRED_FILES) -> list[Path]:
    """The complete `step_NNNNNN/` checkpoints under `root`, oldest first (by step number)."""
    found = []
    for path in Path(root).glob("step_*"):
        number = path.name.removeprefix("step_")
        if number.isdigit() and is_complete(path, required):
            found.append((int(number), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: Path, required: tuple[str, ...] = REQUIRED_FILES) -> Path | None:
    """The checkpoint `root/latest` names; when that pointer is missing, empty or names no
    complete checkpoint, the newest complete step checkpoint (None when there is none)."""
    root = Path(root)
    pointer = root / LATEST
    name = pointer.read_text().strip() if pointer.is_file() else ""
    if name and is_complete(root / name, required):
        return root / name
    steps = step_checkpoints(root, required)
    return steps[-1] if steps else None


def resumable_checkpoint(root: Path) -> Path | None:
    """The checkpoint a resumed run continues from: the latest step checkpoint, or `best/`
    when it holds a later step. best/ is a whole checkpoint too (weights, optimizer, RNG, data
    position), written at an evaluation before that step's own save: it is newer when the run
    stopped between step checkpoints, and the only one when the first step save failed (a full
    disk). None when there is neither."""
    latest, best = latest_checkpoint(root), Path(root) / "best"
    if not is_complete(best):
        return latest
    if latest is None or _trainer_state(best).get("step", -1) > _trainer_state(latest).get(
        "step", -1
    ):
        return best
    return latest


# --- opening a checkpoint as a model: the one loader --------------------------------------------
CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"


@dataclass(frozen=True)
class Loaded:
    """What `open_checkpoint` returns.

    Attributes:
        model: in eval mode, on the device asked for (quantized layers where the file says so;
            a LoRA run's adapters merged, or kept with `keep_adapters`).
        config: its ModelConfig.
        tokenizer: from tokenizer.json beside the weights, or None.
        run: the run config dict of config.json ({"model": ..., and "train", "data" for a
            training checkpoint, "n_labels" for a model-only one with a task head}).
        path: the checkpoint directory that was read (a run directory resolved to it).
        sampling: the checkpoint's own sampling defaults as {SamplingConfig field: value}
            (an HF directory's generation_config.json where it samples, a GGUF file's
            general.sampling.* keys); {} where it states none.
    """

    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer | None
    run: dict
    path: Path
    sampling: dict = field(default_factory=dict)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, the latest one under a run's out_dir or checkpoints/, or
    the cached download of a Hub model named "hf:ORG/NAME[@REV]" (interop.hub)."""
    if is_hub_name(path):
        return resolve_hub_name(str(path))
    path = Path(path)
    if (path / CONFIG).is_file():
        return path
    for root in (path, path / "checkpoints"):
        if (latest := latest_checkpoint(root, required=(CONFIG, WEIGHTS))) is not None:
            return latest
    return path  # open_checkpoint says what is missing


def is_hf_config(config: dict) -> bool:
    """Whether a config.json is an HF one (model_type / architectures, no attnlab "model")."""
    return not isinstance(config.get("model"), dict) and (
        "model_type" in config or "architectures" in config
    )


def open_checkpoint(
    path: str | Path,
    device: str | torch.device = "cpu",
    *,
    scheme: str | None = None,
    group_size: int | None = None,
    layout: str = "half",
    dtype: torch.dtype | None = None,
    keep_adapters: bool = False,
) -> Loaded:
    """Open any checkpoint directory as a model (built on meta, weights assigned, eval mode).

    Args:
        path: a checkpoint directory (attnlab or HF), a run's out_dir or checkpoints/, or
            "hf:ORG/NAME[@REV]", a Hub model (downloaded once into huggingface_hub's cache).
        device: where the weights go.
        scheme, group_size: the quantization the caller expects (ValueError naming both when
            the file holds another); None accepts what the file holds, float included.
        layout: the RoPE layout of a model read from an HF Llama-family directory.
        dtype: cast floating-point weights to this dtype (default: as stored).
        keep_adapters: a LoRA fine-tuning run (`attnlab finetune --lora.rank R`) opens with
            its adapters merged into the base weights (a plain model of its config) unless
            this is True: then they stay LoRALinear modules (adapters.lora), unmerged. No
            effect on a checkpoint without adapters.

    Returns:
        Loaded(model, config, tokenizer, run, path).

    A `.gguf` file (llama.cpp's format, llama family) is dequantized to fp32, or with
    scheme="int4" keeps its Q4_1 matrices as Int4Linear (interop/gguf/reader.py).
    """
    if str(path).endswith(".gguf"):
        return _open_gguf(Path(path), device, scheme, group_size, layout, dtype)
    path = resolve_checkpoint(path)
    config = _read_config(path)
    if is_hf_config(config):
        if scheme is not None:
            raise ValueError(f"{str(path)!r} is an HF directory, but {scheme} was asked for")
        return _open_hf(path, device, layout, dtype)
    if layout != "half":
        raise ValueError(
            f"layout={layout!r} applies to HF checkpoints; {str(path)!r} records its own"
        )
    if not isinstance(config.get("model"), dict):
        raise ValueError(f"{str(path / CONFIG)!r} has no 'model' section (nor an HF model_type)")
    if not (path / WEIGHTS).is_file():
        raise ValueError(f"{str(path)!r} is not a checkpoint (no {WEIGHTS})")
    if _prompt_method(config) != "none":
        if scheme is not None:
            raise ValueError(
                f"{str(path)!r} is a prefix- or prompt-tuning run; open it without a scheme"
            )
        return _open_prompt_learning(path, config, device, dtype)
    if _lora_rank(config):
        if scheme is not None:
            raise ValueError(
                f"{str(path)!r} is a LoRA fine-tuning run, but {scheme} weights were asked for: "
                "open it without a scheme (a QLoRA run keeps its base's)"
            )
        return _open_lora(path, config, device, dtype, keep_adapters)
    found = _expected_scheme(path / WEIGHTS, scheme, group_size)
    return _open_attnlab(path, config, found, device, dtype)


def _read_config(path: Path) -> dict:
    """The JSON object in a checkpoint directory's config.json (attnlab's run config or HF's)."""
    if not (path / CONFIG).is_file():
        raise ValueError(
            f"{str(path)!r} is not a checkpoint (no {CONFIG}; give a checkpoint directory, "
            "or a run directory whose checkpoints/latest names one)"
        )
    try:
        config = json.loads((path / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path / CONFIG)!r} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path / CONFIG)!r} must hold a JSON object")
    return config


def _lora_rank(run: dict) -> int:
    """The LoRA rank of a run config `attnlab finetune` wrote with adapters ("lora": {"rank"}),
    else 0."""
    lora = run.get("lora")
    return (lora.get("rank") or 0) if isinstance(lora, dict) else 0


def plain_model(loaded: "Loaded", what: str) -> "Loaded":
    """`loaded`, unless it is a prefix- or prompt-tuning run (a PromptLearningLM), which `what`
    (a command's work on a plain model: export, quantize, analyze) cannot take: then a
    ValueError naming the checkpoint."""
    if isinstance(loaded.model, PromptLearningLM):
        raise ValueError(
            f"{str(loaded.path)!r} is a {loaded.model.method}-tuning run (a frozen base and a "
            f"learned prefix): {what}"
        )
    return loaded


def _prompt_method(run: dict) -> str:
    """The prompt-learning method of a run config `attnlab finetune --peft.method M` wrote
    ("prefix" or "prompt"), else "none"."""
    peft = run.get("peft")
    return (peft.get("method") or "none") if isinstance(peft, dict) else "none"


def _open_prompt_learning(path: Path, run: dict, device, dtype) -> Loaded:
    """A prefix- or prompt-tuning run: the frozen base (run["base"], as for LoRA) and its
    prefix, as the PromptLearningLM it trained (adapters/prompt_learning.py), which generation
    knows how to run."""
    cfg = from_dict(ModelConfig, run["model"])
    p = from_dict(PromptLearningConfig, run["peft"])
    weights = load_file(str(path / WEIGHTS))
    base = _open_base(path, run, cfg) if run.get("base_sha256") else build_model(cfg)
    model = PromptLearningLM(base, p.method, p.num_virtual_tokens, p.prefix_projection)
    _copy_trained(model, weights, path, run)
    if dtype is not None:
        model = model.to(dtype)
    tokenizer = Tokenizer.from_file(path) if (path / TOKENIZER).is_file() else None
    return Loaded(model.to(device).eval(), cfg, tokenizer, run, path)


def _open_lora(path: Path, run: dict, device, dtype, keep_adapters: bool) -> Loaded:
    """A LoRA fine-tuning run: its checkpoint holds the adapters (and what trained beside them:
    the section's bias and modules_to_save, a task head), its run config the LoRA section and
    the base it started from (run["base"], checked against run["base_sha256"]), as peft names
    its base. (A run written before it stored only these holds the base's weights too.) The
    adapters go back on the base, then (unless `keep_adapters`) merge into a float base: a
    plain model with the same logits. A quantized (QLoRA) base keeps its adapters unmerged
    (re-quantizing W0 + BA would lose the update)."""
    cfg, lora = from_dict(ModelConfig, run["model"]), from_dict(LoraConfig, run["lora"])
    weights = load_file(str(path / WEIGHTS))
    quantized = any(not t.is_floating_point() for t in weights.values())
    if run.get("base_sha256"):  # the adapters alone: the base from where the run recorded it
        model = _open_base(path, run, cfg)
        quantized = any(not t.is_floating_point() for t in model.state_dict().values())
    elif quantized:
        try:
            model = open_checkpoint(run.get("base") or "").model
        except ValueError as e:
            raise ValueError(
                f"{str(path)!r} holds LoRA adapters on a quantized base, whose layout is read "
                f"from the base checkpoint the run started from: {e}"
            ) from None
        if cfg.head is not None:  # QLoRA with a task head: a float head
            model = quantized_like(build_model(cfg), model)
    else:
        model = build_model(cfg)
    add_lora(
        model,
        lora.target_names,
        lora.rank,
        lora.alpha,
        lora.dropout,
        lora.bias,
        lora.save_names,
        rslora=lora.rslora,
    )
    _copy_trained(model, weights, path, run)
    if not (
        quantized or keep_adapters
    ):  # a plain model, trainable as any other (add_lora froze it)
        remove_lora(model, merge=True).requires_grad_(True)
    if dtype is not None:
        model = model.to(dtype)
    tokenizer = Tokenizer.from_file(path) if (path / TOKENIZER).is_file() else None
    return Loaded(model.to(device).eval(), cfg, tokenizer, run, path)


def fingerprint(path: str | Path) -> str:
    """The sha256 of what a model is read from: a file (a .gguf), or a checkpoint directory's
    config.json and weights (*.safetensors, in name order). A run that stores only what it
    trains records its base's, so that a base changed since is refused, never combined."""
    path = Path(path)
    files = [path] if path.is_file() else [path / CONFIG, *sorted(path.glob("*.safetensors"))]
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def _open_base(path: Path, run: dict, cfg: ModelConfig) -> nn.Module:
    """The base a run that stores only what it trains started from (run["base"], checked
    against run["base_sha256"]), as a model of the run's config `cfg`: the base itself, or with
    the fresh task head the run put on it (the head's weights are the run's)."""
    base = run.get("base") or ""
    where = f"{str(path)!r} holds what a run trained on the base {base!r}"
    fix = f'put the base back there, or set "base" in {str(path / CONFIG)!r} to where it is now'
    if not base or not Path(base).exists():
        raise ValueError(f"{where}, which is not there: {fix}")
    try:
        if fingerprint(base) != run["base_sha256"]:
            raise ValueError(
                f"{where}, which has changed since the run (its sha256 differs): the adapters "
                "fit only the base they trained on; " + fix
            )
        loaded = open_checkpoint(base)
    except OSError as e:
        raise ValueError(f"{where}, which cannot be read ({e.strerror or e})") from None
    if loaded.config == cfg:
        return loaded.model
    return copy_body(quantized_like(build_model(cfg), loaded.model), loaded.model)


def _copy_trained(model: nn.Module, weights: dict, path: Path, run: dict) -> None:
    """Copy a run's checkpoint `weights` into `model`: all of its weights, or (a run that
    stores only what it trains: run["base_sha256"]) the trained ones, the rest the base's."""
    trained = set(weights) if run.get("base_sha256") else None
    copy_weights(model, weights, f"checkpoint {str(path)!r}", only=trained)


def _open_hf(path: Path, device, layout: str, dtype: torch.dtype | None) -> Loaded:
    """An HF directory through its family converter (interop.hf); run = {"model": ...}."""
    model, cfg = load_hf(path, layout=layout, dtype=dtype)
    run = _model_run({}, cfg)
    tokenizer = load_tokenizer(path) if (path / TOKENIZER).is_file() else None
    sampling = _hf_sampling(path / "generation_config.json")
    return Loaded(model.to(device).eval(), cfg, tokenizer, run, path, sampling)


# SamplingConfig's fields as an HF generation_config.json and a GGUF file (llama.cpp's
# general.sampling.* keys) name them.
HF_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def _hf_sampling(file: Path) -> dict:
    """The sampling defaults of a generation_config.json: its values only where it samples
    (do_sample true; without it transformers decodes greedily and the values are unused)."""
    try:
        data = json.loads(file.read_text()) if file.is_file() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(file)!r} is corrupt (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict) or data.get("do_sample") is not True:
        return {}
    return {name: data[name] for name in HF_SAMPLING if data.get(name) is not None}


def _open_gguf(path: Path, device, scheme, group_size, layout, dtype) -> Loaded:
    """A GGUF file through interop.gguf; run = {"model": ...}."""
    if scheme is not None and group_size not in (None, 32):
        raise ValueError(f"{str(path)!r}: Q4_1 is int4 at group_size 32, not {group_size}")
    model, cfg, tokenizer, meta = load_gguf(path, layout=layout, scheme=scheme)
    if dtype is not None:
        model = model.to(dtype)
    sampling = {name: meta[key] for key, name in GGUF_SAMPLING.items() if key in meta}
    return Loaded(model.to(device).eval(), cfg, tokenizer, _model_run({}, cfg), path, sampling)


def _open_attnlab(
    path: Path, run: dict, scheme: QuantScheme | None, device, dtype: torch.dtype | None
) -> Loaded:
    """Build the model of `run` on meta (with the task head its config names; the quantized
    Linears of `scheme`), then assign the tensors of model.safetensors."""
    try:
        cfg = from_dict(ModelConfig, run["model"])
    except ValueError as e:  # a field of the wrong type: say which file holds it
        raise ValueError(f"{str(path / CONFIG)!r}: {e}") from None
    if cfg.head is None and "n_labels" in run:  # written before heads were in the config
        cfg = replace(cfg, head=HeadConfig("sequence", run["n_labels"]))
    with torch.device("meta"):
        model = build_model(cfg)
    if scheme is not None:  # the same Linears as when it was quantized, still empty
        heads = read_heads(path / WEIGHTS)
        names = linear_names(model, heads == "quantized", scheme.group_size)
        swap_modules(model, scheme.name, scheme.group_size, names)
        if heads == "int8":  # an int4 model with int8 heads (a Q4_1 GGUF's)
            swap_modules(model, "int8", None, head_names(model))
    load_weights(model, load_file(str(path / WEIGHTS), device=str(device)))
    if dtype is not None:
        model = model.to(dtype)
    tokenizer = Tokenizer.from_file(path) if (path / TOKENIZER).is_file() else None
    return Loaded(model.to(device).eval(), cfg, tokenizer, run, path)


def _model_run(run: dict, cfg: ModelConfig) -> dict:
    """`run` with its "model" section, and "n_labels" for a model with a task head (which the
    commands that need an LM head look for)."""
    run = {**run, "model": to_dict(cfg)}
    if cfg.head is not None:
        run["n_labels"] = cfg.head.num_labels
    return run


def _expected_scheme(file: Path, scheme: str | None, group_size: int | None) -> QuantScheme | None:
    """The scheme in `file`'s metadata (None: float weights), checked against the one asked
    for (if any)."""
    found = read_scheme(file)
    if scheme is None:
        return found
    if group_size is None and found is not None:
        group_size = found.group_size  # "int4" without a group size accepts the file's
    wanted = make_scheme(scheme, group_size)
    if found is None:
        raise ValueError(
            f"{str(file)!r} holds unquantized (float) weights, but {wanted} was asked for"
        )
    if wanted != found:
        raise ValueError(f"{str(file)!r} holds {found} weights, but {wanted} was asked for")
    return found


def save_pretrained(
    path: str | Path,
    model: nn.Module,
    config: ModelConfig,
    tokenizer: Tokenizer | None = None,
    run: dict | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write a model-only checkpoint directory that `open_checkpoint` reads.

    config.json holds `run` (default: none but the model) with its "model" section set to
    `config` (and the task head `model` has, when `config` does not name it) and, for a model
    with a task head, "n_labels"; model.safetensors stores a tied tensor once
    (under its first name, as save_checkpoint does), with `metadata` (a quantized model's
    scheme); tokenizer.json is written when given. Written atomically, as a training
    checkpoint is (`_write_dir`); an existing directory's other files (not CHECKPOINT_FILES)
    stay. Refusing a non-empty `path` is the caller's choice (`check_output_dir`).
    """
    run = _model_run(run or {}, config_with_head(config, model))
    weights = without_tied_names(model.state_dict(), model)  # a tied matrix stored once
    weights = {k: v.contiguous() for k, v in weights.items()}
    files = {CONFIG: _json_writer(run), WEIGHTS: lambda f: save_file(weights, str(f), metadata)}
    if tokenizer is not None:
        files[TOKENIZER] = tokenizer.save
        if tokenizer.chat_template is not None:  # read back by Tokenizer.from_file
            files[TOKENIZER_CONFIG] = tokenizer.save_config
    return _write_dir(Path(path), files, keep_others=True)
