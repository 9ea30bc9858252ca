"""``StepConfig``: what a Reducer was built with, given once to everything it makes.

The Reducer resolves its arguments into one frozen ``StepConfig``; its own step machine and
every fused step it builds read the same object, so no option travels as loose arguments or
is set on an object from outside afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._comm.mesh import Mesh
from .._protocols import Engine
from ..hooks import CommHook
from .machine import Steps


@dataclass(frozen=True)
class StepConfig:
    """A Reducer's resolved configuration (see ``fdp.Reducer`` for each option).

    Attributes:
      mesh: the groups (``mesh.full``: every rank; ``mesh.shard``/``mesh.replicate``: a
        sharded step's).
      shard: whether ``grad_and_update`` shards the optimizer state (ZeRO-1/2).
      hook: the comm hook every bucket goes through.
      wire: the dtype buckets travel in (None: the gradients' own).
      debug: check each collective's fingerprint across ranks first.
      hook_threshold_bytes: trailing buckets whose leaves average fewer bytes get no hooks.
      engine: ``"autograd"`` or ``"functorch"``.
      skip_nonfinite: check the averaged gradients for inf/NaN each step.
      grad_views: ``reducer.grad`` returns views into buffers reused every step.
      overlap: launch all-reduces during the backward.
      steps: the count every step of this Reducer adds to (its machines and fused steps).
      units: fully sharded params (``shard="params"``): the units' module names, the root
        (``""``) first; the plan has one bucket per unit and dtype. None otherwise.
      reshard_after_forward: fully sharded, free a unit's gathered params after its forward
        (and gather them again for its backward) rather than keep them until then.
      param_dtype: the dtype the fused step's loss runs in (fully sharded: units are gathered in it) (None: the
        params' own).
      reduce_micro_batches: a sharded step's ``step.accumulate`` reduce-scatters each micro-batch
        and keeps this rank's slice of the sum (``fdp/_fused/micro.py``), not the whole sum.
    """

    mesh: Mesh
    shard: bool
    hook: CommHook
    wire: torch.dtype | None
    debug: bool
    hook_threshold_bytes: int
    engine: Engine
    skip_nonfinite: bool
    grad_views: bool
    overlap: bool
    steps: Steps
    units: tuple[str, ...] | None = None
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_micro_batches: bool = False

    @property
    def sharded(self) -> bool:
        """Whether the fused step really cuts buckets: ``shard=True`` over more than one rank
        (a shard group of one, as ``torchrun`` with one process or a ``(2, 1)`` mesh, is the
        unsharded step)."""
        return self.shard and self.mesh.shard.size > 1
