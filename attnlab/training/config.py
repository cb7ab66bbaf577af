"""Training configs: what data (DataConfig), how to train (TrainConfig), and the run that joins
them with a ModelConfig. A run config is saved in every checkpoint's config.json."""

from dataclasses import dataclass, field
from typing import Literal

from attnlab.configs import check_literals
from attnlab.models.config import ModelConfig
from attnlab.tokenizer import CHAT_TOKENS

Task = Literal["clm", "mlm", "seq2seq", "vqa", "vla", "prefix_lm", "permutation_lm"]


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from.

    task: "clm", "mlm", "seq2seq", "vqa", "vla", or, for decoder models, "prefix_lm" (UniLM)
        and "permutation_lm" (XLNet's content stream) (training/tasks.py).
    source: "stdlib" (the running Python's standard library .py files), a named public dataset
        ("shakespeare": downloaded once into the user's cache, see training/datasets.py), a
        text file or a directory of text files, or "synthetic:copy" / "synthetic:reverse" /
        "synthetic:sort".
    tokenizer: "char", "bpe" (trained on the training text), or a path to a tokenizer.json.
    special_tokens: the trained tokenizer's own special tokens besides the fixed seven, comma-
        separated (e.g. "<|endoftext|>"), each one id that BPE never splits; "chat" adds the
        chat markers <|system|>, <|user|>, <|assistant|>, <|end|>, which bring the default chat
        template, so that a base pre-trained with them can be instruction-tuned (SFT) later.
    max_chars: cap on the text read from a directory ("stdlib"), files taken in sorted order.
    val_fraction: the last fraction of the token stream is the validation split.
    synthetic_*: size and shape of the seq2seq tasks (symbols 0..n_symbols-1, lengths in range).
        synthetic_n_val is also the number of held-out scenes of the "vqa" / "vla" tasks.
    scene_grid, scene_cell: the "vqa" / "vla" scenes (training/embodied.py) are grids of
        scene_grid x scene_grid cells of scene_cell pixels.
    pack: sequence packing, for task "clm" (`--data.pack true`). Without it a batch row is a
        random window of the concatenated files, read across file boundaries. With it each row
        of context + 1 tokens holds whole documents (one document = one file; a document longer
        than a row is cut into row-sized pieces, each then a document of its own; a row is filled
        with the following documents or pieces, in order, and padded at the end: `pack_rows` in
        training/data.py), and rows are drawn at random. The model sees a causal document mask
        (a token attends only to earlier tokens of its own document), positions that restart at
        0 at each document, and no loss on a label from another document or from padding. So
        training on packed rows is training on the documents one at a time, without padding
        costs. A single-document source (a file, "shakespeare") is cut into pieces of context + 1
        tokens, one per row: packing then only fixes where the windows start (and the last token
        of each piece has no label).
    """

    task: Task = "clm"
    source: str = "stdlib"
    tokenizer: str = "char"
    special_tokens: str = ""
    bpe_vocab_size: int = 2048
    max_chars: int = 4_000_000
    val_fraction: float = 0.1
    cache_dir: str = ".attnlab_cache"
    mlm_probability: float = 0.15
    synthetic_n_symbols: int = 10
    synthetic_min_len: int = 4
    synthetic_max_len: int = 12
    synthetic_n_val: int = 1000
    scene_grid: int = 4
    scene_cell: int = 8
    pack: bool = False

    def __post_init__(self):
        check_literals(self)
        if self.pack and self.task != "clm":
            raise ValueError(
                f"data.pack packs documents for task 'clm' only, got task {self.task!r}; "
                "set --data.pack false"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(
                f"data.val_fraction must be in (0, 1), got {self.val_fraction}; e.g. 0.1 keeps "
                "the last tenth of the text for validation"
            )
        if self.special_tokens and self.tokenizer not in ("char", "bpe"):
            raise ValueError(
                f"data.special_tokens={self.special_tokens!r} applies to a tokenizer trained here "
                f"('char' or 'bpe'); the tokenizer file {self.tokenizer!r} keeps its own"
            )

    @property
    def special_token_list(self) -> list[str]:
        """The special_tokens option as a list ("chat": the chat markers)."""
        names = [t.strip() for t in self.special_tokens.split(",") if t.strip()]
        return [t for name in names for t in (CHAT_TOKENS if name == "chat" else [name])]


@dataclass(frozen=True)
class TrainConfig:
    """How to train. Global batch = batch_size * grad_accum * ranks sequences of `context`.

    batch_size: sequences per micro-batch on each rank (process).
    grad_clip: the largest global gradient norm; 0 turns clipping off.
    warmup_convention: how cosine and constant warm up over `warmup` steps (training/
        schedules.py): "attnlab", lr * (s + 1) / warmup at 0-based step s (the first step
        trains); "transformers", lr * s / warmup (step 0 at lr 0), as transformers'
        get_cosine_schedule_with_warmup. Noam has its own (steps counted from 1).
    distributed: "ddp" or "fsdp" when launched by torchrun (one process per GPU or CPU worker;
        see training/distributed.py); "none" for a single process.
    sample_tokens: length of the text sample drawn at each evaluation; 0 draws none.
    moe_aux_weight: the weight of a Mixture-of-Experts model's load-balancing loss in the
        training loss (components/moe.py; Switch used 0.01, Mixtral's HF config 0.001); it
        does nothing for a dense model. The task loss alone is logged as train_loss.

    Accelerators (attnlab/accel/), off unless turned on; the same numbers either way:
    keep_freed_memory: on CPU, have glibc keep freed memory in the process instead of handing
        it back, so large tensors are not page-faulted in again every step (accel/host_memory.py).
        It applies to the whole process, from the start of training on.
    flat_adamw: AdamW over one flat buffer per parameter group (accel/flat_adamw.py): the
        per-tensor costs of the step, the clip and zero_grad paid once per group. One process
        only (distributed="none").
    compile (above) also turns on the accelerators the compiled step is written for
        (accel/short_attention.py, accel/sigmoid_gelu.py).
    """

    steps: int = 2000
    batch_size: int = 12
    context: int = 64
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    schedule: Literal["cosine", "noam", "constant"] = "cosine"
    warmup_convention: Literal["attnlab", "transformers"] = "attnlab"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    label_smoothing: float = 0.0
    moe_aux_weight: float = 0.01
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    compile: bool = False
    eval_every: int = 250
    eval_batches: int = 20
    log_every: int = 10
    ckpt_every: int = 500
    keep_last: int = 2
    sample_tokens: int = 200
    seed: int = 1337
    device: str = "auto"
    distributed: Literal["none", "ddp", "fsdp"] = "none"
    out_dir: str = "runs/default"
    progress: bool = True
    keep_freed_memory: bool = False
    flat_adamw: bool = False

    def __post_init__(self):
        check_literals(self)
        at_least_one = (
            "steps",
            "batch_size",
            "context",
            "grad_accum",
            "eval_batches",
            "keep_last",
            "eval_every",
            "log_every",
            "ckpt_every",
        )
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise ValueError(
                    f"train.{name} must be >= 1, got {getattr(self, name)}: set --train.{name}"
                )
        for name in ("warmup", "grad_clip", "weight_decay", "sample_tokens", "moe_aux_weight"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"train.{name} must be >= 0, got {getattr(self, name)}: set --train.{name}"
                )
        if self.flat_adamw and self.distributed != "none":
            raise ValueError(
                f"train.flat_adamw works in one process only, not with "
                f"distributed={self.distributed!r}: set train.flat_adamw=false"
            )
        if self.schedule == "noam" and self.warmup_convention != "attnlab":
            raise ValueError(
                f"train.warmup_convention={self.warmup_convention!r} applies to the cosine and "
                "constant schedules; noam counts its steps from 1 (Vaswani et al.): drop "
                "--train.warmup_convention or choose --train.schedule cosine"
            )
        if self.min_lr > self.lr:
            raise ValueError(
                f"train.min_lr={self.min_lr} is above train.lr={self.lr}: the schedule decays "
                f"from lr to min_lr, so set --train.min_lr too "
                f"(e.g. --train.min_lr={self.lr / 10:g})"
            )


@dataclass(frozen=True)
class RunConfig:
    """A whole run: model, training and data."""

    model: ModelConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
