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

A server has the opposite concern: its peak. glibc gives each thread that allocates its own
arena (up to 8 per core), and each arena keeps the memory freed in it for that thread's next
allocations. `attnlab serve` runs an HTTP event loop, an engine thread and the threads of a
worker pool, so memory one of them freed sits idle while another grows a heap of its own.
`share_one_malloc_arena()` (mallopt(M_ARENA_MAX, 1), as MALLOC_ARENA_MAX=1 does) has every
thread allocate from the main heap, so they reuse each other's freed memory: `attnlab serve`'s
peak on SmolLM2 at 16 streams went from 1,119 to 1,067 MiB (benchmarks/README.md, "Memory").
The server's threads seldom allocate at the same moment (the engine's tensors are large and
few, the event loop's objects come from Python's own allocator), so the lock they now share
costs little; `serve` calls it as it starts.
"""

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # mallopt's, from glibc's malloc.h
NEVER_TRIM = 2**31 - 1  # bytes: mallopt takes an int


def glibc() -> ctypes.CDLL | None:
    """The C library, where it is glibc (whose mallopt settings this module uses)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c"))


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory in the process (see above); True where it took effect."""
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


def share_one_malloc_arena() -> bool:
    """Have every thread allocate from glibc's main heap from now on (see above); True where
    it took effect. Threads that already have an arena of their own keep it."""
    libc = glibc()
    return libc is not None and bool(libc.mallopt(M_ARENA_MAX, 1))
