"""The ranks fdp talks over: ``fdp.init`` and ``Group``."""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import _internals
from .lifetime import install_exit_hook, tune_malloc

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
            timeout = pg_timeout(pg, torch.device(device))
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


def pg_timeout(pg: Any, device: torch.device) -> timedelta:
    """The timeout the process group was created with (gloo and NCCL backends expose it).

    Not while torch.compile traces: dynamo cannot read a backend's options (torch 2.13:
    ``UnsafeScriptObjectError`` on the ``OpaqueObject``), and the traced collectives
    (``torch.distributed._functional_collectives``) take no timeout anyway.
    """
    if torch.compiler.is_compiling():
        return DEFAULT_TIMEOUT
    t = _internals.backend_timeout(pg, device)
    return DEFAULT_TIMEOUT if t is None else t


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(backend: str | None = None, *, timeout: timedelta | float = DEFAULT_TIMEOUT,
         malloc: str | None = None) -> Group:
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
      malloc: ``"keep"``: raise glibc's malloc thresholds (and cap its arenas) so memory a
        step frees stays in the process for the next step instead of being faulted in again
        (no page faults per step once warm, as DDP's reused buckets; docs/performance.md);
        ``"os"``: leave glibc's defaults. ``None`` (default): the ``FDP_MALLOC`` environment
        variable, else ``"keep"``. Applied once per process, before the process group
        starts its threads (a process group made before ``fdp.init`` keeps the arenas it
        made: set ``MALLOC_ARENA_MAX=4`` in its environment).

    Returns:
      The world's ``Group`` (``Group.single()`` without torchrun).

    Raises:
      RuntimeError: ``RANK`` and ``WORLD_SIZE`` are set but another torchrun variable is
        missing. Rendezvous errors come from ``torch.distributed.init_process_group``.
      ValueError: an unknown ``malloc`` mode.

    Example:
      >>> group = fdp.init()
      >>> group.rank, group.size
      (0, 1)
    """
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    tune_malloc(malloc)  # before the backend's threads start: it caps the malloc arenas too
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
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    install_exit_hook()
    group = Group.from_process_group(dist.group.WORLD, device=device, timeout=timeout)
    _remember_world(group, replace=True)
    return group


# The world's Group, made once per process group (per thread with simulated ranks, where
# every thread has its own world): `group=None` is the common argument of every fdp call,
# and making a Group queries the backend (rank, size, name, timeout). Resolving it once,
# eagerly (by fdp.init, or the first call), also keeps that query out of code that
# torch.compile traces, where reading the backend's options fails (see pg_timeout).
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
