"""Toy embodied tasks: seeded scenes, rendering, answers and paths, batches, the held-out split,
a few training steps of both models, the attention picture, and bad input."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.training.config import DataConfig, RunConfig, TrainConfig
from attnlab.training.embodied import (
    BACKGROUND,
    COLOURS,
    HELD_OUT_SEED,
    KINDS,
    MOVES,
    SPRITES,
    SceneTask,
    answer,
    make_scene,
    question,
    render,
    scene_tokenizer,
    shortest_path,
)
from attnlab.training.loop import train
from attnlab.training.objectives import IGNORE_INDEX
from attnlab.training.tasks import build_task
from attnlab.viz.patch_attention import patch_attention, plot_patch_attention

PRESET = {"vqa": "vqa-tiny", "vla": "vla-tiny"}


def scene_run(tmp_path, form: str, n_val: int = 8, **train) -> RunConfig:
    model = replace(get_preset(PRESET[form]), d_model=32, d_ff=64, vocab_size=40)
    kw = dict(
        steps=3,
        batch_size=8,
        warmup=1,
        eval_every=1000,
        log_every=1,
        ckpt_every=1000,
        sample_tokens=1,
        device="cpu",
        out_dir=str(tmp_path / form),
        progress=False,
    )
    kw.update(train)
    return RunConfig(model, TrainConfig(**kw), DataConfig(task=form, synthetic_n_val=n_val))


# --- scenes ------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**40), form=st.sampled_from(["vqa", "vla"]))
def test_scenes_are_seeded_and_well_formed(seed, form):
    scene = make_scene(seed, form)
    assert scene == make_scene(seed, form)  # a pure function of the seed
    kinds = [k for k, *_ in scene.objects]
    cells = [(r, c) for *_, r, c in scene.objects] + ([scene.agent] if scene.agent else [])
    assert 2 <= len(kinds) <= 4 and len(set(kinds)) == len(kinds) and set(kinds) <= set(KINDS)
    assert len(set(cells)) == len(cells)  # objects and agent in distinct cells
    assert all(0 <= r < 4 and 0 <= c < 4 for r, c in cells)
    assert scene.target in kinds
    assert (scene.agent is not None) == (form == "vla")


def test_different_seeds_give_different_scenes():
    scenes = {make_scene(seed, "vqa") for seed in range(200)}
    assert len(scenes) > 190


def test_render_draws_each_sprite_in_its_cell_and_colour():
    scene = make_scene(5, "vla")
    image = render(scene)  # (3, 32, 32)
    assert image.shape == (3, 32, 32) and image.dtype == np.float32
    assert 0.0 <= image.min() and image.max() <= 1.0
    drawn = [(k, b, r, c) for k, b, r, c in scene.objects] + [("agent", 1.0, *scene.agent)]
    for kind, brightness, r, c in drawn:
        cell = image[:, r * 8 + 1 : r * 8 + 7, c * 8 + 1 : c * 8 + 7]  # the 6 x 6 sprite area
        ink = np.all(np.isclose(cell, np.multiply(COLOURS[kind], brightness)[:, None, None]), 0)
        assert np.array_equal(ink, SPRITES[kind]), kind
    occupied = {(r, c) for *_, r, c in drawn}
    for r in range(4):
        for c in range(4):
            if (r, c) not in occupied:
                cell = image[:, r * 8 : r * 8 + 8, c * 8 : c * 8 + 8]
                assert np.allclose(cell, np.array(BACKGROUND)[:, None, None])


def test_vqa_answer_is_the_target_cell():
    scene = make_scene(11, "vqa")
    r, c = next((r, c) for k, _, r, c in scene.objects if k == scene.target)
    assert question(scene) == f"where is the {scene.target} ?"
    assert answer(scene) == f"r{r} c{c}"


def test_shortest_path_examples_and_tie_break():
    assert shortest_path((2, 2), (0, 1)) == ["up", "up", "left"]
    assert shortest_path((0, 0), (3, 3)) == ["down"] * 3 + ["right"] * 3  # vertical first
    assert shortest_path((1, 3), (1, 0)) == ["left"] * 3


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**40))
def test_vla_actions_reach_the_target_by_a_shortest_path(seed):
    scene = make_scene(seed, "vla")
    actions = answer(scene).split()
    (r, c), (tr, tc) = scene.agent, scene.target_cell
    for a in actions:
        dr, dc = MOVES[a]
        r, c = r + dr, c + dc
        assert 0 <= r < 4 and 0 <= c < 4  # never leaves the grid
    assert (r, c) == (tr, tc)
    assert len(actions) == abs(scene.agent[0] - tr) + abs(scene.agent[1] - tc)
    vertical = [a in ("up", "down") for a in actions]
    assert vertical == sorted(vertical, reverse=True)  # all vertical moves come first
    assert question(scene) == f"move to the {scene.target}"


def test_tokenizer_covers_every_question_and_answer():
    tok = scene_tokenizer(4)
    unk = tok.token_id("<unk>")
    for seed in range(50):
        for form in ("vqa", "vla"):
            scene = make_scene(seed, form)
            for text in (question(scene), answer(scene)):
                ids = tok.encode(text)
                assert unk not in ids and tok.decode(ids) == text


# --- the task ----------------------------------------------------------------------------------
def test_batch_layout_scores_only_the_answer(tmp_path):
    task = SceneTask(scene_run(tmp_path, "vla"))
    scenes = [make_scene(s, "vla") for s in range(4)]
    batch = task.batch(scenes)
    assert batch["images"].shape == (4, 3, 32, 32)
    for i, scene in enumerate(scenes):
        prompt = task.prompt(scene)
        target = task.tokenizer.encode(answer(scene)) + [task.eos]
        n = len(prompt) + len(target) - 1
        assert batch["ids"][i, :n].tolist() == prompt + target[:-1]
        labels = batch["labels"][i].tolist()
        assert labels[: len(prompt) - 1] == [IGNORE_INDEX] * (len(prompt) - 1)
        assert labels[len(prompt) - 1 : n] == target  # <sep> predicts the first answer token
        assert set(labels[n:]) <= {IGNORE_INDEX} and batch["mask"][i].sum() == n


def test_held_out_scenes_never_train(tmp_path):
    task = SceneTask(scene_run(tmp_path, "vqa", n_val=50))
    assert task.held_out == [make_scene(HELD_OUT_SEED + i, "vqa") for i in range(50)]
    replaced = task.scenes([HELD_OUT_SEED + 3])  # a held-out seed is moved to the next one
    assert replaced[0] not in task.held_out_set
    gen = torch.Generator().manual_seed(0)
    seen = [
        s
        for _ in range(5)
        for s in task.scenes(torch.randint(HELD_OUT_SEED, (8,), generator=gen).tolist())
    ]
    assert not set(seen) & task.held_out_set


@pytest.mark.parametrize("form", ["vqa", "vla"])
def test_a_few_training_steps_and_exact_match(tmp_path, form):
    run = scene_run(tmp_path, form)
    task = build_task(run)
    assert isinstance(task, SceneTask)
    model = build_model(run.model)
    state = train(model, task, run)
    assert len(state.losses) == 3 and all(np.isfinite(state.losses))
    metrics = state.last_eval
    assert 0.0 <= metrics["val_exact_match"] <= 1.0 and metrics["val_loss"] > 0
    assert (tmp_path / form / "checkpoints" / "best" / "tokenizer.json").is_file()


# --- the attention picture ---------------------------------------------------------------------
@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.parametrize("form", ["vqa", "vla"])
def test_attention_picture(tmp_path, form):
    run = scene_run(tmp_path, form)
    task = SceneTask(run)
    model = build_model(run.model).eval()
    scene = make_scene(7, form)
    prompt, produced = task.prompt(scene), answer(scene).split() + ["<eos>"]
    ids = torch.tensor(prompt + task.tokenizer.encode(answer(scene)))
    image = render(scene)
    maps = patch_attention(model, torch.from_numpy(image), ids, len(prompt))
    assert maps.shape == (2, 4, len(produced), 4, 4) and (maps >= 0).all()  # (L, H, A, G, G)
    if form == "vqa":  # cross-attention: each query's weights over the patches sum to 1
        np.testing.assert_allclose(maps.sum((-2, -1)), 1.0, rtol=1e-5)
    else:  # prefix: the image prefix gets part of the mass, the text the rest
        assert (maps.sum((-2, -1)) <= 1.0 + 1e-5).all()
    out = tmp_path / f"{form}_attention.png"
    fig = plot_patch_attention(image, maps, produced, f"{question(scene)} -> {answer(scene)}", out)
    assert out.is_file() and out.stat().st_size > 1000
    assert len(fig.axes) == len(produced) * (1 + 2 * 4) + 1  # scene + L*H maps per row, colour bar
    with pytest.raises(ValueError, match="n_prompt=0"):
        patch_attention(model, torch.from_numpy(image), ids, 0)
    with pytest.raises(ValueError, match="labels"):
        plot_patch_attention(image, maps, produced[:-1])


# --- bad input ---------------------------------------------------------------------------------
def test_bad_scene_settings():
    with pytest.raises(ValueError, match="unknown scene form 'vqx'"):
        make_scene(0, "vqx")
    with pytest.raises(ValueError, match="grid=2"):
        make_scene(0, "vqa", grid=2)
    with pytest.raises(ValueError, match="cells of 4 pixels"):
        render(make_scene(0, "vqa"), cell=4)


def test_scene_size_must_match_the_model(tmp_path):
    run = scene_run(tmp_path, "vqa")
    bad = replace(run, data=replace(run.data, scene_cell=6))
    with pytest.raises(ValueError, match=r"scenes are 24x24 RGB .* takes 32x32 images"):
        SceneTask(bad)
    text_model = replace(run, model=get_preset("gpt2-tiny"))
    with pytest.raises(ValueError, match=r"needs a 'vlm' model, got arch='decoder'"):
        SceneTask(text_model)
    short = replace(
        run,
        model=replace(
            run.model, max_seq_len=20, vision=replace(run.model.vision, connect="prefix")
        ),
    )
    with pytest.raises(ValueError, match=r"16 image \+ 9 text tokens exceed .*max_seq_len=20"):
        SceneTask(short)
