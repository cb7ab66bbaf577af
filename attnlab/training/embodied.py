"""Toy embodied tasks: small rendered scenes, a question or an instruction, an answer or actions.

A scene is a G x G grid of cells (default 4 x 4 cells of 8 x 8 pixels = a 32 x 32 RGB image) with
2-4 objects of different kinds, each with its own shape and colour (a red cup, a green ball, a blue
box, a yellow cone) at a random brightness. VLA scenes also hold the agent (a white ring) in an
empty cell.

    VQA  "where is the cup ?"  ->  "r2 c3 <eos>"          the target's row and column
    VLA  "move to the cup"     ->  "up up left <eos>"     a shortest path from the agent

Tie-breaking of the path: all vertical moves first, then all horizontal ones (objects do not
block). The asked-for kind is drawn among the kinds present.

Seeds: a scene is a pure function of its seed. Held-out scenes use seeds HELD_OUT_SEED + i;
training seeds are drawn below HELD_OUT_SEED from the training generator, and a training scene
equal to a held-out one (same objects, brightnesses, agent and question) is replaced by the
next seed.

Text layout for both model kinds (teacher forcing; only answer tokens are scored):

    ids     where is the cup ? <sep>  r2  c3
    labels    -   -   -   -  -   r2   c3 <eos>
"""

import random
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers
from torch import Tensor, nn

from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.tokenizer import SPECIAL_TOKENS, Tokenizer
from attnlab.training.config import RunConfig
from attnlab.training.data import pad_batch
from attnlab.training.objectives import IGNORE_INDEX, cross_entropy, n_targets

HELD_OUT_SEED = 1_000_000_000  # held-out scenes: seeds from here up; training seeds below
EVAL_CHUNK = 250  # held-out scenes per evaluation forward pass
GREEDY = SamplingConfig(temperature=0.0)  # answers are the most likely tokens
SPRITE = 6  # sprites are 6 x 6, centred in a cell (cells must be at least this big)
KINDS = ("cup", "ball", "box", "cone")
MIN_OBJECTS, MAX_OBJECTS = 2, 4
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
BACKGROUND = (0.1, 0.1, 0.12)
COLOURS = {
    "cup": (0.9, 0.2, 0.2),
    "ball": (0.2, 0.8, 0.3),
    "box": (0.25, 0.4, 1.0),
    "cone": (0.95, 0.85, 0.2),
    "agent": (1.0, 1.0, 1.0),
}
BRIGHTNESS = (0.6, 0.8, 1.0)  # each object's colour is scaled by one of these
SHAPES = {  # 6 x 6 masks, "#" = ink
    "cup": ["#..#..", "#..##.", "#..#.#", "#..##.", "####..", "......"],
    "ball": ["..##..", ".####.", "######", "######", ".####.", "..##.."],
    "box": ["######", "#....#", "#....#", "#....#", "#....#", "######"],
    "cone": ["..##..", "..##..", ".####.", ".####.", "######", "######"],
    "agent": ["..##..", ".#..#.", "#....#", "#....#", ".#..#.", "..##.."],
}
SPRITES = {k: np.array([[c == "#" for c in row] for row in rows]) for k, rows in SHAPES.items()}


@dataclass(frozen=True)
class Scene:
    """One scene: objects as (kind, brightness, row, col), the kind asked for, the agent's cell."""

    grid: int
    objects: tuple[tuple[str, float, int, int], ...]
    target: str
    agent: tuple[int, int] | None = None

    @property
    def target_cell(self) -> tuple[int, int]:
        return next((r, c) for kind, _, r, c in self.objects if kind == self.target)


def make_scene(seed: int, form: str, grid: int = 4) -> Scene:
    """The scene of `seed`: 2-4 kinds in distinct cells (and the agent, for "vla")."""
    if form not in ("vqa", "vla"):
        raise ValueError(f"unknown scene form {form!r}; choose 'vqa' or 'vla'")
    if grid < 3:
        raise ValueError(f"scene grid must be >= 3 cells per side, got grid={grid}")
    rng = random.Random(seed)
    kinds = rng.sample(KINDS, rng.randint(MIN_OBJECTS, MAX_OBJECTS))
    cells = rng.sample(range(grid * grid), len(kinds) + (form == "vla"))
    objects = sorted(
        ((k, rng.choice(BRIGHTNESS), *divmod(c, grid)) for k, c in zip(kinds, cells)),
        key=lambda o: o[2:],
    )  # sorted by cell: equal scenes compare equal
    agent = divmod(cells[-1], grid) if form == "vla" else None
    return Scene(grid, tuple(objects), rng.choice(kinds), agent)


def render(scene: Scene, cell: int = 8) -> np.ndarray:
    """The scene as a (3, G*cell, G*cell) float32 image in [0, 1]."""
    if cell < SPRITE:
        raise ValueError(f"cells of {cell} pixels cannot hold the {SPRITE}x{SPRITE} sprites")
    side, pad = scene.grid * cell, (cell - SPRITE) // 2
    image = np.empty((side, side, 3), dtype=np.float32)
    image[:] = BACKGROUND
    things = list(scene.objects)
    if scene.agent is not None:
        things.append(("agent", 1.0, *scene.agent))
    for kind, brightness, r, c in things:
        y, x = r * cell + pad, c * cell + pad
        image[y : y + SPRITE, x : x + SPRITE][SPRITES[kind]] = np.multiply(
            COLOURS[kind], brightness
        )
    return image.transpose(2, 0, 1)  # (3, H, W)


def shortest_path(start: tuple[int, int], goal: tuple[int, int]) -> list[str]:
    """Moves from start to goal: vertical ones first, then horizontal (the fixed tie-break)."""
    (r0, c0), (r1, c1) = start, goal
    vertical = ["down" if r1 > r0 else "up"] * abs(r1 - r0)
    horizontal = ["right" if c1 > c0 else "left"] * abs(c1 - c0)
    return vertical + horizontal


def question(scene: Scene) -> str:
    """The VQA question or the VLA instruction."""
    if scene.agent is None:
        return f"where is the {scene.target} ?"
    return f"move to the {scene.target}"


def answer(scene: Scene) -> str:
    """The expected answer: "r2 c3" (VQA) or the actions, e.g. "up up left" (VLA)."""
    r, c = scene.target_cell
    if scene.agent is None:
        return f"r{r} c{c}"
    return " ".join(shortest_path(scene.agent, (r, c)))


def scene_tokenizer(grid: int = 4) -> Tokenizer:
    """A word-level tokenizer over the tasks' words (whitespace and "?" split), specials first."""
    words = ["where", "is", "the", "?", "move", "to", *KINDS, *MOVES]
    words += [f"r{i}" for i in range(grid)] + [f"c{i}" for i in range(grid)]
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + words)}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return Tokenizer(backend)


class SceneTask:
    """VQA or VLA on generated scenes, for a "vlm" model; exact match of greedy answers.

    Args:
        run: the run config; run.data.task is "vqa" or "vla", run.data.synthetic_n_val the number
            of held-out scenes, run.data.scene_grid / scene_cell the geometry.
    """

    def __init__(self, run: RunConfig):
        d, m = run.data, run.model
        self.run, self.form, self.grid, self.cell = run, d.task, d.scene_grid, d.scene_cell
        self.tokenizer = scene_tokenizer(self.grid)
        self.pad, self.sep, self.eos = (
            self.tokenizer.token_id(t) for t in ("<pad>", "<sep>", "<eos>")
        )
        self.max_answer = 2 * (self.grid - 1) + 1 if self.form == "vla" else 3  # with <eos>
        self._check_model(m)
        self.held_out = [
            make_scene(HELD_OUT_SEED + i, self.form, self.grid) for i in range(d.synthetic_n_val)
        ]
        self.held_out_set = set(self.held_out)

    def _check_model(self, m) -> None:
        side = self.grid * self.cell
        if m is None:  # a task built only for its data
            return
        if m.vision is None or m.arch != "vlm":
            raise ValueError(f"task {self.form!r} needs a 'vlm' model, got arch={m.arch!r}")
        if (m.vision.image_size, m.vision.in_channels) != (side, 3):
            raise ValueError(
                f"scenes are {side}x{side} RGB (scene_grid={self.grid} x scene_cell={self.cell}) "
                f"but the model takes {m.vision.image_size}x{m.vision.image_size} images with "
                f"{m.vision.in_channels} channels"
            )
        text = len(self.prompt(make_scene(0, self.form, self.grid))) + self.max_answer
        prefix = m.vision.n_tokens if m.vision.connect == "prefix" else 0
        if prefix + text > m.max_seq_len:
            raise ValueError(
                f"sequences of {prefix} image + {text} text tokens exceed "
                f"model.max_seq_len={m.max_seq_len}"
            )

    def prompt(self, scene: Scene) -> list[int]:
        return self.tokenizer.encode(question(scene)) + [self.sep]

    def scenes(self, seeds: list[int]) -> list[Scene]:
        """Training scenes of `seeds`; a scene equal to a held-out one moves to the next seed."""
        out = []
        for seed in seeds:
            scene = make_scene(seed, self.form, self.grid)
            while scene in self.held_out_set:
                seed = (seed + 1) % HELD_OUT_SEED
                scene = make_scene(seed, self.form, self.grid)
            out.append(scene)
        return out

    def batch(self, scenes: list[Scene]) -> dict:
        """images (B, 3, H, W), ids / mask / labels (B, T): prompt + answer, answer scored."""
        seqs, labels = [], []
        for s in scenes:
            p, a = self.prompt(s), self.tokenizer.encode(answer(s)) + [self.eos]
            seqs.append(p + a[:-1])
            labels.append([IGNORE_INDEX] * (len(p) - 1) + a)
        ids, mask = pad_batch(seqs, self.pad)
        labels, _ = pad_batch(labels, IGNORE_INDEX)
        images = torch.from_numpy(np.stack([render(s, self.cell) for s in scenes]))
        return {"images": images, "ids": ids, "mask": mask, "labels": labels}

    def train_batch(self, gen: torch.Generator, rank: int = 0, world: int = 1) -> dict:
        b = self.run.train.batch_size
        seeds = torch.randint(HELD_OUT_SEED, (b * world,), generator=gen)[rank * b : (rank + 1) * b]
        return self.batch(self.scenes(seeds.tolist()))

    def n_targets(self, batch: dict) -> int:
        """The answer tokens (labels != IGNORE_INDEX)."""
        return n_targets(batch["labels"], IGNORE_INDEX)

    def loss_sum(self, model: nn.Module, batch: dict) -> Tensor:
        """The cross-entropy summed over the answer tokens (a scalar)."""
        logits = model(batch["images"], batch["ids"], batch["mask"])
        return cross_entropy(logits, batch["labels"], reduction="sum")

    @torch.no_grad()
    def answers(self, model: nn.Module, scenes: list[Scene], device) -> list[str]:
        """Greedy answers of `model` for `scenes`, as text without <eos>."""
        images = torch.from_numpy(np.stack([render(s, self.cell) for s in scenes])).to(device)
        prompts = [self.prompt(s) for s in scenes]
        rows = generate(
            model,
            prompts,
            GenerationConfig(self.max_answer, GREEDY, stop_tokens=[self.eos]),
            source=images,
        )
        return [self.tokenizer.decode([t for t in row if t != self.eos]) for row in rows]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, n_batches: int, device) -> dict:
        """Loss and exact-match accuracy on every held-out scene (n_batches is not used)."""
        loss, count, hits = 0.0, 0, 0
        for i in range(0, len(self.held_out), EVAL_CHUNK):
            chunk = self.held_out[i : i + EVAL_CHUNK]
            batch = {k: v.to(device) for k, v in self.batch(chunk).items()}
            loss += self.loss_sum(model, batch).item()
            count += self.n_targets(batch)
            hits += sum(a == answer(s) for a, s in zip(self.answers(model, chunk, device), chunk))
        return {"val_loss": loss / count, "val_exact_match": hits / len(self.held_out)}

    @torch.no_grad()
    def sample(self, model: nn.Module, n_tokens: int, device, prompt: str = "") -> str:
        scene = self.held_out[0]
        got = self.answers(model, [scene], device)[0]
        return f"{question(scene)} -> {got} (expected {answer(scene)})"
