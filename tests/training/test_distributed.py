"""Data parallelism: 2 CPU processes (torchrun, gloo) against 1 process on the same global batch.

One torchrun launch runs every 2-process job in turn (starting processes is the slow part):

    ddp, fsdp            6 steps, per-rank batch 2 x 2 micro-batches, checkpoints at steps 3, 6
    ddp_mlm              the same for masked LM: ranks hold different numbers of masked tokens
    ddp_from_fsdp, ...   resume at step 3 from the other wrapper's (or 1 process's) checkpoint
    failing              rank 1 raises in step 5: the whole job must end, non-zero, soon

The 1-process runs (batch 4 x 2 micro-batches: the same global batch) run in this process.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from attnlab.checkpoint import (
    CheckpointDir,
    read_checkpoint,
    save_checkpoint,
    without_tied_names,
)
from attnlab.configs import to_dict
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.training import distributed
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from attnlab.training.loop import train
from attnlab.training.optim import build_optimizer
from attnlab.training.tasks import build_task
from tests.data import SHAKESPEARE

B, ACCUM, STEPS, CUT = 2, 2, 6, 3  # per-rank batch, micro-batches, steps, checkpoint step
LAUNCH_TIMEOUT = 240  # seconds; a hang fails the test instead of the whole session
TOLERANCE = 1e-5  # relative: 2 ranks and 1 process sum the same numbers in another order

DRIVER = """
import json, shutil, sys
from pathlib import Path
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from attnlab.configs import from_dict
from attnlab.models.build import build_model
from attnlab.training.config import RunConfig
from attnlab.training.loop import train
from attnlab.training.optim import build_optimizer
from attnlab.training.tasks import build_task

import time
jobs, results = json.loads(Path(sys.argv[1]).read_text()), {}
dist.init_process_group("gloo")  # train() joins this group instead of starting its own
for job in jobs:
    run = from_dict(RunConfig, job["run"])
    if job["start_from"] and dist.get_rank() == 0:
        root = Path(run.train.out_dir) / "checkpoints"
        shutil.copytree(job["start_from"], root / Path(job["start_from"]).name)
        (root / "latest").write_text(Path(job["start_from"]).name)
    dist.barrier()
    torch.manual_seed(0)
    task = build_task(run)
    if job.get("fail_at") and dist.get_rank() == 1:
        real, calls = task.train_batch, []
        def failing(*args):
            calls.append(1)
            if len(calls) == job["fail_at"]:
                print(f"failing at {time.time()}", flush=True)
                raise RuntimeError("boom: rank 1 failed on purpose")
            return real(*args)
        task.train_batch = failing
    results[job["name"]] = train(build_model(run.model), task, run, resume=job["resume"]).losses
    if dist.get_rank() == 0:
        Path(sys.argv[2]).write_text(json.dumps(results))
dist.destroy_process_group()
"""


def make_run(root: Path, out: str, preset: str = "llama-tiny", **train) -> RunConfig:
    text = root / "tiny.txt"
    if not text.is_file():
        text.write_text(SHAKESPEARE.read_text()[:20_000])
    train_kw = dict(
        steps=STEPS,
        batch_size=B,
        grad_accum=ACCUM,
        context=16,
        warmup=2,
        lr=3e-3,
        eval_every=1000,
        eval_batches=1,
        log_every=1,
        ckpt_every=CUT,
        sample_tokens=8,  # evaluation and sampling run on every rank (FSDP: a collective)
        device="cpu",
        out_dir=str(root / out),
        progress=False,
    )
    train_kw.update(train)
    task = "mlm" if preset.startswith("bert") else "clm"
    data = DataConfig(task=task, source=str(text), cache_dir=str(root / "cache"))
    return RunConfig(replace(get_preset(preset), dropout=0.0), TrainConfig(**train_kw), data)


def moe_run(root: Path, out: str, **train) -> RunConfig:
    """moe-tiny with DeepSeek-V3's router bias: its update reads every rank's expert load. No
    load-balancing loss: computed per micro-batch on each rank (as transformers and Megatron
    do), it would differ from one process's over the whole batch."""
    run = make_run(root, out, "moe-tiny", moe_aux_weight=0.0, sample_tokens=0, **train)
    moe = replace(run.model.moe, score="sigmoid", bias_update_rate=0.05)
    return replace(run, model=replace(run.model, moe=moe))


def torchrun(root: Path, jobs: list[dict]) -> dict:
    """Run `jobs` in 2 processes; returns exit code, output, losses, and when the launch ended."""
    (root / "driver.py").write_text(DRIVER)
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(root / "driver.py"), str(root / "jobs.json"), str(root / "results.json")]
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=LAUNCH_TIMEOUT
        )
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:  # a hang: the failure test reports it
        code, output = None, f"{e.stdout or ''}{e.stderr or ''}"
    results = root / "results.json"
    losses = json.loads(results.read_text()) if results.is_file() else {}
    return {"code": code, "output": output, "losses": losses, "ended": time.time()}


def job(run: RunConfig, name: str, resume: bool = False, start_from=None, **extra) -> dict:
    return dict(name=name, run=to_dict(run), resume=resume, start_from=start_from, **extra)


def checkpoint(root: Path, out: str, step: int) -> Path:
    return root / out / "checkpoints" / f"step_{step:06d}"


def train_here(run: RunConfig, resume: bool = False, start_from: Path | None = None) -> list:
    """One process (distributed="none"), as `attnlab train` without torchrun."""
    if start_from is not None:
        root = Path(run.train.out_dir) / "checkpoints"
        shutil.copytree(start_from, root / start_from.name)
        (root / "latest").write_text(start_from.name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        return train(build_model(run.model), build_task(run), run, resume=resume).losses
    finally:
        torch.set_num_threads(threads)


def relative(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run's per-step losses (and the root its checkpoints are under)."""
    root = tmp_path_factory.mktemp("distributed")
    # The 1-process reference first: it also prepares the token cache the ranks then share.
    single = make_run(root, "single", batch_size=2 * B)
    single_mlm = make_run(root, "single_mlm", "bert-tiny", batch_size=2 * B, sample_tokens=0)
    losses = {"single": train_here(single), "single_mlm": train_here(single_mlm)}
    losses["single_moe"] = train_here(moe_run(root, "single_moe", batch_size=2 * B))
    jobs = [
        job(make_run(root, "ddp", distributed="ddp"), "ddp"),
        job(make_run(root, "ddp_mlm", "bert-tiny", distributed="ddp", sample_tokens=0), "ddp_mlm"),
        job(make_run(root, "fsdp", distributed="fsdp"), "fsdp"),
        job(
            make_run(root, "ddp_from_fsdp", distributed="ddp"),
            "ddp_from_fsdp",
            resume=True,
            start_from=str(checkpoint(root, "fsdp", CUT)),
        ),
        job(
            make_run(root, "fsdp_from_ddp", distributed="fsdp"),
            "fsdp_from_ddp",
            resume=True,
            start_from=str(checkpoint(root, "ddp", CUT)),
        ),
        job(
            make_run(root, "ddp_from_single", distributed="ddp"),
            "ddp_from_single",
            resume=True,
            start_from=str(checkpoint(root, "single", CUT)),
        ),
        job(moe_run(root, "ddp_moe", distributed="ddp"), "ddp_moe"),
        job(moe_run(root, "fsdp_moe", distributed="fsdp"), "fsdp_moe"),
        # Last, as it ends the launch: rank 1 raises at its 5th batch (step 5).
        job(
            make_run(root, "failing", distributed="ddp", grad_accum=1, ckpt_every=2),
            "failing",
            fail_at=5,
        ),
    ]
    t0 = time.perf_counter()
    launch = torchrun(root, jobs)
    print(f"torchrun, 2 processes, {len(jobs)} jobs: {time.perf_counter() - t0:.1f} s")
    assert set(launch["losses"]) == {j["name"] for j in jobs[:-1]}, launch["output"][-6000:]
    losses.update(launch["losses"])
    for wrapper in ("ddp", "fsdp"):
        one = make_run(root, f"single_from_{wrapper}", batch_size=2 * B)
        start = checkpoint(root, wrapper, CUT)
        losses[f"single_from_{wrapper}"] = train_here(one, resume=True, start_from=start)
    return {"root": root, "losses": losses, "launch": launch}


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_two_ranks_match_one_process_on_the_same_global_batch(runs, wrapper):
    losses, root = runs["losses"], runs["root"]
    assert len(losses[wrapper]) == STEPS
    worst_loss = max(relative(a, b) for a, b in zip(losses[wrapper], losses["single"]))
    final = read_checkpoint(checkpoint(root, wrapper, STEPS))
    reference = read_checkpoint(checkpoint(root, "single", STEPS))
    assert final["weights"].keys() == reference["weights"].keys()
    worst_weight = max(
        relative(final["weights"][k], reference["weights"][k]) for k in reference["weights"]
    )
    print(
        f"{wrapper}: max relative difference, losses {worst_loss:.2e}, weights {worst_weight:.2e}"
    )
    assert worst_loss <= TOLERANCE and worst_weight <= TOLERANCE
    # The optimizer state is the full one, numbered as a single process numbers it.
    mine, theirs = final["optimizer"], reference["optimizer"]
    assert mine["state"].keys() == theirs["state"].keys()
    assert [g["params"] for g in mine["param_groups"]] == [
        g["params"] for g in theirs["param_groups"]
    ]
    for i in theirs["state"]:
        assert relative(mine["state"][i]["exp_avg"], theirs["state"][i]["exp_avg"]) <= 1e-4
    # Rank 0 alone wrote the metrics: one line per step (the evaluation adds none).
    lines = (root / wrapper / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, STEPS + 1))
    assert "sample" in json.loads(lines[-1])  # sampling ran under the wrapper too


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_an_moe_model_trains_on_two_ranks_as_in_one_process(runs, wrapper):
    """Same losses, same weights, and the same router biases: the expert load is summed over
    ranks before the bias step."""
    losses, root = runs["losses"], runs["root"]
    assert max(map(relative, losses[f"{wrapper}_moe"], losses["single_moe"])) <= TOLERANCE
    final = read_checkpoint(checkpoint(root, f"{wrapper}_moe", STEPS))["weights"]
    reference = read_checkpoint(checkpoint(root, "single_moe", STEPS))["weights"]
    assert any(k.endswith("router_bias") for k in reference)
    assert max(relative(final[k], reference[k]) for k in reference) <= TOLERANCE


@pytest.mark.slow
def test_two_ranks_weigh_masked_tokens_as_one_process(runs):
    """Token-weighted accumulation across ranks: each rank's slice holds a different number of
    masked tokens, and the update is still the one batch's (the loop sums counts over ranks)."""
    losses = runs["losses"]
    assert len(losses["ddp_mlm"]) == STEPS
    assert max(relative(a, b) for a, b in zip(losses["ddp_mlm"], losses["single_mlm"])) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_a_two_rank_checkpoint_continues_in_one_process(runs, wrapper):
    """1 process resumed from the 2-rank step-3 checkpoint takes the same steps 4..6."""
    losses = runs["losses"]
    resumed, continued = losses[f"single_from_{wrapper}"], losses[wrapper][CUT:]
    assert len(resumed) == STEPS - CUT
    worst = max(relative(a, b) for a, b in zip(resumed, continued))
    print(f"1 process from a {wrapper} checkpoint: max relative loss difference {worst:.2e}")
    assert worst <= TOLERANCE


@pytest.mark.slow
def test_two_ranks_resume_any_checkpoint(runs):
    """FSDP2 resumes DDP's checkpoint and back, DDP one written by 1 process: rank 0 reads the
    full states and broadcasts them (FSDP2 then keeps each rank's shard)."""
    losses = runs["losses"]
    pairs = (("fsdp_from_ddp", "ddp"), ("ddp_from_fsdp", "fsdp"), ("ddp_from_single", "single"))
    for name, source in pairs:
        assert len(losses[name]) == STEPS - CUT
        worst = max(relative(a, b) for a, b in zip(losses[name], losses[source][CUT:]))
        print(f"{name}: max relative loss difference {worst:.2e}")
        assert worst <= TOLERANCE


@pytest.mark.slow
def test_a_failing_rank_ends_the_job_and_keeps_the_last_checkpoint(runs):
    launch, root = runs["launch"], runs["root"]
    assert launch["code"] is not None, f"still running after {LAUNCH_TIMEOUT} s: a hang"
    assert launch["code"] != 0
    assert "boom: rank 1 failed on purpose" in launch["output"]  # the error is shown
    failed_at = float(launch["output"].split("failing at ")[1].split()[0])
    print(f"failing rank: the job ended {launch['ended'] - failed_at:.1f} s after the error")
    assert launch["ended"] - failed_at < 60  # torchrun stopped rank 0, blocked in a collective
    latest = CheckpointDir(root / "failing" / "checkpoints").latest()
    assert latest is not None and latest.name == "step_000004"
    assert read_checkpoint(latest)["trainer"]["step"] == 4


class Recorder:
    """Stands in for a DDP / FSDP2 module: records what gradient_sync asks of it."""

    def __init__(self):
        self.calls = []

    def no_sync(self):
        self.calls.append("no_sync")
        return torch.no_grad()  # any context manager

    def set_requires_gradient_sync(self, sync: bool):
        self.calls.append(sync)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_gradients_are_averaged_on_the_last_micro_batch_only(kind):
    ranks, model = distributed.Ranks(kind, 0, 2), Recorder()
    for i in range(3):
        with ranks.gradient_sync(model, sync=i == 2):
            pass
    assert model.calls == (["no_sync", "no_sync"] if kind == "ddp" else [False, False, True])


def test_distributed_without_torchrun_and_torchrun_without_distributed(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"'fsdp' needs the process group torchrun sets up"):
        distributed.start("fsdp", "cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2.*--train.distributed ddp or fsdp"):
        distributed.start("none", "cpu")


def test_mlm_ranks_slice_one_masked_global_batch(tmp_path):
    """Masks are drawn for the global batch, so they do not depend on the number of ranks."""
    run = make_run(tmp_path, "mlm", batch_size=3)
    run = replace(
        run, model=replace(get_preset("bert-tiny"), dropout=0.0), data=replace(run.data, task="mlm")
    )
    task = build_task(run)
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    whole = build_task(replace(run, train=replace(run.train, batch_size=6))).train_batch(gen())
    parts = [task.train_batch(gen(), rank, 2) for rank in range(2)]
    for key in whole:
        assert torch.equal(torch.cat([p[key] for p in parts]), whole[key]), key
    g1, g2 = gen(), gen()
    task.train_batch(g1, 0, 2)
    task.train_batch(g2, 1, 2)
    assert torch.equal(g1.get_state(), g2.get_state())  # every rank's generator stays in step


def test_a_full_state_dict_checkpoint_equals_a_module_one(tmp_path):
    """What FSDP's rank 0 writes (torch.distributed.checkpoint's full state dicts: weights by
    name, optimizer state by parameter name) equals what one process writes, tied matrix too."""
    cfg = replace(get_preset("gpt2-tiny"), n_layers=1)  # tied embedding and head
    model = build_model(cfg)
    optimizer = build_optimizer(model, 1e-3, 0.1, (0.9, 0.99))
    model(torch.randint(cfg.vocab_size, (2, 8))).float().logsumexp(-1).mean().backward()
    optimizer.step()
    run = RunConfig(cfg, TrainConfig(), DataConfig(source="x.txt"))
    weights = without_tied_names(get_model_state_dict(model), model)
    optim_state = distributed._by_index(get_optimizer_state_dict(model, optimizer))
    save_checkpoint(tmp_path / "dicts", weights, optim_state, run, {"step": 1})
    save_checkpoint(tmp_path / "module", model, optimizer, run, {"step": 1})
    a, b = read_checkpoint(tmp_path / "dicts"), read_checkpoint(tmp_path / "module")
    assert len(a["weights"]) == len(b["weights"]) == len(dict(model.named_parameters()))
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for i, state in b["optimizer"]["state"].items():
        assert torch.equal(a["optimizer"]["state"][i]["exp_avg"], state["exp_avg"])
    # ... and _by_name inverts _by_index, giving back the names set_optimizer_state_dict wants.
    by_name = distributed._by_name(optim_state, optimizer, model)
    assert by_name["param_groups"] == get_optimizer_state_dict(model, optimizer)["param_groups"]
    fresh = build_model(cfg)
    fresh_optimizer = build_optimizer(fresh, 1e-3, 0.1, (0.9, 0.99))
    distributed.Ranks().load_checkpoint_state(fresh, fresh_optimizer, a["weights"], a["optimizer"])
    assert fresh.head.weight is fresh.embed.weight
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name


def test_nproc_relaunches_the_same_command_through_torchrun():
    import argparse

    from attnlab.cli import train as train_cli

    parser = argparse.ArgumentParser()
    parser.set_defaults(command="train")
    train_cli.add_parser(parser)
    flags = ["--nproc", "2", "--preset", "llama-tiny", "--resume", "--train.lr=3e-4"]
    argv = train_cli.torchrun_argv(parser.parse_args(flags))
    assert argv == [
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "attnlab",
        "train",
        "--preset=llama-tiny",
        "--resume",
        "--train.lr=3e-4",
        "--train.distributed=ddp",  # DDP unless told otherwise
    ]
    fsdp = train_cli.torchrun_argv(parser.parse_args([*flags, "--train.distributed", "fsdp"]))
    assert fsdp[-2:] == ["--train.lr=3e-4", "--train.distributed=fsdp"]
