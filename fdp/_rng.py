"""Every rank's random-number-generator states: ``rng_state``, ``set_rng_state``, ``RngState``.

The ``RngState`` that ``rng_state`` returns is the per-rank state of a checkpoint: one row
per rank, so it does not carry over to a world of another size. Its type says so: every
copy, ``fdp.save`` and ``fdp.load`` see an ``RngState`` (a NamedTuple), so ``fdp.save``
records which leaves are per-rank, and ``fdp.load`` allows a world-size change for a
checkpoint that holds none.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import optree
import torch

from . import _tree
from ._comm import collectives as comm
from ._comm.group import Group, resolve
from ._errors import CheckpointError

__all__ = ["RngState", "rng_state", "set_rng_state"]


class RngState(NamedTuple):
    """Every rank's RNG states, as ``fdp.rng_state`` gathers them (one row per rank).

    Attributes:
      cpu: ``uint8[world, n]``: each rank's ``torch.get_rng_state()``.
      cuda: ``uint8[world, devices, m]``: each rank's ``torch.cuda.get_rng_state_all()``, or
        None when CUDA is not initialised.

    ``state["cpu"]`` reads a field too (the dict this used to be). In checkpoints its leaves
    are ``['cpu']`` and ``['cuda']``.
    """

    cpu: torch.Tensor
    cuda: torch.Tensor | None = None
    def per_rank(self) -> bool:
        """``fdp._protocols.PerRank``: these leaves hold a row per rank (``fdp.save`` says so)."""
        return True

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            if key not in self._fields:
                raise KeyError(key)
            return getattr(self, key)
        return tuple.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default) if key in self._fields else default


# In fdp's namespace its leaves keep the paths of the dict it used to be (['cpu'], ['cuda']),
# so checkpoints written before it load into it. (optree warns that a NamedTuple is already
# a node elsewhere: that is the point, other namespaces keep the NamedTuple form.)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    optree.register_pytree_node(
        RngState, lambda s: ((s.cpu, s.cuda), None, ("cpu", "cuda")), lambda _, children: RngState(*children),
        path_entry_type=optree.MappingEntry, namespace=_tree.NAMESPACE)


def rng_state(group: Group | Any | None = None) -> RngState:
    """Every rank's random-number-generator states, gathered; a collective over ``group``.

    Returns the same ``RngState`` on every rank, ready to save: ``cpu``, ``uint8[world, n]`` with
    each rank's ``torch.get_rng_state()``, and ``cuda``, ``uint8[world, devices, m]`` with
    each rank's ``torch.cuda.get_rng_state_all()`` when CUDA is initialised (else None). Restore with
    ``set_rng_state``, which picks this rank's row.

    Args:
      group: the ranks (default: the world, or a world of one).

    Returns:
      An ``fdp.RngState`` of CPU tensors, indexed by rank on dim 0.

    Raises:
      CheckpointError: the ranks disagree on whether CUDA is initialised or on the shape of
        their RNG states.
      CollectiveError: a rank did not join within the group's timeout.

    Example:
      >>> fdp.rng_state()["cpu"].shape  # a world of one
      torch.Size([1, 5056])
    """
    group = resolve(group)
    what = "fdp.rng_state"
    cpu = torch.get_rng_state()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.stack(torch.cuda.get_rng_state_all())
    # Ranks must agree on what they gather (all_gather needs equal shapes everywhere).
    header = [cpu.numel(), *(cuda.shape if cuda is not None else (0, 0))]
    headers = comm.all_gather(torch.tensor(header, device=group.device), group, what).tolist()
    if any(h != headers[0] for h in headers):
        raise CheckpointError(
            f"fdp.rng_state: ranks disagree on their RNG states (per rank [cpu bytes, cuda "
            f"devices, cuda bytes]: {headers}); initialise CUDA on every rank or on none"
        )
    cpus = comm.all_gather(cpu.to(group.device), group, what).cpu()
    cudas = comm.all_gather(cuda.to(group.device), group, what).cpu() if cuda is not None else None
    return RngState(cpus, cudas)


def set_rng_state(state: RngState | Mapping[str, torch.Tensor], group: Group | Any | None = None) -> None:
    """Restore this rank's RNG states from ``rng_state``'s tree (no communication).

    Args:
      state: the tree ``rng_state`` returned (typically loaded from a checkpoint).
      group: the ranks (default: the world, or a world of one); this rank's row is restored.

    Raises:
      CheckpointError: the state was gathered in a world of another size, it holds CUDA
        states but this process cannot restore them (no CUDA, another device count), or it
        is not a tree ``rng_state`` made.

    Example:
      >>> saved = fdp.rng_state()
      >>> a = torch.rand(2)
      >>> fdp.set_rng_state(saved)
      >>> torch.equal(torch.rand(2), a)
      True
    """
    group = resolve(group)
    cpu = state.get("cpu") if isinstance(state, (Mapping, RngState)) else None
    if not isinstance(cpu, torch.Tensor) or cpu.dim() != 2 or cpu.dtype != torch.uint8:
        raise CheckpointError("fdp.set_rng_state: expected the RngState fdp.rng_state() returns")
    if cpu.shape[0] != group.size:
        raise CheckpointError(
            f"fdp.set_rng_state: the RNG states are from a world of {cpu.shape[0]} ranks, "
            f"but this world has {group.size}"
        )
    cuda = state.get("cuda")
    if cuda is not None:
        if not torch.cuda.is_available() or torch.cuda.device_count() != cuda.shape[1]:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise CheckpointError(
                f"fdp.set_rng_state: the state holds RNG states of {cuda.shape[1]} CUDA "
                f"devices, but this process has {have}"
            )
        torch.cuda.set_rng_state_all(list(cuda[group.rank].cpu()))
    torch.set_rng_state(cpu[group.rank].cpu().clone())
