"""Keep freed CPU memory in the process, so large tensors do not page-fault anew every step.

glibc's malloc serves each block above its mmap threshold (128 KB, rising to at most 32 MB)
with a fresh mmap and hands it back with munmap when freed. A CPU training step of a GPT-2-sized
model allocates and frees several tensors of a few hundred MB (the (B*T, V) logits, their
log-softmax and its gradient, the tied embedding's gradient), so every step the kernel faults
each of their 4 KB pages in and zeroes it again: a sizeable share of the step
(benchmarks/README.md).

Two glibc settings keep that memory instead, as PyTorch's CUDA caching allocator does on GPU:

    mallopt(M_MMAP_MAX, 0)           no block gets its own mmap: all come from the heap
    mallopt(M_TRIM_THRESHOLD, huge)  the heap's free top is never handed back to the kernel

A freed block is then reused by the next allocation of its size without a fault. The cost: the
process keeps its high-water mark of memory until it exits. They apply to the whole process,
from the call on; on other C libraries (macOS, musl) the call changes nothing. So it is off
unless asked for: `TrainConfig.keep_freed_memory` (or a direct call).
"""

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's malloc.h
NEVER_TRIM = 2**31 - 1  # bytes: mallopt takes an int


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory in the process (see above); True where it took effect."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
