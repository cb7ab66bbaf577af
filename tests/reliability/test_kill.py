"""A real kill -9 of a training process at an arbitrary moment (not at a chosen write): the run
it leaves resumes bit-exactly. Slow: it starts a Python process and trains in it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnlab.configs import to_dict
from tests.reliability.test_checkpoints import (
    SMALL,
    assert_resumes_exactly,
    assert_tidy,
    uninterrupted,
)

SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)
from attnlab.configs import from_dict
from attnlab.models.build import build_model
from attnlab.training.config import RunConfig
from attnlab.training.loop import train
from attnlab.training.tasks import build_task

run = from_dict(RunConfig, json.loads(open(sys.argv[1]).read()))
torch.manual_seed(0)
train(build_model(run.model), build_task(run), run)
print("finished before the kill")
"""


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.37])
def test_kill_9_mid_run_resumes_exactly(make_run, tmp_path, delay):
    kw = dict(SMALL, steps=40, ckpt_every=1, eval_every=5, keep_last=2)
    run = make_run(out="killed", **kw)
    (tmp_path / "run.json").write_text(json.dumps(to_dict(run)))
    (tmp_path / "train.py").write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    repo = Path(__file__).resolve().parents[2]  # this checkout, wherever pytest runs from
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "train.py"), str(tmp_path / "run.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    latest = Path(run.train.out_dir) / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not (latest.is_file() and latest.read_text() >= "step_000003"):
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "no checkpoint in 120 s"
        time.sleep(0.01)
    time.sleep(delay)  # somewhere in a later step, or in a save
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stdout.read().decode()

    assert_tidy(Path(run.train.out_dir) / "checkpoints")
    assert_resumes_exactly(run, uninterrupted(make_run(out="reference", **kw)))
