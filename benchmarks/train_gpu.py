"""GPU check of distributed training: DDP and FSDP2 through torchrun (nccl) on every visible GPU,
against one process training on the whole global batch. Not run by the tests (they use gloo on
CPU); run it by hand on a CUDA machine:

    python benchmarks/train_gpu.py [--steps 20] [--tolerance 1e-3]

Prints each run's losses, the largest relative difference to the 1-process run, and the wall
time; exits non-zero when a difference is above --tolerance or a run fails. A bf16 FSDP run is
checked for finite, falling losses only. With one GPU the DDP/FSDP runs have a single rank: that
checks the nccl, device and sharding paths, not the splitting of the batch.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

COMMON = [
    "--preset=llama-char",
    "--data.source=stdlib",
    "--data.max_chars=300000",
    "--train.device=cuda",
    "--train.context=128",
    "--train.grad_accum=2",
    "--train.warmup=5",
    "--train.log_every=1",
    "--train.eval_every=100000",
    "--train.eval_batches=2",
    "--train.sample_tokens=32",
    "--train.progress=false",
]


def launch(name: str, root: Path, gpus: int, batch: int, steps: int, *extra: str) -> list[float]:
    """Train in `gpus` processes (0: plain, no torchrun); returns the logged losses."""
    out = root / name
    flags = [*COMMON, f"--data.cache_dir={root / 'cache'}", f"--train.out_dir={out}"]
    flags += [f"--train.steps={steps}", f"--train.batch_size={batch}", *extra]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += [f"--nproc_per_node={gpus}"] if gpus else []
    command = [*(launcher if gpus else [sys.executable]), "-m", "attnlab", "train", *flags]
    t0 = time.perf_counter()
    subprocess.run(command, check=True)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["train_loss"] for line in lines]
    print(f"{name:>10}: {time.perf_counter() - t0:6.1f} s  losses {[round(x, 4) for x in losses]}")
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences per GPU")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    gpus, worst = torch.cuda.device_count(), {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        single = launch("single", root, 0, args.batch * gpus, args.steps)
        for kind in ("ddp", "fsdp"):
            losses = launch(kind, root, gpus, args.batch, args.steps, f"--train.distributed={kind}")
            worst[kind] = max(abs(a - b) / abs(b) for a, b in zip(losses, single))
        bf16 = launch("fsdp-bf16", root, gpus, args.batch, args.steps,
                      "--train.distributed=fsdp", "--train.precision=bf16")  # fmt: skip
    print(f"{gpus} GPU(s); max relative loss difference to 1 process: {worst}")
    ok = all(w <= args.tolerance for w in worst.values())
    ok &= all(math.isfinite(x) for x in bf16) and bf16[-1] < bf16[0]
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
