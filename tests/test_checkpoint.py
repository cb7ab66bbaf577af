"""Checkpoints: plain files only (safetensors, JSON, tensor-only torch files), atomic saves,
the `latest` pointer, keep_last pruning, and save -> load identity."""

import json
import os
import shutil
import stat
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import attnlab.checkpoint as ckpt
from attnlab.checkpoint import CheckpointDir, load_checkpoint, read_checkpoint, save_checkpoint
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from attnlab.training.optim import build_optimizer

FILES = {"config.json", "model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json"}


def trained_pair(preset: str = "gpt2-tiny"):
    """A tiny model and an AdamW that has taken one step (so it has state to save)."""
    cfg = replace(get_preset(preset), n_layers=1)
    model = build_model(cfg)
    optimizer = build_optimizer(model, 1e-3, 0.1, (0.9, 0.99))
    ids = torch.randint(cfg.vocab_size, (2, 8))
    logits = model(ids, ids) if cfg.arch == "encoder_decoder" else model(ids)
    logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    run = RunConfig(cfg, TrainConfig(steps=7), DataConfig(source="x.txt"))
    return model, optimizer, run


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "data": torch.Generator().manual_seed(3).get_state()}


def test_checkpoint_holds_only_plain_files_loadable_with_weights_only(tmp_path):
    model, optimizer, run = trained_pair()
    path = save_checkpoint(
        tmp_path / "step_000001", model, optimizer, run, {"step": 1}, rng_state()
    )
    assert {f.name for f in path.iterdir()} == FILES
    assert not (tmp_path / "step_000001.tmp").exists()

    # Each file opens without unpickling code: JSON, safetensors, torch.load(weights_only=True).
    saved = json.loads((path / "config.json").read_text())
    assert saved["model"]["d_model"] == 64 and saved["train"]["steps"] == 7
    assert saved["data"]["source"] == "x.txt"
    assert json.loads((path / "trainer_state.json").read_text()) == {"step": 1}
    tensors = load_file(path / "model.safetensors")
    params = dict(model.named_parameters())  # tied matrices appear once here
    assert set(tensors) <= set(model.state_dict()) and len(tensors) == len(params)
    opt_state = torch.load(path / "optimizer.pt", weights_only=True)
    assert opt_state["param_groups"][0]["weight_decay"] == 0.1
    rng = torch.load(path / "rng.pt", weights_only=True)
    assert torch.equal(rng["torch"], rng_state()["torch"])


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "t5-tiny"])
def test_save_then_load_is_identity(tmp_path, preset):
    model, optimizer, run = trained_pair(preset)
    rng = rng_state()
    save_checkpoint(tmp_path / "ckpt", model, optimizer, run, {"step": 4, "best_val": 2.5}, rng)

    torch.manual_seed(123)  # a different initialisation to load over
    other = build_model(run.model)
    other_opt = build_optimizer(other, 1e-3, 0.1, (0.9, 0.99))
    saved_run, trainer, saved_rng = load_checkpoint(tmp_path / "ckpt", other, other_opt)

    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    # Tied matrices stay tied (named_parameters lists a shared tensor once).
    assert len(dict(other.named_parameters())) == len(dict(model.named_parameters()))
    want, got = optimizer.state_dict(), other_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for i, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(value, got["state"][i][key]), (i, key)
    assert trainer == {"step": 4, "best_val": 2.5}
    assert torch.equal(saved_rng["torch"], rng["torch"])
    assert torch.equal(saved_rng["data"], rng["data"])
    assert saved_run["model"]["vocab_size"] == run.model.vocab_size


def test_load_checkpoint_never_unpickles(tmp_path, monkeypatch):
    model, optimizer, run = trained_pair()
    save_checkpoint(tmp_path / "ckpt", model, optimizer, run, {"step": 1}, rng_state())
    real_load, calls = torch.load, []

    def checked_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", checked_load)
    load_checkpoint(tmp_path / "ckpt", build_model(run.model), optimizer)
    assert calls == [True, True]  # optimizer.pt and rng.pt


def test_load_into_a_different_model_names_the_keys(tmp_path):
    model, optimizer, run = trained_pair("llama-tiny")
    save_checkpoint(tmp_path / "ckpt", model, optimizer, run, {"step": 1})
    bigger = build_model(replace(run.model, n_layers=2))
    with pytest.raises(ValueError, match=r"missing \[.*blocks\.1\."):
        load_checkpoint(tmp_path / "ckpt", bigger)
    with pytest.raises(ValueError, match="not a checkpoint"):
        load_checkpoint(tmp_path / "nowhere", bigger)


def test_latest_pointer_and_keep_last_pruning(tmp_path):
    model, optimizer, run = trained_pair()
    ckpts = CheckpointDir(tmp_path / "checkpoints", keep_last=2)
    assert ckpts.latest() is None
    for step in range(1, 6):
        path = ckpts.save(step, model, optimizer, run, {"step": step})
        assert ckpts.latest() == path == tmp_path / "checkpoints" / f"step_{step:06d}"
    ckpts.save_best(model, optimizer, run, {"step": 5})
    step_dirs = sorted(p.name for p in ckpts.root.glob("step_*"))
    assert step_dirs == ["step_000004", "step_000005"]
    assert sorted(p.name for p in ckpts.root.iterdir()) == [
        "best",
        "latest",
        "step_000004",
        "step_000005",
    ]
    assert (ckpts.root / "latest").read_text().strip() == "step_000005"
    # keep_last=1 on the same directory keeps exactly one.
    CheckpointDir(ckpts.root, keep_last=1).save(6, model, optimizer, run, {"step": 6})
    assert sorted(p.name for p in ckpts.root.glob("step_*")) == ["step_000006"]


def test_interrupted_save_is_ignored_and_cleaned_up(tmp_path):
    model, optimizer, run = trained_pair()
    ckpts = CheckpointDir(tmp_path, keep_last=3)
    ckpts.save(1, model, optimizer, run, {"step": 1})
    half = tmp_path / "step_000002.tmp"  # what a save killed half-way leaves
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"partial")
    assert ckpts.latest() == tmp_path / "step_000001"
    CheckpointDir(tmp_path, keep_last=3)  # opening the run's checkpoints again tidies up
    assert not half.exists()
    # Saving the same step twice replaces it cleanly.
    ckpts.save(1, model, optimizer, run, {"step": 1, "again": True})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]
    _, trainer, _ = load_checkpoint(tmp_path / "step_000001", build_model(run.model))
    assert trainer == {"step": 1, "again": True}


def test_every_file_of_a_checkpoint_follows_the_umask(tmp_path):
    """safetensors creates its file 0600; every file is made 0666 & ~umask like the others."""
    model, optimizer, run = trained_pair()
    old = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path / "c", model, optimizer, run, {"step": 1}, rng_state())
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in path.iterdir()}
    assert modes == {name: 0o644 for name in FILES}


def _saved(path, step: int) -> int:
    return json.loads((path / "trainer_state.json").read_text())["step"]


@pytest.mark.parametrize(
    "left",
    [
        "tmp",  # killed while writing the new best.tmp
        "aside",  # killed after renaming best aside, before renaming the new one in
        "both",  # killed after the new best is in, before best.old was deleted
        "trash",  # killed while deleting
    ],
)
def test_each_state_a_killed_replacement_of_best_leaves_is_recovered(tmp_path, left):
    model, optimizer, run = trained_pair()
    root = tmp_path / "checkpoints"
    ckpts = CheckpointDir(root)
    ckpts.save_best(model, optimizer, run, {"step": 1}, rng_state())
    best, old, tmp = root / "best", root / "best.old", root / "best.tmp"
    save_checkpoint(tmp_path / "new", model, optimizer, run, {"step": 2}, rng_state())
    if left == "tmp":
        shutil.copytree(tmp_path / "new", tmp)
        (tmp / "trainer_state.json").unlink()  # half written
        want = 1
    elif left == "aside":
        os.replace(best, old)
        shutil.copytree(tmp_path / "new", tmp)
        want = 1
    elif left == "both":
        os.replace(best, old)
        os.replace(tmp_path / "new", best)
        (old / "model.safetensors").unlink()  # half deleted
        want = 2
    else:
        shutil.copytree(best, root / "step_000001.trash")
        want = 1
    CheckpointDir(root)
    assert sorted(p.name for p in root.iterdir()) == ["best"]
    assert _saved(best, 1) == want
    load_checkpoint(best, build_model(run.model))  # complete


def test_replacing_best_renames_the_old_one_aside_before_the_new_one_in(tmp_path, monkeypatch):
    """The old best/ is deleted only after the new one has its name: at no instant is there
    no complete best (the order the recovery above relies on)."""
    model, optimizer, run = trained_pair()
    root = tmp_path / "checkpoints"
    ckpts = CheckpointDir(root)
    ckpts.save_best(model, optimizer, run, {"step": 1})
    events = []
    real_rename, real_rmtree = ckpt._rename, shutil.rmtree
    monkeypatch.setattr(
        ckpt, "_rename", lambda a, b: (events.append(("rename", a.name, b.name)), real_rename(a, b))
    )
    monkeypatch.setattr(
        ckpt.shutil,
        "rmtree",
        lambda p, **kw: (events.append(("rmtree", Path(p).name)), real_rmtree(p, **kw)),
    )
    ckpts.save_best(model, optimizer, run, {"step": 2})
    renames = [e for e in events if e[0] == "rename" or e[1] != "best.tmp"]
    assert renames == [
        ("rename", "best", "best.old"),
        ("rename", "best.tmp", "best"),
        ("rename", "best.old", "best.old.trash"),
        ("rmtree", "best.old.trash"),
    ]
    assert _saved(root / "best", 2) == 2


def test_a_damaged_checkpoint_file_is_named(tmp_path):
    model, optimizer, run = trained_pair()
    path = save_checkpoint(tmp_path / "c", model, optimizer, run, {"step": 1}, rng_state())
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match=r"model\.safetensors' cannot be read"):
        read_checkpoint(path)
    (path / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match=r"trainer_state\.json' is missing"):
        read_checkpoint(path)
