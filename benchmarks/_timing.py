"""Small timing and peak-memory helpers shared by the benchmarks.

Timing: warm up, then time every candidate once per round, interleaved (A B A B ...), and keep
the median. Interleaving means a noisy neighbour slows both sides of a comparison alike, so the
ratio measured in one run is far steadier than either absolute time.

Peak memory on CPU: the high-water mark of resident memory (VmHWM), reset just before the code
under test, minus the resident memory at that moment. Linux lets a process reset its own VmHWM
by writing "5" to /proc/self/clear_refs; without that, getrusage's ru_maxrss is used and the
baseline is the peak so far, which can only under-count.
"""

import os
import platform
import re
import resource
import statistics
import time
from collections.abc import Callable

import torch

MiB = 2**20


def use_all_cores() -> int:
    """Set torch's intra-op threads to the cores this process may run on; return that number."""
    n = len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Time each function `repeats` times, one call of each per round (A B A B ...).

    Returns:
        name -> list of `repeats` wall-clock times in seconds.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def _status_kib(field: str) -> int:
    status = open("/proc/self/status").read()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1))


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_method() -> str:
    """How `peak_rss_mib` measures on this machine, in words."""
    if _reset_peak_rss():
        return "VmHWM reset by writing 5 to /proc/self/clear_refs"
    return "ru_maxrss from getrusage (cannot be reset: may under-count)"


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, or the machine type."""
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", open("/proc/cpuinfo").read(), re.M)
    except OSError:
        match = None
    return match.group(1).strip() if match else platform.machine()


def peak_rss_mib(fn: Callable[[], object]) -> tuple[float, str]:
    """Run `fn` once and return (peak resident memory above the level before it in MiB, method).

    Whatever `fn` returns is kept alive until the peak is read, so results count too.
    """
    if _reset_peak_rss():
        baseline = _status_kib("VmRSS")
        result = fn()
        peak = _status_kib("VmHWM")
        method = "VmHWM after clear_refs"
    else:
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        result = fn()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        method = "ru_maxrss (no reset; may under-count)"
    del result
    return max(peak - baseline, 0) / 1024, method
