"""The ranks fdp talks over: ``fdp.init`` and ``Group``."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._malloc import keep_freed_memory

DEFAULT_TIMEOUT = timedelta(minutes=10)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Group:
    """A set of ranks that hold replicas: a torch ``ProcessGroup`` plus what fdp needs to know.

    Attributes:
      process_group: the torch ProcessGroup, or ``None`` for a world of one (no communication).
      rank: this process's rank in the group.
      size: number of ranks.
      local_rank: rank on this machine (``LOCAL_RANK`` under torchrun).
      device: where this rank's tensors live (``cuda:<local_rank>`` with NCCL, else ``cpu``).
      timeout: applied to every collective fdp issues; a collective that does not finish in
        time raises instead of hanging.
      backend: the process group's backend name (``"gloo"``, ``"nccl"``, ``"threaded"``), or
        ``"none"`` for a world of one.

    Build one with ``fdp.init()``, or from an existing group with
    ``Group.from_process_group(pg)`` or ``Group.from_mesh(mesh, dim)``. Every fdp function
    that takes ``group=`` accepts a ``Group``, a torch ``ProcessGroup``, a 1-D ``DeviceMesh``,
    or ``None``: the world (the torchrun job), or a world of one when torch.distributed is not
    initialised. A frozen dataclass.

    Example:
      >>> group = fdp.Group.single("cpu")
      >>> group.rank, group.size, group.is_main, group.process_group
      (0, 1, True, None)
    """

    process_group: Any
    rank: int
    size: int
    local_rank: int
    device: torch.device
    timeout: timedelta = DEFAULT_TIMEOUT
    backend: str = "none"

    @property
    def is_main(self) -> bool:
        """True on rank 0: the rank that logs, plots and writes checkpoints."""
        return self.rank == 0

    @classmethod
    def single(cls, device: torch.device | str | None = None) -> Group:
        """A world of one: every collective is the identity and no rendezvous happens."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(None, 0, 1, 0, torch.device(device), DEFAULT_TIMEOUT, "none")

    @classmethod
    def from_process_group(
        cls,
        pg: Any = None,
        *,
        device: torch.device | str | None = None,
        timeout: timedelta | None = None,
    ) -> Group:
        """Wrap an initialised torch ProcessGroup (default: the world group).

        Args:
          pg: the process group (default: the world).
          device: this rank's device (default: the current CUDA device with NCCL, else CPU).
          timeout: the collectives' timeout (default: the one the group was created with).

        Raises:
          RuntimeError: torch.distributed is not initialised.
          ValueError: this process is not a member of ``pg``.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "fdp: torch.distributed is not initialised; call fdp.init() first "
                "(or pass no group to work in a world of one)"
            )
        if pg is None:
            pg = dist.group.WORLD
        rank = dist.get_rank(pg)
        size = dist.get_world_size(pg)
        if rank < 0:
            raise ValueError("fdp: this process is not a member of the given process group")
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        backend = str(dist.get_backend(pg)).lower()
        if device is None:
            if "nccl" in backend:
                device = torch.device("cuda", torch.cuda.current_device())
            else:
                device = torch.device("cpu")
        if timeout is None:
            timeout = _pg_timeout(pg, torch.device(device))
        group = cls(pg, rank, size, local_rank, torch.device(device), timeout, backend)
        if pg is dist.group.WORLD:
            _remember_world(group, replace=False)
        return group

    @classmethod
    def from_mesh(cls, mesh: Any, dim: int | str | None = None) -> Group:
        """The ranks along one dimension of a ``DeviceMesh`` (``dim`` may be its name).

        Raises:
          ValueError: ``dim`` is None and the mesh has more than one dimension.
        """
        if dim is None:
            if mesh.ndim != 1:
                raise ValueError(
                    f"fdp: a {mesh.ndim}-D DeviceMesh needs `dim` (an index or one of "
                    f"{mesh.mesh_dim_names}) to say which dimension is data-parallel"
                )
            dim = 0
        pg = mesh.get_group(dim)
        if mesh.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device(mesh.device_type)
        return cls.from_process_group(pg, device=device)

    def __repr__(self) -> str:
        return (
            f"Group(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
            f"device={self.device}, backend={self.backend})"
        )


def _pg_timeout(pg: Any, device: torch.device) -> timedelta:
    """The timeout the process group was created with (gloo and NCCL backends expose it).

    Not while torch.compile traces: dynamo cannot read a backend's options (torch 2.13:
    ``UnsafeScriptObjectError`` on the ``OpaqueObject``), and the traced collectives
    (``torch.distributed._functional_collectives``) take no timeout anyway.
    """
    if torch.compiler.is_compiling():
        return DEFAULT_TIMEOUT
    try:
        t = pg._get_backend(device).options._timeout
    except Exception:  # noqa: BLE001 - backends without options (threaded test PG)
        t = None
    return t if isinstance(t, timedelta) else DEFAULT_TIMEOUT


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(backend: str | None = None, *, timeout: timedelta | float = DEFAULT_TIMEOUT) -> Group:
    """Join the world described by torchrun's environment and return its ``Group``.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
    The backend is NCCL when CUDA is available and gloo otherwise; with NCCL the CUDA device
    is set from ``LOCAL_RANK``. ``timeout`` (a timedelta or seconds) applies to every
    collective. Idempotent: if torch.distributed is already initialised, the world group is
    returned. Without torchrun's environment this is a world of one: no rendezvous, and every
    collective is the identity, so the same script runs as plain ``python train.py``.

    Args:
      backend: the process group's backend (default: ``"nccl"`` with CUDA, else ``"gloo"``).
      timeout: the process group's timeout, for every collective fdp waits on.

    Returns:
      The world's ``Group`` (``Group.single()`` without torchrun).

    Raises:
      RuntimeError: ``RANK`` and ``WORLD_SIZE`` are set but another torchrun variable is
        missing. Rendezvous errors come from ``torch.distributed.init_process_group``.

    Example:
      >>> group = fdp.init()
      >>> group.rank, group.size
      (0, 1)
    """
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if dist.is_available() and dist.is_initialized():
        return Group.from_process_group(dist.group.WORLD, timeout=timeout)
    if not _under_torchrun():
        return Group.single()
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"fdp.init: RANK and WORLD_SIZE are set but {', '.join(missing)} "
            "is not; launch with torchrun (e.g. `torchrun --standalone --nproc-per-node 2 train.py`)"
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    # Under `torchrun --max-restarts`, workers of every attempt rendezvous through the same
    # agent store, so a restarted rank can read the previous attempt's gloo/NCCL addresses
    # (seen as "Connection refused" in connectFullMesh after a restart). Keys are therefore
    # namespaced by the attempt.
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"fdp/attempt-{attempt}", store)
    keep_freed_memory()  # before the backend's threads start: it caps the malloc arenas too
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _install_shutdown()
    group = Group.from_process_group(dist.group.WORLD, device=device, timeout=timeout)
    _remember_world(group, replace=True)
    return group


_failed = False  # an uncaught exception is ending this process
_collective_failed = False  # a collective raised or timed out (see mark_failed)
_kept: list[tuple[Any, timedelta]] = []  # work handles of failed collectives (see keep_until_exit)


def mark_failed() -> None:
    """Record that a collective failed: the exit hook then skips its barrier (see below)."""
    global _collective_failed
    _collective_failed = True


def keep_until_exit(work: Any, group: Group) -> None:
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
    limit = max(group.timeout, _pg_timeout(group.process_group, group.device))
    _kept.append((work, limit))


def _drain() -> None:
    for work, timeout in _kept:
        try:
            work.wait(timeout)
        except Exception:  # noqa: BLE001 - it failed already; only its end matters
            pass


def _install_shutdown() -> None:
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
    status it chose (issue 15). After a failed collective the barrier is skipped too.
    """
    previous = sys.excepthook

    def excepthook(*exc_info: Any) -> None:
        global _failed
        _failed = True
        previous(*exc_info)

    sys.excepthook = excepthook
    atexit.register(_shutdown)


def _shutdown() -> None:
    """The exit hook (see ``_install_shutdown``).

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
    (docs/performance.md, "Clean exits under load").
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


# The world's Group, made once per process group (per thread with simulated ranks, where
# every thread has its own world): `group=None` is the common argument of every fdp call,
# and making a Group queries the backend (rank, size, name, timeout). Resolving it once,
# eagerly (by fdp.init, or the first call), also keeps that query out of code that
# torch.compile traces, where reading the backend's options fails (see _pg_timeout).
_worlds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_worlds_lock = threading.Lock()


def _remember_world(group: Group, *, replace: bool) -> None:
    """The first Group made for the world is what ``group=None`` means; the one ``fdp.init``
    makes when it creates the world replaces it (its timeout is the process group's)."""
    if torch.compiler.is_compiling():
        return
    with _worlds_lock:
        if replace or group.process_group not in _worlds:
            _worlds[group.process_group] = group


def _world() -> Group:
    pg = dist.group.WORLD
    if not torch.compiler.is_compiling():
        known = _worlds.get(pg)
        if known is not None:
            return known
    return Group.from_process_group(pg)


def resolve(group: Group | Any | None) -> Group:
    """The ``Group`` an fdp call talks over: ``None`` means the world (or a world of one)."""
    if isinstance(group, Group):
        return group
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return _world()
        return Group.single()
    if hasattr(group, "get_group") and hasattr(group, "mesh"):
        return Group.from_mesh(group)
    return Group.from_process_group(group)
