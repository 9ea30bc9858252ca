"""Keep freed memory in the process, so each training step reuses it instead of faulting it in.

A step allocates gradient-sized tensors (autograd's gradients, fresh buckets, the pure
optimizer's new params) and frees them by the end of the step. glibc's malloc serves large
blocks with ``mmap`` and, by default, hands freed memory above a threshold back to the kernel
(``munmap``, heap trimming), so the next step touches fresh pages again: thousands of minor
page faults per step that DDP's reused buckets avoid (``python -m fdp.bench`` counts them per
kind; docs/performance.md). Raising glibc's mmap and trim thresholds keeps that memory in the
process for reuse; it is what switching to jemalloc or tcmalloc achieves for PyTorch on CPUs.
The cost: freed memory is not returned to the OS while the process lives (the peak RSS
stays), which is how a training process behaves anyway.

Untrimmed, every malloc arena keeps what was freed in it, and glibc gives a thread a new
arena whenever the ones it tried were locked (up to 8 per core): gloo's worker threads
allocate and free bucket-sized scratch while the main thread allocates, so each of several
arenas came to hold its own copy of a step's large blocks. Measured on 2 gloo ranks, a
32 MiB MLP's fused SGD step: the RSS grew for ~35 steps, +104 MiB over the first step's,
against +46 MiB with at most 4 arenas from before the process group started, +19 MiB with
``MALLOC_ARENA_MAX=4`` from the process's start, and +6 MiB with glibc's defaults (which
fault the memory in again every step instead; the plain ``reducer.grad`` step: +18 MiB). So fdp also caps the arenas
at ``ARENAS`` unless ``MALLOC_ARENA_MAX`` is set. The cap bounds arenas made after it, so
``fdp.init`` (and ``fdp.testing``'s gloo ranks) apply all of this before the process group
starts its threads; the first Reducer does it otherwise (a job that made its own process
group already may have more arenas: set ``MALLOC_ARENA_MAX=4`` in its environment).

``FDP_MALLOC=os`` leaves glibc's defaults alone. Non-glibc platforms are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

from ._log import log

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
ARENAS = 4
# 32 MiB: glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit); blocks above
# it still come from mmap.
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only above 2 GiB of free heap top

_lock = threading.Lock()
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; whether they are raised."""
    global _done
    with _lock:
        if _done is not None:
            return _done
        _done = False
        if os.environ.get("FDP_MALLOC", "keep") == "os" or not sys.platform.startswith("linux"):
            return False
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):  # not glibc (musl has no mallopt)
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        if ok and "MALLOC_ARENA_MAX" not in os.environ:
            mallopt(_M_ARENA_MAX, ARENAS)
        if ok:
            log.debug("malloc: mmap threshold %d MiB, no trimming (FDP_MALLOC=os to keep glibc's defaults)",
                     MMAP_THRESHOLD >> 20)
        _done = ok
        return ok
