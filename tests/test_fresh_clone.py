"""A bare clone passes: the repository's tracked files, copied into an empty folder with nothing
beside it (no sibling folders, no caches, no data home), pass the fast tier there.

This is the guard that keeps tests from reading files outside the repository (issue 19 found
tests reading a data folder next to the checkout and passing only on machines that had it)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSIDE = "ATTNLAB_FRESH_CLONE_TEST"  # set in the copy's environment: never run from inside it


def tracked_files(repo: Path) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True, timeout=60
    )
    return [name for name in out.stdout.decode().split("\0") if name]


@pytest.mark.slow
def test_a_bare_copy_of_the_repository_passes_the_fast_tier(tmp_path):
    if os.environ.get(INSIDE):
        pytest.skip("already inside the fresh-clone copy")  # -m "not slow" skips it too
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    root = tmp_path / "bare"  # the copy is root/attnlab; root holds nothing else
    clone = root / "attnlab"
    for name in tracked_files(REPO):
        source = REPO / name
        if source.is_file():  # a file deleted in the working tree is not copied
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, clone / name)
    assert sorted(p.name for p in root.iterdir()) == ["attnlab"]
    env = {
        **os.environ,
        "PYTHONPATH": str(clone),
        "ATTNLAB_DATA": str(root / "attnlab" / ".no_data_home"),  # no dataset is cached
        INSIDE: "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-x", "-p", "no:cacheprovider"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
    assert result.returncode == 0, f"the fast tier failed in a bare copy:\n{tail}"
    summary = tail.splitlines()[-1]  # pytest's closing line (a warning's text may say "failed")
    assert " passed" in summary and not re.search(r"\d+ failed", summary), summary
