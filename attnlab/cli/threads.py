"""How many CPU threads a command computes with, chosen so that a busy machine does not collapse.

PyTorch's CPU kernels run on an OpenMP team. A team thread that reaches a barrier first spins
(busy-waits) for its partners, which is fastest on idle cores. When another process holds one of
the cores, the partner it waits for is descheduled and the spinning thread burns its time slice
for nothing: every step then waits a scheduler tick per barrier, and two threads run many times
slower than one. So the policy is:

- threads: one per core this process may use (`os.sched_getaffinity`) that other processes leave
  free (rounded), at least one. A quiet machine gets all its cores; a machine whose cores are all
  busy gets one thread, which cannot wait for anyone. "Busy" is measured now, over a quarter of a
  second of /proc/stat (the CPUs' busy time, scaled to cores), not from the 1-minute load average:
  that average still counts a job that ended a minute ago, and would give a machine that just
  became quiet one thread. Where /proc/stat cannot be read, the load average is the estimate.
- wait policy: left as OpenMP's default (spin a while, then sleep). OMP_WAIT_POLICY=PASSIVE
  (sleep at once) would soften a process that starts mid-run, but on a quiet machine it made the
  main job slower with two threads than with one (the wake-ups cost more than the second core
  buys at these sizes; figures in benchmarks/README.md), so it is for the user to export.

`--threads N` overrides the count (and the policy's guess); the run header prints the choice.
"""

import math
import os
import time
from dataclasses import dataclass

SAMPLE_S = 0.25  # how long /proc/stat is watched to see how many cores are busy now


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count a command runs with, and what it was chosen from."""

    threads: int
    cores: int
    load: float | None
    source: str = "load"  # "load" (the policy), "--threads", or "caller" (main() in a process
    # that had already imported torch, such as a test, keeps that process's setting)

    def describe(self) -> str:
        """The run header's line, e.g. "threads: 1 (2 cores, load 1.3)"."""
        load = "load unknown" if self.load is None else f"load {self.load:.1f}"
        how = {"load": "", "--threads": ", set by --threads", "caller": ", as the caller set"}
        return f"threads: {self.threads} ({self.cores} cores, {load}{how[self.source]})"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(sample_s: float = SAMPLE_S) -> float | None:
    """How many cores other processes keep busy now (this process is not computing yet): the
    busy fraction of all CPUs over `sample_s` seconds times their number; else the 1-minute load
    average; None when neither can be read."""
    try:
        busy0, total0 = _cpu_times()
        time.sleep(sample_s)
        busy1, total1 = _cpu_times()
        if total1 > total0:
            return (busy1 - busy0) / (total1 - total0) * (os.cpu_count() or 1)
    except (OSError, ValueError, IndexError):
        pass
    return load_average()


def load_average() -> float | None:
    """The 1-minute load average (instant to read: for the header when no choice depends on
    it), or None where the system does not keep one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def choose_threads(requested: int | None = None) -> ThreadChoice:
    """One thread per core the other processes leave free (at least one), or `requested`."""
    cores = usable_cores()
    if requested is not None:  # nothing to measure: the header shows the load average
        if requested < 1:
            raise ValueError(f"--threads must be >= 1, got {requested}")
        return ThreadChoice(requested, cores, load_average(), "--threads")
    load = busy_cores()
    free = cores if load is None else math.floor(cores - load + 0.5)
    return ThreadChoice(max(1, min(cores, free)), cores, load)


def apply_threads(choice: ThreadChoice) -> None:
    """Give torch's intra-op pool the chosen number of threads."""
    import torch  # here: `attnlab --help` and the argument errors need no torch

    torch.set_num_threads(choice.threads)
