"""Answer a generated VQA / VLA scene with a checkpoint, and draw where the answer looked
(`attnlab embodied`, `attnlab generate --scene`): the scene from training.embodied, the
attention to the image patches from viz.patch_attention.
"""

from dataclasses import dataclass
from pathlib import Path

import matplotlib.image
import numpy as np
import torch

from attnlab.checkpoint import open_checkpoint
from attnlab.configs import from_dict
from attnlab.training.config import RunConfig
from attnlab.training.embodied import SceneTask, answer, make_scene, question, render
from attnlab.viz.patch_attention import patch_attention, plot_patch_attention

PNG_SCALE = 8  # scene.png is drawn this many screen pixels per scene pixel


@dataclass
class SceneAnswer:
    """What `answer_scene` found: the question, the model's answer and the expected one."""

    question: str
    answer: str
    expected: str
    scene_png: Path
    attention_png: Path

    @property
    def correct(self) -> bool:
        return self.answer == self.expected

    def report(self) -> str:
        """The answer as `attnlab embodied` prints it: the files, question, answer, expected."""
        return "\n".join(
            [
                f"scene     {self.scene_png}",
                f"question  {self.question}",
                f"answer    {self.answer}",
                f"expected  {self.expected} ({'correct' if self.correct else 'wrong'})",
                f"attention {self.attention_png}",
            ]
        )


def answer_scene(
    ckpt: str | Path, seed: int, out: str | Path = "embodied_demo", device: str = "cpu"
) -> SceneAnswer:
    """Load a "vqa"/"vla" checkpoint, answer scene `seed` greedily, save scene and attention PNGs.

    Args:
        ckpt: a checkpoint directory, or a run's out_dir / checkpoints/ (its latest).
        seed: the scene's seed.  out: directory for scene.png and attention.png.
        device: where the model runs.
    """
    loaded = open_checkpoint(ckpt, device)
    task = loaded.run.get("data", {}).get("task")  # a model-only checkpoint has no data section
    if task not in ("vqa", "vla"):
        raise ValueError(
            f"checkpoint {str(ckpt)!r} was trained on task {task!r}, not on scenes ('vqa' or 'vla')"
        )
    model, run = loaded.model, from_dict(RunConfig, loaded.run)
    task = SceneTask(run)
    scene = make_scene(seed, task.form, task.grid)
    got = task.answers(model, [scene], device)[0]
    image = render(scene, task.cell)  # (3, H, W)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    scene_png = out / "scene.png"
    big = np.kron(image.transpose(1, 2, 0), np.ones((PNG_SCALE, PNG_SCALE, 1)))  # (H*s, W*s, 3)
    matplotlib.image.imsave(scene_png, big.clip(0, 1))
    ids = task.prompt(scene) + task.tokenizer.encode(got)
    maps = patch_attention(
        model,
        torch.from_numpy(image).to(device),
        torch.tensor(ids, device=device),
        len(task.prompt(scene)),
    )
    attention_png = out / "attention.png"
    produced = got.split() + ["<eos>"]
    plot_patch_attention(image, maps, produced, f'"{question(scene)}" -> "{got}"', attention_png)
    return SceneAnswer(question(scene), got, answer(scene), scene_png, attention_png)
