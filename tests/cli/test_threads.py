"""The CLI's thread policy (cli/threads.py): one thread per core other processes leave free now,
`--threads N` wins, and the run header says which."""

import os
import subprocess
import sys
import time

import pytest
import torch

from attnlab.cli import threads
from attnlab.cli.__main__ import main


@pytest.fixture
def machine(monkeypatch):
    """machine(cores, load): pretend this process may use `cores` cores under `load`."""

    def set_machine(cores: int, load: float | None):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
        monkeypatch.setattr(threads, "busy_cores", lambda: load)
        monkeypatch.setattr(threads, "load_average", lambda: load)  # what --threads N shows

    return set_machine


@pytest.mark.parametrize(
    "cores, load, expected",
    [
        (2, 0.1, 2),  # quiet: every core
        (2, 0.6, 1),  # rounds: 1.4 free cores -> 1
        (2, 1.3, 1),  # another process holds a core: one thread, which waits for no one
        (2, 6.0, 1),  # busier than the cores: still one
        (16, 3.2, 13),
        (8, None, 8),  # no /proc/stat and no load average: the cores
    ],
)
def test_threads_follow_the_free_cores(machine, cores, load, expected):
    machine(cores, load)
    choice = threads.choose_threads()
    assert (choice.threads, choice.cores, choice.source) == (expected, cores, "load")


def test_the_flag_wins_and_must_be_positive(machine):
    machine(2, 1.3)
    assert (
        threads.choose_threads(2).threads == 2 and threads.choose_threads(2).source == "--threads"
    )
    with pytest.raises(ValueError, match="--threads must be >= 1, got 0"):
        threads.choose_threads(0)


def test_busy_cores_are_measured_now_from_proc_stat(monkeypatch):
    """One core of two busy over the sample, whatever the (stale) load average says."""
    samples = iter([(1000, 4000), (1100, 4200)])  # busy +100 of +200 jiffies: half the CPUs
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.9, 1.9))
    assert threads.busy_cores(sample_s=0) == pytest.approx(1.0)


def test_busy_cores_fall_back_to_the_load_average(monkeypatch):
    def unreadable():
        raise OSError("no /proc/stat here")

    monkeypatch.setattr(threads, "_cpu_times", unreadable)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.7, 0.7, 0.7))
    assert threads.busy_cores(sample_s=0) == 0.7


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_a_spinning_process_is_seen_as_one_busy_core():
    """The real measurement, against a real process spinning on one core for the sample."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        busy = threads.busy_cores(sample_s=0.5)
    finally:
        spin.kill()
    assert busy is not None and 0.7 <= busy <= (os.cpu_count() or 1)


def test_the_header_line(machine):
    machine(2, 1.3)
    assert threads.choose_threads().describe() == "threads: 1 (2 cores, load 1.3)"
    assert (
        threads.choose_threads(3).describe() == "threads: 3 (2 cores, load 1.3, set by --threads)"
    )


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
def test_threads_flag_sets_torch_anywhere_on_the_line(capsys):
    before = torch.get_num_threads()
    try:
        assert main(["inspect", "gpt2-tiny", "--threads", "2"]) == 0
        assert torch.get_num_threads() == 2
        assert main(["--threads=1", "inspect", "gpt2-tiny"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_main_called_in_a_process_with_torch_keeps_the_callers_threads(capsys):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["inspect", "gpt2-tiny"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_cli_does_not_import_torch_before_choosing_threads():
    """`import attnlab` (the public API is imported lazily) and the CLI's entry module leave
    torch unimported: a process that has imported torch already keeps its own thread setting
    (main() called from a test or a notebook), so an eager import would switch the policy off."""
    probe = "import sys, attnlab, attnlab.cli.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
