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


# Four threads allocate; then glibc's own account (malloc_info) says how many arenas it keeps.
ARENAS = """
import ctypes, threading
from attnlab.accel.host_memory import glibc, share_one_malloc_arena

libc = glibc()
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.open_memstream.restype = ctypes.c_void_p
took = share_one_malloc_arena() if {share} else False

together = threading.Barrier(4)

def allocate():  # all four at once, so none can take over an arena another has left
    together.wait()
    block = libc.malloc(5000)
    together.wait()
    libc.free(block)

threads = [threading.Thread(target=allocate) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
text, size = ctypes.c_char_p(), ctypes.c_size_t()
stream = ctypes.c_void_p(libc.open_memstream(ctypes.byref(text), ctypes.byref(size)))
libc.malloc_info(0, stream)
libc.fclose(stream)
print(took, text.value.decode().count("<heap nr="))
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_one_malloc_arena_serves_every_thread():
    def arenas(share: bool) -> list[str]:
        code = ARENAS.format(share=share)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        return run.stdout.split()

    assert arenas(share=True) == ["True", "1"]
    took, default = arenas(share=False)
    assert int(default) > 1  # by default the threads had arenas of their own
