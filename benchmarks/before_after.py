"""One benchmark script at two revisions, interleaved: did a change cost speed?

    .venv/bin/python benchmarks/before_after.py --old 713a7c8 --rounds 2 -- decode.py --quick
    .venv/bin/python benchmarks/before_after.py --old 713a7c8 -- train.py --quick

The old revision is exported with `git archive` into a temporary folder; then each round runs
the script there (its own copy of the script and of attnlab) and here (the working tree), in
that order, alternating (old new old new ...), in the same venv. Each run's "Targets" lines,
ratios each benchmark measures within one run against its own peer (plain PyTorch,
`transformers`, the one-at-a-time baseline), are printed side by side; compare those ratios,
not the milliseconds.
"""

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def export(rev: str) -> Path:
    """The tree of `rev` in a new temporary folder."""
    where = Path(tempfile.mkdtemp(prefix=f"attnlab-{rev[:12]}-"))
    archive = where / "tree.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", rev], cwd=ROOT, stdout=f, check=True)
    with tarfile.open(archive) as t:
        t.extractall(where / "tree", filter="data")
    return where / "tree"


def targets(tree: Path, script: list[str]) -> list[str]:
    """Run benchmarks/<script> in `tree`; its lines from "Targets" on (or its last 5)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "benchmarks" / script[0]), *script[1:]]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = out.stdout.splitlines()
    if out.returncode != 0:
        return [f"exit {out.returncode}: {(out.stderr.strip().splitlines() or [''])[-1]}"]
    start = next((i for i, line in enumerate(lines) if line.startswith("Targets")), None)
    return lines[start:] if start is not None else lines[-5:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("script", nargs="+", help="-- SCRIPT.py [its arguments]")
    args = parser.parse_args()
    old = export(args.old)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(
        f"{' '.join(args.script)}: old {args.old}, new {head} (+ working tree); load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    for r in range(args.rounds):
        for name, tree in (("old", old), ("new", ROOT)):
            print(f"\n-- round {r + 1}, {name}", flush=True)
            print("\n".join(targets(tree, args.script)), flush=True)


if __name__ == "__main__":
    main()
