"""Data parallelism under torchrun: the same training loop on N processes, with DDP or FSDP2.

    torchrun --nproc_per_node=2 -m attnlab train --train.distributed ddp    # or fsdp

Each rank draws the same global batch from the same data generator and keeps its own slice
(`task.train_batch(gen, rank, world)`), so the data seen does not depend on the number of ranks.

    ddp   DistributedDataParallel (Li et al. 2020, arXiv:2006.15704): every rank holds the whole
          model and optimizer; backward all-reduces (averages) the gradients, bucket by bucket.
    fsdp  FSDP2, `fully_shard` (Zhao et al. 2023, arXiv:2304.11277; ZeRO-3, arXiv:1910.02054):
          every rank holds 1/N of each parameter, gradient and optimizer state (dim 0 sharded);
          each block all-gathers its weights just before it runs and reduce-scatters its grads.

Both average gradients over ranks. Each rank's loss is its share's loss summed over its target
tokens, times world / (the global batch's number of target tokens, `Ranks.sum` of the counts), so
the average is the gradient of the global batch's mean loss: the update a single process would
make on the whole global batch.

Checkpoints keep the single-process format: full (unsharded) weights and optimizer state, which
rank 0 writes and, on resume, reads and broadcasts. So a run may resume on another number of
processes. With one process (`kind="none"`) every method here does the plain thing and no
collective is ever called.
"""

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from attnlab.checkpoint import copy_weights
from attnlab.components.blocks import DecoderBlock  # EncoderBlock is a subclass
from attnlab.models.weights import with_tied_names, without_tied_names

Kind = Literal["none", "ddp", "fsdp"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def clip_grad_norm_(params, max_norm: float) -> Tensor:
    """`nn.utils.clip_grad_norm_`, with the norm of sharded (FSDP2) gradients made whole first.

    Returns:
        the total gradient norm before clipping, a plain scalar tensor.
    """
    params = list(params)
    norm = nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job. One process: kind="none", rank 0 of 1."""

    kind: Kind = "none"
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        """Rank 0 logs, draws the progress bar and writes every file."""
        return self.rank == 0

    # --- wrapping ---------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP around `model`, or `model` sharded in place by FSDP2 (one unit per block)."""
        if self.kind == "ddp":  # broadcasts rank 0's weights on construction
            ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(model, device_ids=ids)
        if self.kind == "fsdp":
            for tensor in model.state_dict().values():  # fully_shard keeps each rank's own
                dist.broadcast(tensor, src=0)  # slice, so first give every rank rank 0's weights
            mesh = init_device_mesh(self.device.type, (self.world,))
            for block in [m for m in model.modules() if isinstance(m, DecoderBlock)]:
                fully_shard(block, mesh=mesh)
            # The root (embeddings, final norm, head) stays gathered from forward to backward.
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The model's own module: what DDP wraps (FSDP2 shards in place, nothing to unwrap)."""
        return model.module if isinstance(model, DistributedDataParallel) else model

    def gradient_sync(self, model: nn.Module, sync: bool):
        """Around one micro-batch's forward and backward: average gradients over ranks only when
        `sync` (the last micro-batch); before that each rank accumulates its own, for free."""
        if self.kind == "ddp" and not sync:
            return model.no_sync()
        if self.kind == "fsdp":
            model.set_requires_gradient_sync(sync)
        return nullcontext()

    @contextmanager
    def evaluating(self, model: nn.Module):
        """The model in eval mode, to evaluate and sample with on every rank (each computes the
        same numbers; only rank 0 reports them).

        DDP: the wrapped module, which runs without collectives. FSDP2: the root's weights are
        gathered for the whole evaluation, since generation calls submodules (the decoder, the
        encoder) outside the root's forward; the blocks gather their own as they run."""
        inner = self.unwrap(model).eval()
        if self.kind == "fsdp":
            model.unshard()
        try:
            yield inner
        finally:
            if self.kind == "fsdp":
                model.reshard()
            inner.train()

    # --- collectives (no-ops for one process) -------------------------------------------------
    def mean(self, x: Tensor) -> Tensor:
        """The mean of `x` over ranks (for logging: then every rank reports the same number)."""
        if self.world == 1:
            return x
        x = x.clone()
        dist.all_reduce(x)  # SUM: gloo has no AVG
        return x / self.world

    def sum(self, x: Tensor) -> Tensor:
        """The sum of `x` over ranks (the global batch's token count, its summed loss)."""
        if self.world == 1:
            return x
        x = x.clone()
        dist.all_reduce(x)  # SUM
        return x

    def broadcast(self, obj):
        """Rank 0's `obj` (picklable) on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's `obj`, as a list on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    # --- checkpoints --------------------------------------------------------------------------
    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """What rank 0 writes as weights and optimizer state: the module and optimizer themselves
        (one process, DDP), or full state dicts gathered from the shards (FSDP2, a collective).

        Returns:
            (module or weights dict, optimizer or state dict) on rank 0, (None, None) elsewhere.
        """
        if self.kind == "fsdp":
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # only rank 0 gets it
            weights = get_model_state_dict(model, options=full)
            optim_state = get_optimizer_state_dict(model, optimizer, options=full)
            if not self.main:
                return None, None
            return without_tied_names(weights, model), _by_index(optim_state)
        return (self.unwrap(model), optimizer) if self.main else (None, None)

    def load_checkpoint_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        weights,
        optim_state,
        only: set[str] | None = None,
    ) -> None:
        """Load full state dicts that rank 0 read from a checkpoint into every rank's model and
        optimizer (rank 0 broadcasts; each rank keeps its shard). Other ranks pass None.
        only: the names the weights hold (a run on a frozen base stores what trains), the
        model's other weights kept as they are; None: all of them."""
        inner = self.unwrap(model)
        if self.kind == "none":
            copy_weights(model, weights, only=only)
            optimizer.load_state_dict(optim_state)
            return
        if self.main:
            weights = _first_module_names(with_tied_names(weights, inner), inner)
            expected = _first_module_names(inner.state_dict(), inner).keys()
            if only is not None:
                expected = expected & only
            if weights.keys() != expected:
                raise ValueError(
                    f"the checkpoint does not fit this model: missing "
                    f"{sorted(expected - weights.keys())}, unexpected "
                    f"{sorted(weights.keys() - expected)}"
                )
            optim_state = _by_name(optim_state, optimizer, inner)
        # strict=False: load_state_dict would miss a shared module's second name (checked above).
        full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(model, weights or {}, options=full)
        set_optimizer_state_dict(model, optimizer, optim_state or {}, options=full)

    def rng_state(self, data_gen: torch.Generator) -> dict | None:
        """The RNG to checkpoint (on rank 0): the data generator, one for all ranks, and each
        rank's torch RNG (dropout); "torch" is rank 0's, as a single process saves it."""
        states = self.gather(torch.get_rng_state())
        if not self.main:
            return None
        rng = {"torch": states[0], "data": data_gen.get_state()}
        if self.world > 1:
            rng["torch_per_rank"] = states
        return rng

    def set_rng_state(self, rng: dict, data_gen: torch.Generator, seed: int) -> None:
        data_gen.set_state(rng["data"])
        states = rng.get("torch_per_rank", [rng["torch"]])
        if self.rank < len(states):
            torch.set_rng_state(states[self.rank])
        else:  # more ranks than when the checkpoint was written: a fresh dropout stream
            torch.manual_seed(seed + self.rank)


def start(kind: Kind, device: str) -> Ranks:
    """Join the process group torchrun set up (gloo on CPU, nccl on CUDA); one process: nothing.

    Args:
        kind: "none", "ddp" or "fsdp" (train.distributed).
        device: train.device; under torchrun "cuda"/"auto" means cuda:LOCAL_RANK.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if kind == "none":
        if world > 1:
            raise ValueError(
                f"launched as {world} processes (WORLD_SIZE={world}) but train.distributed is "
                "'none': each would train alone and write the same files; pass "
                "--train.distributed ddp or fsdp"
            )
        return Ranks(device=resolve_device(device))
    if "RANK" not in os.environ:
        raise ValueError(
            f"train.distributed={kind!r} needs the process group torchrun sets up: run "
            f"`torchrun --nproc_per_node N -m attnlab train ...` or `attnlab train --nproc N ...`"
        )
    where = resolve_device(device)
    if where.type == "cuda":
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(where)
    if not dist.is_initialized():
        backend = "nccl" if where.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=where if where.type == "cuda" else None)
    return Ranks(kind, dist.get_rank(), dist.get_world_size(), where)


def stop() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


# --- the single-process checkpoint format: tied weights once, optimizer state by number ----
def every_rank(x: Tensor, world: int) -> Tensor:
    """Every rank's `x` (the same shape on each) joined along dim 0 in rank order: what a task
    whose statistics span the global batch needs (GRPO's "batch" reward std); `x` itself for
    one process."""
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def _first_module_names(weights: dict, module: nn.Module) -> dict:
    """Only the names of each module's first path: set_model_state_dict visits a shared module
    (one embedding for encoder and decoder) once, and would not shard a copy under a second."""
    paths = {name for name, _ in module.named_modules()}  # a shared module under its first name
    return {k: v for k, v in weights.items() if k.rpartition(".")[0] in paths}


def _by_index(state: dict) -> dict:
    """A full optimizer state keyed by parameter name -> `optimizer.state_dict()`'s format, where
    parameters are numbered in param_groups order (the format a single process saves)."""
    index: dict[str, int] = {}
    groups = [
        {**g, "params": [index.setdefault(name, len(index)) for name in g["params"]]}
        for g in state["param_groups"]
    ]
    return {"state": {index[k]: v for k, v in state["state"].items()}, "param_groups": groups}


def _by_name(state: dict, optimizer: torch.optim.Optimizer, module: nn.Module) -> dict:
    """The inverse of `_by_index`: numbers -> names, the keys set_optimizer_state_dict expects."""
    names = {id(p): name for name, p in module.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {order[i]: v for i, v in state["state"].items()}, "param_groups": groups}
