"""keep_freed_memory: a freed large tensor stays resident (reused without page faults), checked
against the kernel's own count of the process's resident memory. Each case runs in a fresh
interpreter, since the setting lasts for the whole process."""

import platform
import subprocess
import sys

import pytest

# Allocates and frees a 256 MB tensor, then prints how much of it is still resident (MB).
PROBE = """
import os
import torch
from attnlab.accel.host_memory import keep_freed_memory

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

took = keep_freed_memory() if {keep} else False
before = rss_mb()
t = torch.ones(64 * 2**20)  # 256 MB, every page written
del t
print(took, rss_mb() - before)
"""


def _probe(keep: bool) -> tuple[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(keep=keep)], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], float(out[1])


@pytest.mark.slow
@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_freed_memory_stays_resident_only_when_kept():
    took, kept_mb = _probe(keep=True)
    assert took == "True"
    assert kept_mb > 200  # the freed 256 MB stayed in the process
    _, default_mb = _probe(keep=False)
    assert default_mb < 50  # by default malloc unmapped it at once
