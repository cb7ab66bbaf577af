"""Answer a new generated scene with a VQA / VLA checkpoint, and show where the answer looked.

    attnlab embodied --ckpt runs/vqa_cups/checkpoints/best --seed 7 --out demo/

renders scene `--seed` of the checkpoint's task (scene.png), prints the question or instruction,
the model's greedy answer and the expected one, and draws the answer's attention to the image
patches over the scene (attention.png). Seeds from 1,000,000,000 up are the held-out scenes.
"""

import argparse

from attnlab.lab.embodied import answer_scene


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ckpt",
        required=True,
        metavar="DIR",
        help="a vqa/vla checkpoint, or a run's out_dir or checkpoints/ (its latest)",
    )
    p.add_argument("--seed", type=int, required=True, metavar="S", help="the scene's seed")
    p.add_argument(
        "--out",
        default="embodied_demo",
        metavar="DIR",
        help="where scene.png and attention.png go (default %(default)s)",
    )
    p.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> int:
    print(answer_scene(args.ckpt, args.seed, args.out, args.device).report())
    return 0
