"""Process-lifetime workarounds, in one place: what a process that runs collectives needs
so that it starts fast and ends with the exit status it chose.

Each workaround names the torch versions it was seen on and the upstream issue.

1. **gloo's worker thread and interpreter teardown** (torch 2.4-2.13; pytorch #190489,
   open; the atexit fix of pytorch #179291 was abandoned). When a gloo worker thread drops
   the last reference to a tensor made in Python, it must take the GIL to free it; during
   ``Py_FinalizeEx`` it cannot, and the process aborts with "terminate called without an
   active exception" after a successful run (gdb: ``ProcessGroupGloo::runLoop ->
   ~Async*Work -> TensorImpl::decref_pyobject -> take_gil -> pthread_exit ->
   std::terminate``). fdp makes the main thread the last holder of such tensors:
   ``RECENT`` keeps the small tensors of recent collectives, ``keep_until_exit`` the work of
   a collective whose wait failed, the step machine owns its status tensor
   (``fdp._step.machine.StatusSlot``), and the exit hook holds its barrier's work for good.
2. **Ranks that exit at different times** (pytorch #109478: a process group is not
   destroyed at exit). A rank that finishes first closes its gloo connections while a
   peer's threads still use them, and the peer can abort the same way. ``fdp.init``
   installs an exit hook: a barrier with the other ranks (skipped after an uncaught
   exception or a failed collective: the others may be stuck), then
   ``destroy_process_group``.
3. **malloc** (not a torch bug; an explicit option, ``fdp.init(malloc=...)``):
   A step allocates gradient-sized tensors (autograd's gradients, fresh buckets, the pure
   optimizer's new params) and frees them by the end of the step. glibc's malloc serves large
   blocks with ``mmap`` and, by default, hands freed memory above a threshold back to the kernel
   (``munmap``, heap trimming), so the next step touches fresh pages again: thousands of minor
   page faults per step that DDP's reused buckets avoid (``python -m fdp.bench`` counts them per
   kind; docs/measurements.md, "Page faults"). Raising glibc's mmap and trim thresholds keeps that memory in the
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

import atexit
import collections
import ctypes
import ctypes.util
import os
import sys
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._log import log

# ---------------------------------------------------------------------------- 1. gloo teardown
# The small tensors of recent collectives (counts, digests, flags), held a little longer than
# their callers hold them: ``fdp._comm.collectives`` appends every tensor of at most
# ``SMALL_BYTES`` it issues a collective on. gloo's worker thread drops its reference to a
# finished collective after the caller has seen it complete; when that is the last reference
# to a tensor made in Python, the thread must take the GIL to free it, and at interpreter
# shutdown it cannot: the process aborts ("terminate called without an active exception";
# the module docstring, 1.). Holding them here makes the main thread the one that frees them.
# Large tensors (buckets) are held by their owners anyway; the bound (64 KiB each, 2 MiB in
# all) covers the RNG states of fdp.rng_state (about 5 KB), which nothing else holds once the
# gather returns.
RECENT: collections.deque = collections.deque(maxlen=32)
SMALL_BYTES = 64 * 1024



_failed = False  # an uncaught exception is ending this process
_collective_failed = False  # a collective raised or timed out (see mark_failed)
_kept: list[tuple[Any, timedelta]] = []  # work handles of failed collectives (see keep_until_exit)


def mark_failed() -> None:
    """Record that a collective failed: the exit hook then skips its barrier (see below)."""
    global _collective_failed
    _collective_failed = True


def keep_until_exit(work: Any, limit: timedelta) -> None:
    """Hold the work handle of a collective whose wait failed until this process exits.

    A wait that times out returns while the backend still runs the collective. When gloo's
    worker thread later finishes it and drops the last reference to the work, the work's
    tensors release their Python objects from that thread; during interpreter teardown that
    thread cannot take the GIL, and the process dies with "terminate called without an
    active exception" (SIGABRT) after the program chose its exit status. gdb shows the stack
    ``ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork -> TensorImpl::decref_pyobject ->
    take_gil -> pthread_exit -> std::terminate`` (torch 2.13). So the handle is held here and,
    at exit, waited for once more, for at most the process group's own timeout (by then the
    backend has ended the operation), so that the last reference is this module's, released
    by the main thread.
    """
    mark_failed()
    if not _kept:
        atexit.register(_drain)  # registered after _shutdown, so it runs before it
    _kept.append((work, limit))


def _drain() -> None:
    for work, timeout in _kept:
        try:
            work.wait(timeout)
        except Exception:  # noqa: BLE001 - it failed already; only its end matters
            pass


def install_exit_hook() -> None:
    """Shut the group down at exit, in step with the other ranks.

    Left to the interpreter's teardown, a rank that finishes first closes its gloo
    connections while a peer's gloo threads still use them, and the peer can die with
    "terminate called without an active exception" (exit code -6) after a successful run
    (seen in about 1 of 10 two-rank torchrun runs of plain torch on this machine). So at a
    normal exit every rank meets the others in a barrier, then destroys the group. After an
    uncaught exception the barrier is skipped: the others may be stuck in a collective, and
    this rank should exit now so torchrun can restart or stop the job.

    The group is destroyed in every case, also when the barrier fails or is skipped: after
    a collective timed out, gloo's connections are broken and the barrier raises at once;
    skipping the destroy then left the group's threads to the interpreter's teardown, and a
    rank that had caught the timeout and finished died with SIGABRT instead of the exit
    status it chose. After a failed collective the barrier is skipped too.
    """
    previous = sys.excepthook

    def excepthook(*exc_info: Any) -> None:
        global _failed
        _failed = True
        previous(*exc_info)

    sys.excepthook = excepthook
    atexit.register(_shutdown)


def _shutdown() -> None:
    """The exit hook (see ``install_exit_hook``).

    The exit barrier's work handle is held for good (its reference count raised, never
    lowered). gloo's barrier keeps weak references to the works in flight when it was issued,
    and such a work, once its last strong reference is gone, is destroyed (its tensors
    released) only with the barrier: so none of them is ever destroyed, and no gloo worker
    thread releases a tensor during the interpreter's teardown. Before, a worker dropped its
    reference to a finished work a moment after the waiting thread had woken; descheduled in
    between on an oversubscribed machine, its drop could be the last, the work's tensors then
    released their Python objects from that thread while the interpreter was finalizing, it
    could not take the GIL, and the process aborted ("terminate called without an active
    exception") after a successful run. Core dumps of such aborts (4-rank torchrun runs that
    saved a sharded checkpoint just before exiting) showed ``ProcessGroupGloo::runLoop ->
    ~AsyncBarrierWork -> ~AsyncAllgatherWork -> TensorImpl::decref_pyobject -> take_gil ->
    pthread_exit -> std::terminate`` (torch 2.13), the main thread in ``Py_FinalizeEx``. A
    0.2 s sleep after the barrier made it rare, not impossible: such runs on 2 cores at load
    8 aborted 5 times in 36 without the sleep, 0 times in 60 with the handle held and no sleep
    (docs/measurements.md, "Clean exits under load").
    """
    if not dist.is_initialized():
        return
    if not (_failed or _collective_failed):
        try:
            work = dist.barrier(async_op=True)
            _hold_forever(work)
            work.wait()
        except Exception:  # noqa: BLE001 - exiting anyway; a dead peer must not block the exit
            pass
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - as above
        pass


def _hold_forever(obj: Any) -> None:
    """Raise ``obj``'s reference count for good: the interpreter's teardown never frees it."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


# ---------------------------------------------------------------------------- 3. malloc
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
MALLOC_MODES = ("keep", "os")


def tune_malloc(mode: str | None = None) -> bool:
    """``mode="keep"``: raise glibc's mmap and trim thresholds (and cap its arenas) once per
    process; ``"os"``: leave glibc's defaults. ``None``: the ``FDP_MALLOC`` environment
    variable, else ``"keep"``. Returns whether the thresholds are raised."""
    global _done
    mode = os.environ.get("FDP_MALLOC", "keep") if mode is None else mode
    if mode not in MALLOC_MODES:
        raise ValueError(f"fdp.init: malloc must be one of {MALLOC_MODES} (or None: FDP_MALLOC, else 'keep'), got {mode!r}")
    with _lock:
        if _done is not None:
            return _done
        _done = False
        if mode == "os" or not sys.platform.startswith("linux"):
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
