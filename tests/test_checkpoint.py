"""Checkpoints: plain files only (safetensors, JSON, tensor-only torch files), atomic saves,
the `latest` pointer, keep_last pruning, and save -> load identity."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.checkpoint import CheckpointDir, load_checkpoint, save_checkpoint
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
