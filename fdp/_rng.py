"""Every rank's random-number-generator states: ``rng_state`` and ``set_rng_state``.

The trees ``rng_state`` returns are the per-rank state of a checkpoint: one row per rank,
so they do not carry over to a world of another size. Their tensors are remembered (weakly)
so that ``fdp.save`` can record which leaves are per-rank, and ``fdp.load`` can then allow a
world-size change for a checkpoint that holds none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._comm import collectives as comm
from ._comm.group import Group, resolve
from ._errors import CheckpointError
from ._marks import TensorMarks

__all__ = ["is_per_rank", "mark_per_rank", "rng_state", "set_rng_state"]

_per_rank = TensorMarks()


def mark_per_rank(t: torch.Tensor) -> torch.Tensor:
    """Remember ``t`` as per-rank state (a row per rank); returns ``t``."""
    return _per_rank.mark(t)


def is_per_rank(t: Any) -> bool:
    """Whether ``t`` is a tensor ``rng_state`` made (or ``fdp.load`` restored as per-rank)."""
    return t in _per_rank


def rng_state(group: Group | Any | None = None) -> dict[str, torch.Tensor]:
    """Every rank's random-number-generator states, gathered; a collective over ``group``.

    Returns the same tree on every rank, ready to save: ``{"cpu": uint8[world, n]}`` with
    each rank's ``torch.get_rng_state()``, plus ``"cuda": uint8[world, devices, m]`` with
    each rank's ``torch.cuda.get_rng_state_all()`` when CUDA is initialised. Restore with
    ``set_rng_state``, which picks this rank's row.

    Args:
      group: the ranks (default: the world, or a world of one).

    Returns:
      ``{"cpu": Tensor[, "cuda": Tensor]}`` of CPU tensors, indexed by rank on dim 0.

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
    out = {"cpu": mark_per_rank(comm.all_gather(cpu.to(group.device), group, what).cpu())}
    if cuda is not None:
        out["cuda"] = mark_per_rank(comm.all_gather(cuda.to(group.device), group, what).cpu())
    return out


def set_rng_state(state: Mapping[str, torch.Tensor], group: Group | Any | None = None) -> None:
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
    cpu = state.get("cpu") if isinstance(state, Mapping) else None
    if not isinstance(cpu, torch.Tensor) or cpu.dim() != 2 or cpu.dtype != torch.uint8:
        raise CheckpointError("fdp.set_rng_state: expected the dict fdp.rng_state() returns")
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
